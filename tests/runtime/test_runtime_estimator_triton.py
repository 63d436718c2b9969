"""Estimator kernels (Triton, interpreter on CPU) against the torch AcceptanceEstimator.

Tolerances (estimator_triton's docstring): features 1e-5, predictions 1 float32 ulp on the same
features, float64 state rtol 1e-9 after several refits; call counts and the refit schedule exact.
"""

from __future__ import annotations

import pytest
import torch

from dspark_compile.runtime import AcceptanceEstimator, EstimatorConfig, draft_logit_qmax
from dspark_compile.runtime.estimator_triton import (
    estimator_launch,
    feature_predict_triton,
    observe_triton,
)

STATE = ("slope", "bias", "count", "grad", "h_xx", "h_x1", "h_11")


def _pair(**kwargs):
    cfg = EstimatorConfig(**kwargs)
    return AcceptanceEstimator(cfg), AcceptanceEstimator(cfg)


def _step(gen, r: int, gamma: int, slope: float = 1.0):
    x = 2.0 * torch.randn(r, gamma, generator=gen)  # [R, gamma]
    ok = torch.rand(r, gamma, generator=gen) < torch.sigmoid(slope * x)
    accepted = torch.cumprod(ok.long(), 1).sum(1)  # [R]
    verified = torch.randint(0, gamma + 1, (r,), generator=gen)  # [R]; 0: nothing judged
    return x, torch.minimum(accepted, verified), verified


def _assert_state_close(a, b):
    for name in STATE:
        torch.testing.assert_close(getattr(b, name), getattr(a, name), rtol=1e-9, atol=1e-12,
                                   msg=lambda m, n=name: f"{n}: {m}")
    assert int(a.calls) == int(b.calls)


@pytest.mark.parametrize("r,gamma,vocab", [(1, 1, 1), (3, 4, 37), (2, 5, 2500)])
def test_feature_predict_matches_torch(r, gamma, vocab):
    gen = torch.Generator().manual_seed(vocab)
    est, _ = _pair(gamma=gamma, initial_slope=0.7, initial_bias=-0.3)
    logits = 3.0 * torch.randn(r, gamma, vocab, generator=gen)
    if vocab > 1:
        logits[0, 0, vocab // 2] = 1e4  # q_max rounds to 1: x clamps to 40
        logits[-1, -1, :] = 2.0  # all tied: the max is left out once, its equals stay
    temperature = torch.linspace(0.0, 2.0, r)  # row 0 greedy (scored at T = 1)
    x, p = feature_predict_triton(est, logits, temperature)
    torch.testing.assert_close(x, draft_logit_qmax(logits, temperature), rtol=1e-5, atol=1e-5)
    ulp = torch.finfo(torch.float32).eps
    torch.testing.assert_close(p, est.predict(x), rtol=ulp, atol=1e-30)
    if vocab > 1:
        assert float(x[0, 0]) == 40.0
        assert abs(float(x[-1, -1]) + torch.log(torch.tensor(vocab - 1.0))) < 1e-5


def test_observe_and_refit_match_torch_over_several_refits():
    gen = torch.Generator().manual_seed(1)
    ref, dev = _pair(gamma=5, refit_every=3, initial_slope=3.0, max_step=0.5)
    slopes = set()
    for _ in range(10):  # three refits, then one call into the next window
        step = _step(gen, 70, 5)  # 70 requests: two row tiles, the second partial
        ref.observe(*step)
        observe_triton(dev, *step)
        _assert_state_close(ref, dev)
        slopes.add(float(dev.slope))
    assert len(slopes) == 4, "a refit on every third call: four distinct slopes"
    assert float(dev.count.sum()) > 0  # the open window holds the last call


def test_observe_int32_counts_and_odd_gamma():
    gen = torch.Generator().manual_seed(2)
    ref, dev = _pair(gamma=3, refit_every=2)
    for _ in range(4):
        x, acc, ver = _step(gen, 5, 3)
        ref.observe(x, acc, ver)
        observe_triton(dev, x, acc.int(), ver.int())
    _assert_state_close(ref, dev)


def test_observe_is_deterministic():
    gen = torch.Generator().manual_seed(3)
    steps = [_step(gen, 130, 4) for _ in range(3)]
    runs = []
    for _ in range(2):
        est = AcceptanceEstimator(EstimatorConfig(gamma=4, refit_every=2))
        for step in steps:
            observe_triton(est, *step)
        runs.append(torch.cat([est.slope[None], est.bias, est.grad, est.h_xx]))
    assert torch.equal(runs[0], runs[1])


def test_non_finite_steps_are_dropped_and_slope_stays_non_negative():
    ref, dev = _pair(gamma=4, refit_every=1)
    x = torch.full((2, 4), float("nan"))
    counts = (torch.tensor([2, 1]), torch.tensor([4, 4]))
    ref.observe(x, *counts)
    observe_triton(dev, x, *counts)
    assert float(dev.slope) == 1.0 and dev.bias.tolist() == [0.0] * 4
    assert dev.count.tolist() == [0.0] * 4 and int(dev.calls) == 1
    gen = torch.Generator().manual_seed(4)
    ref, dev = _pair(gamma=4, refit_every=1, initial_slope=0.05)
    for _ in range(3):  # anti-correlated drafts push the slope down: halved or dropped
        step = _step(gen, 40, 4, slope=-3.0)
        ref.observe(*step)
        observe_triton(dev, *step)
        assert float(dev.slope) >= 0.0
    _assert_state_close(ref, dev)


def test_bad_arguments_are_refused():
    est = AcceptanceEstimator(EstimatorConfig(gamma=4))
    with pytest.raises(ValueError, match=r"\[R, gamma=4, V >= 1\]"):
        feature_predict_triton(est, torch.zeros(2, 3, 5), torch.ones(2))
    with pytest.raises(ValueError, match=r"temperature has shape \(3,\)"):
        feature_predict_triton(est, torch.zeros(2, 4, 5), torch.ones(3))
    with pytest.raises(ValueError, match="contiguous"):
        feature_predict_triton(est, torch.zeros(2, 5, 4).transpose(1, 2), torch.ones(2))
    with pytest.raises(ValueError, match="accepted has dtype"):
        observe_triton(est, torch.zeros(2, 4), torch.zeros(2), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="unknown kernel"):
        estimator_launch("_nope", 4, None)


@pytest.mark.gpu
def test_gpu_observe_captures_in_a_graph():
    gen = torch.Generator().manual_seed(5)
    ref = AcceptanceEstimator(EstimatorConfig(gamma=7, refit_every=2))
    dev = AcceptanceEstimator(EstimatorConfig(gamma=7, refit_every=2), device="cuda")
    x, acc, ver = _step(gen, 256, 7)
    bufs = [t.cuda() for t in (x, acc, ver)]
    observe_triton(dev, *bufs)  # compile outside the capture
    ref.observe(x, acc, ver)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        observe_triton(dev, *bufs)
    for _ in range(3):
        graph.replay()
        ref.observe(x, acc, ver)
    for name in STATE:
        torch.testing.assert_close(getattr(dev, name).cpu(), getattr(ref, name), rtol=1e-9,
                                   atol=1e-12)
    assert int(dev.calls) == int(ref.calls) == 4
