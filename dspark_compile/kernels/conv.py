"""Triton lowering of ``dspark::causal_conv1d`` and ``dspark::causal_conv1d_commit``.

Kernels first, then the launch plan and the host wrappers (the Triton tutorials' order); the
oracle is :mod:`dspark_compile.ops.linear_attention_reference`, schemas are in ``linear_ops``.

Forward (one launch, grid ``(N // BLOCK_T + R + 1, cdiv(dim, BLOCK_D))`` from shapes only):

- Axis 0 enumerates chunks of at most ``BLOCK_T`` rows of one request: request ``i`` owns
  chunk ids ``qsl[i] // BLOCK_T + i ..`` (strictly increasing, so one compare-and-count over
  ``query_start_loc`` finds it on the device, empty requests included); ids past the last
  request belong to a pseudo-request of the padding rows ``qsl[R] .. N-1`` (zeros out,
  nothing to the ring). Surplus ids exit at once. A verify block (<= 8 rows) is one chunk;
  a prefill is many, each reading the three rows before it again.
- A chunk is one ``[BLOCK_T, BLOCK_D]`` tile. Tap ``b`` back of row ``j`` reads input
  position ``j - b``: the tile's rows shifted by ``b`` (re-read from ``x``, an L1/L2 hit) where
  ``j - b >= 0``, else column ``W-1 + j - b`` of the slot's ``conv_state``, picked by selects
  from three ``[BLOCK_D]`` column vectors (a scalar slot per chunk: no per-element state
  gather). Both sources are masked to their own case and joined by ``tl.where``, so no row of
  another request, and no rejected row after ``j``, is ever read. fp32 accumulation, one
  rounding. All loads precede the two stores (ring, out), so a chunk's reads are in flight
  together.
- The three column vectors are where the kernel assumes the width: ``2 <= W <= 4`` is
  checked on the host (Qwen3-Next and Mamba2 use 4). Registers (sm_90, ``ptxas -v``, bf16,
  dim a multiple of 16): 123 at 8 x 256, no spills. A first version tiled rows of any
  request and gathered the state per element: 198-255 registers and spills at 16 x 128 and
  16 x 256, from its 64-bit pointer tiles. Untuned on a GPU: ``benchmarks/hybrid_kernels.py
  --sweep`` times other tiles.

Commit (grid ``(R, cdiv(dim, BLOCK_D))``): the new window of a request is one
``[BLOCK_D, KEEP_PAD]`` tile, column ``c`` = entry ``a + c`` of ``[state, ring rows]``, i.e.
``[state[a:], x_0 .. x_{a-1}]`` (``KEEP = W-1`` padded to a power of two and masked), loaded
with two disjoint masks, joined by a select and written with one store.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import launch
from ..ops.linear_attention_reference import check_conv, check_conv_commit
from .device import device_sm_count
from .experts import _gate

__all__ = ["ConvPlan", "plan_conv", "causal_conv1d_triton",
           "causal_conv1d_commit_triton"]

_SEARCH_MAX = 256  # request lookup: query_start_loc entries compared per step
_NUM_WARPS = 4  # 4 warps = 128 threads (256 lanes on AMD's 64-wide wavefronts)
_BLOCK_T = 8  # rows per chunk: the largest verify block of the H200 benchmark is one chunk
_MAX_BLOCK_D = 256  # 8 x 256 tile: 16 elements per thread at 4 warps of 32
_MAX_WIDTH = 4  # the forward kernel picks state columns from three vectors


@triton.jit
def _find_chunk_request(query_start_loc_ptr, chunk, num_requests, BLOCK_T: tl.constexpr,
                        SEARCH: tl.constexpr):
    """Largest ``i`` in ``0..R`` with ``qsl[i] // BLOCK_T + i <= chunk`` (``R``: padding).

    ``qsl[i] // BLOCK_T + i`` strictly increases, so ``i`` is the count of entries ``<= chunk``
    minus one: ``SEARCH`` entries per load and one reduction.
    """
    offs = tl.arange(0, SEARCH)
    count = 0
    for c in range(0, num_requests + 1, SEARCH):
        i = c + offs
        start = tl.load(query_start_loc_ptr + i, mask=i <= num_requests, other=0)
        count += tl.sum(((start // BLOCK_T + i <= chunk) & (i <= num_requests)).to(tl.int32))
    return count - 1


@triton.jit
def _state_columns(state_ptr, slot, num_slots, offs_d, d_ok, stride_s_slot, stride_s_dim,
                   stride_s_col, WIDTH: tl.constexpr):
    """The slot's window as three fp32 ``[BLOCK_D]`` columns, oldest first (zeros past
    ``WIDTH - 2``, and for a slot outside ``[0, num_slots)``: no pool row is touched)."""
    slot_d = offs_d.to(tl.int64) * 0 + slot  # a vector: the interpreter rejects scalar masks
    ok = d_ok & (slot_d >= 0) & (slot_d < num_slots)
    ptrs = state_ptr + slot * stride_s_slot + offs_d * stride_s_dim
    sc0 = tl.load(ptrs, mask=ok & (0 < WIDTH - 1), other=0.0).to(tl.float32)
    sc1 = tl.load(ptrs + stride_s_col, mask=ok & (1 < WIDTH - 1), other=0.0).to(tl.float32)
    sc2 = tl.load(ptrs + 2 * stride_s_col, mask=ok & (2 < WIDTH - 1), other=0.0)
    return sc0, sc1, sc2.to(tl.float32)


_ACT = {"none": 0, "silu": 1, "gelu": 2, "gelu_pytorch_tanh": 3}
"""The kernel's code of each of ``ACTIVATIONS`` (the GELUs as the experts kernel's ``_gate``
numbers them)."""


@triton.jit
def _activate(acc, ACT: tl.constexpr):
    """The conv's activation in fp32 (:data:`_ACT`): SiLU, or a GELU by ``_gate``."""
    if ACT == 1:
        acc = acc * tl.sigmoid(acc)
    elif ACT != 0:
        acc = _gate(acc, ACT)
    return acc


