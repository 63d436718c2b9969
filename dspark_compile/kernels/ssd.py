"""Triton lowering of ``dspark::ssd`` and ``dspark::ssd_commit`` (Mamba-2 verify with rollback).

Kernels first, then the launch plan and the host wrappers; the oracle is
:mod:`dspark_compile.ops.ssd_reference`, schemas and the ring layout are in ``ops/ssd.py``.

Forward, row walk (grid ``(R + 1, H * cdiv(P, BLOCK_P))``, from shapes only): one program per
(request, head, block of ``BLOCK_P`` head channels) holds its ``[N, BLOCK_P]`` slice of the
fp32 state in registers and walks the request's rows in order (the recurrent form)::

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
reloads itself), so their latency overlaps the update instead of adding to the serial chain.
The pool is only read; the state never leaves registers. A row only ever sees earlier rows of
its own request, so a NaN or Inf in a rejected draft reaches that row's and later rows' outputs
only: there is no causal mask term to get wrong. Ring writers: every channel block its slice of
``x * dt``; channel block 0 of each head ``A * dt``; block 0 of the first head of each group that
group's B. Program row ``R`` is the padding pseudo-request: it zeroes rows
``query_start_loc[R] .. N-1``. Empty requests exit.

Forward, block form (``SsdPlan.block_rows``; :func:`plan_ssd` says when):
a request of ``block_from..block_rows`` rows is taken at once from the state before it,
``out = diag(exp(cum)) C S0 + L (x * dt) + D x`` (:func:`_ssd_block`), the state streamed once
through float32 FMA dots, one multiply-add per state element per row against the walk's three.
By default in a launch of its own before the walk's (``ROLE`` 1, then 2 for the other
requests), so each kernel's registers fit its one form. Its containment rule differs from the
walk's and is in :func:`_ssd_block`.

dt is rounded to its own dtype after the bias and after the softplus, as HF computes it in
that dtype (a no-op in float32). Softplus is ``log(1 + exp(v))`` below 20 and ``v`` above
(torch's threshold).

Commit (grid ``(R, H * cdiv(P, BLOCK_P))``): the same update, fed from the rings for the first
``clamp(accept_lens[i], 0, len_i)`` rows, then one store of ``s * T`` into the pool. The update
is the shared ``_ssd_step``, so the committed state is the row walk's own arithmetic (the block
form's outputs agree with it to float32 rounding).

Token-serial by design, like the GDN kernel: a long prefill runs ``len`` dependent steps per
program (correct, not fast; a chunked kernel would be the prefill path).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .gdn import _fill_block, _load_state, _zero_padding_rows  # shared tiles, the fill rule
from .launch import launch
from ..ops.ssd_reference import check_ssd, check_ssd_commit
from .device import device_sm_count, device_target, register_cap

__all__ = ["SsdPlan", "plan_ssd", "ssd_triton", "ssd_commit_triton"]

_MAX_TILE = 4096  # fp32 state elements per program: 128 registers per thread on one warp
_MIN_BLOCK_P = 16
_PAD_ROWS = 16  # padding rows zeroed per store by the pseudo-request
_BLOCK_ROWS = 8  # requests up to this many rows take the block form (the verify widths)
_BLOCK_FROM = 1  # ... and at least this many (plan_ssd: all of them, see its docstring)
_BLOCK_WALK_P = 16  # channels at a time the block form's launch walks longer requests
_BLOCK_MIN_REQUESTS = 8  # below this many requests the walk's shorter chain is faster
_BLOCK_MIN_WIDTH = 6  # ... and below this many rows a request (tokens / requests), the walk
_BLOCK_FORM_P = 64  # head channels a block-form program streams, at most
_BLOCK_FORM_REGISTERS = 128  # maxnreg of the block form's launch (SsdPlan.block_form_registers)
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
def _ssd_block(out_ptr, x_ptr, dt_ptr, b_ptr, c_ptr, state_ptr, ring_x_ptr, ring_b_ptr,
               ring_da_ptr, start, length, slot, num_slots, head, group, pb, a, d, bias, dt_min,
               dt_max, offs_p, p_ok, stride_x_tok, stride_x_head, stride_dt_tok, stride_b_tok,
               stride_b_group, stride_c_tok, stride_c_group, stride_out_tok, stride_out_head,
               stride_s_slot, stride_s_head, stride_s_n, H: tl.constexpr, G: tl.constexpr,
               NS: tl.constexpr, P: tl.constexpr, N_PAD: tl.constexpr, BLOCK_P: tl.constexpr,
               HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
               T: tl.constexpr, BLOCK_N: tl.constexpr):
    """A request of at most ``T`` rows from the state before it (the block form)::

        out = diag(exp(cum)) C S0 + L (x * dt) + D x,   L[t, s] = [s <= t] exp(win(s, t)) C_t . B_s

    with ``cum_t`` the sum of ``A dt`` over rows ``0..t`` and ``win(s, t)`` over ``s < i <= t``
    (sums over windows, never a difference of prefix sums, so a ``-inf`` decay gives 0). The state
    is streamed once, ``BLOCK_N`` of its N rows at a time, through float32 FMA dots (one
    multiply-add per state element per row); the Gram ``C B^T`` rides in the same loop.

    Containment: C and B only reach a row's own and later outputs through the dots and the
    select that builds ``L``; ``x * dt`` is the one operand a product mixes across rows, so a
    non-finite element is replaced by 0 before it, and the block's outputs from the first row
    with a non-finite ``x * dt`` on are set to NaN (the row form gives NaN or Inf in that row's
    non-finite channels from there on)."""
    f32: tl.constexpr = tl.float32
    offs_t = tl.arange(0, T)
    in_req = offs_t < length
    rows = start.to(tl.int64) + offs_t
    tt = offs_t[:, None]
    ss = offs_t[None, :]
    dt = tl.load(dt_ptr + rows * stride_dt_tok + head, mask=in_req, other=0.0).to(f32)
    dt = _process_dt(dt, bias, HAS_DT_BIAS, SOFTPLUS, dt_min, dt_max, dt_ptr.dtype.element_ty)
    da = tl.where(in_req, a * dt, 0.0)
    writes_b = (pb == 0) & (head % (H // G) == 0)
    if pb == 0:
        tl.store(ring_da_ptr + rows * H + head, da, mask=in_req)
    offs_c = tl.arange(0, BLOCK_N)
    s_base = state_ptr + slot * stride_s_slot + head * stride_s_head
    if writes_b:  # one program a group, before the stream (after it, it costs registers)
        # whole rows: one load and one store (a store between chunk loads would order them)
        nn = tl.arange(0, N_PAD)
        rn_ok = in_req[:, None] & (nn < NS)[None, :]
        b = tl.load(b_ptr + rows[:, None] * stride_b_tok + group * stride_b_group + nn[None, :],
                    mask=rn_ok, other=0.0).to(f32)
        tl.store(ring_b_ptr + (rows[:, None] * G + group) * NS + nn[None, :], b, mask=rn_ok)
    acc = tl.zeros([T, BLOCK_P], f32)
    cb = tl.zeros([T, T], f32)
    for n0 in range(0, N_PAD, BLOCK_N):
        nn = n0 + offs_c
        n_ok = nn < NS
        rn_ok = in_req[:, None] & n_ok[None, :]
        c = tl.load(c_ptr + rows[:, None] * stride_c_tok + group * stride_c_group + nn[None, :],
                    mask=rn_ok, other=0.0).to(f32)
        b = tl.load(b_ptr + rows[:, None] * stride_b_tok + group * stride_b_group + nn[None, :],
                    mask=rn_ok, other=0.0).to(f32)
        slot_n = nn.to(tl.int64) * 0 + slot  # a vector: the interpreter rejects scalar masks
        s_ok = n_ok & (slot_n >= 0) & (slot_n < num_slots)
        s0 = tl.load(s_base + nn[:, None] * stride_s_n + offs_p[None, :],
                     mask=s_ok[:, None] & p_ok[None, :], other=0.0).to(f32)
        acc = tl.dot(c, s0, acc, input_precision="ieee")
        cb = tl.dot(c, tl.trans(b), cb, input_precision="ieee")
    # x after the stream (its tiles are not live across the loop), loaded as the second operand
    # of one [T, 2T] @ [2T, BLOCK_P] product: rows r < T are x * dt of row r, rows r >= T are x of
    # row r - T (the D x term); two halves because triton 3.6's float32 dots need K >= 16
    offs_r = tl.arange(0, 2 * T)
    top = offs_r < T
    r_rows = start.to(tl.int64) + offs_r % T
    r_in = (offs_r % T) < length
    x2 = tl.load(x_ptr + r_rows[:, None] * stride_x_tok + head * stride_x_head + offs_p[None, :],
                 mask=r_in[:, None] & p_ok[None, :], other=0.0).to(f32)
    dt2 = tl.load(dt_ptr + r_rows * stride_dt_tok + head, mask=r_in & top, other=0.0).to(f32)
    dt2 = _process_dt(dt2, bias, HAS_DT_BIAS, SOFTPLUS, dt_min, dt_max, dt_ptr.dtype.element_ty)
    x2 = x2 * tl.where(top, dt2, 1.0)[:, None]
    tl.store(ring_x_ptr + (r_rows[:, None] * H + head) * P + offs_p[None, :], x2,
             mask=(r_in & top)[:, None] & p_ok[None, :])
    finite = (x2 == x2) & (tl.abs(x2) < float("inf"))
    bad = tl.max(tl.where(finite, 0, 1), 1) > 0  # [2T]: a row with a non-finite x * dt (or x)
    first_bad = tl.min(tl.where(bad, offs_r % T, T), 0)
    ii = offs_t[None, None, :]
    win = tl.sum(tl.where((ii > ss[:, :, None]) & (ii <= tt[:, :, None]), da[None, None, :],
                          0.0), 2)
    cum = tl.sum(tl.where(ss <= tt, da[None, :], 0.0), 1)
    lmat = tl.where(ss <= tt, cb * tl.exp(win), 0.0)
    if HAS_D:
        diag = tl.where(tt == ss, d, 0.0)
    else:
        diag = tl.zeros([T, T], f32)
    l2 = tl.reshape(tl.permute(tl.join(lmat, diag), (0, 2, 1)), (T, 2 * T))  # [L | D I]
    out = acc * tl.exp(cum)[:, None] + tl.dot(l2, tl.where(finite, x2, 0.0),
                                              input_precision="ieee")
    out = tl.where((offs_t >= first_bad)[:, None], float("nan"), out)
    rp_ok = in_req[:, None] & p_ok[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out_tok + head * stride_out_head + offs_p[None, :],
             out, mask=rp_ok)


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
        HEADS_FIRST: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_FROM: tl.constexpr,
        BLOCK_N: tl.constexpr, ROLE: tl.constexpr, WALK_P: tl.constexpr):
    """One (request, head, channel block): the block form for ``BLOCK_FROM..BLOCK_ROWS`` rows
    (``BLOCK_ROWS`` 0: never), else the request's rows in order. ``ROLE`` 0 takes both forms in
    one launch; 1 only the block form's requests (the others exit; no padding program), 2 only
    the others (its registers then never hold the block form's tiles). ``ROLE`` 1 with
    ``WALK_P`` also walks the other requests, ``WALK_P`` channels at a time, and has the
    padding program: then there is no second launch."""
    req = tl.program_id(1 if HEADS_FIRST else 0)
    head = tl.program_id(0 if HEADS_FIRST else 1) // NUM_PB
    pb = tl.program_id(0 if HEADS_FIRST else 1) % NUM_PB
    offs_n = tl.arange(0, N_PAD)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    n_ok = offs_n < NS
    p_ok = offs_p < P
    start = tl.load(query_start_loc_ptr + req)
    if (ROLE != 1) | (WALK_P > 0):
        if req == num_requests:
            _zero_padding_rows(out_ptr, start, num_tokens, head, offs_p, p_ok, stride_out_tok,
                               stride_out_head, BLOCK_P, PAD_ROWS)
            return
    length = tl.load(query_start_loc_ptr + req + 1) - start
    if length <= 0:
        return
    in_block = (length >= BLOCK_FROM) & (length <= BLOCK_ROWS)
    if (ROLE == 1) & (WALK_P == 0):
        if in_block == 0:
            return
    if ROLE == 2:
        if in_block:
            return
    slot = tl.load(slots_ptr + req).to(tl.int64)
    group = head // (H // G)
    a = tl.load(a_ptr + head).to(tl.float32)
    d = tl.load(d_ptr + head).to(tl.float32)  # read only with HAS_D (else A's address)
    # HF adds dt_bias.to(dt.dtype): round it to dt's dtype first
    bias = tl.load(dt_bias_ptr + head).to(dt_ptr.dtype.element_ty).to(tl.float32)
    if (BLOCK_ROWS > 0) & (ROLE != 2):  # constexprs first: else the block form is not built
        if in_block:
            _ssd_block(out_ptr, x_ptr, dt_ptr, b_ptr, c_ptr, state_ptr, ring_x_ptr, ring_b_ptr,
                       ring_da_ptr, start, length, slot, num_slots, head, group, pb, a, d, bias,
                       dt_min, dt_max, offs_p, p_ok, stride_x_tok, stride_x_head, stride_dt_tok,
                       stride_b_tok, stride_b_group, stride_c_tok, stride_c_group, stride_out_tok,
                       stride_out_head, stride_s_slot, stride_s_head, stride_s_n, H, G, NS, P,
                       N_PAD, BLOCK_P, HAS_D, HAS_DT_BIAS, SOFTPLUS, BLOCK_ROWS, BLOCK_N)
            return
    # the walk: the whole channel block at once, or (the block form's launch walking the
    # requests it does not take) WALK_P channels at a time; none in a block-only build
    WALK: tl.constexpr = BLOCK_P if WALK_P == 0 else WALK_P
    if (ROLE != 1) | (WALK_P > 0):
        for sub in tl.static_range(BLOCK_P // WALK):
            offs_w = pb * BLOCK_P + sub * WALK + tl.arange(0, WALK)
            _ssd_rows(out_ptr, x_ptr, dt_ptr, b_ptr, c_ptr, state_ptr, ring_x_ptr, ring_b_ptr,
                      ring_da_ptr, start, length, slot, num_slots, head, group,
                      pb * (BLOCK_P // WALK) + sub, a, d, bias, dt_min, dt_max, offs_n, offs_w,
                      n_ok, offs_w < P, stride_x_tok, stride_x_head, stride_dt_tok,
                      stride_b_tok, stride_b_group, stride_c_tok, stride_c_group,
                      stride_out_tok, stride_out_head, stride_s_slot, stride_s_head,
                      stride_s_n, H, G, NS, P, HAS_D, HAS_DT_BIAS, SOFTPLUS)


@triton.jit
def _ssd_rows(out_ptr, x_ptr, dt_ptr, b_ptr, c_ptr, state_ptr, ring_x_ptr, ring_b_ptr,
              ring_da_ptr, start, length, slot, num_slots, head, group, pb, a, d, bias, dt_min,
              dt_max, offs_n, offs_p, n_ok, p_ok, stride_x_tok, stride_x_head, stride_dt_tok,
              stride_b_tok, stride_b_group, stride_c_tok, stride_c_group, stride_out_tok,
              stride_out_head, stride_s_slot, stride_s_head, stride_s_n, H: tl.constexpr,
              G: tl.constexpr, NS: tl.constexpr, P: tl.constexpr, HAS_D: tl.constexpr,
              HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr):
    """The request's rows in order, its state slice in registers (the recurrent form)."""
    _, state = _load_state(state_ptr, slot, num_slots, head, offs_n, offs_p, n_ok, p_ok,
                           stride_s_slot, stride_s_head, stride_s_n)
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
    heads_first: bool = False
    """The grid's first axis enumerates (head, channel block) and its second the requests: for
    more than ``_MAX_GRID_Y`` of them (a Mamba-1 mixer runs ``d_inner * d_state`` one-element
    heads, ``frontend/mamba.py``), which CUDA's second grid axis cannot hold."""
    block_rows: int = 0
    """The forward takes requests of ``block_from..block_rows`` rows in the block form
    (:func:`_ssd_block`: the state streamed once through float32 dots, no row-serial chain);
    0: every request walks its rows. 0 or 8 (the width measured and tested on the GPU)."""
    block_from: int = 1
    """The shortest request the block form takes (shorter ones walk their rows)."""
    block_n: int = 16
    """State rows (of N) a block-form step streams; at least 16 (triton 3.6's float32 dots)."""
    block_launch: bool = True
    """The block form in a launch of its own, before the row walk's: each kernel is then built
    for one form, so the block form's programs are not sized by the row walk's registers."""
    block_form_p: int = 0
    """Head channels a block-form program takes in its own launch (0: ``block_p``)."""
    block_form_warps: int = 0
    """Warps of a block-form program in its own launch (0: ``num_warps``)."""
    block_walk_p: int = 0
    """With ``block_launch``: the block form's launch also walks the requests it does not take,
    this many channels at a time, and zeroes the padding rows, so that there is no second
    launch (whose programs all exit when every request is in the block form); 0: those
    requests walk in a second launch. A power of two of at least 16 dividing the block form's
    channel block. The walk's path sets that launch's build at 255 registers (triton 3.6, sm_90,
    Nemotron-H's shapes, 16 channels): cap it with ``block_form_registers``. :func:`plan_ssd`
    sets 16 with ``block_from`` 1, where only requests over 8 rows walk; with ``block_from`` 8 at
    a mean of 7 rows (most requests walking) it was 27-36% slower than the second launch on an
    H200: a program walks its 64 channels as four chains one after another."""
    block_form_registers: int = 0
    """``maxnreg`` of the block form's own launch (NVIDIA; 0: the compiler's choice). Its build
    has 139 registers (14 programs a multiprocessor); at 128 it spills nothing (16 a
    multiprocessor), and with ``block_walk_p`` 16 only the walk and two registers across the
    stream spill (144 bytes). :func:`plan_ssd` caps it at 128: on an H200 (bf16, all 8 rows,
    ``ssd_kernels_one_launch.json``, ``ssd_kernels_mean7.json``) the op is 5% faster at bs 64
    and 128, and 3% at a mean of 7 rows (most requests walking in the second launch)."""


@functools.lru_cache(maxsize=1024)
def plan_ssd(num_requests: int, num_heads: int, state_dim: int, head_dim: int,
             sm_count: int, block_form: bool | None = None,
             num_tokens: int | None = None) -> SsdPlan:
    """``BLOCK_P`` from host ints: at most ``_MAX_TILE / N_PAD`` channels (32 at N = 128, so the
    state slice stays in registers), halved (down to 16) while ``R * H * P / BLOCK_P``
    programs are fewer than two per multiprocessor (the GDN kernel's rule).

    ``block_form``: requests of 1..``_BLOCK_ROWS`` rows (the verify widths) take the block form,
    in one launch that also walks longer requests ``_BLOCK_WALK_P`` channels at a time (no
    second launch), capped at ``_BLOCK_FORM_REGISTERS``, where a channel block has at least 16
    channels (its float32 dots; narrower heads, Mamba-1's one-element ones, walk their rows).
    ``None`` (the default): from ``_BLOCK_MIN_REQUESTS`` requests on, where ``num_tokens`` (the
    launch's rows, padding included: a tier's width times its requests) is at least
    ``_BLOCK_MIN_WIDTH`` rows a request. On the H200 at Nemotron-H's shapes (docs/benchmarks.md,
    ``ssd_kernels.py --ssd-plans``) the block form is faster with all 8 rows from bs 8 on and
    slower at bs 1, where the walk's shorter chain wins; at a mean of 3 rows the walk is faster
    (bs 64: 83 against 89-108 us), at a mean of 6 or 7 every request in the block form is (bs
    64: 98-99 us against 127-144 with requests under 8 rows walking in a second launch,
    ``ssd_kernels_from_mean6.json``, ``ssd_kernels_from_mean7.json``)."""
    def filled(block: int) -> int:
        return _fill_block(block, _MIN_BLOCK_P, max(num_requests, 1) * num_heads, head_dim,
                           sm_count)

    n_pad = triton.next_power_of_2(max(state_dim, 1))
    p_pad = triton.next_power_of_2(max(head_dim, 1))
    block_p = filled(min(p_pad, max(_MIN_BLOCK_P, _MAX_TILE // n_pad)))
    num_pb = triton.cdiv(head_dim, block_p)
    if block_form is None:
        block_form = num_requests >= _BLOCK_MIN_REQUESTS and num_tokens is not None \
            and num_tokens >= _BLOCK_MIN_WIDTH * num_requests
    # the block form streams its slice instead of holding it: up to 64 channels (narrower heads
    # masked up to 16), by the same rule
    form_p = filled(max(min(p_pad, _BLOCK_FORM_P), _MIN_BLOCK_P))
    return SsdPlan(n_pad, block_p, num_pb, heads_first=num_heads * num_pb > _MAX_GRID_Y,
                   block_rows=_BLOCK_ROWS if block_form and block_p >= _MIN_BLOCK_P else 0,
                   block_from=_BLOCK_FROM, block_form_p=form_p, block_walk_p=_BLOCK_WALK_P,
                   block_form_registers=_BLOCK_FORM_REGISTERS)


def _check_plan(plan: SsdPlan) -> None:
    """The block form's knobs, before any launch: ``ValueError`` naming the value and the rule."""

    def dot_size(v: int) -> bool:  # the block form's float32 dots: a power of two, >= 16
        return v >= _MIN_BLOCK_P and v & (v - 1) == 0

    pow2 = f"a power of two of at least {_MIN_BLOCK_P} (the block form's float32 dots)"
    rules = [(plan.block_rows in (0, _BLOCK_ROWS), "block_rows", plan.block_rows,
              f"0 or {_BLOCK_ROWS}"),
             (plan.block_from >= 1, "block_from", plan.block_from, "at least 1")]
    if plan.block_rows:
        rules += [(dot_size(plan.block_n), "block_n", plan.block_n, pow2),
                  (plan.block_form_p == 0 or dot_size(plan.block_form_p), "block_form_p",
                   plan.block_form_p, pow2 + ", or 0")]
        form_p = plan.block_form_p or plan.block_p
        rules.append((plan.block_form_registers == 0 or plan.block_form_registers >= 32,
                      "block_form_registers", plan.block_form_registers,
                      "0 (the compiler's choice) or at least 32"))
        rules.append((plan.block_walk_p == 0 or (plan.block_launch and dot_size(plan.block_walk_p)
                                                 and form_p % plan.block_walk_p == 0),
                      "block_walk_p", plan.block_walk_p,
                      f"0, or with block_launch a power of two of at least {_MIN_BLOCK_P} "
                      f"dividing the block form's channel block ({form_p})"))
        if not (plan.block_launch and plan.block_form_p):  # the walk's channel blocks
            rules.append((plan.block_p >= _MIN_BLOCK_P, "block_p", plan.block_p,
                          f"at least {_MIN_BLOCK_P} where the block form takes the walk's "
                          "channel blocks"))
    for ok, name, value, rule in rules:
        if not ok:
            raise ValueError(f"dspark::ssd: SsdPlan.{name}={value!r}: must be {rule}")


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

    One launch (two with ``plan.block_launch``), no host sync (CUDA-graph safe); ``plan``
    overrides the tiles. Returns ``[N, H, P]`` float32; the pool is only read, the rings get the
    replay inputs.
    """
    check_ssd(x, dt, A, B, C, D, dt_bias, ssm_state, query_start_loc, slots,
              (ring_x, ring_b, ring_da), dt_softplus, dt_min, dt_max)
    n, h, p = x.shape
    g, n_state = B.shape[1:]
    r = query_start_loc.shape[0] - 1
    out = torch.empty((n, h, p), dtype=torch.float32, device=x.device)
    if n == 0 or p == 0:
        return out
    plan = plan or plan_ssd(r, h, n_state, p, device_sm_count(x.device), num_tokens=n)
    _check_plan(plan)
    st = ssm_state
    args = (out, x, dt, A, B, C, A if D is None else D, A if dt_bias is None else dt_bias, st,
            query_start_loc, slots, ring_x, ring_b, ring_da, float(dt_min), float(dt_max), n, r,
            st.shape[0], x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1),
            C.stride(0), C.stride(1), out.stride(0), out.stride(1), st.stride(0), st.stride(1),
            st.stride(2))
    shape = dict(H=h, G=g, NS=n_state, P=p, N_PAD=plan.n_pad, HAS_D=D is not None,
                 HAS_DT_BIAS=dt_bias is not None, SOFTPLUS=bool(dt_softplus), PAD_ROWS=_PAD_ROWS,
                 HEADS_FIRST=plan.heads_first, BLOCK_ROWS=plan.block_rows,
                 BLOCK_FROM=plan.block_from, BLOCK_N=plan.block_n)
    role = 0
    if plan.block_rows and plan.block_launch:
        block_p = plan.block_form_p or plan.block_p
        num_pb = triton.cdiv(p, block_p)
        walk_p = plan.block_walk_p
        regs = register_cap(plan.block_form_registers, device_target(x.device)[0], x.device)
        launch(_ssd_forward_kernel, _grid(r + (1 if walk_p else 0), h * num_pb,
                                          plan.heads_first), *args,
               BLOCK_P=block_p, NUM_PB=num_pb, ROLE=1, WALK_P=walk_p,
               num_warps=plan.block_form_warps or plan.num_warps, **regs, **shape)
        if walk_p:
            return out
        role = 2
    launch(_ssd_forward_kernel, _grid(r + 1, h * plan.num_pb, plan.heads_first), *args,
           BLOCK_P=plan.block_p, NUM_PB=plan.num_pb, ROLE=role, WALK_P=0,
           num_warps=plan.num_warps, **shape)
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
           HEADS_FIRST=plan.heads_first, num_warps=plan.num_warps)
