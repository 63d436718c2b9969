"""Planner: budget by argmax Theta, prefix lengths, options, determinism, refusals."""

from __future__ import annotations

import math

import numpy as np

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_compile.runtime import (
    AdditiveStepModel,
    Planner,
    PlannerConfig,
    SpsEntry,
    SpsMetadata,
    SpsTable,
    plan_lengths,
    plan_verify,
    survival,
)

RANK = PlannerConfig(flat_tolerance=None)  # the ranking itself, never the flat shortcut
META = SpsMetadata(gpu="test", model="test")
SETTINGS = settings(max_examples=60, deadline=None)

# Ties on purpose: 0, 1 and a few repeated values besides arbitrary probabilities.
probability = st.one_of(st.sampled_from([0.0, 1.0, 0.5, 0.25, 0.9]),
                        st.floats(0.0, 1.0, allow_nan=False))


@st.composite
def cases(draw, max_r=5, max_gamma=4):
    r = draw(st.integers(1, max_r))
    gamma = draw(st.integers(1, max_gamma))
    conf = torch.tensor(draw(st.lists(probability, min_size=r * gamma, max_size=r * gamma)),
                        dtype=torch.float32).reshape(r, gamma)
    top = r * (gamma + 1) + 2
    rates = draw(st.lists(st.floats(1.0, 100.0), min_size=top, max_size=top))
    table = SpsTable(META, tuple(SpsEntry(b + 1, rate) for b, rate in enumerate(rates)))
    return conf, table


def _ranked_reference(conf: torch.Tensor) -> list[tuple[float, int, int]]:
    """(survival, position, request) sorted by survival desc, position asc, request asc."""
    surv = survival(conf).tolist()
    items = [(s, j, r) for r, row in enumerate(surv) for j, s in enumerate(row)]
    return sorted(items, key=lambda t: (-t[0], t[1], t[2]))


def _brute_force_k(conf: torch.Tensor, table, min_survival: float = 1e-6) -> int:
    r = conf.shape[0]
    ranked = [s for s, _, _ in _ranked_reference(conf) if s >= min_survival]
    best_k, best, mass = 0, -math.inf, 0.0
    for k in range(len(ranked) + 1):
        if k:
            mass += ranked[k - 1]
        theta = (r + mass) * float(table.steps_per_second(torch.tensor([r + k]), r)[0])
        if theta > best:
            best_k, best = k, theta
    return best_k


def _reference_lens(conf: torch.Tensor, k: int) -> list[int]:
    counts = [0] * conf.shape[0]
    for _, _, r in _ranked_reference(conf)[:k]:
        counts[r] += 1
    return [1 + c for c in counts]


@SETTINGS
@given(cases())
def test_budget_matches_brute_force_and_lengths_are_top_k_prefixes(case):
    conf, table = case
    r, gamma = conf.shape
    plan = plan_verify(conf, table, RANK)
    assert plan.num_draft_tokens == _brute_force_k(conf, table)
    assert plan.lens.dtype == torch.int32 and plan.lens.shape == (r,)
    assert int(plan.lens.sum()) - r == plan.num_draft_tokens
    assert plan.num_tokens == int(plan.lens.sum())
    assert int(plan.lens.min()) >= 1 and int(plan.lens.max()) <= gamma + 1
    assert plan.lens.tolist() == _reference_lens(conf, plan.num_draft_tokens)
    # Prefix: the picks of every row are its first len - 1 positions.
    picked = {(rr, j) for _, j, rr in _ranked_reference(conf)[: plan.num_draft_tokens]}
    for rr, length in enumerate(plan.lens.tolist()):
        assert {j for q, j in picked if q == rr} == set(range(length - 1))


