"""Uniform width policy: hazards from lagged histograms, choices, switch margin, refusals."""

from __future__ import annotations

import math

import pytest
import torch

from dspark_compile.runtime import (
    SpsEntry,
    SpsMetadata,
    SpsTable,
    WidthPolicy,
    WidthPolicyConfig,
    expected_tokens,
)

GAMMA = 7
ALL_WIDTHS = tuple(range(1, GAMMA + 2))
META = SpsMetadata(gpu="AMD Instinct MI355X (shape)", model="test")


def _hist(hazards: list[float], width: int, requests: float = 1000.0) -> torch.Tensor:
    """Expected histogram of accepted drafts for ``requests`` requests at ``width``."""
    hist = torch.zeros(GAMMA + 1, dtype=torch.float64)
    alive = requests
    for a in range(width - 1):
        hist[a] = alive * (1.0 - hazards[a])
        alive *= hazards[a]
    hist[width - 1] = alive
    return hist


def _policy(rate, lag: int = 0, **kwargs) -> WidthPolicy:
    cfg = WidthPolicyConfig(gamma=GAMMA, widths=kwargs.pop("widths", ALL_WIDTHS),
                            histogram_lag=lag, **kwargs)
    return WidthPolicy(cfg, rate)


def _flat_table(rate: float = 100.0) -> SpsTable:
    return SpsTable(META, (SpsEntry(1, rate),))


def test_narrow_widths_measure_only_the_positions_they_reach():
    h = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]
    policy = _policy(_flat_table())
    policy.observe(3, _hist(h, 3))  # verifies drafts 0 and 1 only
    got = policy.hazards()
    torch.testing.assert_close(got[:2], torch.tensor(h[:2], dtype=torch.float64))
    assert bool(torch.isnan(got[2:]).all())
    policy.observe(8, _hist(h, 8))
    torch.testing.assert_close(policy.hazards(), torch.tensor(h, dtype=torch.float64))
    # Counts are decayed by 0.9 per fold: position 0 saw both steps, position 5 only the last.
    assert math.isclose(float(policy.reached[0]), 0.9 * 1000 + 1000)
    assert math.isclose(float(policy.reached[5]), 1000 * math.prod(h[:5]))


def test_hazards_follow_the_newest_steps():
    policy = _policy(_flat_table())
    policy.observe(8, _hist([0.2] * GAMMA, 8))
    for _ in range(60):
        policy.observe(8, _hist([0.8] * GAMMA, 8))
    assert abs(float(policy.hazards()[0]) - 0.8) < 1e-3


def test_histogram_is_read_only_after_the_lag():
    policy = _policy(_flat_table(), lag=2)
    first = _hist([0.5] * GAMMA, 8)
    policy.observe(8, first)
    first.zero_()  # the engine reuses its buffer; the queued copy must not change
    policy.observe(8, _hist([0.9] * GAMMA, 8))
    assert bool(torch.isnan(policy.hazards()).all())  # nothing folded yet
    policy.observe(8, _hist([0.9] * GAMMA, 8))
    assert float(policy.hazards()[0]) == 0.5  # the step of two observations ago


def test_full_width_until_every_position_is_measured_then_every_64th_step():
    h = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]
    policy = _policy(_table_mi355x())
    assert policy.choose(64) == GAMMA + 1
    policy.observe(4, _hist(h, 4))  # positions 3.. still unmeasured
    assert [policy.choose(64) for _ in range(3)] == [GAMMA + 1] * 3
    policy.observe(8, _hist(h, 8))
    widths = [policy.choose(64) for _ in range(4, 200)]  # steps 4..199
    for step, w in zip(range(4, 200), widths):
        assert (w == GAMMA + 1) == (step % 64 == 0), (step, w)


def _table_mi355x() -> SpsTable:
    """Step time 1 + 0.006 * B (ms): with hazards that collapse after five drafts this gives the
    MI355X sweep's best widths: 6 up to bs 8, 4 at bs 64, 3 at bs 128-256."""
    points = sorted({bs * w for bs in (1, 2, 4, 8, 16, 32, 64, 128, 256) for w in ALL_WIDTHS})
    return SpsTable(META, tuple(SpsEntry(b, 1000.0 / (1.0 + 0.006 * b)) for b in points))


MI355X_HAZARDS = [0.9, 0.82, 0.74, 0.66, 0.58, 0.05, 0.05]


@pytest.mark.parametrize("bs,best", [(1, 6), (2, 6), (4, 6), (8, 6), (64, 4), (128, 3),
                                     (256, 3)])
def test_width_shrinks_with_batch_size(bs, best):
    policy = _policy(_table_mi355x())
    policy.observe(8, _hist(MI355X_HAZARDS, 8))
    policy.choose(bs)  # step 0 is a refresh step
    assert policy.choose(bs) == best
    scores = policy.scores(bs)
    assert max(scores, key=scores.get) == best


def test_expected_tokens_formula():
    h = torch.tensor([0.5, 0.5, 1.0, 0.0], dtype=torch.float64)
    assert expected_tokens(h).tolist() == [1.0, 1.5, 1.75, 2.0, 2.0]


