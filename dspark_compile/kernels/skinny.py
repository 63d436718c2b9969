"""Triton lowering of ``dspark::skinny_linear``: ``a @ w.T`` for the few rows of a verify step,
with the RMSNorm (and residual add) or SiLU-and-mul around it that ``fuse_linears`` folds in.

At a verify step's few rows (``M`` = packed tokens: 3 at one request of mean length 3, 24 at
eight) a matmul is a weight read: its time is how fast ``w`` streams from HBM. The kernel is
written for that case:

- **Weight rows as the tile's long side** ("swap AB"): a program computes ``w[cols] @ a.T``,
  ``[BLOCK_N, BLOCK_M]``, so ``tl.dot`` gets the weight tile as its first operand and the
  tokens (padded to 16, 32 or 64) as its narrow second one. No weight tile is transposed.
- **One long K loop per program** with a deep software pipeline; K is split only while the
  column tiles alone are fewer than ``skinny_min_programs`` (about one per multiprocessor).
- **Split-K folded into the launch**: each split writes fp32 partials, and the last program of
  a column tile to finish (an int32 counter per tile, reset by that program) sums them in split
  order, so the result does not depend on which program finished last and replays are bitwise
  equal. No second launch.
- **Prologue / epilogue**: the matmul input may be ``silu(gate) * up`` or HF's RMSNorm of
  ``x (+ residual)`` (the sum is written out as ``h``), computed on the activation tile in the
  K loop; the output may be ``silu(gate rows' product) * up rows' product``, or q/k heads
  rotated as ``dspark::rotary_apply`` does (``rot_cols``).
- **The first weight tile before the PDL wait** (``EARLY_W``, a settled weight at few rows):
  its load overlaps the launch before; ``kernels/pdl.py`` says when that is safe.
- **No fused multiply-add** outside the dot (``enable_fp_fusion=False``): the rotation rounds
  each product to the activation dtype, and with fp16 the compiler would otherwise narrow those
  products and their sum to half-precision ops and contract them into one ``fma.f16``, one
  ulp off the reference's two roundings (seen on the H200; bf16 rounds on the integer bits and
  was not affected). The norm's squares round on their own too.

``skinny_linear_triton`` takes 16-bit activations and a contiguous weight of the same dtype;
bad input is a ``ValueError`` naming the value, before any launch. Past
``TargetConfig.skinny_max_m`` rows it makes the launches Inductor would (the input in one
Triton launch, then ``torch.mm``), except that a matmul with K >= ``mid_split_min_ratio`` x N
(the down projection) up to ``mid_split_max_m`` rows runs as one batched GEMM over K chunks
into fp32 partials and one launch that sums them in order (``mid_split_k``; sm_90). The
oracle is the op's math in fp32, rounded once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import launch, tensor_descriptor
from .pdl import pdl_enter, pdl_options, use_pdl
from .targets import TargetConfig
from .attention import split_counters
from .device import device_target
from .linear import linear_reduce_kernel
from .rotary import rotate_halves, round_to, rotary_apply_triton

__all__ = ["SkinnyPlan", "plan_skinny", "skinny_linear_triton"]


@triton.jit
def _silu_mul(g, u):
    """``silu(g) * u`` in fp32."""
    g = g.to(tl.float32)
    return g / (1.0 + tl.exp(-g)) * u.to(tl.float32)


LAUNCH_OPTIONS = {"enable_fp_fusion": False}
"""Compile options of every ``_skinny_kernel`` launch (module docstring: no fused
multiply-add). The prologue launch past ``skinny_max_m`` rows feeds cuBLAS and keeps them."""


@triton.jit
def _rotate_heads(acc, cos_ptr, sin_ptr, stride_cos, stride_sin, offs_m, m_ok, col0, rot_cols,
                  dtype: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                  ROT_D: tl.constexpr):
    """``acc [BLOCK_N, BLOCK_M]`` (columns ``col0 ..``, whole heads of ``ROT_D``) rounded to
    ``dtype``, each head before ``rot_cols`` rotated as HF does in ``dtype`` (``x * cos +
    rotate_half(x) * sin``, each product rounded, then the sum); kept in fp32."""
    HEADS: tl.constexpr = BLOCK_N // ROT_D
    HALF: tl.constexpr = ROT_D // 2
    y = round_to(acc, dtype)
    x1, x2 = tl.split(tl.permute(tl.reshape(y, [HEADS, 2, HALF, BLOCK_M]), [0, 2, 3, 1]))
    j = tl.arange(0, HALF)
    rows = offs_m[None, None, :].to(tl.int64)
    ok = m_ok[None, None, :]
    c_ptrs = cos_ptr + rows * stride_cos + j[None, :, None]  # [1, HALF, BLOCK_M]
    s_ptrs = sin_ptr + rows * stride_sin + j[None, :, None]
    c1 = tl.load(c_ptrs, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(c_ptrs + HALF, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(s_ptrs, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(s_ptrs + HALF, mask=ok, other=0.0).to(tl.float32)
    o1, o2 = rotate_halves(x1, x2, c1, c2, s1, s2, dtype)
    rot = (col0 + tl.arange(0, HEADS) * ROT_D < rot_cols)[:, None, None]
    o = tl.join(tl.where(rot, o1, x1), tl.where(rot, o2, x2))  # [HEADS, HALF, BLOCK_M, 2]
    return tl.reshape(tl.permute(o, [0, 3, 1, 2]), [BLOCK_N, BLOCK_M])


@triton.jit
def _skinny_epilogue(acc, acc_u, ssq, k, eps, bias_ptr, out_ptr, offs_n, offs_m, n_ok, m_ok,
                     stride_om, n, cos_ptr, sin_ptr, stride_cos, stride_sin, col0, rot_cols,
                     PRO: tl.constexpr, HAS_BIAS: tl.constexpr, EPI_GLU: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, ROT_D: tl.constexpr):
    """``acc [BLOCK_N, BLOCK_M]`` (RMS: times each row's ``rsqrt(ssq / K + eps)``; + bias;
    ``EPI_GLU``: ``silu(acc) * acc_u``, ``acc_u`` the up rows' product treated the same;
    ``ROT_D``: heads before ``rot_cols`` rotated, :func:`_rotate_heads`) stored transposed into
    ``out [M, N]``, rounded once."""
    if PRO == 2:
        rstd = tl.rsqrt(ssq / k + eps)[None, :]
        acc = acc * rstd
        if EPI_GLU:
            acc_u = acc_u * rstd
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        if EPI_GLU:
            acc_u += tl.load(bias_ptr + n + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    if EPI_GLU:
        acc = _silu_mul(acc, acc_u)
    if ROT_D > 0:
        if col0 < rot_cols:
            acc = _rotate_heads(acc, cos_ptr, sin_ptr, stride_cos, stride_sin, offs_m, m_ok,
                                col0, rot_cols, out_ptr.dtype.element_ty, BLOCK_N, BLOCK_M,
                                ROT_D)
    ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _w_tile(w_ptr, w_ptrs, row0, k0, n_ok, k_ok, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
            W_DESC: tl.constexpr):
    """The ``[BLOCK_N, BLOCK_K]`` weight tile at rows ``row0``, K offset ``k0`` (streamed once:
    evict first)."""
    if W_DESC:
        wt = w_ptr.load([row0, k0])
    elif EVEN_K:
        if EVEN_N:
            wt = tl.load(w_ptrs, eviction_policy="evict_first")
        else:
            wt = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
    else:
        wt = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                     eviction_policy="evict_first")
    return wt


@triton.jit
def _w_tiles(w_ptr, w_ptrs, row0, k0, n, k, n_ok, k_ok, EVEN_N: tl.constexpr,
             EVEN_K: tl.constexpr, W_DESC: tl.constexpr, EPI_GLU: tl.constexpr):
    """``(wt, wu)``: the weight tile of a K step and, with ``EPI_GLU``, the up rows' tile ``n``
    rows below it (else ``wt`` again, unused)."""
    wt = _w_tile(w_ptr, w_ptrs, row0, k0, n_ok, k_ok, EVEN_N, EVEN_K, W_DESC)
    wu = wt
    if EPI_GLU:
        up_ptrs = w_ptrs if W_DESC else w_ptrs + n * k  # a descriptor loads by coordinates
        wu = _w_tile(w_ptr, up_ptrs, n + row0, k0, n_ok, k_ok, EVEN_N, EVEN_K, W_DESC)
    return wt, wu


@triton.jit
def _prologue_tiles(x_ptrs, res_ptrs, gamma_ptr, kk, k_ok, m_ok, glu_offset, PRO: tl.constexpr,
                    HAS_RES: tl.constexpr):
    """The prologue's loads for K offsets ``kk``: ``(a, b)`` = (gate, up) for GLU, (x or
    x + residual, gamma) for RMS. Each ``[BLOCK_K, BLOCK_M]`` (gamma ``[BLOCK_K]``)."""
    mask = m_ok[None, :] & k_ok[:, None]
    a = tl.load(x_ptrs, mask=mask, other=0.0)
    if PRO == 1:
        b = tl.load(x_ptrs + glu_offset, mask=mask, other=0.0)
    else:
        if HAS_RES:  # the residual stream's add, rounded to its dtype as the model's add is
            a = (a.to(tl.float32) + tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)
                 ).to(a.dtype)
        b = tl.load(gamma_ptr + kk, mask=k_ok, other=0.0)
    return a, b


@triton.jit
def _k_step(wt, wu, acc, acc_u, ssq, nxt_a, nxt_b, x_ptrs, res_ptrs, h_ptrs, gamma_ptr, k0,
            k_hi, offs_k, m_ok, glu_offset, tile, x_ty: tl.constexpr, BLOCK_K: tl.constexpr,
            PRO: tl.constexpr, HAS_RES: tl.constexpr, EVEN_K: tl.constexpr,
            EPI_GLU: tl.constexpr, SWAP: tl.constexpr):
    """One K step of :func:`_skinny_kernel` at offset ``k0`` with its weight tile ``wt`` (and
    ``wu``, the up rows' with ``EPI_GLU``): the activation tile (through the prologue), the
    dot(s), the pointers moved one step."""
    if EVEN_K:
        x_mask = m_ok[None, :]
    else:
        x_mask = m_ok[None, :] & (k0 + offs_k < k_hi)[:, None]
    if PRO == 0:
        xt = tl.load(x_ptrs, mask=x_mask, other=0.0)  # [BLOCK_K, BLOCK_M]
    else:
        # This step uses the tiles loaded in the previous one and issues the next ones'
        # loads first, so their L2 latency overlaps this step's work.
        cur_a, cur_b = nxt_a, nxt_b
        kk = k0 + BLOCK_K + offs_k
        nxt_a, nxt_b = _prologue_tiles(x_ptrs + BLOCK_K, res_ptrs + BLOCK_K, gamma_ptr, kk,
                                       kk < k_hi, m_ok, glu_offset, PRO, HAS_RES)
        if PRO == 1:
            xt = _silu_mul(cur_a, cur_b).to(x_ty)
        else:
            if HAS_RES:
                if tile == 0:
                    tl.store(h_ptrs, cur_a, mask=x_mask)
                h_ptrs += BLOCK_K
            a = cur_a.to(tl.float32)
            ssq += tl.sum(a * a, 0)
            xt = (a * cur_b.to(tl.float32)[:, None]).to(x_ty)
        res_ptrs += BLOCK_K
    if SWAP:
        acc = tl.dot(tl.trans(xt), tl.trans(wt), acc)
    else:
        acc = tl.dot(wt, xt, acc)
    if EPI_GLU:
        if SWAP:
            acc_u = tl.dot(tl.trans(xt), tl.trans(wu), acc_u)
        else:
            acc_u = tl.dot(wu, xt, acc_u)
    return acc, acc_u, ssq, nxt_a, nxt_b, x_ptrs + BLOCK_K, res_ptrs, h_ptrs


@triton.jit(do_not_specialize=["m"])
def _skinny_kernel(x_ptr, w_ptr, bias_ptr, gamma_ptr, res_ptr, h_ptr, out_ptr, part_ptr,
                   counter_ptr, cos_ptr, sin_ptr, m, n, k, stride_xm, stride_rm, stride_hm,
                   stride_om, stride_cos, stride_sin, rot_cols, k_per_split, glu_offset, eps,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT_K: tl.constexpr, PRO: tl.constexpr, HAS_BIAS: tl.constexpr,
                   HAS_RES: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                   W_DESC: tl.constexpr, EPI_GLU: tl.constexpr, SWAP: tl.constexpr,
                   PDL: tl.constexpr, ROT_D: tl.constexpr, EARLY_W: tl.constexpr):
    """One (column tile, K split): ``w[cols, ks] @ a[:, ks].T``, then the epilogue or the
    split merge. ``a`` is ``x`` (``PRO`` 0), ``silu(x[:, k]) * x[:, glu_offset + k]`` (1), or
    ``gamma * h`` with ``h = x (+ residual)`` (2; the rows' sums of squares of ``h`` are kept
    alongside and the epilogue scales by ``rsqrt(mean + eps)``; with a residual, the programs
    of column tile 0 store ``h``). ``W_DESC``: ``w_ptr`` is a tensor descriptor of ``w`` with
    block ``[BLOCK_N, BLOCK_K]`` (TMA on sm_90; it reads zeros past ``w``'s edges).
    ``EPI_GLU``: ``w`` is ``[2N, K]`` (gate rows, then up rows) and the output is
    ``silu(a @ gate.T) * (a @ up.T)``: each program also streams the up rows of its columns.
    ``SWAP``: the products are ``a @ w.T`` tiles (the activation tile as the dot's first operand,
    which may stay in registers) and are transposed once after the loop. ``PDL``: launched
    with programmatic dependent launch (``kernels/pdl.py``). ``ROT_D`` > 0: the output's
    first ``rot_cols`` columns are heads of ``ROT_D`` (``BLOCK_N`` a multiple of it), rotated
    in the epilogue with ``cos``/``sin [M, ROT_D]``. ``EARLY_W``: the first weight tile(s) are
    loaded before the PDL wait (the caller vouches the launch before does not write ``w``)
    and their K step runs before the loop over the rest."""
    tile = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < n
    m_ok = offs_m < m
    k_lo = split * k_per_split
    k_hi = tl.minimum(k, k_lo + k_per_split)
    if W_DESC:
        w_ptrs = w_ptr  # unused: the descriptor loads by coordinates
    else:
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * k + (k_lo + offs_k)[None, :]
    if EARLY_W:  # weights: written by no launch of a step, so read before the wait
        wt0, wu0 = _w_tiles(w_ptr, w_ptrs, tile * BLOCK_N, k_lo, n, k, n_ok,
                            k_lo + offs_k < k_hi, EVEN_N, EVEN_K, W_DESC, EPI_GLU)
    pdl_enter(PDL)
    rows = offs_m[None, :].to(tl.int64)
    x_ptrs = x_ptr + rows * stride_xm + (k_lo + offs_k)[:, None]
    res_ptrs = res_ptr + rows * stride_rm + (k_lo + offs_k)[:, None]
    h_ptrs = h_ptr + rows * stride_hm + (k_lo + offs_k)[:, None]
    if SWAP:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    ssq = tl.zeros([BLOCK_M], tl.float32)
    if PRO != 0:  # the prologue's inputs are loaded one iteration ahead (_k_step)
        nxt_a, nxt_b = _prologue_tiles(x_ptrs, res_ptrs, gamma_ptr, k_lo + offs_k,
                                       k_lo + offs_k < k_hi, m_ok, glu_offset, PRO, HAS_RES)
    else:  # unused
        nxt_a = tl.zeros([BLOCK_K, BLOCK_M], x_ptr.dtype.element_ty)
        nxt_b = nxt_a
    k_start = k_lo
    if EARLY_W:  # the first weight tile was loaded before the wait: its step comes first
        acc, acc_u, ssq, nxt_a, nxt_b, x_ptrs, res_ptrs, h_ptrs = _k_step(
            wt0, wu0, acc, acc_u, ssq, nxt_a, nxt_b, x_ptrs, res_ptrs, h_ptrs, gamma_ptr,
            k_lo, k_hi, offs_k, m_ok, glu_offset, tile, x_ptr.dtype.element_ty, BLOCK_K, PRO,
            HAS_RES, EVEN_K, EPI_GLU, SWAP)
        if not W_DESC:
            w_ptrs += BLOCK_K
        k_start = k_lo + BLOCK_K
    for k0 in range(k_start, k_hi, BLOCK_K):
        wt, wu = _w_tiles(w_ptr, w_ptrs, tile * BLOCK_N, k0, n, k, n_ok, k0 + offs_k < k_hi,
                          EVEN_N, EVEN_K, W_DESC, EPI_GLU)
        acc, acc_u, ssq, nxt_a, nxt_b, x_ptrs, res_ptrs, h_ptrs = _k_step(
            wt, wu, acc, acc_u, ssq, nxt_a, nxt_b, x_ptrs, res_ptrs, h_ptrs, gamma_ptr, k0,
            k_hi, offs_k, m_ok, glu_offset, tile, x_ptr.dtype.element_ty, BLOCK_K, PRO, HAS_RES,
            EVEN_K, EPI_GLU, SWAP)
        if not W_DESC:
            w_ptrs += BLOCK_K
    if SWAP:
        acc = tl.trans(acc)
        acc_u = tl.trans(acc_u)
    if SPLIT_K == 1:
        _skinny_epilogue(acc, acc_u, ssq, k, eps, bias_ptr, out_ptr, offs_n, offs_m, n_ok, m_ok,
                         stride_om, n, cos_ptr, sin_ptr, stride_cos, stride_sin,
                         tile * BLOCK_N, rot_cols, PRO, HAS_BIAS, EPI_GLU, BLOCK_N, BLOCK_M,
                         ROT_D)
    else:
        # fp32 partials [SPLIT_K, N_ACC, N, BLOCK_M] (N_ACC = 2 with EPI_GLU), then for RMS
        # the sums of squares [tiles, SPLIT_K, BLOCK_M]; the tile's last program sums them in
        # split order
        N_ACC: tl.constexpr = 2 if EPI_GLU else 1
        tile_part = offs_n[:, None].to(tl.int64) * BLOCK_M + offs_m[None, :]
        part = part_ptr + split * N_ACC * n * BLOCK_M + tile_part
        tl.store(part, acc, mask=n_ok[:, None])
        if EPI_GLU:
            tl.store(part + n * BLOCK_M, acc_u, mask=n_ok[:, None])
        ssq_ptr = part_ptr + SPLIT_K * N_ACC * n * BLOCK_M + tile * SPLIT_K * BLOCK_M
        if PRO == 2:
            tl.store(ssq_ptr + split * BLOCK_M + offs_m, ssq)
        tl.debug_barrier()  # every thread's partial stores are issued before the release
        counter = counter_ptr + tile
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1:
            tl.store(counter, 0)  # reset for the next launch
            total = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            total_u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            ssq_total = tl.zeros([BLOCK_M], tl.float32)
            for s in tl.static_range(SPLIT_K):
                part = part_ptr + s * N_ACC * n * BLOCK_M + tile_part
                total += tl.load(part, mask=n_ok[:, None], other=0.0, cache_modifier=".cg")
                if EPI_GLU:
                    total_u += tl.load(part + n * BLOCK_M, mask=n_ok[:, None], other=0.0,
                                       cache_modifier=".cg")
                if PRO == 2:
                    ssq_total += tl.load(ssq_ptr + s * BLOCK_M + offs_m, cache_modifier=".cg")
            _skinny_epilogue(total, total_u, ssq_total, k, eps, bias_ptr, out_ptr, offs_n,
                             offs_m, n_ok, m_ok, stride_om, n, cos_ptr, sin_ptr, stride_cos,
                             stride_sin, tile * BLOCK_N, rot_cols, PRO, HAS_BIAS, EPI_GLU,
                             BLOCK_N, BLOCK_M, ROT_D)


@dataclass(frozen=True)
class SkinnyPlan:
    """Tiles, split and grid of one launch (from shapes and the target only)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    k_per_split: int
    grid: tuple[int, int]
    num_warps: int
    num_stages: int
    tma: bool
    """Weight tiles through a tensor descriptor (``TargetConfig.skinny_tma``; its row stride
    must be a multiple of 16 bytes, so only when ``K % 8 == 0``)."""
    swap: bool
    """Activation tile as the dot's first operand (``TargetConfig.skinny_swap``)."""
    early_w: bool = False
    """The first weight tile is loaded before the PDL wait (``EARLY_W``): asked for, and its
    extra buffer fits (``plan_skinny``)."""


@functools.lru_cache(maxsize=1024)
def plan_skinny(m: int, n: int, k: int, cfg: TargetConfig, sm_count: int,
                block_n: int | None = None, block_k: int | None = None,
                split_k: int | None = None, num_warps: int | None = None,
                num_stages: int | None = None, tma: bool | None = None,
                glu_out: bool = False, swap: bool | None = None,
                rms: bool = False, rot_d: int = 0, staged_x: bool = False,
                early_w: bool = False) -> SkinnyPlan:
    """``BLOCK_M``: the smallest of 16 / 32 / 64 holding ``m``; ``BLOCK_N``, ``BLOCK_K``, warps
    and stages from ``cfg`` (``BLOCK_K`` halved, unless given, until two stages fit, then stages
    cut while the pipeline would take more than ``cfg.skinny_max_smem`` or ``cfg.max_shared``;
    ``glu_out`` streams two weight tiles an iteration). Split-K (a
    power of two) while the column tiles x splits are fewer than ``cfg.skinny_min_programs``,
    keeping at least ``cfg.skinny_min_split_k`` of K per split. An RMSNorm prologue (``rms``)
    without ``glu_out`` whose column tiles alone reach ``skinny_min_programs`` (no split: the
    LM head) takes ``cfg.skinny_rms_block_k`` and ``skinny_rms_num_stages``. A rotary epilogue
    over heads of ``rot_d`` makes ``BLOCK_N`` a multiple of ``rot_d`` (whole heads a tile).
    ``early_w`` asks for the first weight tile before the PDL wait; with ``staged_x`` (no
    prologue: the activation tiles are pipelined through shared memory with the weight's) that
    build holds one stage more than the pipeline's (sm_90 builds of triton 3.6 and 3.9: 278,528
    bytes at 256-column tiles and 3 stages, past the H200's 232,448), so it is kept only where
    that fits ``cfg.max_shared``. The other keyword arguments override a choice (the
    benchmark's sweep)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    k_given = block_k is not None
    block_n = block_n or cfg.skinny_block_n
    if rot_d:
        block_n = -(-block_n // rot_d) * rot_d
    if (rms and not glu_out and block_k is None and num_stages is None and split_k is None
            and -(-n // block_n) >= cfg.skinny_min_programs):
        block_k, num_stages = cfg.skinny_rms_block_k, cfg.skinny_rms_num_stages
    block_k = block_k or cfg.skinny_block_k
    num_stages = num_stages or cfg.skinny_num_stages
    w_rows = 2 * block_n if glu_out else block_n
    budget = min(cfg.skinny_max_smem, cfg.max_shared)
    while not k_given and block_k > 32 and (w_rows + block_m) * block_k * 2 * 2 > budget:
        block_k //= 2  # two stages must fit (gfx942's 64 KB: 128-column tiles take K 64)
    stage_bytes = (w_rows + block_m) * block_k * 2
    while num_stages > 2 and stage_bytes * num_stages > budget:
        num_stages -= 1
    early_w = early_w and not (staged_x and stage_bytes * (num_stages + 1) > cfg.max_shared)
    tiles = -(-n // block_n)
    if split_k is None:
        split_k = 1
        while (tiles * split_k < cfg.skinny_min_programs
               and k // (2 * split_k) >= cfg.skinny_min_split_k):
            split_k *= 2
    k_per_split = -(-(-(-k // split_k)) // block_k) * block_k  # a multiple of BLOCK_K
    split_k = -(-k // k_per_split)  # no empty split
    return SkinnyPlan(block_m, block_n, block_k, split_k, k_per_split, (tiles, split_k),
                      num_warps or cfg.skinny_num_warps, num_stages,
                      (cfg.skinny_tma if tma is None else tma) and k % 8 == 0,
                      cfg.skinny_swap if swap is None else swap, early_w)


@triton.jit
def _prologue_kernel(x_ptr, gamma_ptr, res_ptr, h_ptr, out_ptr, k, stride_xm, stride_rm,
                     stride_hm, glu_offset, eps, PRO: tl.constexpr, HAS_RES: tl.constexpr,
                     BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One row of the matmul input for rows past the skinny kernel's, the row held whole:
    ``silu(gate) * up`` (``PRO`` 1) or HF's RMSNorm ``gamma * dtype(h * rsqrt(mean(h^2) +
    eps))`` of ``h = x (+ residual, then stored)`` (2)."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    ok = offs < k
    ty = out_ptr.dtype.element_ty
    a = tl.load(x_ptr + row * stride_xm + offs, mask=ok, other=0.0)
    if PRO == 1:
        a = _silu_mul(a, tl.load(x_ptr + row * stride_xm + glu_offset + offs, mask=ok, other=0.0))
    else:
        if HAS_RES:
            r = tl.load(res_ptr + row * stride_rm + offs, mask=ok, other=0.0)
            a = (a.to(tl.float32) + r.to(tl.float32)).to(ty)
            tl.store(h_ptr + row * stride_hm + offs, a, mask=ok)
        h = a.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(h * h, 0) / k + eps)
        g = tl.load(gamma_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        a = g * (h * rstd).to(ty).to(tl.float32)
    tl.store(out_ptr + row * k + offs, a.to(ty), mask=ok)


_NO_COUNTERS = "skinny_linear_triton: {why}; this launch leaves K whole (no split)"


def _fail(msg: str) -> None:
    raise ValueError(f"skinny_linear_triton: {msg}")


def _desc(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {tuple(t.shape)} on {t.device}"


def _check(x, w, bias, gamma, residual, glu: bool, glu_out: bool) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.stride(-1) != 1:
        _fail(f"x is {_desc(x)}; it must be a 2-D tensor [M, K] with a dense last dim")
    if x.dtype not in (torch.bfloat16, torch.float16):
        _fail(f"x is {x.dtype}; the kernel takes bfloat16 or float16 (float32 matmuls stay "
              "with torch.mm, which does not round through TF32)")
    k = x.shape[1] // 2 if glu else x.shape[1]
    if glu and x.shape[1] % 2:
        _fail(f"x has {x.shape[1]} columns with glu=True; it must be [M, 2K] (gate, then up)")
    if (not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[1] != k
            or w.dtype != x.dtype or w.device != x.device or not w.is_contiguous()):
        _fail(f"w is {_desc(w)}; it must be a contiguous [N, K={k}] tensor of x's dtype "
              f"{x.dtype} on {x.device}")
    if glu_out and w.shape[0] % 2:
        _fail(f"w has {w.shape[0]} rows with glu_out=True; it must be [2N, K] (gate, then up)")
    for name, t, shape in (("bias", bias, (w.shape[0],)), ("gamma", gamma, (k,)),
                           ("residual", residual, tuple(x.shape))):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape
                              or t.dtype != x.dtype or t.device != x.device
                              or t.stride(-1) != 1):
            _fail(f"{name} is {_desc(t)}; it must be {list(shape)} of x's dtype {x.dtype} on "
                  f"{x.device} with a dense last dim")
    if glu and gamma is not None:
        _fail("glu=True and gamma given; a matmul input is one or the other")
    if residual is not None and gamma is None:
        _fail("residual given without gamma; the residual add is fused only before a norm")


def _check_rot(x, w, cos, sin, rot_cols: int, glu_out: bool) -> int:
    """Head dim of a rotary epilogue (0: none), after checking its inputs."""
    if not rot_cols:
        return 0
    if glu_out:
        _fail(f"rot_cols={rot_cols} with glu_out=True; the rotary epilogue is for q/k columns")
    for name, t in (("cos", cos), ("sin", sin)):
        if (not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] != x.shape[0]
                or t.dtype != x.dtype or t.device != x.device or t.stride(-1) != 1):
            _fail(f"{name} is {_desc(t)}; with rot_cols={rot_cols} it must be [M={x.shape[0]}, "
                  f"D] of x's dtype {x.dtype} on {x.device} with a dense last dim")
    d = cos.shape[1]
    if sin.shape[1] != d or d < 2 or d & (d - 1):
        _fail(f"cos/sin are {tuple(cos.shape)} / {tuple(sin.shape)}; the head dim must be one "
              "power of two (>= 2) for both")
    if rot_cols < 0 or rot_cols % d or rot_cols > w.shape[0]:
        _fail(f"rot_cols={rot_cols}; it must be a multiple of the head dim {d} and at most the "
              f"{w.shape[0]} output columns")
    return d


def skinny_linear_triton(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                         gamma: torch.Tensor | None = None, eps: float = 0.0, glu: bool = False,
                         residual: torch.Tensor | None = None, glu_out: bool = False,
                         config: TargetConfig | None = None, cos: torch.Tensor | None = None,
                         sin: torch.Tensor | None = None, rot_cols: int = 0,
                         weight_settled: bool = False,
                         **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, h)`` with ``y = a @ w.T + bias`` (``glu_out``: ``silu(y[:, :N]) * y[:, N:]`` of
    ``w [2N, K]``), where ``a`` is ``x``, or ``silu(x[:, :K]) * x[:, K:]`` (``glu``), or HF's
    RMSNorm with weight ``gamma`` and ``eps`` of ``h = x + residual`` (or of ``x``); ``h`` is
    returned when a residual is given (else an empty tensor). Up to ``cfg.skinny_max_m`` rows:
    one launch of the skinny kernel (module docstring); more rows: the input in one Triton
    launch (``glu`` / ``gamma``), ``torch.mm`` (``addmm`` with a bias), and the output's SiLU in
    one more (``glu_out``): the launches Inductor would make; a long-K matmul there may run as
    K-chunk partials and a sum launch instead (``TargetConfig.mid_split_k``).
    ``rot_cols`` > 0: the first ``rot_cols`` output columns are heads rotated with
    ``cos``/``sin [M, D]`` as ``dspark::rotary_apply`` does (in the epilogue from
    ``skinny_rope_min_m`` rows; with fewer rows or past ``skinny_max_m``, in place by the
    rotary kernel after the matmul).
    ``weight_settled``: the caller vouches that the launch just before this one does not
    write ``w`` (``lower`` sets it from the graph, ``select.settled_weight``); up to
    ``cfg.skinny_early_w_max_m`` rows the first weight tile is then loaded before the PDL wait.
    ``overrides`` (``block_n``, ``block_k``, ``split_k``, ``num_warps``, ``num_stages``,
    ``tma``, ``swap``) are for the benchmark's sweep. No host sync; CUDA-graph safe (a split
    launch takes its counters from the buffer of the current stream, made outside any capture
    by the first call)."""
    _check(x, w, bias, gamma, residual, glu, glu_out)
    rot_d = _check_rot(x, w, cos, sin, rot_cols, glu_out)
    cfg, sm_count = device_target(x.device)
    cfg = config or cfg
    pdl = use_pdl(x.device, cfg)
    m = x.shape[0]
    n, k = w.shape
    n_out = n // 2 if glu_out else n
    pro = 1 if glu else 2 if gamma is not None else 0
    h = x.new_empty((m, k) if residual is not None else (0,))
    res_args = (residual, h, residual.stride(0), h.stride(0)) if residual is not None else \
        (x, x, 0, 0)
    if m > cfg.skinny_max_m or k == 0:
        a = x
        if pro and m:
            a = x.new_empty((m, k))
            _prologue(x, gamma, res_args, a, k, eps, pro, residual is not None, pdl)
        chunks = _mid_split(m, n, k, glu_out, cfg)
        if chunks > 1:
            y = _split_mm(a, w, bias, chunks, pdl)
        else:
            y = torch.mm(a, w.t()) if bias is None else torch.addmm(bias, a, w.t())
        if glu_out:
            out = x.new_empty((m, n_out))
            if m:
                _prologue(y, None, (x, x, 0, 0), out, n_out, 0.0, 1, pdl=pdl)
            y = out
        if rot_d and m:
            _rotate_in_place(y, cos, sin, rot_cols, rot_d)
        return y, h
    out = x.new_empty((m, n_out))
    if m == 0 or n == 0:
        if residual is not None:
            torch.add(x, residual, out=h)
        return out, h
    head_d, rot_d = rot_d, rot_d if m >= cfg.skinny_rope_min_m else 0  # rot_d: the epilogue's
    early = weight_settled and m <= cfg.skinny_early_w_max_m
    plan = plan_skinny(m, n_out, k, cfg, sm_count, glu_out=glu_out, rms=pro == 2, rot_d=rot_d,
                       staged_x=pro == 0, early_w=early, **overrides)
    split = plan.split_k
    counters = split_counters(x.device, plan.grid[0], _NO_COUNTERS) if split > 1 else None
    if split > 1 and counters is None:  # logged once by split_counters
        plan = plan_skinny(m, n_out, k, cfg, sm_count, glu_out=glu_out, rms=pro == 2,
                           rot_d=rot_d, staged_x=pro == 0, early_w=early,
                           **{**overrides, "split_k": 1})
        split = 1
    n_acc = 2 if glu_out else 1
    part = (x.new_empty((split * (n_acc * n_out + plan.grid[0]) * plan.block_m,),
                        dtype=torch.float32) if split > 1 else out)
    w_arg = tensor_descriptor(w, [plan.block_n, plan.block_k]) if plan.tma else w
    launch(_skinny_kernel, plan.grid,
        x, w_arg, bias if bias is not None else x, gamma if gamma is not None else x,
        res_args[0], res_args[1], out, part, counters if counters is not None else out,
        cos if rot_d else x, sin if rot_d else x, m, n_out, k, x.stride(0), res_args[2],
        res_args[3], out.stride(0), cos.stride(0) if rot_d else 0,
        sin.stride(0) if rot_d else 0, rot_cols, plan.k_per_split, k, eps,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, SPLIT_K=split,
        PRO=pro, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        EVEN_N=n_out % plan.block_n == 0,
        EVEN_K=k % plan.k_per_split == 0 and plan.k_per_split % plan.block_k == 0,
        W_DESC=plan.tma, EPI_GLU=glu_out, SWAP=plan.swap, PDL=pdl, ROT_D=rot_d,
        EARLY_W=plan.early_w,
        num_warps=plan.num_warps, num_stages=plan.num_stages, **pdl_options(pdl),
        **LAUNCH_OPTIONS)
    if head_d and not rot_d:  # fewer rows than skinny_rope_min_m: the rotary kernel after
        _rotate_in_place(out, cos, sin, rot_cols, head_d)
    return out, h


def _mid_split(m: int, n: int, k: int, glu_out: bool, cfg: TargetConfig) -> int:
    """K chunks of the matmul past the skinny kernel's rows (1: one ``torch.mm``):
    ``TargetConfig.mid_split_k``, halved each time the rows double past
    ``mid_split_full_m``, down to 2. Each chunk must start 16-byte aligned for cuBLAS."""
    s, rows = cfg.mid_split_k, cfg.mid_split_full_m
    if (s <= 1 or glu_out or not m * n * k or m > cfg.mid_split_max_m
            or k < cfg.mid_split_min_ratio * n):
        return 1
    while m > rows and s > 2:
        s, rows = s // 2, rows * 2
    return 1 if k % (8 * s) else s


def _split_partials(a: torch.Tensor, w: torch.Tensor, chunks: int) -> torch.Tensor:
    """fp32 ``[chunks, M, N]``: ``a @ w.T`` over each of ``chunks`` equal K ranges, as one
    batched GEMM over strided views (nothing copied). On a CPU (the interpreter's tests) the
    operands are widened first: a 16-bit product is exact in fp32, so the partials are the
    same sums either way, up to the order of the adds."""
    m, k = a.shape
    n = w.shape[0]
    a3 = a.view(m, chunks, k // chunks).transpose(0, 1)  # [chunks, M, K/chunks]
    w3 = w.view(n, chunks, k // chunks).permute(1, 2, 0)  # [chunks, K/chunks, N]
    if a.device.type == "cuda":
        return torch.bmm(a3, w3, out_dtype=torch.float32)
    return torch.bmm(a3.float(), w3.float())


def _split_mm(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, chunks: int,
              pdl: bool) -> torch.Tensor:
    """``a @ w.T (+ bias)`` in ``a``'s dtype as ``chunks`` K-chunk partials and one sum launch
    (``triton_linear.linear_reduce_kernel``; ``TargetConfig.mid_split_k``): at 192 rows the
    1.1B model's down projection (2048 x 8192) has too few output tiles for the H200's 132
    multiprocessors, and cuBLAS's own split-K measured slower (``benchmarks/splitk_bmm.py``)."""
    m, n = a.shape[0], w.shape[0]
    part = _split_partials(a, w, chunks)
    out = a.new_empty((m, n))
    block_n = min(1024, triton.next_power_of_2(n))
    tiles = triton.cdiv(n, block_n)
    # the grouped matmul's sum launch, for a group of one (no second or third output)
    launch(linear_reduce_kernel, (m, tiles),
        part, out, out, out, bias if bias is not None else part, m, n, 0, 0, tiles, 0, n, n, n,
        chunks, BLOCK_N=block_n, HAS_BIAS=bias is not None, PDL=pdl, num_warps=4,
        **pdl_options(pdl))
    return out


def _rotate_in_place(y: torch.Tensor, cos, sin, rot_cols: int, rot_d: int) -> None:
    """The first ``rot_cols`` columns of ``y`` rotated as heads of ``rot_d`` by the rotary
    kernel, in place (the same roundings as the epilogue)."""
    heads = y[:, :rot_cols].unflatten(1, (-1, rot_d))
    rotary_apply_triton(heads, heads[:, :0], cos, sin, out=[heads, heads[:, :0]])


def _prologue(x, gamma, res_args, out, k: int, eps: float, pro: int,
              has_res: bool = False, pdl: bool = False) -> None:
    """``out [M, k]`` <- the matmul input of ``x``'s rows (``_prologue_kernel``)."""
    launch(_prologue_kernel, (x.shape[0],),
        x, gamma if gamma is not None else x, res_args[0], res_args[1], out, k, x.stride(0),
        res_args[2], res_args[3], k, eps, PRO=pro, HAS_RES=has_res,
        BLOCK_K=max(16, triton.next_power_of_2(k)), PDL=pdl,
        num_warps=4 if k <= 4096 else 8, **pdl_options(pdl))