@SETTINGS
@given(cases(), st.data())
def test_raising_a_requests_confidence_never_shortens_it(case, data):
    conf, table = case
    r = data.draw(st.integers(0, conf.shape[0] - 1))
    factor = data.draw(st.floats(0.0, 1.0))
    raised = conf.clone()
    raised[r] = raised[r] + factor * (1.0 - raised[r])  # elementwise >= and still <= 1
    base = plan_verify(conf, table, budget_confidence=conf)
    more = plan_verify(raised, table, budget_confidence=conf)  # same lagged budget
    assert int(more.lens[r]) >= int(base.lens[r])


@SETTINGS
@given(cases())
def test_same_inputs_same_plan_bit_for_bit(case):
    conf, table = case
    a = plan_verify(conf, table)
    b = plan_verify(conf.clone().double(), table)
    c = Planner(table)(conf.clone())
    assert torch.equal(a.lens, b.lens) and torch.equal(a.lens, c.lens)
    assert a.num_draft_tokens == b.num_draft_tokens == c.num_draft_tokens


@pytest.mark.parametrize("levels", [None, 4])
def test_large_batch_matches_the_reference_ordering(levels):
    gen = torch.Generator().manual_seed(1)
    conf = torch.rand(256, 7, generator=gen)
    if levels:  # many exact ties across requests and positions
        conf = torch.floor(conf * levels) / levels + 1.0 / levels
    table = SpsTable(META, tuple(SpsEntry(b, 1000.0 / (1.0 + b / 300.0))
                                 for b in (1, 64, 256, 300, 512, 1024, 2048)))
    plan = plan_verify(conf, table)
    assert plan.lens.tolist() == _reference_lens(conf, plan.num_draft_tokens)
    assert plan.num_draft_tokens == _brute_force_k(conf, table)
    assert 0 < plan.num_draft_tokens < 256 * 7


def test_additive_model_as_the_rate():
    model = AdditiveStepModel(bias=1.5e-3, request_knots=(1, 64), request_seconds=(0.0, 1e-3),
                              token_knots=(1, 512, 2048), token_seconds=(0.0, 4e-3, 2e-2))
    conf = torch.rand(64, 7, generator=torch.Generator().manual_seed(2))
    plan = plan_verify(conf, model)
    assert plan.num_draft_tokens == _brute_force_k(conf, model)
    assert plan.lens.tolist() == _reference_lens(conf, plan.num_draft_tokens)


def test_ties_go_to_the_lower_position_then_the_lower_request():
    conf = torch.tensor([[1.0, 1.0, 0.5], [1.0, 1.0, 0.5]])  # survivals [1, 1, .5] twice
    lens = {k: plan_verify(conf, None, PlannerConfig(budget_frac=k / 6)).lens.tolist()
            for k in range(1, 7)}
    assert lens == {1: [2, 1], 2: [2, 2], 3: [3, 2], 4: [3, 3], 5: [4, 3], 6: [4, 4]}


def test_theta_ties_go_to_the_smallest_budget():
    conf = torch.tensor([[1.0, 0.5, 1.0]])  # survivals 1, .5, .5
    # Theta(k) = (1 + P_k) * SPS(1 + k) = 1*3, 2*1.5, 2.5*1.2, 3*1 : all equal to 3.
    table = SpsTable(META, (SpsEntry(1, 3.0), SpsEntry(2, 1.5), SpsEntry(3, 1.2),
                            SpsEntry(4, 1.0)))
    rates = table.rate_span(1, 4, 1).tolist()
    assert [rate * (1 + p) for rate, p in zip(rates, (0, 1, 1.5, 2))] == [3.0] * 4
    assert plan_verify(conf, table).num_draft_tokens == 0
    table = SpsTable(META, (SpsEntry(1, 2.0), SpsEntry(2, 1.5), SpsEntry(3, 1.2),
                            SpsEntry(4, 1.0)))
    assert plan_verify(conf, table).num_draft_tokens == 1


