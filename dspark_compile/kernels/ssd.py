"""Triton lowering of ``dspark::ssd`` and ``dspark::ssd_commit`` (Mamba-2 verify with rollback).

Kernels first, then the launch plan and the host wrappers; the oracle is
:mod:`dspark_compile.ops.ssd_reference`, schemas and the ring layout are in ``ops/ssd.py``.

Forward (grid ``(R + 1, H * cdiv(P, BLOCK_P))``, from shapes only): one program per
(request, head, block of ``BLOCK_P`` head channels) reads its ``[N, BLOCK_P]`` slice of the
fp32 state once and takes the request's rows ``CHUNK`` (16) at a time in the chunked form. The
recurrence ::

    dt <- clamp(softplus(dt + dt_bias));  xdt = x * dt;  da = A * dt
    S  <- S * exp(da) + B (x) xdt;        out = S^T C + D * x

unrolls, with ``c_t`` the cumulative ``da`` from the chunk's start and ``S0`` the state there,
to ``out_t = e^{c_t} C_t S0 + sum_{s<=t} e^{c_t - c_s} (C_t . B_s) xdt_s + D x_t``: the state
enters through one product ``C S0`` (``tl.dot`` in three TF32 passes, float32 accuracy; ``ieee``
on AMD) and the rest is ``[CHUNK, BLOCK_P]`` work, summed row by row with selects so that a
later row (a NaN or Inf in a rejected draft) never enters an earlier row's output. A request
past ``CHUNK`` rows carries the state to the chunk's end with one more product and goes on.
The pool is only read. Ring writers: every channel block its slice of ``x * dt``; channel
block 0 of each head ``A * dt``; block 0 of the first head of each group that group's B.
Program row ``R`` is the padding pseudo-request: it zeroes rows ``query_start_loc[R] .. N-1``.
Empty requests exit.

dt is rounded to its own dtype after the bias and after the softplus, as HF computes it in
that dtype (a no-op in float32). Softplus is ``log(1 + exp(v))`` below 20 and ``v`` above
(torch's threshold).

Commit (grid ``(R, H * cdiv(P, BLOCK_P))``): the same update, fed from the rings for the first
``clamp(accept_lens[i], 0, len_i)`` rows, then one store of the tile into the pool. The update
is the shared ``_ssd_step``, so the committed state is the forward's own arithmetic.

The commit stays recurrent, as the GDN commit does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .gdn import _CHUNK, _load_state, _zero_padding_rows  # shared tiles: same layout
from .launch import launch
from ..ops.ssd_reference import check_ssd, check_ssd_commit
from .device import device_sm_count
from .targets import target_for_device

__all__ = ["SsdPlan", "plan_ssd", "ssd_triton", "ssd_commit_triton"]

_MAX_TILE = 4096  # fp32 state elements per program: 32 registers per thread at 4 warps of 32
_MIN_BLOCK_P = 16
_PAD_ROWS = 16  # padding rows zeroed per store by the pseudo-request


@triton.jit
def _ssd_step(state, xdt, b, da):
    """One selective-state update of a ``[N_PAD, BLOCK_P]`` fp32 tile (the reference's order:
    ``S * exp(da) + b (x) xdt``)."""
    return state * tl.exp(da) + b[:, None] * xdt[None, :]


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
def _ssd_forward_kernel(
        out_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, dt_bias_ptr, state_ptr,
        query_start_loc_ptr, slots_ptr, ring_x_ptr, ring_b_ptr, ring_da_ptr, dt_min, dt_max,
        num_tokens, num_requests, num_slots, stride_x_tok, stride_x_head, stride_dt_tok,
        stride_b_tok, stride_b_group, stride_c_tok, stride_c_group, stride_out_tok,
        stride_out_head, stride_s_slot, stride_s_head, stride_s_n, H: tl.constexpr,
        G: tl.constexpr, NS: tl.constexpr, P: tl.constexpr, N_PAD: tl.constexpr,
        BLOCK_P: tl.constexpr, NUM_PB: tl.constexpr, HAS_D: tl.constexpr,
        HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, PAD_ROWS: tl.constexpr,
        CHUNK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One (request, head, channel block): the request's rows, ``CHUNK`` at a time, in the
    chunked form (module docstring)."""
    req = tl.program_id(0)
    head = tl.program_id(1) // NUM_PB
    pb = tl.program_id(1) % NUM_PB
    offs_n = tl.arange(0, N_PAD)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_t = tl.arange(0, CHUNK)
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
    slot = tl.load(slots_ptr + req).to(tl.int64)
    _, state = _load_state(state_ptr, slot, num_slots, head, offs_n, offs_p, n_ok, p_ok,
                           stride_s_slot, stride_s_head, stride_s_n)
    group = head // (H // G)
    a = tl.load(a_ptr + head).to(tl.float32)
    d = tl.load(d_ptr + head).to(tl.float32)  # read only with HAS_D (else A's address)
    # HF adds dt_bias.to(dt.dtype): round it to dt's dtype first
    bias = tl.load(dt_bias_ptr + head).to(dt_ptr.dtype.element_ty).to(tl.float32)
    # ring writers as [CHUNK] vectors (the interpreter rejects scalar & tensor masks): block 0
    # of each head writes A * dt, and of the first head of each group that group's B
    first_block = (offs_t * 0 + pb) == 0
    b_writer = first_block & ((offs_t * 0 + head) % (H // G) == 0)
    row = offs_t[:, None]
    col = offs_t[None, :]
    for c0 in range(0, length, CHUNK):
        rows = (start + c0 + offs_t).to(tl.int64)
        t_ok = (c0 + offs_t) < length
        tp = t_ok[:, None] & p_ok[None, :]
        tn = t_ok[:, None] & n_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x_tok + head * stride_x_head
                    + offs_p[None, :], mask=tp, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + rows * stride_dt_tok + head, mask=t_ok, other=0.0).to(tl.float32)
        bc = tl.load(b_ptr + rows[:, None] * stride_b_tok + group * stride_b_group
                     + offs_n[None, :], mask=tn, other=0.0).to(tl.float32)
        cc = tl.load(c_ptr + rows[:, None] * stride_c_tok + group * stride_c_group
                     + offs_n[None, :], mask=tn, other=0.0).to(tl.float32)
        dt = tl.where(t_ok, _process_dt(dt, bias, HAS_DT_BIAS, SOFTPLUS, dt_min, dt_max,
                                        dt_ptr.dtype.element_ty), 0.0)
        xdt = x * dt[:, None]
        da = a * dt
        tl.store(ring_x_ptr + (rows[:, None] * H + head) * P + offs_p[None, :], xdt, mask=tp)
        tl.store(ring_da_ptr + rows * H + head, da, mask=t_ok & first_block)
        tl.store(ring_b_ptr + (rows[:, None] * G + group) * NS + offs_n[None, :], bc,
                 mask=tn & b_writer[:, None])
        cum = tl.cumsum(da, 0)  # log of the decay from the chunk's start through row t
        # the state's share of every row at once (each row of the product reads that row only)
        cs = tl.dot(cc, state, input_precision=DOT_PRECISION) * tl.exp(cum)[:, None]
        cb = tl.dot(cc, tl.trans(bc), input_precision=DOT_PRECISION)  # [CHUNK, CHUNK]
        mix = tl.where(col <= row, tl.exp(cum[:, None] - cum[None, :]) * cb, 0.0)
        if HAS_D:
            cs = cs + d * x
        # out_t = cs_t + sum_{s<=t} mix[t, s] xdt_s, row by row: a later row's x never
        # enters (a select, not a zero weight, so a NaN there stays there)
        out = tl.zeros([CHUNK, BLOCK_P], tl.float32)
        for t in range(tl.minimum(length - c0, CHUNK)):
            sel = row == t
            w_t = tl.sum(tl.where(sel, mix, 0.0), 0)  # [CHUNK] over s
            o_t = tl.sum(tl.where(sel, cs, 0.0), 0) + tl.sum(
                tl.where(row <= t, w_t[:, None] * xdt, 0.0), 0)
            out = tl.where(sel, o_t[None, :], out)
        tl.store(out_ptr + rows[:, None] * stride_out_tok + head * stride_out_head
                 + offs_p[None, :], out, mask=tp)
        if c0 + CHUNK < length:  # the state at the chunk's end, for the next chunk
            total = tl.sum(tl.where(offs_t == CHUNK - 1, cum, 0.0), 0)
            bw = bc * tl.exp(total - cum)[:, None]
            state = state * tl.exp(total) + tl.dot(tl.trans(bw), xdt,
                                                   input_precision=DOT_PRECISION)


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
        BLOCK_P: tl.constexpr, NUM_PB: tl.constexpr):
    """Replay the accepted rows of one (request, head, channel block) onto the pool."""
    req = tl.program_id(0)
    head = tl.program_id(1) // NUM_PB
    pb = tl.program_id(1) % NUM_PB
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
    xdt, b, da = _load_ring_row(ring_x_ptr, ring_b_ptr, ring_da_ptr, start.to(tl.int64), head,
                                group, offs_n, offs_p, n_ok, p_ok, H, G, NS, P)
    for t in range(accepted):
        n = (start + t).to(tl.int64)
        xdt_next, b_next, da_next = _load_ring_row(  # prefetched, as in the forward
            ring_x_ptr, ring_b_ptr, ring_da_ptr, tl.minimum(n + 1, last).to(tl.int64), head,
            group, offs_n, offs_p, n_ok, p_ok, H, G, NS, P)
        state = _ssd_step(state, xdt, b, da)
        xdt, b, da = xdt_next, b_next, da_next
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
    num_warps: int = 4
    """Warps per program (``benchmarks/ssd_kernels.py --sweep`` times 1 to 8)."""


