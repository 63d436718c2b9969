"""Triton kernels of :class:`~dspark_compile.runtime.estimator.AcceptanceEstimator`.

Two launches per step, on the estimator's own state tensors (the torch path and these kernels
can take turns on one estimator), with no host sync and shape-only launch arguments, so both
can be captured in a CUDA graph:

- :func:`feature_predict_triton`: ``x = logit(q_max)`` of the temperature-scaled draft logits
  (:func:`~dspark_compile.runtime.estimator.draft_logit_qmax`) and ``p = sigmoid(slope * x +
  bias_k)`` in one pass over the vocabulary. Grid ``(R, gamma)``; a program streams its row in
  ``BLOCK_V`` tiles keeping the running max ``m`` and ``s = sum exp(z - m)`` over every element
  but one instance of the max (a new max moves the old one into ``s``), so ``x = -log(s)``
  stays finite where ``q_max`` rounds to 1, as the torch path's "logsumexp without the max".
- :func:`observe_triton`: labels, IRLS statistics, call counter and the guarded Newton refit
  (``EstimatorConfig``) in one program: the batch is read in ``[BLOCK_R, G_PAD]`` tiles into
  per-lane float64 accumulators that are reduced once at the end (a fixed order: the same
  inputs give the same bits), then the refit is applied with selects when the device counter
  says it is due.

Precision (what the tests check): the state stays float64 like the torch path. Sums are added
in another order than torch's and ``exp`` comes from another library, so statistics and
parameters agree to ~1e-12 relative, not bitwise (tests: rtol 1e-9 after several refits); the
float32 features agree to 1e-5 (float32 logsumexp in another order) and the float32
predictions to 1 float32 ulp of ``AcceptanceEstimator.predict`` on the same features. Calls
and the refit schedule are exact.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from ..kernels.targets import TargetConfig, target_for_device
from ._checks import check_outcomes
from .estimator import AcceptanceEstimator

__all__ = ["feature_predict_triton", "observe_triton", "estimator_launch"]

_X_CLAMP = tl.constexpr(40.0)  # as estimator._X_CLAMP
_BLOCK_R = 64  # requests per tile of the observe loop: 64 x 16 float64 per accumulator
_MAX_BLOCK_V = 2048  # vocabulary tile of the feature pass (8 KB of float32 logits)


@triton.jit
def _feature_predict_kernel(logits_ptr, temperature_ptr, slope_ptr, bias_ptr, x_ptr, out_ptr,
                            gamma, vocab, stride_lr, stride_lk, BLOCK_V: tl.constexpr):
    """One (request, position) row: ``x`` (float32) and ``p`` (float32) into ``[R, gamma]``."""
    r = tl.program_id(0)
    k = tl.program_id(1)
    t = tl.load(temperature_ptr + r).to(tl.float32)
    t = tl.where(t > 0.0, t, 1.0)  # greedy rows are scored at T = 1
    row = logits_ptr + r.to(tl.int64) * stride_lr + k * stride_lk
    offs = tl.arange(0, BLOCK_V)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    v0 = tl.zeros([], tl.int32)
    while v0 < vocab:  # a while, not range(vocab): triton 3.6's interpreter fails at vocab 1
        ok = v0 + offs < vocab
        z = tl.load(row + v0 + offs, mask=ok, other=float("-inf")).to(tl.float32) / t
        bm = tl.max(z, 0)
        new_m = tl.maximum(m, bm)
        first = tl.min(tl.where(z == bm, offs, BLOCK_V), 0)  # one instance of the block max
        skip = offs == tl.where(bm > m, first, BLOCK_V)  # a new max is left out, not an equal
        ex = tl.where(ok & ~skip, tl.exp(z - new_m), 0.0)
        s = tl.where(bm > m, (s + 1.0) * tl.exp(m - new_m), s) + tl.sum(ex, 0)
        m = new_m
        v0 += BLOCK_V
    # s < 1e-30 (V = 1, or q_max rounding to 1) gives -log(s) > 69: clamped to 40 either way.
    x = tl.minimum(tl.maximum(-tl.log(tl.maximum(s, 1e-30)), -_X_CLAMP), _X_CLAMP)
    logit = tl.load(slope_ptr) * x.to(tl.float64) + tl.load(bias_ptr + k)
    p = 1.0 / (1.0 + tl.exp(-logit))
    tl.store(x_ptr + r * gamma + k, x)
    tl.store(out_ptr + r * gamma + k, p.to(tl.float32))


@triton.jit
def _accumulate(x_ptr, accepted_ptr, verified_ptr, slope, bias, R, gamma, stride_xr,
                BLOCK_R: tl.constexpr, G_PAD: tl.constexpr):
    """Per-position sums over the batch: count, d/dbias, h_xx, h_x1, h_11 ([G_PAD] each) and
    d/dslope (scalar), from per-lane accumulators reduced once (a fixed order)."""
    offs_k = tl.arange(0, G_PAD)
    acc_n = tl.zeros([BLOCK_R, G_PAD], tl.float64)
    acc_gx = tl.zeros([BLOCK_R, G_PAD], tl.float64)
    acc_g1 = tl.zeros([BLOCK_R, G_PAD], tl.float64)
    acc_xx = tl.zeros([BLOCK_R, G_PAD], tl.float64)
    acc_x1 = tl.zeros([BLOCK_R, G_PAD], tl.float64)
    acc_11 = tl.zeros([BLOCK_R, G_PAD], tl.float64)
    r0 = tl.zeros([], tl.int32)
    while r0 < R:  # a while, as in _feature_predict_kernel
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_ok = offs_r < R
        acc = tl.load(accepted_ptr + offs_r, mask=r_ok, other=0).to(tl.int64)
        ver = tl.load(verified_ptr + offs_r, mask=r_ok, other=0).to(tl.int64)
        kk = offs_k[None, :].to(tl.int64)  # [1, G_PAD]
        tile_ok = r_ok[:, None] & (offs_k[None, :] < gamma)
        judged = tile_ok & (kk < tl.minimum(acc + 1, ver)[:, None])  # [BLOCK_R, G_PAD]
        w = judged.to(tl.float64)
        label = (kk < acc[:, None]).to(tl.float64)
        x = tl.load(x_ptr + offs_r[:, None] * stride_xr + offs_k[None, :], mask=tile_ok,
                    other=0.0).to(tl.float64)
        p = 1.0 / (1.0 + tl.exp(-(slope * x + bias[None, :])))
        resid = w * (label - p)
        curv = w * p * (1.0 - p)
        acc_n += w
        acc_gx += resid * x
        acc_g1 += resid
        acc_xx += curv * x * x
        acc_x1 += curv * x
        acc_11 += curv
        r0 += BLOCK_R
    return (tl.sum(acc_n, 0), tl.sum(tl.sum(acc_gx, 0), 0), tl.sum(acc_g1, 0),
            tl.sum(acc_xx, 0), tl.sum(acc_x1, 0), tl.sum(acc_11, 0))


@triton.jit
def _guarded_slope_step(slope, d_slope, halvings):
    """Halve a slope step that would turn the slope negative (up to ``halvings`` times), else 0."""
    factor = tl.full([], 1.0, tl.float64)
    kept = tl.zeros([], tl.float64)
    found = tl.zeros([], tl.int1)
    h = tl.zeros([], tl.int32)
    while h <= halvings:
        step = d_slope * factor
        take = ~found & (slope + step >= 0.0)
        kept = tl.where(take, step, kept)
        found = found | take
        factor = factor * 0.5  # powers of two: exact, as torch.pow(0.5, h)
        h += 1
    return kept


@triton.jit
def _clamp_keep_nan(v, bound):
    """``torch.clamp(v, -bound, bound)``: NaN stays NaN (both comparisons are false)."""
    return tl.where(v > bound, bound, tl.where(v < -bound, -bound, v))


@triton.jit
def _observe_kernel(x_ptr, accepted_ptr, verified_ptr, slope_ptr, bias_ptr, calls_ptr,
                    count_ptr, grad_ptr, h_xx_ptr, h_x1_ptr, h_11_ptr, R, gamma, stride_xr,
                    refit_every, halvings, ridge_bits, damping_bits, max_step_bits,
                    BLOCK_R: tl.constexpr, G_PAD: tl.constexpr):
    """One program: add a verified step's statistics, count the call, refit when due.
    ``*_bits``: float64 constants as int64 bits (a Python float argument would be float32)."""
    ridge = ridge_bits.to(tl.int64).to(tl.float64, bitcast=True)
    damping = damping_bits.to(tl.int64).to(tl.float64, bitcast=True)
    max_step = max_step_bits.to(tl.int64).to(tl.float64, bitcast=True)
    offs_k = tl.arange(0, G_PAD)
    k_ok = offs_k < gamma
    slope = tl.load(slope_ptr)
    bias = tl.load(bias_ptr + offs_k, mask=k_ok, other=0.0)  # [G_PAD]
    n_b, g_x, g_b, s_xx, s_x1, s_11 = _accumulate(x_ptr, accepted_ptr, verified_ptr, slope,
                                                  bias, R, gamma, stride_xr, BLOCK_R, G_PAD)
    count = tl.load(count_ptr + offs_k, mask=k_ok, other=0.0) + n_b
    grad_s = tl.load(grad_ptr) + g_x
    grad_b = tl.load(grad_ptr + 1 + offs_k, mask=k_ok, other=0.0) + g_b
    h_xx = tl.load(h_xx_ptr + offs_k, mask=k_ok, other=0.0) + s_xx
    h_x1 = tl.load(h_x1_ptr + offs_k, mask=k_ok, other=0.0) + s_x1
    h_11 = tl.load(h_11_ptr + offs_k, mask=k_ok, other=0.0) + s_11
    calls = tl.load(calls_ptr) + 1
    due = calls % refit_every == 0
    # Newton step on the arrow Hessian by Schur complement (estimator._newton_step).
    d = h_11 + ridge
    a = tl.sum(h_xx, 0) + ridge
    schur = a - tl.sum(tl.where(k_ok, h_x1 * h_x1 / d, 0.0), 0)
    d_slope = (grad_s - tl.sum(tl.where(k_ok, h_x1 * grad_b / d, 0.0), 0)) / schur
    d_bias = (grad_b - h_x1 * d_slope) / d  # [G_PAD]
    n = tl.sum(count, 0)
    damp = n / (n + damping)
    d_slope = _clamp_keep_nan(d_slope * damp, max_step)
    d_bias = _clamp_keep_nan(d_bias * damp, max_step)
    nan_bias = tl.sum((k_ok & (d_bias != d_bias)).to(tl.int32), 0)
    finite = (d_slope == d_slope) & (nan_bias == 0)  # clamped: only NaN is not finite
    d_slope = _guarded_slope_step(slope, d_slope, halvings)
    apply = due & finite
    tl.store(slope_ptr, tl.where(apply, slope + d_slope, slope))
    tl.store(bias_ptr + offs_k, tl.where(apply, bias + d_bias, bias), mask=k_ok)
    tl.store(calls_ptr, calls)
    tl.store(count_ptr + offs_k, tl.where(due, 0.0, count), mask=k_ok)
    tl.store(grad_ptr, tl.where(due, 0.0, grad_s))
    tl.store(grad_ptr + 1 + offs_k, tl.where(due, 0.0, grad_b), mask=k_ok)
    tl.store(h_xx_ptr + offs_k, tl.where(due, 0.0, h_xx), mask=k_ok)
    tl.store(h_x1_ptr + offs_k, tl.where(due, 0.0, h_x1), mask=k_ok)
    tl.store(h_11_ptr + offs_k, tl.where(due, 0.0, h_11), mask=k_ok)


def estimator_launch(kernel_name: str, gamma: int, cfg: TargetConfig,
                     vocab: int = _MAX_BLOCK_V) -> tuple[dict, int]:
    """Constexprs and warps of one estimator kernel on one target (the wrappers and the AOT
    test both use it): a vocabulary tile of ``<= _MAX_BLOCK_V``, one warp-sized lane per
    element or more; the observe program covers ``[_BLOCK_R, G_PAD]`` with 4 warps."""
    if kernel_name == "_feature_predict_kernel":
        block_v = min(triton.next_power_of_2(vocab), _MAX_BLOCK_V)
        warps = max(1, min(8, block_v // (4 * cfg.warp_size)))
        return {"BLOCK_V": block_v}, warps
    if kernel_name == "_observe_kernel":
        return {"BLOCK_R": _BLOCK_R, "G_PAD": triton.next_power_of_2(gamma)}, 4
    raise ValueError(f"estimator_launch: unknown kernel {kernel_name!r}; known: "
                     "'_feature_predict_kernel', '_observe_kernel'")


def _f64_bits(value: float) -> int:
    """The IEEE bits of ``value`` as float64, as a Python int (passed to the kernel as i64)."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def _check_device(owner: str, est: AcceptanceEstimator, *tensors: torch.Tensor) -> None:
    """Every input on the estimator's device (a mismatch would read another memory space)."""
    for t in tensors:
        if t.device != est.slope.device:
            raise ValueError(f"{owner}: an input is on {t.device}, the estimator on "
                             f"{est.slope.device}; move it to the estimator's device")


