"""Rate models and tier sets the runtime cannot trust are refused by name, never coerced: a NaN
rate once turned speculation off silently, a short span was broadcast, a zero-token tier built a
table."""

import numpy as np
import pytest
import torch

from dspark_compile.runtime import (PlannerConfig, SpsEntry, SpsMetadata, SpsTable, TierRate,
                                    WidthPolicy, WidthPolicyConfig, plan_verify)
from dspark_compile.session.tiers import Tier

TABLE = SpsTable(SpsMetadata("synthetic", "tiny"), (SpsEntry(1, 100.0), SpsEntry(64, 50.0)))


class Rate:
    """A custom rate model returning ``value`` (a float or a callable of the count)."""

    def __init__(self, value, short: bool = False) -> None:
        self.value, self.short = value, short

    def steps_per_second(self, tokens, requests):
        return torch.full(tokens.shape, self.value, dtype=torch.float64)

    def rate_span(self, first, count, requests):
        return torch.full((count - self.short,), self.value, dtype=torch.float64)


@pytest.mark.parametrize("rate, match", [
    (Rate(float("nan")), r"Rate.rate_span\(3, 13, 3\) returned array\(\[nan"),
    (Rate(0.0), "finite numbers > 0"),
    (Rate(float("inf")), "finite numbers > 0"),
    (Rate(10.0, short=True), r"returned shape \(12,\).*\[13\]"),
])
def test_planner_refuses_bad_rates(rate, match):
    with pytest.raises(ValueError, match=match):
        plan_verify(torch.full((3, 4), 0.9), rate)


def test_planner_takes_good_custom_rates():
    plan = plan_verify(torch.full((3, 4), 0.9), Rate(10.0))
    assert plan.lens.tolist() == [5, 5, 5]  # a flat rate verifies every draft


def test_width_policy_refuses_bad_rates():
    policy = WidthPolicy(WidthPolicyConfig(gamma=2, widths=(1, 2, 3), histogram_lag=0),
                         Rate(float("nan")))
    policy.observe(3, torch.tensor([0, 0, 4]))
    with pytest.raises(ValueError, match="Rate.steps_per_second returned"):
        policy.scores(4)


@pytest.mark.parametrize("tiers, match", [
    ([(0, 1)], r"tiers\[0\] tokens=0"), ([(-8, 2)], r"tiers\[0\] tokens=-8"),
    ([(4, True)], r"tiers\[0\] request_slots=True"), ([(2.5, 1)], "tokens=2.5"),
    ([(2, 4)], "fewer tokens than request slots"), ([(1, 2, 3)], "not a Tier"), ([], "empty"),
])
def test_tier_rate_refuses_bad_tiers(tiers, match):
    with pytest.raises(ValueError, match=match):
        TierRate(TABLE, tiers, max_requests=4)


def test_tier_rate_refuses_bad_sizes_and_rates():
    with pytest.raises(ValueError, match="max_requests=0"):
        TierRate(TABLE, [Tier(4, 2)], max_requests=0)
    with pytest.raises(ValueError, match="step_overhead_s=True"):
        TierRate(TABLE, [Tier(4, 2)], max_requests=2, step_overhead_s=True)
    with pytest.raises(ValueError, match="steps_per_second at tiers"):
        TierRate(Rate(float("nan")), [Tier(4, 2)], max_requests=2)
    rate = TierRate(TABLE, [Tier(4, 2), (8, 2)], max_requests=2)
    assert np.isfinite(rate.dense[1:]).all()


def test_planner_config_refuses_bool_tiers():
    with pytest.raises(ValueError, match=r"tiers\[0\]"):
        PlannerConfig(tiers=((True, 1),))
