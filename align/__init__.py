"""align: align discrete-diffusion drafters to autoregressive verifiers for faster, lossless speculative decoding.

`align.load(verifier=..., drafter=...)` is the Python API (align/api.py). It is imported on first use, so that
`import align` stays cheap (no torch) for the CLI's argument checks.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["load", "Pair", "Generation", "__version__"]
_API = ("load", "Pair", "Generation")


def __getattr__(name: str) -> Any:
    if name in _API:
        from align import api

        return getattr(api, name)
    raise AttributeError(f"module 'align' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
