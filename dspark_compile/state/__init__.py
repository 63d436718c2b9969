"""Engine-owned verify state: KV pools with per-slot bookkeeping, the step ledger (which forward
wrote each slot's provisional rows), and the linear-attention layers' slot pools and replay
rings."""

from .linear import LinearPools
from .pools import VerifierState
from .steps import ProtocolError, StepLedger

__all__ = ["VerifierState", "LinearPools", "StepLedger", "ProtocolError"]
