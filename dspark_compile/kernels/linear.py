"""Triton lowering of ``dspark::linear_group``: skinny matmuls of a verify step, grouped.

A verify step multiplies a few rows (``M`` = packed tokens, 3 to 64 at small batches) by every
weight of the model: the step is a weight read, and its time is how fast the weights stream
from HBM. Vendor GEMMs tile such shapes into too few programs to keep the memory system busy
(a 2048 x 2048 weight at M = 3 ran at 0.8 TB/s on an H200, 17% of its bandwidth). Here:

- One launch covers a group of weights that share the input (q, k, v; gate, up): the grid's
  column tiles run over the weights one after another, each program picking its weight and
  output by tile index, so the group fills the GPU like one wide matmul and no weight is
  copied or concatenated.
- Split-K when the column tiles alone are too few for ``linear_waves`` programs per
  multiprocessor: each split writes fp32 partials, and a second kernel sums them in split
  order (deterministic: replays are bitwise equal) and casts.
- The kernel takes a group of 2+ weights of at most ``linear_max_group_elems`` elements at
  ``M <= linear_max_m``; anything else goes to ``torch.mm`` per weight. Measured on an H200
  (``benchmarks/linear_kernel.py``, 1.1B shapes): q+k+v at M = 3 in 11-14 us against 31.6 us
  for three ``torch.mm``, 14 against 17.9 at M = 24, even at M = 64; but gate+up (67 MB),
  the LM head and every single weight ran 1.4-3x slower than ``torch.mm``, so they stay there.

Kernels, then plan and host wrapper; the oracle is ``x @ w.T`` per weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import launch
from .pdl import pdl_enter
from .targets import TargetConfig
from .device import device_target

__all__ = ["LinearPlan", "plan_linear", "linear_group_triton", "MAX_GROUP"]

MAX_GROUP = 3
"""Most weights in one group (q, k, v)."""


@triton.jit
def _pick(tile, t0, t1, p0, p1, p2):
    """Pointer ``p0`` for tiles before ``t0``, ``p1`` before ``t0 + t1``, else ``p2``."""
    if tile < t0:
        p = p0
    elif tile < t0 + t1:
        p = p1
    else:
        p = p2
    return p


@triton.jit
def _tile_of(tile, t0, t1, n0, n1, n2, col1, col2):
    """(columns of the tile's weight, its first tile, its first column in the partials)."""
    in1 = tile >= t0
    in2 = tile >= t0 + t1
    n = tl.where(in2, n2, tl.where(in1, n1, n0))
    first = tl.where(in2, t0 + t1, tl.where(in1, t0, 0))
    col = tl.where(in2, col2, tl.where(in1, col1, 0))
    return n, first, col


@triton.jit(do_not_specialize=["m", "split_k", "k_per_split"])
def _linear_group_kernel(
        x_ptr, w0_ptr, w1_ptr, w2_ptr, o0_ptr, o1_ptr, o2_ptr, part_ptr, m, k, n0, n1, n2,
        t0, t1, col1, col2, n_total, stride_xm, split_k, k_per_split,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SPLIT: tl.constexpr, EVEN_K: tl.constexpr):
    """One (column tile, K split): ``x[:, ks] @ w[cols, ks].T`` for the tile's weight."""
    tile = tl.program_id(0)
    split = tl.program_id(1)
    w_ptr = _pick(tile, t0, t1, w0_ptr, w1_ptr, w2_ptr)
    o_ptr = _pick(tile, t0, t1, o0_ptr, o1_ptr, o2_ptr)
    n, first, col = _tile_of(tile, t0, t1, n0, n1, n2, col1, col2)
    offs_n = (tile - first) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_ok = offs_n < n
    m_ok = offs_m < m
    k_lo = split * k_per_split
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k_lo + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * k + (k_lo + offs_k)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            wt = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = k_lo + k0 + offs_k < k
            xt = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            wt = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(xt, tl.trans(wt), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SPLIT:  # fp32 partials [split_k, m, n_total]; the reduce kernel sums them in order
        rows = (split * m + offs_m).to(tl.int64)
        ptrs = part_ptr + rows[:, None] * n_total + (col + offs_n)[None, :]
        tl.store(ptrs, acc, mask=m_ok[:, None] & n_ok[None, :])
    else:
        ptrs = o_ptr + offs_m[:, None].to(tl.int64) * n + offs_n[None, :]
        tl.store(ptrs, acc.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["m", "split_k"])
def linear_reduce_kernel(part_ptr, o0_ptr, o1_ptr, o2_ptr, bias_ptr, m, n0, n1, n2, t0, t1,
                          col1, col2, n_total, split_k, BLOCK_N: tl.constexpr,
                          HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    """One (row, column tile): the sum of the split partials ``[split_k, m, n_total]``, in
    split order, plus (``HAS_BIAS``) ``bias [n_total]`` (the group's biases side by side), in
    fp32, cast once. Also the sum launch of ``triton_skinny._split_mm`` (a group of one)."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    o_ptr = _pick(tile, t0, t1, o0_ptr, o1_ptr, o2_ptr)
    n, first, col = _tile_of(tile, t0, t1, n0, n1, n2, col1, col2)
    offs_n = (tile - first) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n
    acc = tl.zeros([BLOCK_N], tl.float32)
    for s in range(split_k):
        acc += tl.load(part_ptr + (s * m + row) * n_total + col + offs_n, mask=n_ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * n + offs_n, acc.to(o_ptr.dtype.element_ty), mask=n_ok)


@dataclass(frozen=True)
class LinearPlan:
    """Tiles, split and grid of one grouped launch (from shapes and the target only)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    k_per_split: int
    tiles: tuple[int, ...]
    """Column tiles of each weight."""
    grid: tuple[int, int]
    num_warps: int
    num_stages: int


def plan_linear(m: int, k: int, ns: tuple[int, ...], cfg: TargetConfig, sm_count: int,
                split_k: int | None = None, block_n: int | None = None,
                block_k: int | None = None, num_stages: int | None = None,
                num_warps: int | None = None) -> LinearPlan:
    """``BLOCK_M`` is the smallest of 16 / 32 / 64 holding ``m`` (few kernel variants per tier
    set). Split rule: the fewest power-of-two splits that give ``linear_waves * sm_count``
    programs, keeping at least ``linear_min_split_k`` of K per split."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = block_n or cfg.linear_block_n
    block_k = block_k or cfg.linear_block_k
    tiles = tuple(-(-n // block_n) for n in ns)
    if split_k is None:
        split_k, want = 1, cfg.linear_waves * sm_count
        while (sum(tiles) * split_k < want and k // (2 * split_k) >= cfg.linear_min_split_k):
            split_k *= 2
    k_per_split = -(-(-(-k // split_k)) // block_k) * block_k  # a multiple of BLOCK_K
    split_k = -(-k // k_per_split)  # no empty split
    return LinearPlan(block_m, block_n, block_k, split_k, k_per_split, tiles,
                      (sum(tiles), split_k), num_warps or cfg.linear_num_warps,
                      num_stages or cfg.linear_num_stages)


def _fail(msg: str) -> None:
    raise ValueError(f"linear_group_triton: {msg}")


def _check(x: torch.Tensor, weights: list[torch.Tensor]) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.stride(-1) != 1:
        _fail(f"x is {getattr(x, 'shape', type(x).__name__)}; it must be a 2-D tensor [M, K] "
              "with a dense last dim")
    if not 1 <= len(weights) <= MAX_GROUP:
        _fail(f"{len(weights)} weights; a group holds 1 to {MAX_GROUP}")
    for i, w in enumerate(weights):
        if (not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[1] != x.shape[1]
                or w.dtype != x.dtype or w.device != x.device or not w.is_contiguous()):
            _fail(f"weights[{i}] is {getattr(w, 'dtype', None)} {tuple(getattr(w, 'shape', ()))}"
                  f" on {getattr(w, 'device', None)}; each must be a contiguous [N, K={x.shape[1]}]"
                  f" tensor of x's dtype {x.dtype} on {x.device}")


def linear_group_triton(x: torch.Tensor, weights: list[torch.Tensor],
                        config: TargetConfig | None = None, **overrides) -> list[torch.Tensor]:
    """``[x @ w.T for w in weights]`` (``x [M, K]``, each ``w [N_i, K]``): one launch (two with
    a split) for 16-bit ``x``, ``M <= linear_max_m`` and a group the table takes (module
    docstring); ``torch.mm`` per weight otherwise, float32 included (its matmuls must not round
    through TF32). ``overrides``
    (``split_k``, ``block_n``, ``block_k``, ``num_stages``, ``num_warps``) are for the
    benchmark's sweep. No host sync; CUDA-graph safe."""
    _check(x, weights)
    cfg, sm_count = device_target(x.device)
    cfg = config or cfg
    m, k = x.shape
    ns = tuple(w.shape[0] for w in weights)
    outs = [x.new_empty((m, n)) for n in ns]
    if m == 0:
        return outs
    if (m > cfg.linear_max_m or x.dtype == torch.float32 or len(weights) < 2
            or sum(ns) * k > cfg.linear_max_group_elems):
        for w, o in zip(weights, outs):
            torch.mm(x, w.t(), out=o)
        return outs
    plan = plan_linear(m, k, ns, cfg, sm_count, **overrides)
    pad = 3 - len(weights)
    ws, os_ = list(weights) + [weights[0]] * pad, outs + [outs[0]] * pad
    ns3 = ns + (0,) * pad
    t0, t1 = plan.tiles[0], plan.tiles[1] if len(ns) > 1 else 0
    col1, col2 = ns3[0], ns3[0] + ns3[1]
    n_total = sum(ns)
    split = plan.split_k > 1
    part = x.new_empty((plan.split_k, m, n_total), dtype=torch.float32) if split else outs[0]
    launch(_linear_group_kernel, plan.grid,
        x, *ws, *os_, part, m, k, *ns3, t0, t1, col1, col2, n_total, x.stride(0), plan.split_k,
        plan.k_per_split, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
        SPLIT=split, EVEN_K=k % plan.k_per_split == 0,
        num_warps=plan.num_warps, num_stages=plan.num_stages)
    if split:
        launch(linear_reduce_kernel, (m, sum(plan.tiles)),
            part, *os_, part, m, *ns3, t0, t1, col1, col2, n_total, plan.split_k,
            BLOCK_N=plan.block_n, HAS_BIAS=False, PDL=False, num_warps=4)
    return outs