def test_flat_step_cost_verifies_every_draft_without_ranking(monkeypatch):
    """Where the step rate at R (gamma + 1) tokens is within flat_tolerance of the best rate,
    the plan is the full width whatever the confidences, and nothing is ranked; a rate that
    falls past the tolerance is ranked as before."""
    from dspark_compile.runtime import planner as planner_module

    conf = torch.tensor([[0.9, 1e-4, 1.0], [0.5, 1e-8, 1e-2]])
    ranked = []
    real_rank = planner_module._rank
    monkeypatch.setattr(planner_module, "_rank", lambda c: ranked.append(1) or real_rank(c))
    flat = SpsTable(META, (SpsEntry(1, 100.0), SpsEntry(8, 96.0)))  # 4% slower at 8 tokens
    plan = plan_verify(conf, flat)
    assert plan.lens.tolist() == [4, 4] and plan.num_draft_tokens == 6 and not ranked
    steep = SpsTable(META, (SpsEntry(1, 100.0), SpsEntry(8, 92.0)))  # 8%: past 5%
    plan = plan_verify(conf, steep)
    assert ranked and plan.lens.tolist() == plan_verify(conf, steep, RANK).lens.tolist()
    assert plan.lens.tolist() != [4, 4]
    tight = plan_verify(conf, flat, PlannerConfig(flat_tolerance=0.02))
    assert tight.lens.tolist() == plan_verify(conf, flat, RANK).lens.tolist() != [4, 4]
    for config in (PlannerConfig(budget_frac=0.5), PlannerConfig(threshold=0.5)):
        assert plan_verify(conf, flat, config).lens.tolist() != [4, 4]  # their own rules
    with pytest.raises(ValueError, match="flat_tolerance"):
        PlannerConfig(flat_tolerance=1.5)


def test_flat_step_still_refuses_bad_confidence_and_never_transposes(monkeypatch):
    """The flat rule's shortcut reads no confidence, but it is checked all the same: a NaN, a
    value past 1 or a bad shape is refused by name, through plan_lengths and plan_verify alike;
    a good one is never copied to the ranking's position-major layout."""
    from dspark_compile.runtime import planner as planner_module

    flat = SpsTable(META, (SpsEntry(1, 100.0), SpsEntry(8, 96.0)))
    copies = []
    real = planner_module._position_major
    monkeypatch.setattr(planner_module, "_position_major",
                        lambda h: copies.append(1) or real(h))
    good = np.array([[0.9, 0.2, 1.0], [0.5, 0.0, -0.0]], np.float32)
    assert plan_lengths(good, flat).tolist() == [4, 4] and not copies
    for bad, match in ((np.float32("nan"), r"confidence\[1, 2\]=nan"),
                       (1.5, r"confidence\[1, 2\]=1.5")):
        conf = good.copy()
        conf[1, 2] = bad
        for plan in (plan_lengths, lambda c, r: plan_verify(torch.from_numpy(c), r)):
            with pytest.raises(ValueError, match=match):
                plan(conf, flat)
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        plan_lengths(good[0], flat)
    # float64 rounds to float32 first, as the ranking reads it: 1 + 1e-12 is 1.0
    assert plan_lengths(good.astype(np.float64) + np.array([[0, 0, 1e-12], [0, 0, 0]]),
                        flat).tolist() == [4, 4]


def _counting_rank(monkeypatch) -> list:
    from dspark_compile.runtime import planner as planner_module

    ranked = []
    real = planner_module._rank
    monkeypatch.setattr(planner_module, "_rank", lambda c: ranked.append(1) or real(c))
    return ranked


