"""Device planner (Triton, run by the interpreter on CPU): bitwise the host reference's plan."""

from __future__ import annotations

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
    plan_verify,
    survival,
)
from dspark_compile.runtime.planner_device import (
    device_tiers,
    exact_prefix_bound,
    plan_verify_device,
    sps_tensor,
)

META = SpsMetadata(gpu="test", model="test")
# The interpreter runs tl.sort in Python (~0.1 s a plan at these sizes): few, small examples.
SETTINGS = settings(max_examples=30, deadline=None)
# Ties, zeros, ones and values around the default min_survival (1e-6) on purpose.
probability = st.one_of(st.sampled_from([0.0, 1.0, 0.5, 0.25, 0.9, 1e-3, 1e-6, 9.99e-7]),
                        st.floats(0.0, 1.0, allow_nan=False))


@st.composite
def cases(draw, max_r=5, max_gamma=4):
    r = draw(st.integers(1, max_r))
    gamma = draw(st.integers(1, max_gamma))
    conf = torch.tensor(draw(st.lists(probability, min_size=r * gamma, max_size=r * gamma)),
                        dtype=torch.float32).reshape(r, gamma)
    top = r * (gamma + 1) + 2
    rates = draw(st.lists(st.sampled_from([1.0, 2.0, 3.0]) | st.floats(1.0, 100.0),
                          min_size=top, max_size=top))
    table = SpsTable(META, tuple(SpsEntry(b + 1, rate) for b, rate in enumerate(rates)))
    return conf, table


def _device_plan(conf, rate, config=PlannerConfig(), budget=None):
    """lens (list) and K (int) of the device path, building its tables as a caller would."""
    rb = conf.shape[0] if budget is None else budget.shape[0]
    sps = None if rate is None else sps_tensor(rate, rb, conf.shape[1], conf.device)
    tiers = device_tiers(config, conf.shape[0], conf.device) if config.tiers else None
    lens, k = plan_verify_device(conf, sps, config, budget_confidence=budget, tiers=tiers)
    assert lens.dtype == torch.int32 and k.dtype == torch.int32 and k.shape == ()
    return lens.tolist(), int(k)


def _assert_same(conf, rate, config=PlannerConfig(), budget=None):
    host = plan_verify(conf, rate, config, budget_confidence=budget)
    lens, k = _device_plan(conf, rate, config, budget)
    assert (lens, k) == (host.lens.tolist(), host.num_draft_tokens)


@SETTINGS
@given(cases(), st.sampled_from([1e-6, 1e-3, 1e-30]), st.sampled_from([0.0, 1e-3, 0.05]))
def test_rate_mode_matches_the_host_bitwise(case, min_survival, rank_cost_s):
    conf, table = case
    _assert_same(conf, table, PlannerConfig(min_survival=min_survival, rank_cost_s=rank_cost_s))


@settings(max_examples=25, deadline=None)
@given(cases(), st.sampled_from([None, 0.1, 0.5, 1.0]), st.sampled_from([None, 0.25, 0.81]),
       st.booleans())
def test_options_match_the_host(case, budget_frac, threshold, tiered):
    conf, table = case
    r, gamma = conf.shape
    tiers = ((r + 1, r), (2 * r + 1, r + 1), (r * gamma + r, 1), (r * (gamma + 2), 64))
    config = PlannerConfig(budget_frac=budget_frac, threshold=threshold,
                           tiers=tiers if tiered else ())
    _assert_same(conf, table, config)
    _assert_same(conf, None, config)


def test_budget_lag_matches_the_hosts_planner():
    table = SpsTable(META, tuple(SpsEntry(b, 100.0 / (1 + b / 20)) for b in range(1, 40)))
    steps = [torch.full((3, 4), v) for v in (0.95, 0.3, 0.6, 0.8)]
    steps[2][1, 2] = 0.0
    planner = Planner(table, PlannerConfig(budget_lag=2))
    ks = set()
    for i, conf in enumerate(steps):
        plan = planner(conf)
        lens, k = _device_plan(conf, table, budget=steps[max(0, i - 2)])
        assert (lens, k) == (plan.lens.tolist(), plan.num_draft_tokens)
        ks.add(k)
    assert len(ks) > 1, "the lag must change the budget in this sequence"
    small = torch.tensor([[0.5, 0.5, 1e-7, 1.0]])  # a lagged budget from a bigger batch
    _assert_same(small, SpsTable(META, (SpsEntry(1, 10.0),)), budget=torch.full((16, 4), 0.99))


