"""dspark_compile: derive a packed-ragged speculative-decoding verify from a dense forward."""

from .config import DSparkConfig
from .layout import VerifyLayout
from .passes import EnsureError, RefusedOp
from .state import VerifierState
from .verifier import (ConcurrentUseError, HookedModelError, ProtocolError, StaleWeightsError,
                       TokenIdError, Verifier, dspark_compile)

__all__ = ["dspark_compile", "DSparkConfig", "Verifier", "VerifyLayout", "VerifierState",
           "RefusedOp", "EnsureError", "ProtocolError", "TokenIdError", "StaleWeightsError",
           "HookedModelError", "ConcurrentUseError"]
__version__ = "0.1.0"
