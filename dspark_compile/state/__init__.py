"""Engine-owned verify state: KV pools with per-slot bookkeeping, and the linear-attention
layers' slot pools and replay rings."""

from .linear import LinearPools
from .pools import VerifierState

__all__ = ["VerifierState", "LinearPools"]
