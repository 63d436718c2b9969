"""DSpark planner on the device (Triton): the host reference's plan with no host sync.

:func:`plan_verify_device` returns what :func:`~dspark_compile.runtime.planner.plan_verify`
returns — bit for bit the same lengths and ``K`` — as device tensors, from one launch of one
program whose grid and arguments depend on shapes and the config only, so it can be captured in
a CUDA graph. The host wrapper checks shapes, dtypes, devices and the table size and raises
``ValueError`` before anything launches; values are not read (that would be a sync).

Kernel (one program, ``M_PAD = G_PAD * R_PAD`` candidates, ``<= 8192``):

1. Survivals in the host's float32 order: ``s_j = s_{j-1} * c_j`` one position at a time
   (``tl.cumprod`` is a tree and would round differently), ``-0.0`` made ``+0.0``.
2. The host's int64 sort keys ``(j * R + r) - (bits(s) << 32)``, padding ``2^62``, ranked by one
   ``tl.sort`` (a bitonic network in registers; int64 works on triton 3.6 and 3.9). Keys are
   unique, so the unstable network is deterministic and its order is the host's.
3. Budget as on the host: ``n`` candidates (survival bits >= those of ``min_survival``),
   ``P_k`` prefix sums in float64, ``Theta(k) = (R + P_k) * SPS(R + k)``, first maximum,
   kept only if above ``R * SPS(R)``; or the threshold count; or everything without a table.
4. Cap, tier alignment, then the picks: the ``K`` smallest keys, i.e. keys below the
   ``K``-th ranked one; ``len_r = 1 + picks in column r``.

Float64 sums: the host sums ``P_k`` sequentially (``np.cumsum``). A scan in registers adds in a
tree, so the kernel first proves that no order can round: every candidate survival is a multiple
of ``2^g`` (``g`` from its exponent), so every partial sum of any order is a multiple of ``2^g``
no larger than the total, and is exact when ``total < 2^(53 + g)``. Then ``tl.cumsum`` equals the
host's sums (the common case: survivals >= ~2^-19 with sums < 1024). Otherwise a sequential loop
adds the ranked survivals one by one, in the host's order and rounding (slower: one reduction per
candidate). :func:`exact_prefix_bound` is that test on the host, shared by the tests.

Invalid confidences (NaN, outside ``[0, 1]``), which the host refuses, cannot raise here without
a sync: the kernel then writes ``K = -1`` and all lengths 1 (anchors only, a valid layout), so
a poisoned step verifies nothing and the flag can be read later, when the host syncs anyway.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..kernels.targets import TargetConfig, target_for_device
from .planner import PlannerConfig, flat_rule
from .sps import StepRateModel

__all__ = ["MAX_CANDIDATES", "plan_verify_device", "sps_tensor", "device_tiers",
           "exact_prefix_bound", "planner_launch"]

MAX_CANDIDATES = 8192
"""Most padded candidates ``G_PAD * R_PAD`` one program ranks (R 512 x gamma 15 pads to 8192)."""
_PAD_KEY = tl.constexpr(1 << 62)  # above every real key (those lie in [-(0x3F800000 << 32), 2^32))
_ELEMS_PER_THREAD = 16  # int64 keys per thread of the sort; untuned (no GPU time was left)


@triton.jit
def _survival_keys(conf_ptr, R, gamma, stride_r, stride_j, R_PAD: tl.constexpr,
                   G_PAD: tl.constexpr):
    """Sort keys [G_PAD, R_PAD] int64, survival bits [G_PAD, R_PAD] int32 (-1: padding) and a
    flag (int32, > 0 if any confidence is not in [0, 1]) of ``conf [R, gamma]``."""
    offs_r = tl.arange(0, R_PAD)
    offs_j = tl.arange(0, G_PAD)
    surv = tl.full([R_PAD], 1.0, tl.float32)
    bits = tl.full([G_PAD, R_PAD], -1, tl.int32)
    bad = tl.zeros([R_PAD], tl.int32)
    for j in tl.static_range(G_PAD):
        ok = (offs_r < R) & (offs_r * 0 + j < gamma)  # vectors: the interpreter refuses
        c = tl.load(conf_ptr + offs_r * stride_r + j * stride_j, mask=ok, other=1.0)
        c = c.to(tl.float32)
        bad += (ok & ~((c >= 0.0) & (c <= 1.0))).to(tl.int32)  # NaN fails both
        surv = surv * tl.where(c == 0.0, 0.0, c)  # -0.0 -> +0.0, as the host's "+ 0.0"
        row = tl.where(ok, surv.to(tl.int32, bitcast=True), -1)  # [R_PAD]
        bits = tl.where(offs_j[:, None] == j, row[None, :], bits)
    index = (offs_j[:, None] * R + offs_r[None, :]).to(tl.int64)  # [G_PAD, R_PAD]: j * R + r
    keys = tl.where(bits >= 0, index - (bits.to(tl.int64) << 32), _PAD_KEY)
    return keys, bits, tl.sum(bad, 0)


@triton.jit
def _serial_argmax(surv, n, r, sps_ptr, sps_last, M_PAD: tl.constexpr):
    """First maximum of Theta(k), k = 1..n, with ``P_k`` added one at a time (host rounding)."""
    pos = tl.arange(0, M_PAD)
    mass = tl.zeros([], tl.float64)
    best = tl.full([], float("-inf"), tl.float64)
    best_k = tl.zeros([], tl.int32)
    k = tl.zeros([], tl.int32)
    while k < n:  # a while, not range(n): triton 3.6's interpreter cannot index with n
        mass += tl.sum(tl.where(pos == k, surv, 0.0), 0)  # the k-th ranked survival, exactly
        rate = tl.load(sps_ptr + tl.minimum(r + k + 1, sps_last))
        theta = (mass + r) * rate
        best_k = tl.where(theta > best, k + 1, best_k)
        best = tl.maximum(theta, best)
        k += 1
    return best, best_k


@triton.jit
def _rate_budget(ranked, bits, n, r, min_bits, sps_ptr, sps_last, M_PAD: tl.constexpr):
    """K = argmax_k Theta(k) (ties to the smallest k), or 0 unless Theta(K) > R * SPS(R)."""
    pos = tl.arange(0, M_PAD)
    cand = pos < n
    surv = tl.where(cand, (-(ranked >> 32)).to(tl.int32).to(tl.float32, bitcast=True), 0.0)
    surv = surv.to(tl.float64)  # [M_PAD] ranked survivals, zeros past the candidates
    # Exactness test (module docstring): partial sums are multiples of 2^g, g = min exponent
    # of the candidates' last mantissa bit; the float64 total bounds the exact one by 2^-41.
    flat_bits = tl.reshape(bits, [M_PAD])
    low = tl.maximum((flat_bits >> 23) & 0xFF, 1) - 150  # [M_PAD] exponent of the last bit
    g = tl.min(tl.where(flat_bits >= min_bits, low, 1 << 20), 0)  # candidates (bits >= 1)
    total = tl.sum(surv, 0) * (1.0 + 2.0 ** -30)
    total_exp = ((total.to(tl.int64, bitcast=True) >> 52) & 0x7FF) - 1023
    exact = total_exp + 1 <= 53 + g
    mass = tl.cumsum(surv, 0)  # [M_PAD] P_k, k = pos + 1
    rate = tl.load(sps_ptr + tl.minimum(r + pos + 1, sps_last))  # [M_PAD] SPS(R + k)
    theta = tl.where(cand, (mass + r) * rate, float("-inf"))
    best = tl.max(theta, 0)
    best_k = tl.min(tl.where(theta == best, pos, M_PAD), 0) + 1
    if not exact:
        best, best_k = _serial_argmax(surv, n, r, sps_ptr, sps_last, M_PAD)
    rate0 = tl.load(sps_ptr + tl.minimum(r, sps_last))
    keep = (n > 0) & (best > r * rate0)
    return tl.where(keep, best_k, 0)


@triton.jit
def _budget(ranked, bits, r, gamma, min_bits, thr_bits, sps_ptr, sps_last,
            HAS_RATE: tl.constexpr, THRESHOLD: tl.constexpr, M_PAD: tl.constexpr):
    """K of one ranked batch of ``r`` requests, before cap and alignment (host ``_budget``)."""
    if THRESHOLD:
        k = tl.sum(tl.reshape(bits >= thr_bits, [M_PAD]).to(tl.int32), 0)
    elif HAS_RATE:
        n = tl.sum(tl.reshape(bits >= min_bits, [M_PAD]).to(tl.int32), 0)
        k = _rate_budget(ranked, bits, n, r, min_bits, sps_ptr, sps_last, M_PAD)
    else:
        k = r * gamma  # no table: verify everything
    return k


@triton.jit
def _align(k, n, r, cap, tiers_ptr, num_tiers, TIERS_PAD: tl.constexpr):
    """Grow ``k`` to fill the smallest tier of >= ``r + k`` tokens (host ``_cap_and_align``);
    ``tiers_ptr`` holds the token counts of the tiers with enough request slots."""
    offs = tl.arange(0, TIERS_PAD)
    tokens = tl.load(tiers_ptr + offs, mask=offs < num_tiers, other=0)
    fit = tl.min(tl.where((offs < num_tiers) & (tokens >= r + k), tokens, 2147483647), 0)
    grown = tl.maximum(k, tl.minimum(tl.minimum(fit - r, n), cap))
    return tl.where(fit < 2147483647, grown, k)


@triton.jit
def _plan_kernel(conf_ptr, budget_ptr, sps_ptr, tiers_ptr, lens_ptr, k_ptr, R, gamma,
                 stride_r, stride_j, RB, stride_br, stride_bj, sps_last, num_tiers, cap,
                 min_bits, thr_bits, R_PAD: tl.constexpr, RB_PAD: tl.constexpr,
                 G_PAD: tl.constexpr, TIERS_PAD: tl.constexpr, HAS_RATE: tl.constexpr,
                 THRESHOLD: tl.constexpr, LAGGED: tl.constexpr):
    """One program: ``lens [R]`` and ``K []`` of ``conf [R, gamma]`` (budget from
    ``budget [RB, gamma]`` if LAGGED)."""
    M_PAD: tl.constexpr = G_PAD * R_PAD
    keys, bits, bad = _survival_keys(conf_ptr, R, gamma, stride_r, stride_j, R_PAD, G_PAD)
    ranked = tl.sort(tl.reshape(keys, [M_PAD]))  # [M_PAD] ascending: the host's order
    n = tl.sum(tl.reshape(bits >= min_bits, [M_PAD]).to(tl.int32), 0)  # candidates now
    if LAGGED:
        MB_PAD: tl.constexpr = G_PAD * RB_PAD
        bkeys, bbits, bbad = _survival_keys(budget_ptr, RB, gamma, stride_br, stride_bj,
                                            RB_PAD, G_PAD)
        bad += bbad
        k = _budget(tl.sort(tl.reshape(bkeys, [MB_PAD])), bbits, RB, gamma, min_bits,
                    thr_bits, sps_ptr, sps_last, HAS_RATE, THRESHOLD, MB_PAD)
        if HAS_RATE or THRESHOLD:
            k = tl.minimum(k, n)  # no sub-candidate drafts
    else:
        k = _budget(ranked, bits, R, gamma, min_bits, thr_bits, sps_ptr, sps_last, HAS_RATE,
                    THRESHOLD, M_PAD)
    k = _align(tl.minimum(k, cap), n, R, cap, tiers_ptr, num_tiers, TIERS_PAD)
    # The K smallest keys are those below the K-th ranked one (keys are unique).
    pos = tl.arange(0, M_PAD)
    kth = tl.min(tl.where(pos >= k, ranked, _PAD_KEY), 0)
    picks = tl.sum((keys < kth).to(tl.int32), 0)  # [R_PAD]; padding keys never pass
    offs_r = tl.arange(0, R_PAD)
    tl.store(lens_ptr + offs_r, tl.where(bad > 0, 1, 1 + picks), mask=offs_r < R)
    tl.store(k_ptr, tl.where(bad > 0, -1, k))


def planner_launch(requests: int, gamma: int, budget_requests: int,
                   cfg: TargetConfig) -> tuple[int, int, int, int]:
    """``(R_PAD, RB_PAD, G_PAD, num_warps)`` of one launch; warps from the target's warp size,
    about ``_ELEMS_PER_THREAD`` sort keys per thread, at most 16 warps."""
    r_pad = triton.next_power_of_2(requests)
    rb_pad = triton.next_power_of_2(budget_requests)
    g_pad = max(triton.next_power_of_2(gamma), 2)  # a sort over >= 2 elements (triton 3.6)
    m_pad = g_pad * max(r_pad, rb_pad)
    warps = min(max(m_pad // (_ELEMS_PER_THREAD * cfg.warp_size), 1), 16)
    return r_pad, rb_pad, g_pad, warps


def sps_tensor(rate: StepRateModel, requests: int, gamma: int,
               device: torch.device | str) -> torch.Tensor:
    """float64 [R * (gamma + 1) + 1]: ``SPS(B)`` at ``B = 0 ..`` for ``requests`` requests, the
    values the host planner reads (``rate.rate_span``). Build it once, before graph capture."""
    count = requests * (gamma + 1) + 1
    return rate.rate_span(0, count, requests).to(device=device, dtype=torch.float64)


def device_tiers(config: PlannerConfig, requests: int,
                 device: torch.device | str) -> torch.Tensor:
    """int32 [T]: token counts of ``config.tiers`` with >= ``requests`` request slots, ascending
    (what the kernel aligns to). Build it once, before graph capture (a host-to-device copy)."""
    tokens = [t for t, slots in config.tiers if slots >= requests]
    return torch.tensor(tokens, dtype=torch.int32, device=device)


def exact_prefix_bound(survivals: torch.Tensor) -> bool:
    """The kernel's test that any summation order of these float32 candidate survivals is exact
    in float64: ``total * (1 + 2^-30) < 2^(53 + g)``, ``2^g`` the least last-mantissa bit."""
    s = survivals.detach().cpu().to(torch.float32).reshape(-1)
    if s.numel() == 0:
        return True
    exps = ((s.view(torch.int32) >> 23) & 0xFF).clamp(min=1) - 150
    total = float(s.double().sum()) * (1.0 + 2.0 ** -30)
    return math.frexp(total)[1] <= 53 + int(exps.min())


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_confidence(name: str, conf, device: torch.device | None) -> None:
    """Shape, dtype and device of a ``[R, gamma]`` confidence (values stay unread)."""
    if not isinstance(conf, torch.Tensor) or conf.dim() != 2 or min(conf.shape) < 1:
        shape = tuple(conf.shape) if isinstance(conf, torch.Tensor) else type(conf).__name__
        raise ValueError(f"plan_verify_device: {name} has shape {shape}; it must be [R >= 1, "
                         "gamma >= 1] (conditional acceptance per request and draft position)")
    if conf.dtype not in _FLOATS:
        raise ValueError(f"plan_verify_device: {name} has dtype {conf.dtype}; pass float16, "
                         "bfloat16, float32 or float64")
    if device is not None and conf.device != device:
        raise ValueError(f"plan_verify_device: {name} is on {conf.device}, the confidence on "
                         f"{device}; move both to one device")


def _check_sps(sps, budget_requests: int, gamma: int, device: torch.device) -> None:
    """The table must be float64 [>= R_budget * (gamma + 1) + 1] on the confidence's device."""
    need = budget_requests * (gamma + 1) + 1
    if not isinstance(sps, torch.Tensor) or sps.dim() != 1 or sps.dtype != torch.float64:
        raise ValueError(f"plan_verify_device: sps={sps!r:.80} is not a float64 [B] tensor; build "
                         "it with sps_tensor(rate, R, gamma, device)")
    if sps.device != device or sps.numel() < need:
        raise ValueError(f"plan_verify_device: sps has {sps.numel()} entries on {sps.device}; "
                         f"it needs >= {need} (B = 0 .. R * (gamma + 1) for R = "
                         f"{budget_requests}) on {device}; build it with sps_tensor(...)")


