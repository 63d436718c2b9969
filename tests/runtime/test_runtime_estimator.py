"""Online acceptance estimator: features, IRLS convergence, safeguards, no host sync."""

from __future__ import annotations

import math

import pytest
import torch

from dspark_compile.runtime import AcceptanceEstimator, EstimatorConfig, draft_logit_qmax

GAMMA = 4
TRUE_BIAS = torch.tensor([1.0, -0.5, 0.5, -1.5], dtype=torch.float64)


def _step(gen, slope: float, bias: torch.Tensor, requests: int = 32, signal: bool = True):
    """One synthetic verify step: features, accepted and verified drafts per request."""
    x = 2.0 * torch.randn(requests, GAMMA, generator=gen, dtype=torch.float64)  # [R, gamma]
    logit = slope * x + bias if signal else torch.full_like(x, 0.4)
    ok = torch.rand(requests, GAMMA, generator=gen, dtype=torch.float64) < torch.sigmoid(logit)
    accepted = torch.cumprod(ok.long(), 1).sum(1)  # [R]: leading accepted drafts
    verified = torch.randint(1, GAMMA + 1, (requests,), generator=gen)  # [R]
    return x.float(), torch.minimum(accepted, verified), verified


def test_draft_logit_qmax_matches_the_definition():
    gen = torch.Generator().manual_seed(0)
    logits = 3.0 * torch.randn(3, GAMMA, 11, generator=gen)
    temperature = torch.tensor([0.0, 0.7, 2.0])  # row 0 greedy: scored at T = 1
    got = draft_logit_qmax(logits, temperature)
    t = torch.tensor([1.0, 0.7, 2.0], dtype=torch.float64)[:, None, None]
    q = torch.softmax(logits.double() / t, -1).amax(-1)
    torch.testing.assert_close(got.double(), torch.log(q / (1 - q)), rtol=1e-5, atol=1e-5)
    assert got.shape == (3, GAMMA) and got.dtype == torch.float32


def test_draft_logit_qmax_is_clamped_and_finite():
    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 2] = 1e4  # q_max rounds to 1
    logits[0, 1] = torch.tensor([-1e4, 0.0, -1e4, -1e4])
    got = draft_logit_qmax(logits, torch.zeros(1))
    assert got.tolist()[0][:2] == [40.0, 40.0]
    assert math.isclose(float(got[0, 2]), math.log(1 / 3), rel_tol=1e-6)  # uniform over 4
    assert float(draft_logit_qmax(torch.zeros(2, 1, 1), torch.ones(2))[0, 0]) == 40.0  # V = 1


def _run(estimator, gen, calls, **kwargs):
    for _ in range(calls):
        estimator.observe(*_step(gen, **kwargs))


def test_slope_recovers_from_three_to_one_within_ten_refits():
    gen = torch.Generator().manual_seed(1)
    est = AcceptanceEstimator(EstimatorConfig(gamma=GAMMA, initial_slope=3.0))
    _run(est, gen, 99, slope=1.0, bias=TRUE_BIAS)
    assert float(est.slope) == 3.0  # no refit before the 100th call
    _run(est, gen, 1, slope=1.0, bias=TRUE_BIAS)
    assert float(est.slope) != 3.0
    _run(est, gen, 900, slope=1.0, bias=TRUE_BIAS)  # ten refits in all
    assert 0.9 <= float(est.slope) <= 1.1
    torch.testing.assert_close(est.bias, TRUE_BIAS, atol=0.4, rtol=0.0)


def test_slope_falls_without_signal_and_never_turns_negative():
    gen = torch.Generator().manual_seed(2)
    est = AcceptanceEstimator(EstimatorConfig(gamma=GAMMA))
    history = []
    for _ in range(20):
        _run(est, gen, 100, slope=0.0, bias=TRUE_BIAS, signal=False)
        history.append(float(est.slope))
    assert min(history) >= 0.0
    assert history[-1] <= 0.1


def test_slope_stays_non_negative_on_anti_correlated_drafts():
    gen = torch.Generator().manual_seed(3)
    est = AcceptanceEstimator(EstimatorConfig(gamma=GAMMA, initial_slope=0.5))
    for _ in range(5):
        _run(est, gen, 100, slope=-2.0, bias=TRUE_BIAS)
        assert float(est.slope) >= 0.0
    assert float(est.slope) < 0.5