@triton.jit
def _causal_conv1d_kernel(
        out_ptr, x_ptr, weight_ptr, bias_ptr, state_ptr, query_start_loc_ptr, slots_ptr,
        ring_ptr, num_tokens, num_requests, num_slots, dim, stride_x, stride_out, stride_ring,
        stride_w, stride_s_slot, stride_s_dim, stride_s_col, WIDTH: tl.constexpr,
        HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr, SEARCH: tl.constexpr):
    """One chunk of <= ``BLOCK_T`` rows of one request x ``BLOCK_D`` channels."""
    chunk = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < dim
    req = _find_chunk_request(query_start_loc_ptr, chunk, num_requests, BLOCK_T, SEARCH)
    start = tl.load(query_start_loc_ptr + req)
    is_pad = req >= num_requests
    end = tl.load(query_start_loc_ptr + req + 1, mask=req < num_requests, other=0)
    length = tl.where(is_pad, num_tokens - start, end - start)
    j0 = (chunk - (start // BLOCK_T + req)) * BLOCK_T  # first own row of the chunk
    if j0 >= length:
        return  # surplus chunk id
    offs_t = tl.arange(0, BLOCK_T)
    rows = (start + j0 + offs_t).to(tl.int64)  # [BLOCK_T]
    tile_ok = (j0 + offs_t < length)[:, None] & d_ok[None, :]  # [BLOCK_T, BLOCK_D]
    out_ptrs = out_ptr + rows[:, None] * stride_out + offs_d[None, :]
    if is_pad:  # padding rows: zeros out, nothing to the ring
        tl.store(out_ptrs, tl.zeros([BLOCK_T, BLOCK_D], tl.float32).to(
            out_ptr.dtype.element_ty), mask=tile_ok)
        return
    slot = tl.load(slots_ptr + req).to(tl.int64)
    sc0, sc1, sc2 = _state_columns(state_ptr, slot, num_slots, offs_d, d_ok, stride_s_slot,
                                   stride_s_dim, stride_s_col, WIDTH)
    x_ptrs = x_ptr + rows[:, None] * stride_x + offs_d[None, :]
    xt = tl.load(x_ptrs, mask=tile_ok, other=0.0)  # the chunk's own rows: tap WIDTH-1
    tap = tl.load(weight_ptr + offs_d * stride_w + (WIDTH - 1), mask=d_ok, other=0.0)
    acc = tap.to(tl.float32)[None, :] * xt.to(tl.float32)
    for back in tl.static_range(1, WIDTH):
        pos = (j0 + offs_t - back)[:, None]  # [BLOCK_T, 1] input position in the request
        shifted = tl.load(x_ptrs - back * stride_x, mask=tile_ok & (pos >= 0), other=0.0)
        # pos < 0: state column WIDTH-1+pos, picked by selects from three [BLOCK_D] vectors
        from_state = tl.where(pos == 1 - WIDTH, sc0[None, :],
                              tl.where(pos == 2 - WIDTH, sc1[None, :], sc2[None, :]))
        value = tl.where(pos >= 0, shifted.to(tl.float32), from_state)
        tap = tl.load(weight_ptr + offs_d * stride_w + (WIDTH - 1 - back), mask=d_ok, other=0.0)
        acc += tap.to(tl.float32)[None, :] * value
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    acc = _activate(acc, ACT)
    # every load above is issued before the first store (nothing may alias, as far as the
    # compiler knows): the whole chunk is in flight at once
    tl.store(ring_ptr + rows[:, None] * stride_ring + offs_d[None, :], xt, mask=tile_ok)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=tile_ok)


@triton.jit
def _conv_commit_kernel(state_ptr, ring_ptr, query_start_loc_ptr, slots_ptr, accept_lens_ptr,
                        num_slots, dim, stride_ring, stride_s_slot, stride_s_dim, stride_s_col,
                        KEEP: tl.constexpr, KEEP_PAD: tl.constexpr, BLOCK_D: tl.constexpr):
    """New window of one request: last ``KEEP`` of ``[state, its first a ring rows]``."""
    req = tl.program_id(0)
    start = tl.load(query_start_loc_ptr + req)
    length = tl.load(query_start_loc_ptr + req + 1) - start
    accepted = tl.minimum(tl.maximum(tl.load(accept_lens_ptr + req), 0), length)
    slot = tl.load(slots_ptr + req).to(tl.int64)
    if (accepted <= 0) | (slot < 0) | (slot >= num_slots):
        return  # empty request, padding slot, nothing accepted: the window stays
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_c = tl.arange(0, KEEP_PAD)
    pos = accepted + offs_c  # [KEEP_PAD] entry of cat(state, ring rows) kept in column c
    tile_ok = (offs_d < dim)[:, None] & (offs_c < KEEP)[None, :]
    from_state = (pos < KEEP)[None, :]
    base = state_ptr + slot * stride_s_slot + offs_d[:, None] * stride_s_dim
    old = tl.load(base + tl.minimum(pos, KEEP - 1)[None, :] * stride_s_col,
                  mask=tile_ok & from_state, other=0.0)
    ring_rows = (start + pos - KEEP).to(tl.int64)
    new = tl.load(ring_ptr + ring_rows[None, :] * stride_ring + offs_d[:, None],
                  mask=tile_ok & ~from_state, other=0.0)
    tile = tl.where(from_state, old, new)
    tl.debug_barrier()  # every state column is read before any warp overwrites one
    tl.store(base + offs_c[None, :] * stride_s_col, tile, mask=tile_ok)


@dataclass(frozen=True)
class ConvPlan:
    """Tiles of the conv launches, derived from shapes and the device only."""

    block_t: int
    """Rows per forward chunk (a verify block fits one)."""
    block_d: int
    """Channels per forward program."""
    commit_block_d: int
    """Channels per commit program."""
    search: int
    """``query_start_loc`` entries compared per step of a chunk's request lookup."""


@functools.lru_cache(maxsize=1024)
def plan_conv(num_tokens: int, dim: int, num_requests: int, width: int,
              sm_count: int) -> ConvPlan:
    """Tiles from host ints. ``BLOCK_D`` starts at ``_MAX_BLOCK_D`` and halves (down to 64)
    while the chunks that have work, about ``min(R, N)`` at verify widths, times the channel
    blocks are under two programs per multiprocessor: bs 1 at dim 10240 spreads over 160."""
    block_t = _BLOCK_T
    busy = max(1, min(num_requests, num_tokens))
    block_d = max(64, min(_MAX_BLOCK_D, triton.next_power_of_2(max(dim, 1))))
    while block_d > 64 and busy * triton.cdiv(dim, block_d) < 2 * sm_count:
        block_d //= 2
    keep_pad = triton.next_power_of_2(max(width - 1, 1))
    commit_block_d = max(64, min(1024 // keep_pad, triton.next_power_of_2(max(dim, 1))))
    search = min(triton.next_power_of_2(num_requests + 1), _SEARCH_MAX)
    return ConvPlan(block_t, block_d, commit_block_d, search)


def causal_conv1d_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_state: torch.Tensor, query_start_loc: torch.Tensor,
                         slots: torch.Tensor, ring: torch.Tensor, activation: str,
                         plan: ConvPlan | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton ``dspark::causal_conv1d``: same arguments and result as the reference.

    ``plan`` overrides the tiles (benchmarks, tests); ``out`` is an optional ``[N, dim]``
    buffer of x's dtype with a dense last dim (every element is written). One launch, no host
    sync: CUDA-graph safe. Returns ``[N, dim]`` in x's dtype.
    """
    check_conv(x, weight, bias, conv_state, query_start_loc, slots, ring, activation)
    n, dim = x.shape
    if out is None:
        out = torch.empty((n, dim), dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != x.dtype or out.device != x.device or \
            (n and out.stride(1) != 1):
        raise ValueError(f"causal_conv1d_triton: out {tuple(out.shape)} {out.dtype} on "
                         f"{out.device} must match x {tuple(x.shape)} {x.dtype} on {x.device} "
                         "with a dense last dim")
    r, width = query_start_loc.shape[0] - 1, weight.shape[1]
    if width > _MAX_WIDTH:
        raise ValueError(f"causal_conv1d_triton: weight has width {width}; the kernel keeps the "
                         f"state in {_MAX_WIDTH - 1} column vectors, so 2 <= width <= {_MAX_WIDTH}"
                         " (use the reference op, dspark::causal_conv1d, for wider kernels)")
    if n == 0 or dim == 0:
        return out
    plan = plan or plan_conv(n, dim, r, width, device_sm_count(x.device))
    grid = (n // plan.block_t + r + 1, triton.cdiv(dim, plan.block_d))
    launch(_causal_conv1d_kernel, grid,
        out, x, weight, bias if bias is not None else weight, conv_state, query_start_loc,
        slots, ring, n, r, conv_state.shape[0], dim, x.stride(0), out.stride(0),
        ring.stride(0), weight.stride(0), conv_state.stride(0), conv_state.stride(1),
        conv_state.stride(2), WIDTH=width, HAS_BIAS=bias is not None,
        ACT=_ACT[activation], BLOCK_T=plan.block_t, BLOCK_D=plan.block_d,
        SEARCH=plan.search, num_warps=_NUM_WARPS)
    return out


def causal_conv1d_commit_triton(conv_state: torch.Tensor, ring: torch.Tensor,
                                query_start_loc: torch.Tensor, slots: torch.Tensor,
                                accept_lens: torch.Tensor, plan: ConvPlan | None = None) -> None:
    """Triton ``dspark::causal_conv1d_commit``: mutates ``conv_state`` in place, one launch,
    no host sync. Slots of requests with something accepted must be distinct (one program per
    request writes its slot)."""
    check_conv_commit(conv_state, ring, query_start_loc, slots, accept_lens)
    r = query_start_loc.shape[0] - 1
    num_slots, dim, keep = conv_state.shape
    if r == 0 or dim == 0 or keep == 0:
        return
    plan = plan or plan_conv(ring.shape[0], dim, r, keep + 1, device_sm_count(ring.device))
    grid = (r, triton.cdiv(dim, plan.commit_block_d))
    launch(_conv_commit_kernel, grid,
        conv_state, ring, query_start_loc, slots, accept_lens, num_slots, dim, ring.stride(0),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), KEEP=keep,
        KEEP_PAD=triton.next_power_of_2(keep), BLOCK_D=plan.commit_block_d,
        num_warps=_NUM_WARPS)
