"""Triton lowering of ``dspark::ssd`` and ``dspark::ssd_commit`` (Mamba-2 verify with rollback).

Kernels first, then the launch plan and the host wrappers; the oracle is
:mod:`dspark_compile.ops.ssd_reference`, schemas and the ring layout are in ``ops/ssd.py``.

Forward (grid ``(R + 1, H * cdiv(P, BLOCK_P))``, from shapes only): one program per
(request, head, block of ``BLOCK_P`` head channels) holds its ``[N, BLOCK_P]`` slice of the
fp32 state in registers and walks the request's rows in order (the recurrent form: at verify
widths the state read dominates)::

    dt <- clamp(softplus(dt + dt_bias));  xdt = x * dt;  da = A * dt
    S  <- S * exp(da) + B (x) xdt;        out = S^T C + D * x

The tile is held in scaled form, ``S = s * T``: the decay multiplies the scalar ``s``, the
update is ``T += B (x) (xdt / s)`` (one FMA per element), ``out = s * T^T C``, and ``s`` outside
``[2^-40, 2^40]`` is folded into the tile (in a branch kept as one). Rounding differs from the
reference's ``S * exp(da)`` order by a few ulp. docs/benchmarks.md has the instruction counts
and timings; the GDN kernels keep the direct decay, which measured faster there.

Every reduction is over N, so channel blocks are independent, which is what lets a small
batch spread over the GPU (:func:`plan_ssd`). The update itself is elementwise; only the output
reduces (over N). Each step issues the next row's loads before its own arithmetic (the last row
reloads itself), so their latency overlaps the update instead of adding to the serial chain. The pool is only read; the state never leaves
registers. A row only ever sees earlier rows of its own request, so a NaN or Inf in a rejected
draft reaches that row's and later rows' outputs only: there is no causal mask term to get
wrong. Ring writers: every channel block its slice of ``x * dt``; channel block 0 of each head
``A * dt``; block 0 of the first head of each group that group's B. Program row ``R`` is the
padding pseudo-request: it zeroes rows ``query_start_loc[R] .. N-1``. Empty requests exit.

dt is rounded to its own dtype after the bias and after the softplus, as HF computes it in
that dtype (a no-op in float32). Softplus is ``log(1 + exp(v))`` below 20 and ``v`` above
(torch's threshold).

Commit (grid ``(R, H * cdiv(P, BLOCK_P))``): the same update, fed from the rings for the first
``clamp(accept_lens[i], 0, len_i)`` rows, then one store of ``s * T`` into the pool. The update
is the shared ``_ssd_step``, so the committed state is the forward's own arithmetic.

Token-serial by design, like the GDN kernel: a long prefill runs ``len`` dependent steps per
program (correct, not fast; a chunked kernel would be the prefill path).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .chunk import chunk_decays, first_bad_row, log2_rows, non_finite
from .gdn import _load_state, _zero_padding_rows  # shared tiles: same layout
from .launch import launch
from ..ops.ssd_reference import check_ssd, check_ssd_commit
from .device import device_sm_count, device_target

__all__ = ["SsdPlan", "plan_ssd", "ssd_triton", "ssd_commit_triton"]

_MAX_TILE = 4096  # fp32 state elements per program: 128 registers per thread on one warp
_MIN_BLOCK_P = 16
_PAD_ROWS = 16  # padding rows zeroed per store by the pseudo-request
_CHUNK_ROWS = 16  # rows per tensor-core step of the chunk form: tl.dot's smallest M
_CHUNK_WARPS = 1  # the products' BLOCK_T rows: one warp's tile
_CHUNK_BLOCK_N = 32  # N per product step of the chunk form
_PREP_WARPS = 4
_CHUNK_BLOCK_P = 64
_COMMIT_WARPS = 1  # SsdPlan.num_warps: one warp is the row-by-row kernels' best
_MAX_GRID_Y = 65535  # CUDA's limit on a grid's second (and third) axis
_SCALE_LO = tl.constexpr(2.0 ** -40)  # a state scale outside [LO, HI] is folded into the tile
_SCALE_HI = tl.constexpr(2.0 ** 40)


@triton.jit
def _ssd_step(state, scale, xdt, b, da):
    """One selective-state update of a ``[N_PAD, BLOCK_P]`` tile in scaled form (the true state
    is ``scale * state``): the decay ``exp(da)`` multiplies the scale only, then ``S += b (x)
    xdt`` is ``T += b (x) (xdt / scale)``, one FMA per element. A scale that leaves ``[2^-40,
    2^40]`` is folded into the tile first (one pass, rare: strong decays over many rows), so
    ``xdt / scale`` stays finite. Returns the tile and its scale."""
    scale = scale * tl.exp(da)
    fold = (scale < _SCALE_LO) | (scale > _SCALE_HI)
    if fold:
        # the barrier keeps this a branch: without it the compiler computes the product on
        # every row and selects, which costs the pass the scaled form saves
        tl.debug_barrier()
        state = state * scale
    scale = tl.where(fold, 1.0, scale)
    return state + b[:, None] * (xdt * (1.0 / scale))[None, :], scale


@triton.jit
def _process_dt(dt, bias, HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, dt_min, dt_max,
                DT_TY: tl.constexpr):
    """HF's time step: bias, softplus and clamp, rounded to dt's dtype after each, as fp32."""
    if HAS_DT_BIAS:
        dt = (dt + bias).to(DT_TY).to(tl.float32)
    if SOFTPLUS:
        dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(dt))).to(DT_TY).to(tl.float32)
    return tl.minimum(tl.maximum(dt, dt_min), dt_max)


@triton.jit
def _load_row(x_ptr, dt_ptr, b_ptr, c_ptr, n, head, group, offs_n, offs_p, n_ok, p_ok,
              stride_x_tok, stride_x_head, stride_dt_tok, stride_b_tok, stride_b_group,
              stride_c_tok, stride_c_group):
    """Row ``n``'s x ``[BLOCK_P]``, raw dt, B and C ``[N_PAD]`` of this head, as fp32."""
    x = tl.load(x_ptr + n * stride_x_tok + head * stride_x_head + offs_p, mask=p_ok, other=0.0)
    dt = tl.load(dt_ptr + n * stride_dt_tok + head)
    b = tl.load(b_ptr + n * stride_b_tok + group * stride_b_group + offs_n, mask=n_ok,
                other=0.0)
    c = tl.load(c_ptr + n * stride_c_tok + group * stride_c_group + offs_n, mask=n_ok,
                other=0.0)
    return x.to(tl.float32), dt.to(tl.float32), b.to(tl.float32), c.to(tl.float32)


