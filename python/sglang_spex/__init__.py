"""sglang-spex: SPEX (speculative tree-of-thought search) and ReSpec for SGLang, as plugins."""

__version__ = "0.1.0"
