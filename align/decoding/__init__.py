"""The speculative decoding runtime: plain PyTorch, one function per screen. Never imports training code."""