def feature_predict_triton(est: AcceptanceEstimator, draft_logits: torch.Tensor,
                           temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, p)``, float32 [R, gamma] each: ``draft_logit_qmax(draft_logits, temperature)`` and
    ``est.predict(x)`` in one launch. ``draft_logits [R, gamma, V]`` (last dim contiguous),
    ``temperature [R]`` (0: greedy, scored at T = 1)."""
    g = est.config.gamma
    if draft_logits.dim() != 3 or draft_logits.shape[1] != g or draft_logits.shape[2] < 1:
        raise ValueError(f"feature_predict_triton: draft_logits have shape "
                         f"{tuple(draft_logits.shape)}; they must be [R, gamma={g}, V >= 1]")
    r = draft_logits.shape[0]
    if temperature.shape != (r,) or not temperature.dtype.is_floating_point:
        raise ValueError(f"feature_predict_triton: temperature has shape "
                         f"{tuple(temperature.shape)} and dtype {temperature.dtype}; it must be "
                         f"a float tensor [R={r}]")
    if draft_logits.stride(2) != 1:
        raise ValueError("feature_predict_triton: draft_logits' vocabulary dim has stride "
                         f"{draft_logits.stride(2)}; pass .contiguous() logits")
    _check_device("feature_predict_triton", est, draft_logits, temperature)
    x = torch.empty(r, g, dtype=torch.float32, device=draft_logits.device)
    p = torch.empty_like(x)
    if r == 0:
        return x, p
    consts, warps = estimator_launch("_feature_predict_kernel", g,
                                     target_for_device(draft_logits.device),
                                     draft_logits.shape[2])
    _feature_predict_kernel[(r, g)](
        draft_logits, temperature, est.slope, est.bias, x, p, g, draft_logits.shape[2],
        draft_logits.stride(0), draft_logits.stride(1), num_warps=warps, enable_fp_fusion=False,
        **consts)  # no fused multiply-add: torch rounds slope * x and + bias separately
    return x, p


def observe_triton(est: AcceptanceEstimator, x: torch.Tensor, accepted: torch.Tensor,
                   verified: torch.Tensor) -> None:
    """``est.observe(x, accepted, verified)`` as one launch: ``x [R, gamma]`` features,
    ``accepted [R]`` and ``verified [R]`` integer counts; updates ``est``'s tensors in place."""
    cfg = est.config
    check_outcomes("observe_triton", x, accepted, verified, cfg.gamma)
    if x.stride(1) != 1:
        raise ValueError(f"observe_triton: x has strides {x.stride()}; pass x.contiguous()")
    _check_device("observe_triton", est, x, accepted, verified)
    consts, warps = estimator_launch("_observe_kernel", cfg.gamma,
                                     target_for_device(x.device))
    _observe_kernel[(1,)](
        x, accepted, verified, est.slope, est.bias, est.calls, est.count, est.grad, est.h_xx,
        est.h_x1, est.h_11, x.shape[0], cfg.gamma, x.stride(0), cfg.refit_every,
        cfg.slope_halvings, _f64_bits(cfg.ridge), _f64_bits(cfg.damping),
        _f64_bits(cfg.max_step), num_warps=warps, enable_fp_fusion=False, **consts)
