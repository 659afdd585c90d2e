"""align: align discrete-diffusion drafters to autoregressive verifiers for faster, lossless speculative decoding."""

__version__ = "0.1.0"
