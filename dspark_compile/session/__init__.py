"""Token-tier CUDA graphs, the verify session that owns them, and the weights they bind."""

from .graphs import TierGraphs, TierReport
from .session import ConcurrentUseError, VerifySession
from .tiers import Tier, tier_set
from .weights import (HookedModelError, StaleWeightsError, WeightBinding, named_tensors,
                      refuse_hooks)

__all__ = ["VerifySession", "ConcurrentUseError", "TierGraphs", "TierReport", "Tier", "tier_set",
           "WeightBinding", "StaleWeightsError", "HookedModelError", "refuse_hooks",
           "named_tensors"]