def test_planner_goes_quiet_after_a_ranking_that_did_not_pay(monkeypatch):
    """A rate that falls past the flat rule's tolerance, with drafts sure enough that the best
    budget is every candidate: the ranking saved nothing, so Planner verifies the next
    quiet_steps steps whole without ranking (the confidences still checked), then ranks again.
    plan_verify, stateless, ranks every step."""
    ranked = _counting_rank(monkeypatch)
    table = SpsTable(META, (SpsEntry(1, 100.0), SpsEntry(4, 100.0), SpsEntry(8, 90.0)))
    sure = np.full((1, 7), 0.99, np.float32)
    planner = Planner(table, PlannerConfig(quiet_steps=3))
    assert planner.lengths(sure).tolist() == [8] and len(ranked) == 1  # ranked: all of them
    with pytest.raises(ValueError, match="not a probability"):  # checked while quiet too
        planner.lengths(np.full((1, 7), 1.5, np.float32))
    for _ in range(3):
        assert planner.lengths(sure).tolist() == [8]
    assert len(ranked) == 1  # three quiet steps
    assert planner.lengths(sure).tolist() == [8] and len(ranked) == 2  # then ranked again
    planner = Planner(table, PlannerConfig(quiet_steps=3))
    for _ in range(5):
        assert planner(torch.from_numpy(sure)).lens.tolist() == [8]
    assert len(ranked) == 4  # steps 1 and 5 of this one
    ranked.clear()
    for _ in range(3):
        assert plan_verify(torch.from_numpy(sure), table).lens.tolist() == [8]
    assert len(ranked) == 3
    ranked.clear()
    planner = Planner(table, PlannerConfig(quiet_steps=0))
    for _ in range(3):
        planner.lengths(sure)
    assert len(ranked) == 3


def test_planner_keeps_ranking_where_the_ranking_pays(monkeypatch):
    """Unsure drafts on a steep rate: the best budget (no draft) beats verifying them all by far
    more than the margin, so every step is ranked and trimmed (to the last draft the 100-SPS
    part of the table still takes); a hard cap (budget_frac) or a
    threshold never goes quiet either."""
    ranked = _counting_rank(monkeypatch)
    steep = SpsTable(META, (SpsEntry(1, 100.0), SpsEntry(8, 50.0)))
    unsure = np.full((2, 7), 0.1, np.float32)
    planner = Planner(steep, PlannerConfig(quiet_steps=3))
    for _ in range(4):
        assert planner.lengths(unsure).tolist() == [4, 3]  # B = 7 of 16
    assert len(ranked) == 4
    sure = np.full((2, 7), 0.99, np.float32)
    table = SpsTable(META, (SpsEntry(1, 100.0), SpsEntry(8, 100.0), SpsEntry(16, 90.0)))
    for config in (PlannerConfig(quiet_steps=3, budget_frac=1.0),
                   PlannerConfig(quiet_steps=3, threshold=0.5)):
        ranked.clear()
        planner = Planner(table, config)
        for _ in range(3):
            planner.lengths(sure)
        assert len(ranked) == 3, config


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_quiet_steps_refuses_what_is_not_a_count(bad):
    with pytest.raises(ValueError, match="quiet_steps"):
        PlannerConfig(quiet_steps=bad)


def test_rank_cost_turns_ranking_off_where_it_cannot_pay_for_itself(monkeypatch):
    """With ``rank_cost_s``, a step cost that falls past the tolerance is still verified whole,
    unranked, when the most step time a budget could save (1 / SPS(full) - 1 / max SPS) is
    within the tolerance plus that cost; a steeper cost is ranked as before."""
    from dspark_compile.runtime import planner as planner_module

    conf = torch.tensor([[0.9, 1e-4, 1.0], [0.5, 1e-8, 1e-2]])
    ranked = []
    real_rank = planner_module._rank
    monkeypatch.setattr(planner_module, "_rank", lambda c: ranked.append(1) or real_rank(c))
    # 100 steps/s at 1 token, 92 at 8: the full step is 10.87 ms, the cheapest 10 ms, so a
    # budget saves at most 0.87 ms; 5% of the full step is 0.54 ms
    steep = SpsTable(META, (SpsEntry(1, 100.0), SpsEntry(8, 92.0)))
    assert plan_verify(conf, steep).lens.tolist() != [4, 4] and ranked
    ranked.clear()
    cheap = plan_verify(conf, steep, PlannerConfig(rank_cost_s=0.4e-3))  # 0.54 + 0.4 >= 0.87
    assert cheap.lens.tolist() == [4, 4] and cheap.num_draft_tokens == 6 and not ranked
    costly = plan_verify(conf, steep, PlannerConfig(rank_cost_s=0.3e-3))  # 0.54 + 0.3 < 0.87
    assert ranked and costly.lens.tolist() == plan_verify(conf, steep, RANK).lens.tolist()
    assert plan_verify(conf, steep, PlannerConfig(rank_cost_s=1.0, flat_tolerance=None)) \
        .lens.tolist() == costly.lens.tolist()  # no flat rule: always ranked
    for bad in (-1e-3, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ValueError, match="rank_cost_s"):
            PlannerConfig(rank_cost_s=bad)


