"""Triton lowering of the mixture-of-experts ops (``ops/experts.py``): routing, the grouped up
projection with its gate, the grouped down projection with the routing weights, the combine.

Kernels first, then the plan and the host wrappers (the Triton tutorials' order); the oracle is
:mod:`dspark_compile.ops.experts_reference`. Every grid is sized from ``N``, ``K`` and ``E``
alone (never from the routing), so a layer captures in a tier's CUDA graph with no host sync.

- Routing, three launches: ``_route_count`` writes the per-expert histogram of each block of
  ``BLOCK_P`` pairs; ``_route_scan`` (one program per ``BLOCK_E`` buckets) turns it in place
  into each block's count of earlier blocks' pairs and sums every bucket (work linear in the
  blocks: each placing block summing all earlier rows itself read ``blocks^2 * E_P2`` entries,
  38 MB at 6144 pairs over 128 experts); ``_route_place`` takes its block's row and the
  totals (each expert's start), ranks its pairs within their expert by a prefix sum of a
  one-hot ``[BLOCK_P, E_P2]`` tile and scatters pair ids to ``order``: a stable counting sort,
  equal to the reference's ``torch.sort(stable=True)``. Pairs routed nowhere (padding rows,
  ids outside ``[0, E)``) form one more bucket ``E``, last.
- Grouped GEMM (one kernel for up and down): a 1-D grid of (row tile, column tile) programs,
  row tile major, so the column tiles of one row tile run together (its rows stay in L2, its
  expert's weight columns are read in address order) and the surplus row tiles, which exit at
  once, come last instead of between every column tile's real ones. Row tiles hold ``BLOCK_M``
  pairs of one bucket (bucket ``b`` owns tiles ``cum[b-1] .. cum[b]`` of the prefix sum of
  ``cdiv(count_b, BLOCK_M)``, found by one compare-and-count over ``E_P2`` buckets). A tile
  gathers its pairs' rows (``x[p // K]`` for up, ``h[p]`` for down), streams its expert's
  weight columns ``[BLOCK_K, BLOCK_N]`` once (an expert with at most ``BLOCK_M`` pairs, every
  verify expert up to bs ~64, reads its weights exactly once; more pairs re-read them from L2,
  one expert's row tiles following each other in the grid), accumulates
  in fp32, adds the bias, applies the gate (``*_glu``: the gate and up halves of the same
  columns in two accumulators) or the routing weight (down), and stores one rounding to the
  pair's row. Tiles of bucket ``E`` store zeros, so every row of the result is written once.
- Combine: ``out[n] = sum_k scratch[n*K + k]`` in ``k`` order (fp32, one rounding): replays and
  eager runs are bitwise equal; no atomics.

Vendor option: ``torch._grouped_mm`` (CUTLASS grouped GEMM, bf16) runs the two projections on
rows gathered into expert order, selected per target by ``TargetConfig.experts_kernel``
(``benchmarks/moe_layer.py`` times both).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .device import device_target, fp32_dot_precision
from .launch import descriptor_ok, launch, tensor_descriptor
from .pdl import pdl_enter, pdl_options, pdl_release, pdl_wait, use_pdl
from .targets import TargetConfig
from ..ops.experts import down_dtype
from ..ops.experts_reference import ACTIVATIONS, activate, check_down, check_route, \
    check_up, up_columns

__all__ = ["ExpertsPlan", "plan_experts", "experts_route_triton", "experts_up_triton",
           "experts_down_triton", "uses_grouped_mm"]

_ACT = {name: i for i, name in enumerate(ACTIVATIONS)}  # none 0, silu 1, gelu 2, gelu_tanh 3
COMBINE_TOKENS = 8
"""Tokens a combine program sums (``BLOCK_T``): with ``K`` unrolled loads in flight, 8 rows of
256 columns keep a thread's loads in registers and give bs 256 (768 tokens) 768 programs."""


