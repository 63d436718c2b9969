"""Temperature calibration: recovery of a known temperature, blending, saturation, static mode."""

from __future__ import annotations

import math

import pytest
import torch

from dspark_compile.runtime import CalibrationConfig, TemperatureCalibrator

GAMMA = 3
GRID_STEP = 2.0 ** (1.0 / 8.0)  # 49 points over 2^-3 .. 2^3


def _trace(gen, true_t: torch.Tensor, requests: int = 64):
    """A step whose raw confidence is sigmoid(z) while acceptance is sigmoid(z / true_t[k])."""
    z = 8.0 * torch.rand(requests, GAMMA, generator=gen, dtype=torch.float64) - 4.0
    ok = torch.rand(requests, GAMMA, generator=gen, dtype=torch.float64) < torch.sigmoid(z / true_t)
    accepted = torch.cumprod(ok.long(), 1).sum(1)  # [R]
    verified = torch.full((requests,), GAMMA)
    return torch.sigmoid(z).float(), accepted, verified


def _fit(true_t, steps: int, seed: int = 0, **kwargs) -> TemperatureCalibrator:
    gen = torch.Generator().manual_seed(seed)
    cal = TemperatureCalibrator(CalibrationConfig(gamma=GAMMA, **kwargs))
    true_t = torch.as_tensor(true_t, dtype=torch.float64)
    for _ in range(steps):
        cal.observe(*_trace(gen, true_t))
    return cal