@triton.jit
def _walk_rows(out_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, dt_bias_ptr, state_ptr,
               slots_ptr, ring_x_ptr, ring_b_ptr, ring_da_ptr, dt_min, dt_max, num_slots, req,
               start, length, head, pb, offs_n, offs_p, n_ok, p_ok, stride_x_tok,
               stride_x_head, stride_dt_tok, stride_b_tok, stride_b_group, stride_c_tok,
               stride_c_group, stride_out_tok, stride_out_head, stride_s_slot, stride_s_head,
               stride_s_n, H: tl.constexpr, G: tl.constexpr, NS: tl.constexpr,
               P: tl.constexpr, HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
               SOFTPLUS: tl.constexpr):
    """The row-by-row form over one request's rows (``length >= 1``), from its pool slot."""
    slot = tl.load(slots_ptr + req).to(tl.int64)
    _, state = _load_state(state_ptr, slot, num_slots, head, offs_n, offs_p, n_ok, p_ok,
                           stride_s_slot, stride_s_head, stride_s_n)
    group = head // (H // G)
    a = tl.load(a_ptr + head).to(tl.float32)
    d = tl.load(d_ptr + head).to(tl.float32)  # read only with HAS_D (else A's address)
    # HF adds dt_bias.to(dt.dtype): round it to dt's dtype first
    bias = tl.load(dt_bias_ptr + head).to(dt_ptr.dtype.element_ty).to(tl.float32)
    last = start + length - 1
    scale = 1.0  # the state's scale (:func:`_ssd_step`)
    x, dt, b, c = _load_row(x_ptr, dt_ptr, b_ptr, c_ptr, start.to(tl.int64), head, group,
                            offs_n, offs_p, n_ok, p_ok, stride_x_tok, stride_x_head,
                            stride_dt_tok, stride_b_tok, stride_b_group, stride_c_tok,
                            stride_c_group)
    for t in range(length):
        n = (start + t).to(tl.int64)
        # the next row's loads go out before this row's arithmetic (the last row reloads
        # itself): their latency overlaps the update instead of stalling the next step
        x_next, dt_next, b_next, c_next = _load_row(
            x_ptr, dt_ptr, b_ptr, c_ptr, tl.minimum(n + 1, last).to(tl.int64), head, group,
            offs_n, offs_p, n_ok, p_ok, stride_x_tok, stride_x_head, stride_dt_tok,
            stride_b_tok, stride_b_group, stride_c_tok, stride_c_group)
        dt = _process_dt(dt, bias, HAS_DT_BIAS, SOFTPLUS, dt_min, dt_max,
                         dt_ptr.dtype.element_ty)
        xdt = x * dt
        da = a * dt
        state, scale = _ssd_step(state, scale, xdt, b, da)
        out = tl.sum(state * c[:, None], 0) * scale  # [BLOCK_P]
        if HAS_D:
            out = out + d * x
        tl.store(out_ptr + n * stride_out_tok + head * stride_out_head + offs_p, out,
                 mask=p_ok)
        tl.store(ring_x_ptr + (n * H + head) * P + offs_p, xdt, mask=p_ok)
        if pb == 0:
            tl.store(ring_da_ptr + n * H + head, da)
            if head % (H // G) == 0:
                tl.store(ring_b_ptr + (n * G + group) * NS + offs_n, b, mask=n_ok)
        x, dt, b, c = x_next, dt_next, b_next, c_next




@triton.jit
def _ssd_forward_kernel(
        out_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, dt_bias_ptr, state_ptr,
        query_start_loc_ptr, slots_ptr, ring_x_ptr, ring_b_ptr, ring_da_ptr, dt_min, dt_max,
        num_tokens, num_requests, num_slots, stride_x_tok, stride_x_head, stride_dt_tok,
        stride_b_tok, stride_b_group, stride_c_tok, stride_c_group, stride_out_tok,
        stride_out_head, stride_s_slot, stride_s_head, stride_s_n, H: tl.constexpr,
        G: tl.constexpr, NS: tl.constexpr, P: tl.constexpr, N_PAD: tl.constexpr,
        BLOCK_P: tl.constexpr, NUM_PB: tl.constexpr, HAS_D: tl.constexpr,
        HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, PAD_ROWS: tl.constexpr,
        HEADS_FIRST: tl.constexpr):
    """One (request, head, channel block): the request's rows, in order."""
    req = tl.program_id(1 if HEADS_FIRST else 0)
    head = tl.program_id(0 if HEADS_FIRST else 1) // NUM_PB
    pb = tl.program_id(0 if HEADS_FIRST else 1) % NUM_PB
    offs_n = tl.arange(0, N_PAD)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    n_ok = offs_n < NS
    p_ok = offs_p < P
    start = tl.load(query_start_loc_ptr + req)
    if req == num_requests:
        _zero_padding_rows(out_ptr, start, num_tokens, head, offs_p, p_ok, stride_out_tok,
                           stride_out_head, BLOCK_P, PAD_ROWS)
        return
    length = tl.load(query_start_loc_ptr + req + 1) - start
    if length <= 0:
        return
    _walk_rows(out_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, dt_bias_ptr, state_ptr,
               slots_ptr, ring_x_ptr, ring_b_ptr, ring_da_ptr, dt_min, dt_max, num_slots, req,
               start, length, head, pb, offs_n, offs_p, n_ok, p_ok, stride_x_tok,
               stride_x_head, stride_dt_tok, stride_b_tok, stride_b_group, stride_c_tok,
               stride_c_group, stride_out_tok, stride_out_head, stride_s_slot, stride_s_head,
               stride_s_n, H, G, NS, P, HAS_D, HAS_DT_BIAS, SOFTPLUS)


@triton.jit
def _ssd_chunk_prep_kernel(
        x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, dt_bias_ptr, query_start_loc_ptr, ring_x_ptr,
        ring_b_ptr, ring_da_ptr, mats_ptr, vecs_ptr, dt_min, dt_max, stride_x_tok,
        stride_x_head, stride_dt_tok, stride_b_tok, stride_b_group, stride_c_tok,
        stride_c_group, H: tl.constexpr, G: tl.constexpr, NS: tl.constexpr, P: tl.constexpr,
        N_PAD: tl.constexpr, P_PAD: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
        SOFTPLUS: tl.constexpr, HEADS_FIRST: tl.constexpr, BLOCK_T: tl.constexpr):
    """One (request, head) of up to ``BLOCK_T`` rows: everything of the chunk form that does
    not depend on the head channel (module docstring, "Chunk form"). Writes the replay rings,
    the decayed causal ``C B^T diag(dt)`` and two row vectors (the chunk start's weight in each
    row, the live rows) for ``_ssd_chunk_forward_kernel``."""
    req = tl.program_id(1 if HEADS_FIRST else 0)
    head = tl.program_id(0 if HEADS_FIRST else 1)
    start = tl.load(query_start_loc_ptr + req)
    length = tl.load(query_start_loc_ptr + req + 1) - start
    if (length <= 0) | (length > BLOCK_T):
        return  # an empty request, or one the forward walks row by row
    offs_t = tl.arange(0, BLOCK_T)
    offs_n = tl.arange(0, N_PAD)
    offs_p = tl.arange(0, P_PAD)
    group = head // (H // G)
    n = (start + offs_t).to(tl.int64)
    r_ok = offs_t < length
    bn_ok = r_ok[:, None] & (offs_n < NS)[None, :]
    xp_ok = r_ok[:, None] & (offs_p < P)[None, :]
    x = tl.load(x_ptr + n[:, None] * stride_x_tok + head * stride_x_head + offs_p[None, :],
                mask=xp_ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + n[:, None] * stride_b_tok + group * stride_b_group + offs_n[None, :],
                mask=bn_ok, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + n[:, None] * stride_c_tok + group * stride_c_group + offs_n[None, :],
                mask=bn_ok, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + head).to(tl.float32)
    bias = tl.load(dt_bias_ptr + head).to(dt_ptr.dtype.element_ty).to(tl.float32)
    dt = tl.load(dt_ptr + n * stride_dt_tok + head, mask=r_ok, other=0.0).to(tl.float32)
    dt = _process_dt(dt, bias, HAS_DT_BIAS, SOFTPLUS, dt_min, dt_max, dt_ptr.dtype.element_ty)
    da = tl.where(r_ok, a * dt, 0.0)
    # the replay inputs, as the row-by-row form saves them
    tl.store(ring_x_ptr + (n[:, None] * H + head) * P + offs_p[None, :], x * dt[:, None],
             mask=xp_ok)
    tl.store(ring_da_ptr + n * H + head, da, mask=r_ok)
    if head % (H // G) == 0:
        tl.store(ring_b_ptr + (n[:, None] * G + group) * NS + offs_n[None, :], b, mask=bn_ok)
    # rows from the first non-finite one on are zeroed (chunk.py)
    bad = non_finite(tl.sum(x * x, 1) + tl.sum(b * b, 1) + tl.sum(c * c, 1) + dt + da)
    live = offs_t < first_bad_row(bad & r_ok, BLOCK_T)
    cb = tl.dot(tl.where(live[:, None], c, 0.0), tl.trans(tl.where(live[:, None], b, 0.0)),
                input_precision="ieee")
    ratio, decay0 = chunk_decays(tl.where(live, da, 0.0), BLOCK_T)
    causal = (offs_t[:, None] >= offs_t[None, :]) & live[:, None] & live[None, :]
    causal = tl.where(causal, ratio * cb * dt[None, :], 0.0)
    row = (req * H + head).to(tl.int64)
    tl.store(mats_ptr + row * (BLOCK_T * BLOCK_T) + offs_t[:, None] * BLOCK_T
             + offs_t[None, :], causal)
    tl.store(vecs_ptr + row * (2 * BLOCK_T) + offs_t, tl.where(live, decay0, 0.0))
    tl.store(vecs_ptr + row * (2 * BLOCK_T) + BLOCK_T + offs_t, live.to(tl.float32))


@triton.jit
def _ssd_chunk_forward_kernel(
        out_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, dt_bias_ptr, state_ptr,
        query_start_loc_ptr, slots_ptr, ring_x_ptr, ring_b_ptr, ring_da_ptr, dt_min, dt_max,
        num_tokens, num_requests, num_slots, stride_x_tok, stride_x_head, stride_dt_tok,
        stride_b_tok, stride_b_group, stride_c_tok, stride_c_group, stride_out_tok,
        stride_out_head, stride_s_slot, stride_s_head, stride_s_n, mats_ptr, vecs_ptr,
        H: tl.constexpr, G: tl.constexpr, NS: tl.constexpr, P: tl.constexpr,
        N_PAD: tl.constexpr, BLOCK_P: tl.constexpr, NUM_PB: tl.constexpr, HAS_D: tl.constexpr,
        HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, PAD_ROWS: tl.constexpr,
        HEADS_FIRST: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
        NUM_STAGES: tl.constexpr, PRECISION: tl.constexpr, WALK_P: tl.constexpr):
    """One (request, head, channel block): a request of up to ``BLOCK_T`` rows all at once
    from the state before them, with what ``_ssd_chunk_prep_kernel`` left for it (module
    docstring, "Chunk form"); a longer one row by row."""
    req = tl.program_id(1 if HEADS_FIRST else 0)
    head = tl.program_id(0 if HEADS_FIRST else 1) // NUM_PB
    pb = tl.program_id(0 if HEADS_FIRST else 1) % NUM_PB
    offs_n = tl.arange(0, N_PAD)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_t = tl.arange(0, BLOCK_T)
    n_ok = offs_n < NS
    p_ok = offs_p < P
    start = tl.load(query_start_loc_ptr + req)
    if req == num_requests:
        _zero_padding_rows(out_ptr, start, num_tokens, head, offs_p, p_ok, stride_out_tok,
                           stride_out_head, BLOCK_P, PAD_ROWS)
        return
    length = tl.load(query_start_loc_ptr + req + 1) - start
    if length <= 0:
        return
    if length > BLOCK_T:
        # a prefill (its state would have to pass between chunks): row by row, 16 channels at
        # a time, so that this path's state tile stays as small as the chunk path's operands
        for p0 in range(0, BLOCK_P, WALK_P):
            offs_w = pb * BLOCK_P + p0 + tl.arange(0, WALK_P)
            _walk_rows(out_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, dt_bias_ptr,
                       state_ptr, slots_ptr, ring_x_ptr, ring_b_ptr, ring_da_ptr, dt_min,
                       dt_max, num_slots, req, start, length, head, pb + p0, offs_n, offs_w,
                       n_ok, offs_w < P, stride_x_tok, stride_x_head, stride_dt_tok,
                       stride_b_tok, stride_b_group, stride_c_tok, stride_c_group,
                       stride_out_tok, stride_out_head, stride_s_slot, stride_s_head,
                       stride_s_n, H, G, NS, P, HAS_D, HAS_DT_BIAS, SOFTPLUS)
        return
    slot = tl.load(slots_ptr + req).to(tl.int64)
    group = head // (H // G)
    n = (start + offs_t).to(tl.int64)
    r_ok = offs_t < length
    xp_ok = r_ok[:, None] & p_ok[None, :]
    c_rows = c_ptr + n * stride_c_tok + group * stride_c_group
    cs = tl.zeros([BLOCK_T, BLOCK_P], tl.float32)  # C S0, raw: a non-finite row stays in its own
    for n0 in tl.range(0, N_PAD, BLOCK_N, num_stages=NUM_STAGES):
        offs_c = n0 + tl.arange(0, BLOCK_N)
        c_ok = offs_c < NS
        c = tl.load(c_rows[:, None] + offs_c[None, :], mask=r_ok[:, None] & c_ok[None, :],
                    other=0.0)
        _, st = _load_state(state_ptr, slot, num_slots, head, offs_c, offs_p, c_ok, p_ok,
                            stride_s_slot, stride_s_head, stride_s_n)
        cs = tl.dot(c.to(tl.float32), st, cs, input_precision=PRECISION)
    row = (req * H + head).to(tl.int64)
    causal = tl.load(mats_ptr + row * (BLOCK_T * BLOCK_T) + offs_t[:, None] * BLOCK_T
                     + offs_t[None, :])
    decay0 = tl.load(vecs_ptr + row * (2 * BLOCK_T) + offs_t)
    live = tl.load(vecs_ptr + row * (2 * BLOCK_T) + BLOCK_T + offs_t) > 0.0
    x = tl.load(x_ptr + n[:, None] * stride_x_tok + head * stride_x_head + offs_p[None, :],
                mask=xp_ok, other=0.0).to(tl.float32)
    x = tl.where(live[:, None], x, 0.0)
    out = tl.where(live[:, None], decay0[:, None] * cs, 0.0) + \
        tl.dot(causal, x, input_precision="ieee")
    if HAS_D:
        out = out + tl.load(d_ptr + head).to(tl.float32) * x
    out = tl.where(live[:, None], out, float("nan"))
    tl.store(out_ptr + n[:, None] * stride_out_tok + head * stride_out_head + offs_p[None, :],
             out, mask=xp_ok)


@triton.jit
def _load_ring_row(ring_x_ptr, ring_b_ptr, ring_da_ptr, n, head, group, offs_n, offs_p, n_ok,
                   p_ok, H: tl.constexpr, G: tl.constexpr, NS: tl.constexpr, P: tl.constexpr):
    """Row ``n``'s saved ``x * dt`` ``[BLOCK_P]``, B ``[N_PAD]`` and ``A * dt``."""
    xdt = tl.load(ring_x_ptr + (n * H + head) * P + offs_p, mask=p_ok, other=0.0)
    b = tl.load(ring_b_ptr + (n * G + group) * NS + offs_n, mask=n_ok, other=0.0)
    return xdt, b, tl.load(ring_da_ptr + n * H + head)


@triton.jit
def _ssd_commit_kernel(
        state_ptr, ring_x_ptr, ring_b_ptr, ring_da_ptr, query_start_loc_ptr, slots_ptr,
        accept_lens_ptr, num_slots, stride_s_slot, stride_s_head, stride_s_n, H: tl.constexpr,
        G: tl.constexpr, NS: tl.constexpr, P: tl.constexpr, N_PAD: tl.constexpr,
        BLOCK_P: tl.constexpr, NUM_PB: tl.constexpr, HEADS_FIRST: tl.constexpr):
    """Replay the accepted rows of one (request, head, channel block) onto the pool."""
    req = tl.program_id(1 if HEADS_FIRST else 0)
    head = tl.program_id(0 if HEADS_FIRST else 1) // NUM_PB
    pb = tl.program_id(0 if HEADS_FIRST else 1) % NUM_PB
    start = tl.load(query_start_loc_ptr + req)
    length = tl.load(query_start_loc_ptr + req + 1) - start
    accepted = tl.minimum(tl.maximum(tl.load(accept_lens_ptr + req), 0), length)
    slot = tl.load(slots_ptr + req).to(tl.int64)
    if (accepted <= 0) | (slot < 0) | (slot >= num_slots):
        return  # empty request, padding slot or nothing accepted: the state stays
    offs_n = tl.arange(0, N_PAD)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    n_ok = offs_n < NS
    p_ok = offs_p < P
    ptrs, state = _load_state(state_ptr, slot, num_slots, head, offs_n, offs_p, n_ok, p_ok,
                              stride_s_slot, stride_s_head, stride_s_n)
    group = head // (H // G)
    last = start + accepted - 1
    scale = 1.0
    xdt, b, da = _load_ring_row(ring_x_ptr, ring_b_ptr, ring_da_ptr, start.to(tl.int64), head,
                                group, offs_n, offs_p, n_ok, p_ok, H, G, NS, P)
    for t in range(accepted):
        n = (start + t).to(tl.int64)
        xdt_next, b_next, da_next = _load_ring_row(  # prefetched, as in the forward
            ring_x_ptr, ring_b_ptr, ring_da_ptr, tl.minimum(n + 1, last).to(tl.int64), head,
            group, offs_n, offs_p, n_ok, p_ok, H, G, NS, P)
        state, scale = _ssd_step(state, scale, xdt, b, da)
        xdt, b, da = xdt_next, b_next, da_next
    state = state * scale
    tl.debug_barrier()  # the whole tile is read before any warp writes it back
    tl.store(ptrs, state, mask=n_ok[:, None] & p_ok[None, :])


@dataclass(frozen=True)
class SsdPlan:
    """Tiles and grid of the SSD launches, derived from shapes and the device only."""

    n_pad: int
    """The state size N rounded up to a power of two (a program holds every N row)."""
    block_p: int
    """Head channels per program."""
    num_pb: int
    """Channel blocks per head: ``cdiv(P, block_p)``."""
    num_warps: int = 1
    """Warps per program: ``benchmarks/ssd_kernels.py --sweep`` on an H200
    (``ssd_kernels_ssd_sweep.json``) at ``BLOCK_P`` 32, all 8 rows, bs 64 / 128: the forward
    150 / 280 us on one warp against 228 / 450 on four, the commit 188 / 375 on either (the GDN
    kernels' finding: every reduction over N stays in the warp)."""
    chunk_rows: int = 0
    """The forward's form: 0 walks the rows one by one; a power of two >= 16 takes that many
    rows at a time through tensor-core products (the commit stays row by row, one warp)."""
    precision: str = "ieee"
    """``tl.dot``'s input precision of the chunk form's products on the state
    (``TargetConfig.state_dot_precision``)."""
    num_stages: int = 3
    """Software-pipeline depth of the chunk form's loop over N."""
    heads_first: bool = False
    """The grid's first axis enumerates (head, channel block) and its second the requests: for
    more than ``_MAX_GRID_Y`` of them (a Mamba-1 mixer runs ``d_inner * d_state`` one-element
    heads, ``frontend/mamba.py``), which CUDA's second grid axis cannot hold."""


@functools.lru_cache(maxsize=1024)
def plan_ssd(num_requests: int, num_heads: int, state_dim: int, head_dim: int,
             sm_count: int, precision: str = "ieee") -> SsdPlan:
    """``BLOCK_P`` from host ints: at most ``_MAX_TILE / N_PAD`` channels (32 at N = 128, so the
    state slice stays in registers), halved (down to 16) while ``R * H * P / BLOCK_P``
    programs are fewer than two per multiprocessor (the GDN kernel's rule). The forward takes
    the chunk form (``_CHUNK_ROWS`` rows, ``_CHUNK_WARPS`` warps) where its products fit: N and
    ``BLOCK_P`` of at least 16 (a Mamba-1 mixer's one-channel heads walk row by row)."""
    n_pad = triton.next_power_of_2(max(state_dim, 1))
    p_pad = triton.next_power_of_2(max(head_dim, 1))
    block_p = min(p_pad, max(_MIN_BLOCK_P, _MAX_TILE // n_pad))
    while block_p > _MIN_BLOCK_P and \
            max(num_requests, 1) * num_heads * triton.cdiv(head_dim, block_p) < 2 * sm_count:
        block_p //= 2
    num_pb = triton.cdiv(head_dim, block_p)
    heads_first = num_heads * num_pb > _MAX_GRID_Y
    if n_pad >= 16 and p_pad >= 16:
        chunk_p = min(p_pad, _CHUNK_BLOCK_P)
        while chunk_p > _MIN_BLOCK_P and \
                max(num_requests, 1) * num_heads * triton.cdiv(head_dim, chunk_p) < 2 * sm_count:
            chunk_p //= 2
        num_pb = triton.cdiv(head_dim, chunk_p)
        return SsdPlan(n_pad, chunk_p, num_pb, _CHUNK_WARPS, _CHUNK_ROWS, precision,
                       heads_first=num_heads * num_pb > _MAX_GRID_Y)
    return SsdPlan(n_pad, block_p, num_pb, heads_first=heads_first)


def _grid(requests: int, head_blocks: int, heads_first: bool) -> tuple[int, int]:
    """The launch grid: requests on the first axis, (head, channel block) on the second, or the
    other way round with ``heads_first``; either way the second axis must fit CUDA's limit."""
    grid = (head_blocks, requests) if heads_first else (requests, head_blocks)
    if grid[1] > _MAX_GRID_Y:
        raise ValueError(f"dspark::ssd: {requests} request rows and {head_blocks} (head, channel "
                         f"block) programs: the grid's second axis holds at most {_MAX_GRID_Y} "
                         "(SsdPlan.heads_first puts the larger count first)")
    return grid


def ssd_triton(x, dt, A, B, C, D, dt_bias, ssm_state, query_start_loc, slots, ring_x, ring_b,
               ring_da, dt_softplus: bool, dt_min: float, dt_max: float,
               plan: SsdPlan | None = None) -> torch.Tensor:
    """Triton ``dspark::ssd``: same arguments and result as the reference.

    One launch, no host sync (CUDA-graph safe); ``plan`` overrides the tiles. Returns
    ``[N, H, P]`` float32; the pool is only read, the rings get the replay inputs.
    """
    check_ssd(x, dt, A, B, C, D, dt_bias, ssm_state, query_start_loc, slots,
              (ring_x, ring_b, ring_da), dt_softplus, dt_min, dt_max)
    n, h, p = x.shape
    g, n_state = B.shape[1:]
    r = query_start_loc.shape[0] - 1
    out = torch.empty((n, h, p), dtype=torch.float32, device=x.device)
    if n == 0 or p == 0:
        return out
    plan = plan or plan_ssd(r, h, n_state, p, device_sm_count(x.device),
                            device_target(x.device)[0].state_dot_precision)
    st = ssm_state
    grid = _grid(r + 1, h * plan.num_pb, plan.heads_first)
    args = (out, x, dt, A, B, C, A if D is None else D, A if dt_bias is None else dt_bias, st,
            query_start_loc, slots, ring_x, ring_b, ring_da, float(dt_min), float(dt_max), n, r,
            st.shape[0], x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1),
            C.stride(0), C.stride(1), out.stride(0), out.stride(1), st.stride(0), st.stride(1),
            st.stride(2))
    shape = dict(H=h, G=g, NS=n_state, P=p, N_PAD=plan.n_pad, BLOCK_P=plan.block_p,
                 NUM_PB=plan.num_pb, HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None,
                 SOFTPLUS=bool(dt_softplus), PAD_ROWS=_PAD_ROWS, HEADS_FIRST=plan.heads_first,
                 num_warps=plan.num_warps)
    if plan.chunk_rows:
        t = plan.chunk_rows
        log2_rows(t)  # a power of two >= 16, or a ValueError
        mats = torch.empty((max(r, 1) * h, t, t), dtype=torch.float32, device=x.device)
        vecs = torch.empty((max(r, 1) * h, 2, t), dtype=torch.float32, device=x.device)
        if r:
            launch(_ssd_chunk_prep_kernel, _grid(r, h, plan.heads_first), x, dt, A, B, C,
                   A if dt_bias is None else dt_bias, query_start_loc, ring_x, ring_b, ring_da,
                   mats, vecs, float(dt_min), float(dt_max), x.stride(0), x.stride(1),
                   dt.stride(0), B.stride(0), B.stride(1), C.stride(0), C.stride(1), H=h, G=g,
                   NS=n_state, P=p, N_PAD=plan.n_pad, P_PAD=triton.next_power_of_2(p),
                   HAS_DT_BIAS=dt_bias is not None, SOFTPLUS=bool(dt_softplus),
                   HEADS_FIRST=plan.heads_first, BLOCK_T=t, num_warps=_PREP_WARPS)
        launch(_ssd_chunk_forward_kernel, grid, *args, mats, vecs, **shape, BLOCK_T=t,
               BLOCK_N=min(_CHUNK_BLOCK_N, plan.n_pad), NUM_STAGES=plan.num_stages,
               PRECISION=plan.precision, WALK_P=min(_MIN_BLOCK_P, plan.block_p))
    else:
        launch(_ssd_forward_kernel, grid, *args, **shape)
    return out


def ssd_commit_triton(ssm_state, ring_x, ring_b, ring_da, query_start_loc, slots, accept_lens,
                      plan: SsdPlan | None = None) -> None:
    """Triton ``dspark::ssd_commit``: mutates the pool in place, one launch, no host sync.
    Slots of requests with something accepted must be distinct."""
    check_ssd_commit(ssm_state, (ring_x, ring_b, ring_da), query_start_loc, slots, accept_lens)
    st = ssm_state
    _, h, n_state, p = st.shape
    r = query_start_loc.shape[0] - 1
    if r == 0 or p == 0:
        return
    plan = plan or plan_ssd(r, h, n_state, p, device_sm_count(st.device))
    launch(_ssd_commit_kernel, _grid(r, h * plan.num_pb, plan.heads_first),
           st, ring_x, ring_b, ring_da, query_start_loc, slots, accept_lens, st.shape[0],
           st.stride(0), st.stride(1), st.stride(2), H=h, G=ring_b.shape[1], NS=n_state, P=p,
           N_PAD=plan.n_pad, BLOCK_P=plan.block_p, NUM_PB=plan.num_pb,
           HEADS_FIRST=plan.heads_first,
           num_warps=_COMMIT_WARPS if plan.chunk_rows else plan.num_warps)