def _check_tiers(tiers, config: PlannerConfig, device: torch.device) -> None:
    """A device tier tensor must come with ``config.tiers`` (and only then)."""
    if not config.tiers:
        if tiers is not None:
            raise ValueError("plan_verify_device: tiers were passed but config.tiers is empty; "
                             "set PlannerConfig.tiers or drop the tiers argument")
        return
    if not isinstance(tiers, torch.Tensor) or tiers.dim() != 1 or tiers.dtype != torch.int32 \
            or tiers.device != device:
        raise ValueError(f"plan_verify_device: config.tiers={config.tiers} needs tiers="
                         f"device_tiers(config, R, device) (int32 [T] on {device}); got "
                         f"{tiers!r:.80}. Build it once, before graph capture")


def _cut_bits(key_bound: int) -> int:
    """Survival bits of a cut-off from the host's key bound ``(1 - bits) << 32``."""
    return 1 - (key_bound >> 32)


def plan_verify_device(confidence: torch.Tensor, sps: torch.Tensor | None,
                       config: PlannerConfig = PlannerConfig(),
                       budget_confidence: torch.Tensor | None = None,
                       tiers: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lens int32 [R], K int32 [])`` on the confidence's device, equal to ``plan_verify``.

    ``confidence [R, gamma]``; ``sps`` from :func:`sps_tensor` (rates for the budget batch's
    request count) or None to verify everything; ``budget_confidence [R', gamma]`` a lagged
    budget (as :class:`~dspark_compile.runtime.planner.Planner` passes it); ``tiers`` from
    :func:`device_tiers` when ``config.tiers`` is set. ``K = -1`` flags a confidence outside
    ``[0, 1]`` (lengths are then all 1). No host sync; graph-capturable.
    """
    _check_confidence("confidence", confidence, None)
    dev = confidence.device
    r, gamma = confidence.shape
    budget = confidence if budget_confidence is None else budget_confidence
    _check_confidence("budget_confidence", budget, dev)
    if budget.shape[1] != gamma:
        raise ValueError(f"plan_verify_device: budget confidence has gamma={budget.shape[1]} but "
                         f"the confidence has gamma={gamma}; both must come from one drafter")
    r_pad, rb_pad, g_pad, warps = planner_launch(r, gamma, budget.shape[0],
                                                 target_for_device(dev))
    if g_pad * max(r_pad, rb_pad) > MAX_CANDIDATES:
        raise ValueError(f"plan_verify_device: R={max(r, budget.shape[0])} x gamma={gamma} pads "
                         f"to {g_pad * max(r_pad, rb_pad)} candidates; one program ranks at most "
                         f"{MAX_CANDIDATES} (split the batch or use plan_verify)")
    if sps is not None:
        _check_sps(sps, budget.shape[0], gamma, dev)
    _check_tiers(tiers, config, dev)
    cap = r * gamma
    if config.budget_frac is not None:
        cap = min(cap, math.floor(config.budget_frac * r * gamma))
    lens = torch.empty(r, dtype=torch.int32, device=dev)
    k = torch.empty((), dtype=torch.int32, device=dev)
    dummy = torch.empty(1, dtype=torch.float64, device=dev)
    tier_arg = tiers if tiers is not None and tiers.numel() else torch.empty(
        1, dtype=torch.int32, device=dev)
    num_tiers = 0 if tiers is None else tiers.numel()
    thr = config.threshold is not None
    _plan_kernel[(1,)](
        confidence, budget, dummy if sps is None else sps, tier_arg, lens, k, r, gamma,
        confidence.stride(0), confidence.stride(1), budget.shape[0], budget.stride(0),
        budget.stride(1), 0 if sps is None else sps.numel() - 1, num_tiers, cap,
        _cut_bits(config._min_survival_key), _cut_bits(config._threshold_key) if thr else 0,
        R_PAD=r_pad, RB_PAD=rb_pad, G_PAD=g_pad,
        TIERS_PAD=triton.next_power_of_2(max(num_tiers, 1)), HAS_RATE=sps is not None,
        THRESHOLD=thr, LAGGED=budget_confidence is not None, num_warps=warps,
        enable_fp_fusion=False)  # the host rounds every add and multiply on its own
    if sps is not None and config.flat_tolerance is not None and not thr and \
            config.budget_frac is None and budget_confidence is None:
        # the host's _flat on the same rates (B = R .. R (gamma + 1)), without a sync
        span = sps[r: r * (gamma + 1) + 1]
        full = flat_rule(span[-1], span.max(), config) & (k >= 0)
        lens = torch.where(full, torch.full_like(lens, gamma + 1), lens)
        k = torch.where(full, torch.full_like(k, r * gamma), k)
    return lens, k