class _Rates:
    """Step rate given per width at bs 1 (tokens == width)."""

    def __init__(self, by_tokens: dict[int, float]):
        self.by_tokens = by_tokens

    def steps_per_second(self, tokens, requests):
        return torch.tensor([self.by_tokens[int(b)] for b in tokens], dtype=torch.float64)

    def rate_span(self, first_tokens, count, requests):
        return self.steps_per_second(range(first_tokens, first_tokens + count), requests)


@pytest.mark.parametrize("gain,switches", [(1.01, False), (1.019, False), (1.021, True),
                                           (1.03, True)])
def test_switch_needs_more_than_the_margin(gain, switches):
    rates = _Rates({2: 100.0, 8: 10.0})  # all drafts accepted: E(w) = w
    policy = _policy(rates, widths=(2, 8))
    policy.observe(8, _hist([1.0] * GAMMA, 8))
    policy.choose(1)
    assert policy.choose(1) == 2  # 2 * 100 beats 8 * 10
    rates.by_tokens[8] = gain * 200.0 / 8  # width 8 now scores gain * score(2)
    assert policy.choose(1) == (8 if switches else 2)


def test_forced_width_and_full_steps():
    policy = _policy(_table_mi355x(), forced_width=5)
    assert [policy.choose(bs) for bs in (1, 64, 256)] == [5, 5, 5]  # even unmeasured
    assert policy.choose(64, full=True) == GAMMA + 1
    measured = _policy(_table_mi355x())
    measured.observe(8, _hist(MI355X_HAZARDS, 8))
    measured.choose(256)
    assert measured.choose(256) == 3
    assert measured.choose(256, full=True) == GAMMA + 1  # grammar / logprob steps
    assert measured.choose(256) == 3


@pytest.mark.parametrize("kwargs,match", [
    ({"widths": (0, 8)}, "contains 0"),
    ({"widths": (3, 9, 8)}, "contains 9"),
    ({"widths": (3, 4)}, "lacks the full width 8"),
    ({"widths": (3, 8), "forced_width": 4}, "forced_width=4 is not a captured width"),
    ({"widths": (3, 8), "forced_width": 9}, "forced_width=9"),
    ({"decay": 1.5}, "decay"),
    ({"switch_margin": -0.1}, "switch_margin"),
    ({"refresh_every": 0}, "refresh_every"),
    ({"histogram_lag": -1}, "histogram_lag"),
])
def test_bad_configuration_is_refused_at_start_up(kwargs, match):
    kwargs.setdefault("widths", ALL_WIDTHS)
    with pytest.raises(ValueError, match=match):
        WidthPolicyConfig(gamma=GAMMA, **kwargs)


def test_bad_observations_are_refused():
    policy = _policy(_flat_table(), widths=(3, 8))
    with pytest.raises(ValueError, match="width=4 is not a captured width"):
        policy.observe(4, _hist([0.5] * GAMMA, 4))
    with pytest.raises(ValueError, match=r"shape \(7,\)"):
        policy.observe(8, torch.zeros(GAMMA))
    with pytest.raises(ValueError, match="more than 2 accepted drafts in a step of width 3"):
        policy.observe(3, _hist([0.5] * GAMMA, 8))
    with pytest.raises(ValueError, match="negative or non-finite"):
        policy.observe(8, torch.full((GAMMA + 1,), -1.0))
    with pytest.raises(ValueError, match="batch_size"):
        policy.choose(0)


def test_rates_of_a_fixed_table_are_read_once_with_the_same_scores(monkeypatch):
    """An ``SpsTable`` / ``TierRate`` never changes, so the policy keeps the rates it read per
    batch size; its scores and choices are those of a policy that reads them every step."""
    from dspark_compile.runtime import TierRate

    table = _table_mi355x()
    tiers = [(w * r, r) for r in (1, 2, 8, 64) for w in ALL_WIDTHS]
    for rate in (table, TierRate(table, tiers, 64, step_overhead_s=0.0005)):
        kept, fresh = _policy(rate), _policy(rate)
        fresh._rates = None  # read every step
        calls = []
        original = type(rate).steps_per_second
        monkeypatch.setattr(type(rate), "steps_per_second",
                            lambda self, *a: calls.append(a[1]) or original(self, *a))
        g = torch.Generator().manual_seed(0)
        for step in range(40):
            bs = (1, 2, 8, 64)[step % 4]
            hazards = (torch.rand(GAMMA, generator=g) * 0.5 + 0.45).tolist()
            for policy in (kept, fresh):
                width = policy.choose(bs)
                policy.observe(width, _hist(hazards, width))
            if step > 1:
                assert kept.scores(bs) == fresh.scores(bs)
                assert kept.width == fresh.width
        kept_calls = len(calls)
        calls.clear()
        kept.scores(8)
        assert calls == [], "a kept table is not read again"
        fresh.scores(8)
        assert calls == [8] and kept_calls > 0
        monkeypatch.undo()