def test_serial_sums_where_a_tree_could_round():
    # Survivals 1 and 3 * 2^-60 .. : float64 sums of these round, so the kernel must add in the
    # host's order (its exactness test fails here and the serial loop runs).
    conf = torch.tensor([[1.0, 1.0, 2.0 ** -30, 0.75], [1.0, 0.5, 2.0 ** -31, 0.5],
                         [1.0, 1.0, 1.0, 1e-20]])
    surv = survival(conf)
    config = PlannerConfig(min_survival=1e-30)
    assert not exact_prefix_bound(surv[surv >= 1e-30])
    flat = SpsTable(META, (SpsEntry(1, 10.0),))
    _assert_same(conf, flat, config)
    steep = SpsTable(META, tuple(SpsEntry(b, 100.0 / b) for b in range(1, 20)))
    _assert_same(conf, steep, config)
    assert exact_prefix_bound(torch.tensor([1.0, 0.5, 0.25]))


def test_ties_and_theta_ties_as_on_the_host():
    conf = torch.tensor([[1.0, 1.0, 0.5], [1.0, 1.0, 0.5]])
    for k in range(1, 7):
        _assert_same(conf, None, PlannerConfig(budget_frac=k / 6))
    tied = SpsTable(META, (SpsEntry(1, 3.0), SpsEntry(2, 1.5), SpsEntry(3, 1.2),
                           SpsEntry(4, 1.0)))
    assert _device_plan(torch.tensor([[1.0, 0.5, 1.0]]), tied) == ([1], 0)


def test_additive_model_bf16_and_a_strided_view():
    model = AdditiveStepModel(bias=1.5e-3, request_knots=(1, 64), request_seconds=(0.0, 1e-3),
                              token_knots=(1, 512, 2048), token_seconds=(0.0, 4e-3, 2e-2))
    conf = torch.rand(7, 9, generator=torch.Generator().manual_seed(2))
    _assert_same(conf, model)
    _assert_same(conf.bfloat16(), model)
    _assert_same(conf.t().contiguous().t(), model)  # column-major: strides are passed
    _assert_same(conf.double(), model)


def test_invalid_confidence_is_flagged_not_planned():
    for bad in (float("nan"), 1.5, -0.25):
        conf = torch.tensor([[0.5, bad], [0.9, 0.9]])
        assert _device_plan(conf, None) == ([1, 1], -1)
    assert _device_plan(torch.tensor([[-0.0, 0.5], [0.5, 0.5]]), None,
                        PlannerConfig(budget_frac=0.5)) == ([1, 3], 2)


@pytest.mark.parametrize("call,match", [
    (lambda: plan_verify_device(torch.zeros(3), None), r"shape \(3,\)"),
    (lambda: plan_verify_device(torch.zeros(2, 3, dtype=torch.int32), None), "dtype"),
    (lambda: plan_verify_device(torch.zeros(600, 15), None), "8192"),
    (lambda: plan_verify_device(torch.zeros(2, 3), torch.ones(5, dtype=torch.float64)),
     r"needs >= 9"),
    (lambda: plan_verify_device(torch.zeros(2, 3), torch.ones(9)), "float64"),
    (lambda: plan_verify_device(torch.zeros(2, 3), None, budget_confidence=torch.zeros(2, 4)),
     "gamma=4"),
    (lambda: plan_verify_device(torch.zeros(2, 3), None, PlannerConfig(tiers=((8, 2),))),
     "device_tiers"),
    (lambda: plan_verify_device(torch.zeros(2, 3), None,
                                tiers=torch.zeros(1, dtype=torch.int32)), "config.tiers"),
])
def test_bad_arguments_are_refused_before_launch(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.gpu
@pytest.mark.parametrize("r,gamma", [(1, 1), (64, 7), (256, 15), (512, 15)])
def test_gpu_sizes_of_interest_match_and_capture(r, gamma):
    gen = torch.Generator().manual_seed(r)
    conf = torch.rand(r, gamma, generator=gen) ** 0.3
    table = SpsTable(META, tuple(SpsEntry(b, 1000.0 / (1.0 + b / 300.0))
                                 for b in (1, 64, 256, 300, 512, 1024, 2048, 8192)))
    host = plan_verify(conf, table)
    dev = conf.cuda()
    sps = sps_tensor(table, r, gamma, "cuda")
    lens, k = plan_verify_device(dev, sps)
    assert (lens.tolist(), int(k)) == (host.lens.tolist(), host.num_draft_tokens)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_lens, g_k = plan_verify_device(dev, sps)
    dev.copy_(conf.flip(0).cuda())
    graph.replay()
    flipped = plan_verify(conf.flip(0), table)
    assert (g_lens.tolist(), int(g_k)) == (flipped.lens.tolist(), flipped.num_draft_tokens)