def test_small_survivals_are_not_candidates():
    conf = torch.tensor([[0.9, 1e-4, 1.0], [0.9, 1e-3, 1e-2]])  # 9e-5, 9e-5 / 9e-4, 9e-6
    flat = SpsTable(META, (SpsEntry(1, 10.0),))  # constant rate: Theta grows with every token
    assert plan_verify(conf, flat, RANK).lens.tolist() == [4, 4]
    tiny = torch.tensor([[1e-3, 1e-3, 1e-3]])  # 1e-3, 1e-6, 1e-9
    assert plan_verify(tiny, flat, RANK).lens.tolist() == [3]


def test_no_table_verifies_everything_and_cap_is_hard():
    conf = torch.rand(5, 4, generator=torch.Generator().manual_seed(0))
    assert plan_verify(conf, None).lens.tolist() == [5] * 5
    flat = SpsTable(META, (SpsEntry(1, 10.0),))
    capped = plan_verify(conf, flat, PlannerConfig(budget_frac=0.3))
    assert capped.num_draft_tokens == math.floor(0.3 * 20)
    assert capped.lens.tolist() == _reference_lens(conf, 6)


def test_threshold_mode_verifies_survivals_above_it():
    conf = torch.tensor([[0.9, 0.9, 0.5], [0.4, 1.0, 1.0]])  # .9 .81 .405 / .4 .4 .4
    plan = plan_verify(conf, None, PlannerConfig(threshold=0.41))
    assert plan.lens.tolist() == [3, 1]
    assert plan_verify(conf, None, PlannerConfig(threshold=0.4)).lens.tolist() == [4, 4]


def test_budget_aligns_up_to_the_chosen_tier():
    conf = torch.full((4, 3), 0.5)  # survivals .5 .25 .125 per request
    cliff = SpsTable(META, (SpsEntry(1, 100.0), SpsEntry(9, 10.0)))  # B <= 8 fast
    assert plan_verify(conf, cliff).num_draft_tokens == 4  # B = 8
    small_tiers = PlannerConfig(tiers=((6, 4), (8, 2)))  # too few tokens / request slots
    assert plan_verify(conf, cliff, small_tiers).num_draft_tokens == 4
    big_tier = PlannerConfig(tiers=((12, 4), (6, 4), (8, 2)))
    assert plan_verify(conf, cliff, big_tier).lens.tolist() == [3, 3, 3, 3]  # 12 tokens paid
    conf_small = torch.full((4, 3), 0.5)
    slow = SpsTable(META, (SpsEntry(1, 100.0), SpsEntry(6, 10.0)))  # K = 1 (B = 5)
    assert plan_verify(conf_small, slow).num_draft_tokens == 1
    aligned = plan_verify(conf_small, slow, PlannerConfig(tiers=((8, 4), (16, 4))))
    assert aligned.num_draft_tokens == 4  # filled up to the 8-token tier
    assert aligned.lens.tolist() == [2, 2, 2, 2]
    capped = plan_verify(conf_small, slow, PlannerConfig(tiers=((8, 4),), budget_frac=0.25))
    assert capped.num_draft_tokens == 3  # the hard cap wins over alignment