def _auc(score: torch.Tensor, label: torch.Tensor) -> float:
    """Probability that a random positive outranks a random negative (ties count half)."""
    pos, neg = score[label], score[~label]
    greater = (pos[:, None] > neg[None, :]).double().mean()
    equal = (pos[:, None] == neg[None, :]).double().mean()
    return float(greater + 0.5 * equal)


def test_auc_beats_the_raw_qmax_product():
    gen = torch.Generator().manual_seed(4)
    est = AcceptanceEstimator(EstimatorConfig(gamma=GAMMA))
    _run(est, gen, 500, slope=1.0, bias=TRUE_BIAS)
    x, accepted, _ = _step(gen, 1.0, TRUE_BIAS, requests=512)
    label = (torch.arange(GAMMA)[None, :] < accepted[:, None]).reshape(-1)  # draft accepted
    learned = torch.cumprod(est.predict(x).double(), 1).reshape(-1)
    raw = torch.cumprod(torch.sigmoid(x.double()), 1).reshape(-1)  # product of q_max
    auc_learned, auc_raw = _auc(learned, label), _auc(raw, label)
    assert auc_learned > auc_raw + 0.01, (auc_learned, auc_raw)


def test_labels_stop_at_the_first_rejection_and_at_the_verified_drafts():
    est = AcceptanceEstimator(EstimatorConfig(gamma=GAMMA, refit_every=1000))
    x = torch.zeros(3, GAMMA)
    est.observe(x, torch.tensor([1, 4, 0]), torch.tensor([4, 4, 0]))
    # request 0: drafts 0 (hit), 1 (miss); request 1: all four hits; request 2: nothing judged.
    assert est.count.tolist() == [2.0, 2.0, 1.0, 1.0]
    # p = 0.5 everywhere: d/dbias_k = sum(label - 0.5) over judged drafts.
    assert est.grad[1:].tolist() == [1.0, 0.0, 0.5, 0.5]


def test_each_parameter_moves_at_most_max_step_per_refit():
    gen = torch.Generator().manual_seed(5)
    est = AcceptanceEstimator(EstimatorConfig(gamma=GAMMA, initial_slope=3.0, max_step=0.5))
    before = torch.cat([est.slope[None], est.bias]).clone()
    _run(est, gen, 100, slope=1.0, bias=TRUE_BIAS)
    after = torch.cat([est.slope[None], est.bias])
    moved = (after - before).abs()
    assert float(moved.max()) <= 0.5 + 1e-12
    assert float(moved[0]) == 0.5  # the slope wanted to move further


def test_non_finite_steps_are_dropped():
    est = AcceptanceEstimator(EstimatorConfig(gamma=GAMMA, refit_every=1))
    x = torch.full((2, GAMMA), float("nan"))
    est.observe(x, torch.tensor([2, 1]), torch.tensor([4, 4]))
    assert float(est.slope) == 1.0 and est.bias.tolist() == [0.0] * GAMMA
    assert est.count.tolist() == [0.0] * GAMMA  # the window restarted anyway


def test_observe_needs_no_host_sync():
    # Meta tensors have no data: any .item(), bool() or Python if on a value would raise.
    est = AcceptanceEstimator(EstimatorConfig(gamma=GAMMA, refit_every=2), device="meta")
    x = torch.empty(5, GAMMA, device="meta")
    counts = torch.empty(5, dtype=torch.int64, device="meta")
    for _ in range(3):
        est.observe(x, counts, counts)
    assert est.predict(x).shape == (5, GAMMA)


@pytest.mark.parametrize("kwargs,match", [
    ({"gamma": 0}, "gamma"),
    ({"gamma": 4, "initial_slope": -1.0}, "initial_slope"),
    ({"gamma": 4, "refit_every": 0}, "refit_every"),
    ({"gamma": 4, "ridge": 0.0}, "ridge"),
    ({"gamma": 4, "slope_halvings": -1}, "slope_halvings"),
    ({"gamma": 4, "max_step": 0.0}, "max_step"),
])
def test_bad_config_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EstimatorConfig(**kwargs)


def test_bad_shapes_are_refused():
    est = AcceptanceEstimator(EstimatorConfig(gamma=GAMMA))
    with pytest.raises(ValueError, match=r"\[R, gamma=4\]"):
        est.observe(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long),
                    torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="accepted has dtype"):
        est.observe(torch.zeros(2, GAMMA), torch.zeros(2), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"verified has shape \(3,\)"):
        est.observe(torch.zeros(2, GAMMA), torch.zeros(2, dtype=torch.long),
                    torch.zeros(3, dtype=torch.long))
