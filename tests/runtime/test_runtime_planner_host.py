"""Host planner fast paths: bit-identical to a straightforward re-implementation.

The planner ranks survivals with packed sort keys, bisects a tier table derived once per
config, reads rates as a view of ``TierRate``'s table and takes NumPy input
(``plan_lengths``). The reference below does each step the plain way (Python sort of
(survival, position, request) tuples, a float64 running sum, a scan of the tier list, one rate
lookup per budget) at e2e.py's geometry: ``TierRate`` over ``tier_set(256, 8)``, gamma 7.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dspark_compile.session.tiers import select_tier, tier_set
from dspark_compile.runtime import (Planner, PlannerConfig, SpsEntry, SpsMetadata, SpsTable,
                                    TierRate, plan_lengths, plan_verify)

TIERS = tier_set(256, 8)
TIER_PAIRS = tuple((t.tokens, t.request_slots) for t in TIERS)


def _table() -> SpsTable:
    points = sorted({(t.request_slots, t.tokens) for t in TIERS})
    return SpsTable(SpsMetadata("synthetic", "test"), tuple(
        SpsEntry(b, 1e3 / (1.6 + 0.0085 * b + 0.0075 * r), r) for r, b in points))


RATES = {"replay": TierRate(_table(), TIERS, 256), "overhead": TierRate(_table(), TIERS, 256, 8e-4),
         "none": None}
CONFIGS = {"tiers": PlannerConfig(tiers=TIER_PAIRS), "plain": PlannerConfig(),
           "capped": PlannerConfig(budget_frac=0.3, tiers=TIER_PAIRS),
           "threshold": PlannerConfig(threshold=0.3),
           "min_survival": PlannerConfig(min_survival=0.05, tiers=TIER_PAIRS)}


def _ranked(conf: np.ndarray) -> list[tuple[float, int, int]]:
    """(survival, position, request), survival a float32 running product, best first."""
    items = []
    for r, row in enumerate(conf):
        s = np.float32(1.0)
        for j, c in enumerate(row):
            s = np.float32(s * np.float32(c)) + np.float32(0.0)  # -0.0 is a zero
            items.append((float(s), j, r))
    return sorted(items, key=lambda t: (-t[0], t[1], t[2]))


def _reference_budget(ranked, r: int, rate, config: PlannerConfig) -> int:
    if config.threshold is not None:
        return sum(s >= config.threshold for s, _, _ in ranked)
    if rate is None:
        return len(ranked)
    sps = lambda b: float(rate.steps_per_second(torch.tensor([b]), r)[0])  # noqa: E731
    best_k, best, mass = 0, r * sps(r), 0.0
    for k, (s, _, _) in enumerate((t for t in ranked if t[0] >= config.min_survival), 1):
        mass += s
        theta = (mass + r) * sps(r + k)
        if theta > best:
            best_k, best = k, theta
    return best_k


def _reference_lens(conf: np.ndarray, rate, config: PlannerConfig, lagged=None) -> list[int]:
    """The plan the plain way; ``lagged [R', gamma]``: the budget's confidence."""
    r, gamma = conf.shape
    if lagged is None and rate is not None and config.flat_tolerance is not None and \
            config.threshold is None and config.budget_frac is None:
        rates = [float(x) for x in rate.rate_span(r, r * gamma + 1, r)]  # B = r .. r (g + 1)
        # the most step time a budget could save is within the tolerance plus ranking's cost
        if 1.0 / rates[-1] - 1.0 / max(rates) <= config.flat_tolerance / rates[-1] + \
                config.rank_cost_s:
            return [gamma + 1] * r  # a flat step cost: every draft, unranked
    ranked = _ranked(conf)
    candidates = sum(s >= config.min_survival for s, _, _ in ranked)
    if lagged is None:
        k = _reference_budget(ranked, r, rate, config)
    else:
        k = _reference_budget(_ranked(lagged), lagged.shape[0], rate, config)
        if rate is not None or config.threshold is not None:
            k = min(k, candidates)
    cap = r * gamma if config.budget_frac is None else \
        min(r * gamma, math.floor(config.budget_frac * r * gamma))
    k = min(k, cap)
    fits = [t for t, s in sorted(config.tiers) if s >= r and t >= r + k]
    if fits:
        k = max(k, min(fits[0] - r, candidates, cap))
    lens = [1] * r
    for _, _, req in ranked[:k]:
        lens[req] += 1
    return lens


def _confidence(kind: str, r: int, gamma: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "beta":  # e2e.py's synthetic drafter: Beta with mean ~0.6
        return rng.beta(1.2, 0.8, (r, gamma)).astype(np.float32)
    if kind == "levels":  # exact ties across requests and positions, zeros included
        return (np.floor(rng.random((r, gamma)) * 4) / 4).astype(np.float32)
    if kind == "atoms":  # only 0, -0, 1/4, 1/2 and 1
        return rng.choice([0.0, -0.0, 0.25, 0.5, 1.0], (r, gamma)).astype(np.float32)
    return rng.random((r, gamma)) ** 3  # float64, many small survivals


@pytest.mark.parametrize("kind", ["beta", "levels", "atoms", "cubed"])
@pytest.mark.parametrize("r", [1, 3, 8, 64, 256])
def test_lengths_match_the_plain_reimplementation(kind, r):
    rng = np.random.default_rng(r * 10 + len(kind))
    for _ in range(3):
        conf = _confidence(kind, r, 7, rng)
        for rate_name, rate in RATES.items():
            for config_name, config in CONFIGS.items():
                want = _reference_lens(conf, rate, config)
                got = plan_lengths(conf, rate, config)
                assert got.dtype == np.int32 and got.tolist() == want, (rate_name, config_name)
                plan = plan_verify(torch.from_numpy(conf), rate, config)
                assert plan.lens.tolist() == want and plan.num_draft_tokens == sum(want) - r


@pytest.mark.parametrize("r", [1, 5, 64])
def test_lagged_budget_matches_the_plain_reimplementation(r):
    rng = np.random.default_rng(r)
    for _ in range(4):
        conf = _confidence("beta", r, 7, rng)
        lagged = _confidence("levels", int(rng.integers(1, 40)), 7, rng)
        for config in (CONFIGS["tiers"], CONFIGS["threshold"]):
            want = _reference_lens(conf, RATES["overhead"], config, lagged)
            assert plan_lengths(conf, RATES["overhead"], config, lagged).tolist() == want


def test_planner_with_lag_takes_numpy_and_tensors_alike():
    rng = np.random.default_rng(5)
    steps = [_confidence("beta", 8, 7, rng) for _ in range(5)]
    config = PlannerConfig(tiers=TIER_PAIRS, budget_lag=2)
    from_numpy, from_torch = Planner(RATES["overhead"], config), Planner(RATES["overhead"], config)
    for i, conf in enumerate(steps):
        a, b = from_numpy(conf), from_torch(torch.from_numpy(conf))
        assert torch.equal(a.lens, b.lens) and a.num_draft_tokens == b.num_draft_tokens
        want = _reference_lens(conf, RATES["overhead"], config, steps[max(0, i - 2)])
        assert a.lens.tolist() == want


def test_tier_lookup_is_the_smallest_tier_that_holds_the_step():
    config = PlannerConfig(tiers=TIER_PAIRS)
    for r in (1, 2, 3, 5, 64, 100, 256, 257):
        for tokens in range(r, 8 * r + 2):
            tier = select_tier(TIERS, tokens, r)
            assert config._tier_tokens(r, tokens) == (None if tier is None else tier.tokens)


@pytest.mark.parametrize("requests", [1, 3, 64, 256, 300])
def test_rate_span_host_is_the_rate_of_every_step(requests):
    rate = RATES["overhead"]
    for first, count in ((requests, 7 * requests + 1), (0, 5), (2040, 30), (4000, 3)):
        want = rate.steps_per_second(torch.arange(first, first + count), requests)
        host = rate.rate_span_host(first, count, requests)
        assert host.dtype == np.float64 and np.array_equal(host, want.numpy())
        assert torch.equal(rate.rate_span(first, count, requests), want)
    table = _table()
    assert np.array_equal(table.rate_span_host(3, 40, requests),
                          table.steps_per_second(torch.arange(3, 43), requests).numpy())


@pytest.mark.parametrize("conf,match", [
    (np.array([[0.5, np.nan]], np.float32), r"confidence\[0, 1\]=nan is not a probability"),
    (np.array([[0.5, 0.5], [-0.25, 0.5]]), r"confidence\[1, 0\]=-0.25 is not"),
    (np.array([0.5, 0.5], np.float32), "shape"),
    (np.array([[True, False]]), "dtype bool"),
    ([[0.5, 0.5]], "is a list; it must be a tensor or a NumPy array"),
])
def test_bad_numpy_confidence_is_refused(conf, match):
    with pytest.raises(ValueError, match=match):
        plan_lengths(conf, RATES["overhead"], CONFIGS["tiers"])