def test_budget_lag_uses_the_confidence_of_lag_steps_ago():
    table = SpsTable(META, tuple(SpsEntry(b, 100.0 / (1 + b / 20)) for b in range(1, 40)))
    steps = [torch.full((3, 4), v) for v in (0.95, 0.3, 0.6, 0.8)]
    planner = Planner(table, PlannerConfig(budget_lag=2))
    for i, conf in enumerate(steps):
        plan = planner(conf)
        lagged = steps[max(0, i - 2)]
        want = plan_verify(conf, table, budget_confidence=lagged)
        assert plan.num_draft_tokens == want.num_draft_tokens
        assert torch.equal(plan.lens, want.lens)
    assert plan_verify(steps[3], table, budget_confidence=steps[1]).num_draft_tokens != \
        plan_verify(steps[3], table).num_draft_tokens


def test_lagged_budget_from_another_batch_size_is_clipped():
    table = SpsTable(META, (SpsEntry(1, 10.0),))
    big = torch.full((16, 4), 0.99)
    small = torch.tensor([[0.5, 0.5, 1e-7, 1.0]])
    plan = plan_verify(small, table, RANK, budget_confidence=big)
    assert plan.lens.tolist() == [3]  # 64 budgeted, 2 candidates now


@pytest.mark.parametrize("conf,match", [
    (torch.tensor([[0.5, float("nan")]]), r"confidence\[0, 1\]=nan is not a probability"),
    (torch.tensor([[0.5, 1.5]]), r"confidence\[0, 1\]=1.5 is not"),
    (torch.tensor([[0.5, 0.5], [-0.25, 0.5]]), r"confidence\[1, 0\]=-0.25 is not"),
    (torch.tensor([0.5, 0.5]), "shape"),
    (torch.zeros(0, 3), "shape"),
])
def test_bad_confidence_is_refused(conf, match):
    with pytest.raises(ValueError, match=match):
        plan_verify(conf, None)


def test_negative_zero_is_a_zero():
    conf = torch.tensor([[-0.0, 0.5], [0.5, 0.5]])
    plan = plan_verify(conf, None, PlannerConfig(budget_frac=0.5))
    assert plan.lens.tolist() == [1, 3]


@pytest.mark.parametrize("kwargs,match", [
    ({"budget_frac": 0.0}, "budget_frac"),
    ({"budget_frac": 1.5}, "budget_frac"),
    ({"threshold": float("nan")}, "threshold"),
    ({"min_survival": -1.0}, "min_survival"),
    ({"tiers": ((8,),)}, r"tiers\[0\]"),
    ({"tiers": ((8, 0),)}, r"tiers\[0\]"),
    ({"budget_lag": -1}, "budget_lag"),
])
def test_bad_config_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PlannerConfig(**kwargs)


def test_budget_confidence_of_another_drafter_is_refused():
    with pytest.raises(ValueError, match="gamma=4"):
        plan_verify(torch.full((2, 4), 0.5), None, budget_confidence=torch.full((2, 3), 0.5))


def test_follow_keeps_the_planner_for_the_same_rate_and_config_only():
    """``Planner.follow``: the same rate and config objects keep the planner (and its quiet
    steps); a swapped rate or config gets a fresh one built from it."""
    meta = SpsMetadata(gpu="test", model="test")
    rate = SpsTable(meta, (SpsEntry(1, 100.0), SpsEntry(4, 90.0)))
    config = PlannerConfig(quiet_steps=2)
    planner = Planner(rate, config)
    planner._quiet = 2
    assert planner.follow(rate, config) is planner and planner._quiet == 2
    other_rate = SpsTable(meta, (SpsEntry(1, 100.0), SpsEntry(4, 10.0)))
    fresh = planner.follow(other_rate, config)
    assert fresh is not planner and fresh.rate is other_rate and fresh._quiet == 0
    other_config = PlannerConfig(quiet_steps=2)  # equal, but another object: the caller swapped
    fresh = planner.follow(rate, other_config)
    assert fresh is not planner and fresh.config is other_config and fresh._quiet == 0