def test_identity_at_cold_start():
    cal = TemperatureCalibrator(CalibrationConfig(gamma=GAMMA))
    c = torch.tensor([[0.01, 0.5, 0.99], [0.2, 0.7, 0.999]])
    assert cal.temperatures().tolist() == [1.0] * GAMMA
    torch.testing.assert_close(cal.calibrate(c), c, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("true_t", [0.5, 2.0])
def test_recovers_a_shared_temperature(true_t):
    cal = _fit([true_t] * GAMMA, steps=300)
    fitted = cal.temperatures()
    assert bool(((fitted / true_t).log().abs() <= 2 * math.log(GRID_STEP)).all()), fitted


def test_recovers_a_temperature_per_position():
    true_t = [0.5, 1.0, 3.0]
    fitted = _fit(true_t, steps=400).temperatures()
    ratio = fitted / torch.tensor(true_t, dtype=torch.float64)
    assert bool((ratio.log().abs() <= 2 * math.log(GRID_STEP)).all()), fitted


def test_position_without_trials_borrows_the_pooled_fit():
    gen = torch.Generator().manual_seed(3)
    cal = TemperatureCalibrator(CalibrationConfig(gamma=GAMMA))
    for _ in range(200):
        conf, accepted, _ = _trace(gen, torch.tensor(2.0, dtype=torch.float64))
        verified = torch.ones_like(accepted)  # only position 0 is ever judged
        cal.observe(conf, torch.minimum(accepted, verified), verified)
    t = cal.temperatures()
    assert float(cal.trials[1:].sum()) == 0.0
    assert t[1] == t[2]
    # Pooled and own fit of position 0 are one grid point g (same bins); with w = n / (n + 64):
    # log T_1 = w g (pooled, blended toward identity), log T_0 = w g + (1 - w) w g.
    n = float(cal.trials.sum())
    w = n / (n + 64.0)
    g = math.log(t[1]) / w
    assert math.isclose(math.log(t[0]), w * g + (1 - w) * w * g, rel_tol=1e-9)
    assert math.isclose(g / math.log(GRID_STEP), round(g / math.log(GRID_STEP)), abs_tol=1e-9)
    assert abs(g - math.log(2.0)) <= 2 * math.log(GRID_STEP)


def test_trials_and_hits_follow_the_definition():
    cal = TemperatureCalibrator(CalibrationConfig(gamma=GAMMA))
    conf = torch.full((4, GAMMA), 0.5)  # logit 0: bin 8 of 16
    accepted = torch.tensor([0, 1, 3, 2])
    verified = torch.tensor([3, 1, 3, 2])
    cal.observe(conf, accepted, verified)
    # trial: k < min(accepted + 1, verified); hit: k < accepted
    assert cal.trials[:, 8].tolist() == [4.0, 2.0, 1.0]
    assert cal.hits[:, 8].tolist() == [3.0, 2.0, 1.0]
    assert float(cal.trials.sum()) == 7.0
    cal.observe(conf, accepted, verified)
    assert cal.trials[:, 8].tolist() == [4 * 0.999 + 4, 2 * 0.999 + 2, 0.999 + 1]


def test_saturated_confidences_are_counted_and_stay_verifiable():
    cal = TemperatureCalibrator(CalibrationConfig(gamma=GAMMA))
    conf = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    cal.observe(conf, torch.tensor([0, 3]), torch.tensor([3, 3]))
    assert float(cal.trials.sum()) == 4.0  # 1 + 3 trials, none lost
    assert float(cal.trials[0, 0]) == 1.0 and float(cal.trials[0, 15]) == 1.0
    assert float(cal.trials[1, 0]) == 1.0 and float(cal.trials[2, 0]) == 1.0
    out = cal.calibrate(torch.tensor([[0.0, 1.0, 0.5]]))
    assert bool(torch.isfinite(out).all())
    assert 1e-6 < float(out[0, 0]) < 1e-3  # sigmoid(-8 / T): low, but a candidate
    assert float(out[0, 1]) < 1.0


def test_nan_confidence_is_not_counted_and_stays_nan():
    cal = TemperatureCalibrator(CalibrationConfig(gamma=GAMMA))
    conf = torch.tensor([[float("nan"), 0.5, 0.5]])
    cal.observe(conf, torch.tensor([3]), torch.tensor([3]))
    assert float(cal.trials.sum()) == 2.0
    assert math.isnan(float(cal.calibrate(conf)[0, 0]))


def test_static_temperature_is_fixed():
    cal = TemperatureCalibrator(CalibrationConfig(gamma=GAMMA, static_temperature=2.0))
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        cal.observe(*_trace(gen, torch.tensor(0.5, dtype=torch.float64)))
    assert cal.temperatures().tolist() == [2.0] * GAMMA
    assert float(cal.trials.sum()) == 0.0
    c = torch.tensor([[0.2, 0.5, 0.9]])
    want = torch.sigmoid(torch.logit(c.double()) / 2.0).float()
    torch.testing.assert_close(cal.calibrate(c), want)


def test_same_trace_same_temperatures_bit_for_bit():
    a = _fit([2.0] * GAMMA, steps=30, seed=7).temperatures()
    b = _fit([2.0] * GAMMA, steps=30, seed=7).temperatures()
    assert torch.equal(a, b)


def test_observe_and_calibrate_need_no_host_sync():
    cal = TemperatureCalibrator(CalibrationConfig(gamma=GAMMA), device="meta")
    conf = torch.empty(5, GAMMA, device="meta")
    counts = torch.empty(5, dtype=torch.int64, device="meta")
    cal.observe(conf, counts, counts)
    assert cal.calibrate(conf).shape == (5, GAMMA)


@pytest.mark.parametrize("kwargs,match", [
    ({"gamma": 0}, "gamma"),
    ({"static_temperature": 0.0}, "static_temperature"),
    ({"static_temperature": float("inf")}, "static_temperature"),
    ({"decay": 0.0}, "decay"),
    ({"num_bins": 0}, "num_bins"),
    ({"grid_span": 1.0}, "grid_span"),
    ({"prior_trials": -1.0}, "prior_trials"),
])
def test_bad_config_is_refused(kwargs, match):
    kwargs.setdefault("gamma", GAMMA)
    with pytest.raises(ValueError, match=match):
        CalibrationConfig(**kwargs)
