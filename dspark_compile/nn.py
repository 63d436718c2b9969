"""Layers a plain PyTorch decoder calls so that dspark_compile can own its KV cache
(defined in ``frontend/plain.py``, beside the capture that reads them)."""

from .frontend.plain import CachedAttention

__all__ = ["CachedAttention"]
