"""Token-tier CUDA graphs and the verify session that owns them."""

from .graphs import TierGraphs, TierReport
from .session import VerifySession
from .tiers import Tier, tier_set

__all__ = ["VerifySession", "TierGraphs", "TierReport", "Tier", "tier_set"]