# ---------------------------------------------------------------------- kernels
@triton.jit
def _route_keys(ids_ptr, qsl_ptr, block, num_pairs, top_k, num_experts, num_requests,
                HAS_QSL: tl.constexpr, BLOCK_P: tl.constexpr, E_P2: tl.constexpr):
    """``(pairs, in range, bucket)`` of a block: the expert, ``E`` if routed nowhere, ``E_P2``
    (no bucket) past the last pair."""
    p = block * BLOCK_P + tl.arange(0, BLOCK_P)
    ok = p < num_pairs
    e = tl.load(ids_ptr + p, mask=ok, other=0)
    routed = ok & (e >= 0) & (e < num_experts)  # compared before any narrowing cast
    if HAS_QSL:
        real_rows = tl.load(qsl_ptr + num_requests)
        routed = routed & (p // top_k < real_rows)
    key = tl.where(routed, e.to(tl.int32), num_experts)
    return p, ok, tl.where(ok, key, E_P2)


@triton.jit
def _route_count_kernel(ids_ptr, qsl_ptr, hist_ptr, num_pairs, top_k, num_experts,
                        num_requests, HAS_QSL: tl.constexpr, BLOCK_P: tl.constexpr,
                        E_P2: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    block = tl.program_id(0)
    _, _, key = _route_keys(ids_ptr, qsl_ptr, block, num_pairs, top_k, num_experts,
                            num_requests, HAS_QSL, BLOCK_P, E_P2)
    buckets = tl.arange(0, E_P2)
    onehot = (key[:, None] == buckets[None, :]).to(tl.int32)
    tl.store(hist_ptr + block * E_P2 + buckets, tl.sum(onehot, axis=0))


@triton.jit
def _route_scan_kernel(hist_ptr, totals_ptr, num_blocks, E_P2: tl.constexpr,
                       BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr, PDL: tl.constexpr):
    """Buckets ``BLOCK_E * pid ..``: each block's histogram row becomes the count of its
    buckets' pairs in the blocks before it (in place, ``BLOCK_B`` rows at a time), and
    ``totals`` gets each bucket's count over all blocks."""
    pdl_enter(PDL)
    buckets = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    carry = tl.zeros([BLOCK_E], dtype=tl.int32)
    for b0 in range(0, num_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        ptrs = hist_ptr + b[:, None] * E_P2 + buckets[None, :]
        ok = (b < num_blocks)[:, None]
        h = tl.load(ptrs, mask=ok, other=0)
        tl.store(ptrs, tl.cumsum(h, axis=0) - h + carry[None, :], mask=ok)
        carry += tl.sum(h, axis=0)
    tl.store(totals_ptr + buckets, carry)


@triton.jit
def _route_place_kernel(ids_ptr, qsl_ptr, before_ptr, totals_ptr, order_ptr, offsets_ptr,
                        num_pairs, top_k, num_experts, num_requests, HAS_QSL: tl.constexpr,
                        BLOCK_P: tl.constexpr, E_P2: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    block = tl.program_id(0)
    buckets = tl.arange(0, E_P2)
    total = tl.load(totals_ptr + buckets)
    before = tl.load(before_ptr + block * E_P2 + buckets)
    ends = tl.cumsum(total, axis=0)
    first = (buckets * 0 + block) == 0  # a vector: the interpreter rejects scalar masks
    tl.store(offsets_ptr + buckets, ends, mask=(buckets < num_experts) & first)
    p, ok, key = _route_keys(ids_ptr, qsl_ptr, block, num_pairs, top_k, num_experts,
                             num_requests, HAS_QSL, BLOCK_P, E_P2)
    onehot = (key[:, None] == buckets[None, :]).to(tl.int32)
    rank = tl.cumsum(onehot, axis=0) - onehot  # pairs of the same bucket earlier in the block
    place = rank + (ends - total + before)[None, :]
    tl.store(order_ptr + tl.sum(onehot * place, axis=1), p, mask=ok)


@triton.jit
def _find_tile(offsets_ptr, tile, num_pairs, num_experts, BLOCK_M: tl.constexpr,
               E_P2: tl.constexpr):
    """``(bucket, first row, end row)`` in ``order`` of row tile ``tile``; a bucket past
    ``E`` means the tile is surplus."""
    buckets = tl.arange(0, E_P2)
    ends = tl.load(offsets_ptr + buckets, mask=buckets < num_experts, other=0)
    ends = tl.where(buckets < num_experts, ends, num_pairs)
    starts = tl.load(offsets_ptr + buckets - 1, mask=(buckets >= 1) & (buckets <= num_experts),
                     other=0)
    starts = tl.where(buckets <= num_experts, starts, num_pairs)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(tiles, axis=0)
    bucket = tl.sum((cum <= tile).to(tl.int32))
    mine = buckets == bucket
    first_tile = tl.sum(tl.where(mine, cum - tiles, 0))
    row0 = tl.sum(tl.where(mine, starts, 0)) + (tile - first_tile) * BLOCK_M
    return bucket, row0, tl.sum(tl.where(mine, ends, 0))


@triton.jit
def _gate(x, ACT: tl.constexpr):
    """The GLU gate's activation in fp32 (``ACTIVATIONS``: 1 silu, 2 gelu, 3 gelu tanh)."""
    if ACT == 1:
        y = x / (1.0 + tl.exp(-x))
    elif ACT == 2:
        y = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    else:
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        y = 0.5 * x * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))
    return y


@triton.jit
def _experts_gemm_kernel(a_ptr, order_ptr, offsets_ptr, w_ptr, bias_ptr, scale_ptr, out_ptr,
                         num_pairs, row_div, num_experts, n_out, k_dim, stride_am, stride_we,
                         stride_wk, stride_wn, stride_be, stride_om, col_tiles,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         E_P2: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                         HAS_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         W_EVICT: tl.constexpr, KEEP: tl.constexpr, W_DESC: tl.constexpr,
                         PDL: tl.constexpr):
    """One (row tile of one expert, column tile): ``rows @ W[e]`` (+ bias, gate or scale).
    Programs go row tile by row tile (the column tiles of one row tile are adjacent). Cache
    hints: ``W_EVICT`` on the weight loads (read once), ``KEEP`` on the rows' loads and the
    result's stores (re-read by the other column tiles, the next GEMM or the combine). The
    grid runs many waves, so the next launch is released after the K loop, not at the start.
    ``W_DESC``: ``w_ptr`` is a tensor descriptor of the weights as ``[E * rows, K]`` (rows ``n``
    of expert ``e`` at ``e * stride_we + n``; tiles ``[BLOCK_N, BLOCK_K]``, K past its end read
    as zeros), and ``BLOCK_N`` divides ``n_out``: no tile crosses into the next half or expert."""
    pdl_wait(PDL)
    tile = tl.program_id(0) // col_tiles
    bucket, row0, end = _find_tile(offsets_ptr, tile, num_pairs, num_experts, BLOCK_M, E_P2)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = (rows < end) & (rows * 0 + bucket <= num_experts)  # vector masks only
    pair = tl.load(order_ptr + rows, mask=row_ok, other=0)
    col0 = (tl.program_id(0) % col_tiles) * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    out_ptrs = out_ptr + pair[:, None].to(tl.int64) * stride_om + cols[None, :]
    out_ok = row_ok[:, None] & col_ok[None, :]
    if bucket == num_experts:  # routed nowhere: zeros
        tl.store(out_ptrs, tl.zeros([BLOCK_M, BLOCK_N], dtype=out_ptr.dtype.element_ty),
                 mask=out_ok)
    elif bucket < num_experts:
        a_rows = a_ptr + (pair // row_div).to(tl.int64)[:, None] * stride_am
        if W_DESC:  # the tile's first weight row in the [E * rows, K] view
            w_row = bucket * stride_we + col0
        else:
            w_tile = w_ptr + bucket.to(tl.int64) * stride_we + cols[None, :] * stride_wn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, k_dim, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < k_dim
            a = tl.load(a_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0,
                        eviction_policy=KEEP)
            w_ok = k_ok[:, None] & col_ok[None, :]
            if W_DESC:
                w = tl.trans(w_ptr.load([w_row, k0]))
            else:
                w = tl.load(w_tile + ks[:, None] * stride_wk, mask=w_ok, other=0.0,
                            eviction_policy=W_EVICT)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
            if ACT != 0:  # the up half of the same columns: W[e, :, n_out + cols]
                if W_DESC:
                    w2 = tl.trans(w_ptr.load([w_row + n_out, k0]))
                else:
                    w2 = tl.load(w_tile + n_out * stride_wn + ks[:, None] * stride_wk,
                                 mask=w_ok, other=0.0, eviction_policy=W_EVICT)
                acc_up = tl.dot(a, w2, acc_up, input_precision=DOT_PRECISION)
        pdl_release(PDL)
        if HAS_BIAS:
            b_ptr = bias_ptr + bucket.to(tl.int64) * stride_be + cols
            acc += tl.load(b_ptr, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            if ACT != 0:
                acc_up += tl.load(b_ptr + n_out, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if ACT != 0:
            acc = _gate(acc, ACT) * acc_up
        if HAS_SCALE:
            acc *= tl.load(scale_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_ok,
                 eviction_policy=KEEP)


@triton.jit
def _combine_kernel(scratch_ptr, out_ptr, num_tokens, n_cols, TOP_K: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, READ_EVICT: tl.constexpr,
                    PDL: tl.constexpr):
    """``out[n] = sum_k scratch[n*K + k]`` in ``k`` order, fp32, one rounding. The loop over
    ``k`` is unrolled, so its ``K`` loads are in flight together; the adds keep their order."""
    pdl_enter(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = (t < num_tokens)[:, None] & (d < n_cols)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        rows = (t * TOP_K + k).to(tl.int64) * n_cols
        acc += tl.load(scratch_ptr + rows[:, None] + d[None, :], mask=ok, other=0.0,
                       eviction_policy=READ_EVICT).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64)[:, None] * n_cols + d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------- plan
@dataclass(frozen=True)
class ExpertsPlan:
    """Tiles of one layer's experts launches (from ``N*K`` and ``E`` only)."""

    block_m: int
    """Pairs per row tile: 16 / 32 / 64 by the mean pairs per active expert."""
    max_tiles: int
    """Row tiles of the grid: ``cdiv(S, BLOCK_M) + min(E + 1, S)`` bounds any routing."""
    e_p2: int
    """Buckets (``E`` experts and the routed-nowhere one) padded to a power of two."""
    block_p: int
    """Pairs per routing block (``BLOCK_P * E_P2`` one-hot entries stay at 8K)."""
    block_b: int
    """Histogram rows the scan loads at once."""
    block_e: int
    """Buckets per scan program."""


def plan_experts(num_pairs: int, num_experts: int) -> ExpertsPlan:
    e_p2 = triton.next_power_of_2(num_experts + 1)
    mean = num_pairs / max(1, min(num_experts, num_pairs))
    block_m = 16 if mean <= 16 else 32 if mean <= 32 else 64
    max_tiles = triton.cdiv(num_pairs, block_m) + min(num_experts + 1, num_pairs)
    block_p = max(16, min(128, 8192 // e_p2))
    block_e = min(e_p2, 64)
    return ExpertsPlan(block_m, max_tiles, e_p2, block_p, 8192 // block_e, block_e)


# ---------------------------------------------------------------------- host wrappers
def experts_route_triton(ids: torch.Tensor, query_start_loc: torch.Tensor | None,
                         num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``dspark::experts_route`` on the device: three launches, no host sync."""
    check_route(ids, query_start_loc, num_experts)
    ids = ids.contiguous()
    num_pairs = ids.numel()
    order = torch.empty(num_pairs, dtype=torch.int32, device=ids.device)
    if num_pairs == 0:
        return order, torch.zeros(num_experts, dtype=torch.int32, device=ids.device)
    # the placing launch's first block writes every entry: no fill launch
    offsets = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    cfg, _ = device_target(ids.device)
    plan = plan_experts(num_pairs, num_experts)
    blocks = triton.cdiv(num_pairs, plan.block_p)
    hist = torch.empty(blocks, plan.e_p2, dtype=torch.int32, device=ids.device)
    totals = torch.empty(plan.e_p2, dtype=torch.int32, device=ids.device)
    qsl = query_start_loc if query_start_loc is not None else ids
    requests = query_start_loc.shape[0] - 1 if query_start_loc is not None else 0
    common = dict(HAS_QSL=query_start_loc is not None, BLOCK_P=plan.block_p, E_P2=plan.e_p2,
                  PDL=use_pdl(ids.device, cfg), num_warps=4)
    extra = pdl_options(common["PDL"])
    launch(_route_count_kernel, (blocks,), ids, qsl, hist, num_pairs, ids.shape[1],
           num_experts, requests, **common, **extra)
    launch(_route_scan_kernel, (plan.e_p2 // plan.block_e,), hist, totals, blocks,
           E_P2=plan.e_p2, BLOCK_E=plan.block_e, BLOCK_B=plan.block_b, PDL=common["PDL"],
           num_warps=4, **extra)
    launch(_route_place_kernel, (blocks,), ids, qsl, hist, totals, order, offsets, num_pairs,
           ids.shape[1], num_experts, requests, **common, **extra)
    return order, offsets


def uses_grouped_mm(w: torch.Tensor, rows: torch.Tensor, cfg: TargetConfig) -> bool:
    """The target picks the vendor grouped GEMM and it takes these operands: ``torch.
    _grouped_mm`` exists, bf16 on a CUDA device, every row stride 16-byte aligned."""
    return (cfg.experts_kernel == "grouped_mm" and hasattr(torch, "_grouped_mm")
            and w.is_cuda and w.dtype == rows.dtype == torch.bfloat16
            and all(s % 8 == 0 for s in (*w.shape[1:], rows.shape[1])))


def _hint(cfg: TargetConfig, policy: str) -> str:
    """``policy`` as a load's or store's ``eviction_policy``; none without
    ``TargetConfig.experts_cache_hints``."""
    return policy if cfg.experts_cache_hints else ""


def _tma_weights(w: torch.Tensor, transposed: bool, n_out: int, block_n: int,
                 cfg: TargetConfig) -> bool:
    """Load the weight tiles through a tensor descriptor (TMA): the target asks for it
    (``TargetConfig.experts_tma``) and the weights allow it:

    - 16-bit elements (bf16 is measured and tested on the GPU; fp16 moves the same bytes);
      float32 keeps pointer loads;
    - ``[E, rows, K]`` contiguous (not ``transposed``), 16-byte aligned, ``K`` rows a multiple
      of 16 bytes;
    - ``block_n`` dividing ``n_out``: a tile never spans two halves or two experts.

    The kernel is the same otherwise; the interpreter takes the descriptor too (the CPU
    tests)."""
    if not cfg.experts_tma or transposed or not w.is_contiguous() or w.element_size() != 2:
        return False
    return descriptor_ok(w) and n_out % block_n == 0


def _gemm(a, order, offsets, w, bias, scale, out, row_div: int, transposed: bool,
          activation: str, cfg: TargetConfig, block_n: int,
          wide_block_n: int | None = None) -> None:
    """Launch the grouped GEMM writing ``out [S, n_out]`` in pair order, ``block_n`` columns a
    program (``wide_block_n`` where the plan's row tiles hold 64 pairs)."""
    num_pairs, num_experts = order.shape[0], w.shape[0]
    n_out = out.shape[1]
    plan = plan_experts(num_pairs, num_experts)
    if wide_block_n is not None and plan.block_m >= 64:
        block_n = wide_block_n
    # weight element (e, k: input, n: output) at e*s0 + k*s_k + n*s_n
    s_k, s_n = (w.stride(1), w.stride(2)) if transposed else (w.stride(2), w.stride(1))
    pdl = use_pdl(a.device, cfg)
    col_tiles = triton.cdiv(n_out, block_n)
    dummy = out
    tma = _tma_weights(w, transposed, n_out, block_n, cfg)
    w_arg, stride_we = (w, w.stride(0))
    if tma:  # rows of expert e at e * w.shape[1] of a [E * rows, K] view
        w_arg = tensor_descriptor(w.reshape(-1, w.shape[2]), [block_n, cfg.experts_block_k])
        stride_we = w.shape[1]
    launch(_experts_gemm_kernel, (plan.max_tiles * col_tiles,), a, order, offsets, w_arg,
           bias if bias is not None else dummy, scale if scale is not None else dummy, out,
           num_pairs, row_div, num_experts, n_out, a.shape[1], a.stride(0), stride_we, s_k,
           s_n, bias.stride(0) if bias is not None else 0, out.stride(0), col_tiles,
           BLOCK_M=plan.block_m, BLOCK_N=block_n, BLOCK_K=cfg.experts_block_k,
           E_P2=plan.e_p2, ACT=_ACT[activation], HAS_BIAS=bias is not None,
           HAS_SCALE=scale is not None, DOT_PRECISION=fp32_dot_precision(cfg),
           W_EVICT=_hint(cfg, "evict_first"), KEEP=_hint(cfg, "evict_last"), W_DESC=tma,
           PDL=pdl, num_warps=cfg.experts_num_warps, num_stages=cfg.experts_num_stages,
           **pdl_options(pdl))


def experts_up_triton(x: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor,
                      w: torch.Tensor, bias: torch.Tensor | None, transposed: bool,
                      activation: str) -> torch.Tensor:
    """``dspark::experts_up`` on the device: ``[N*K, F']`` in pair order."""
    check_up(x, order, offsets, w, bias, transposed, activation)
    x = x.contiguous()
    out = torch.empty(order.shape[0], up_columns(w, transposed, activation), dtype=w.dtype,
                      device=x.device)
    if out.numel() == 0:
        return out
    cfg, _ = device_target(x.device)
    if uses_grouped_mm(w, x, cfg):
        return _up_grouped_mm(x, order, offsets, w, bias, transposed, activation, out)
    _gemm(x, order, offsets, w, bias, None, out, order.shape[0] // x.shape[0], transposed,
          activation, cfg, cfg.experts_block_n)
    return out


def experts_down_triton(h: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor,
                        weights: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                        transposed: bool) -> torch.Tensor:
    """``dspark::experts_down`` on the device: ``[N, D]``."""
    check_down(h, order, offsets, weights, w, bias, transposed)
    h, weights = h.contiguous(), weights.contiguous()
    num_tokens, top_k = weights.shape
    d = w.shape[2] if transposed else w.shape[1]
    dtype = down_dtype(w, weights)
    out = torch.empty(num_tokens, d, dtype=dtype, device=h.device)
    if out.numel() == 0:
        return out
    cfg, _ = device_target(h.device)
    if uses_grouped_mm(w, h, cfg):
        return _down_grouped_mm(h, order, offsets, weights, w, bias, transposed, dtype)
    scratch = torch.empty(order.shape[0], d, dtype=dtype, device=h.device)
    _gemm(h, order, offsets, w, bias, weights, scratch, 1, transposed, "none", cfg,
          cfg.experts_down_block_n, cfg.experts_down_block_n_wide)
    pdl = use_pdl(h.device, cfg)
    block_d = min(256, triton.next_power_of_2(d))
    launch(_combine_kernel, (triton.cdiv(num_tokens, COMBINE_TOKENS), triton.cdiv(d, block_d)),
           scratch, out, num_tokens, d, TOP_K=top_k, BLOCK_T=COMBINE_TOKENS, BLOCK_D=block_d,
           READ_EVICT=_hint(cfg, "evict_first"), PDL=pdl, num_warps=4, **pdl_options(pdl))
    return out


# ---------------------------------------------------------------------- vendor grouped GEMM
def _sorted_experts(order: torch.Tensor, offsets: torch.Tensor):
    """``(expert of each position of order, routed)`` as int64 ``[S]`` and bool ``[S]``."""
    positions = torch.arange(order.shape[0], device=order.device)
    expert = torch.searchsorted(offsets.to(torch.int64), positions, right=True)
    return expert, expert < offsets.shape[0]


def _grouped(rows: torch.Tensor, w: torch.Tensor, bias, transposed: bool, offsets, expert,
             routed) -> torch.Tensor:
    """``rows`` (sorted by expert) ``@ W[e]`` (+ bias) with ``torch._grouped_mm``; rows past the
    routed pairs (left unwritten by the GEMM) are zeroed."""
    mat = w if transposed else w.transpose(1, 2)  # [E, in, out]
    y = torch._grouped_mm(rows, mat, offs=offsets)
    if bias is not None:
        y = y + bias.index_select(0, expert.clamp(max=w.shape[0] - 1))
    return torch.where(routed[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device))


def _up_grouped_mm(x, order, offsets, w, bias, transposed, activation, out):
    expert, routed = _sorted_experts(order, offsets)
    rows = x.index_select(0, order.to(torch.int64) // (order.shape[0] // x.shape[0]))
    y = activate(_grouped(rows, w, bias, transposed, offsets, expert, routed), activation)
    return out.index_copy_(0, order.to(torch.int64), y)


def _down_grouped_mm(h, order, offsets, weights, w, bias, transposed, dtype):
    expert, routed = _sorted_experts(order, offsets)
    pairs = order.to(torch.int64)
    y = _grouped(h.index_select(0, pairs), w, bias, transposed, offsets, expert, routed)
    y = y * weights.reshape(-1).index_select(0, pairs)[:, None]
    y = torch.where(routed[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device))
    y = torch.empty_like(y, dtype=dtype).index_copy_(0, pairs, y.to(dtype))  # pair order
    return y.view(weights.shape[0], weights.shape[1], -1).sum(dim=1)