@functools.lru_cache(maxsize=1024)
def plan_ssd(num_requests: int, num_heads: int, state_dim: int, head_dim: int,
             sm_count: int) -> SsdPlan:
    """``BLOCK_P`` from host ints: at most ``_MAX_TILE / N_PAD`` channels (32 at N = 128, so the
    state slice stays in registers), halved (down to 16) while ``R * H * P / BLOCK_P``
    programs are fewer than two per multiprocessor (the GDN kernel's rule)."""
    n_pad = triton.next_power_of_2(max(state_dim, 1))
    p_pad = triton.next_power_of_2(max(head_dim, 1))
    block_p = min(p_pad, max(_MIN_BLOCK_P, _MAX_TILE // n_pad))
    while block_p > _MIN_BLOCK_P and \
            max(num_requests, 1) * num_heads * triton.cdiv(head_dim, block_p) < 2 * sm_count:
        block_p //= 2
    return SsdPlan(n_pad, block_p, triton.cdiv(head_dim, block_p))


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
    plan = plan or plan_ssd(r, h, n_state, p, device_sm_count(x.device))
    st = ssm_state
    launch(_ssd_forward_kernel, (r + 1, h * plan.num_pb),
           out, x, dt, A, B, C, A if D is None else D, A if dt_bias is None else dt_bias, st,
           query_start_loc, slots, ring_x, ring_b, ring_da, float(dt_min), float(dt_max), n, r,
           st.shape[0], x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1),
           C.stride(0), C.stride(1), out.stride(0), out.stride(1), st.stride(0), st.stride(1),
           st.stride(2), H=h, G=g, NS=n_state, P=p, N_PAD=plan.n_pad, BLOCK_P=plan.block_p,
           NUM_PB=plan.num_pb, HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None,
           SOFTPLUS=bool(dt_softplus), PAD_ROWS=_PAD_ROWS, CHUNK=_CHUNK,
           DOT_PRECISION=target_for_device(x.device).state_dot_precision, num_warps=plan.num_warps)
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
    launch(_ssd_commit_kernel, (r, h * plan.num_pb),
           st, ring_x, ring_b, ring_da, query_start_loc, slots, accept_lens, st.shape[0],
           st.stride(0), st.stride(1), st.stride(2), H=h, G=ring_b.shape[1], NS=n_state, P=p,
           N_PAD=plan.n_pad, BLOCK_P=plan.block_p, NUM_PB=plan.num_pb,
           num_warps=plan.num_warps)
