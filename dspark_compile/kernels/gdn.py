"""Triton lowering of ``dspark::gated_delta_rule`` and ``dspark::gated_delta_rule_commit``.

Kernels first, then the launch plan and the host wrappers; the oracle is
:mod:`dspark_compile.ops.linear_attention_reference`, schemas and the ring layout are in
``linear_ops``.

Forward (grid ``(R + 1, Hv * cdiv(V, BLOCK_V))``, from shapes only): one program per
(request, value head, block of ``BLOCK_V`` value channels) reads its ``[K, BLOCK_V]`` slice of
the fp32 state once and takes the request's rows ``CHUNK`` (16) at a time in the chunked form.
With ``k, q <- l2norm`` (q also scaled), ``c_t`` the cumulative log decay from the chunk's start
and ``S0`` the state at the chunk's start, the recurrence

    S <- S * exp(g);  delta = beta * (v - S^T k);  S <- S + k delta^T;  out = S^T q

unrolls to ``delta_t = beta_t (v_t - e^{c_t} S0^T k_t - sum_{s<t} e^{c_t - c_s} (k_t . k_s)
delta_s)`` and ``out_t = e^{c_t} S0^T q_t + sum_{s<=t} e^{c_t - c_s} (q_t . k_s) delta_s``. So
the state enters through two products ``K S0`` and ``Q S0`` (``tl.dot`` in three TF32 passes:
float32 accuracy on tensor cores; ``ieee`` on AMD), and what stays token-serial is a forward
substitution over ``[CHUNK, BLOCK_V]`` tiles, not over the ``[K, BLOCK_V]`` state. The
recurrent form spent 4 FMAs per state element per row; this one spends none outside the
products. A request past ``CHUNK`` rows carries the state to the chunk's end with one more
product (``S0 e^{c_T} + (K e^{c_T - c})^T delta``) and goes on. The pool is only read.

Rows only ever see earlier rows of their own request: every product's row reads that row
alone, the triangular terms are selects (``tl.where``), never zero weights, and the
substitution reads rows of ``delta`` not yet computed as zeros; so a NaN or Inf in a rejected
draft reaches that row's and later rows' outputs only. The program of value head ``h`` and
channel block 0 saves ``g``, ``beta`` (and, for the first head of each key group, the
normalized key) into the replay rings; every channel block saves its slice of ``v``. Program
row ``R`` is the padding pseudo-request: it zeroes rows ``query_start_loc[R] .. N-1``. Empty
requests exit.

Commit (grid ``(R, Hv * cdiv(V, BLOCK_V))``): the same update, fed from the rings for the
first ``clamp(accept_lens[i], 0, len_i)`` rows, then one store of the tile into the pool. The
update is the shared ``_delta_step``, so the committed state is the forward's own arithmetic.

The commit stays recurrent (it writes the state: 4 FMAs per element per accepted row at
verify widths cost about what the state's read and write do).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import launch
from ..ops.linear_attention_reference import check_gdn, check_gdn_commit
from .device import device_sm_count
from .targets import target_for_device

__all__ = ["GdnPlan", "plan_gdn", "gated_delta_rule_triton", "gated_delta_rule_commit_triton"]

_NUM_WARPS = 4
_MAX_TILE = 4096  # fp32 state elements per program: 32 registers per thread at 4 warps of 32
_MIN_BLOCK_V = 16
_PAD_ROWS = 16  # padding rows zeroed per store by the pseudo-request
_CHUNK = 16  # rows per chunk of the forward (tl.dot's smallest M); longer requests loop


@triton.jit
def _delta_step(state, k, v, g, beta):
    """One gated delta-rule update of a ``[K_PAD, BLOCK_V]`` fp32 state tile (HF's op order)."""
    state = state * tl.exp(g)
    kv_mem = tl.sum(state * k[:, None], 0)  # [BLOCK_V]
    delta = (v - kv_mem) * beta
    return state + k[:, None] * delta[None, :]


@triton.jit
def _zero_padding_rows(out_ptr, first, num_tokens, head, offs_v, v_ok, stride_out_tok,
                       stride_out_head, BLOCK_V: tl.constexpr, PAD_ROWS: tl.constexpr):
    """``out[first:num_tokens, head, offs_v] = 0``, ``PAD_ROWS`` rows per store."""
    offs_r = tl.arange(0, PAD_ROWS)
    zeros = tl.zeros([PAD_ROWS, BLOCK_V], tl.float32).to(out_ptr.dtype.element_ty)
    for r0 in range(first, num_tokens, PAD_ROWS):
        rows = (r0 + offs_r).to(tl.int64)
        ptrs = out_ptr + rows[:, None] * stride_out_tok + head * stride_out_head + offs_v[None, :]
        tl.store(ptrs, zeros, mask=(rows < num_tokens)[:, None] & v_ok[None, :])


@triton.jit
def _load_state(state_ptr, slot, num_slots, head, offs_k, offs_v, k_ok, v_ok, stride_s_slot,
                stride_s_head, stride_s_k):
    """Pointers and fp32 contents of ``state[slot, head, :, offs_v]`` (zeros: bad slot)."""
    ptrs = state_ptr + slot * stride_s_slot + head * stride_s_head \
        + offs_k[:, None] * stride_s_k + offs_v[None, :]
    # the slot test as a [K_PAD] vector: the interpreter rejects scalar & tensor masks
    slot_k = offs_k.to(tl.int64) * 0 + slot
    ok = k_ok & (slot_k >= 0) & (slot_k < num_slots)
    state = tl.load(ptrs, mask=ok[:, None] & v_ok[None, :], other=0.0)
    return ptrs, state.to(tl.float32)


@triton.jit
def _pick_row(tile, sel):
    """Row ``t`` of a ``[CHUNK, X]`` tile as ``[X]``: a select, then a sum of exact zeros, so a
    NaN elsewhere in the tile never reaches it."""
    return tl.sum(tl.where(sel, tile, 0.0), 0)


@triton.jit
def _gdn_forward_kernel(
        out_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, query_start_loc_ptr,
        slots_ptr, ring_k_ptr, ring_v_ptr, ring_g_ptr, ring_beta_ptr, scale, num_tokens,
        num_requests, num_slots, stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
        stride_v_tok, stride_v_head, stride_g_tok, stride_beta_tok, stride_out_tok,
        stride_out_head, stride_s_slot, stride_s_head, stride_s_k, HK: tl.constexpr,
        HV: tl.constexpr, KD: tl.constexpr, VD: tl.constexpr, K_PAD: tl.constexpr,
        BLOCK_V: tl.constexpr, NUM_VB: tl.constexpr, L2NORM: tl.constexpr,
        PAD_ROWS: tl.constexpr, CHUNK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One (request, value head, value-channel block): the request's rows, ``CHUNK`` at a
    time, in the chunked form (module docstring)."""
    req = tl.program_id(0)
    head = tl.program_id(1) // NUM_VB
    vb = tl.program_id(1) % NUM_VB
    offs_k = tl.arange(0, K_PAD)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_t = tl.arange(0, CHUNK)
    k_ok = offs_k < KD
    v_ok = offs_v < VD
    start = tl.load(query_start_loc_ptr + req)
    if req == num_requests:
        _zero_padding_rows(out_ptr, start, num_tokens, head, offs_v, v_ok, stride_out_tok,
                           stride_out_head, BLOCK_V, PAD_ROWS)
        return
    length = tl.load(query_start_loc_ptr + req + 1) - start
    if length <= 0:
        return
    slot = tl.load(slots_ptr + req).to(tl.int64)
    _, state = _load_state(state_ptr, slot, num_slots, head, offs_k, offs_v, k_ok, v_ok,
                           stride_s_slot, stride_s_head, stride_s_k)
    k_head = head // (HV // HK)
    # ring writers as [CHUNK] vectors (the interpreter rejects scalar & tensor masks): block 0
    # of each value head writes g and beta, and of the first value head per key head the key
    first_block = (offs_t * 0 + vb) == 0
    key_writer = first_block & ((offs_t * 0 + head) % (HV // HK) == 0)
    row = offs_t[:, None]
    col = offs_t[None, :]
    for c0 in range(0, length, CHUNK):
        rows = (start + c0 + offs_t).to(tl.int64)
        t_ok = (c0 + offs_t) < length
        tk = t_ok[:, None] & k_ok[None, :]
        tv = t_ok[:, None] & v_ok[None, :]
        kc = tl.load(k_ptr + rows[:, None] * stride_k_tok + k_head * stride_k_head
                     + offs_k[None, :], mask=tk, other=0.0).to(tl.float32)
        qc = tl.load(q_ptr + rows[:, None] * stride_q_tok + k_head * stride_q_head
                     + offs_k[None, :], mask=tk, other=0.0).to(tl.float32)
        vc = tl.load(v_ptr + rows[:, None] * stride_v_tok + head * stride_v_head
                     + offs_v[None, :], mask=tv, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rows * stride_g_tok + head, mask=t_ok, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + rows * stride_beta_tok + head, mask=t_ok,
                       other=0.0).to(tl.float32)
        if L2NORM:
            kc = kc * tl.rsqrt(tl.sum(kc * kc, 1) + 1e-6)[:, None]
            qc = qc * tl.rsqrt(tl.sum(qc * qc, 1) + 1e-6)[:, None]
        qc = qc * scale
        # the commit's replay inputs
        tl.store(ring_k_ptr + (rows[:, None] * HK + k_head) * KD + offs_k[None, :], kc,
                 mask=tk & key_writer[:, None])
        tl.store(ring_v_ptr + (rows[:, None] * HV + head) * VD + offs_v[None, :], vc, mask=tv)
        tl.store(ring_g_ptr + rows * HV + head, g, mask=t_ok & first_block)
        tl.store(ring_beta_ptr + rows * HV + head, beta, mask=t_ok & first_block)
        # every product with the state tile at once; each row of a product reads that row only
        cum = tl.cumsum(g, 0)  # log of the decay from the chunk's start through row t
        lead = tl.exp(cum)[:, None]
        ks = tl.dot(kc, state, input_precision=DOT_PRECISION) * lead  # [CHUNK, BLOCK_V]
        qs = tl.dot(qc, state, input_precision=DOT_PRECISION) * lead
        kk = tl.dot(kc, tl.trans(kc), input_precision=DOT_PRECISION)  # [CHUNK, CHUNK]
        qk = tl.dot(qc, tl.trans(kc), input_precision=DOT_PRECISION)
        decay = tl.exp(cum[:, None] - cum[None, :])  # row t, col s: decay from s to t
        lower = tl.where(col < row, beta[:, None] * decay * kk, 0.0)
        causal = tl.where(col <= row, decay * qk, 0.0)
        rhs = beta[:, None] * (vc - ks)
        # forward substitution: delta_t = rhs_t - sum_{s<t} lower[t, s] delta_s, then
        # out_t = qs_t + sum_{s<=t} causal[t, s] delta_s; rows past t are still zero
        delta = tl.zeros([CHUNK, BLOCK_V], tl.float32)
        out = tl.zeros([CHUNK, BLOCK_V], tl.float32)
        for t in range(tl.minimum(length - c0, CHUNK)):
            sel = row == t
            d_t = _pick_row(rhs, sel) - tl.sum(_pick_row(lower, sel)[:, None] * delta, 0)
            delta = tl.where(sel, d_t[None, :], delta)
            o_t = _pick_row(qs, sel) + tl.sum(_pick_row(causal, sel)[:, None] * delta, 0)
            out = tl.where(sel, o_t[None, :], out)
        tl.store(out_ptr + rows[:, None] * stride_out_tok + head * stride_out_head
                 + offs_v[None, :], out.to(out_ptr.dtype.element_ty), mask=tv)
        if c0 + CHUNK < length:  # the state at the chunk's end, for the next chunk
            total = tl.sum(tl.where(offs_t == CHUNK - 1, cum, 0.0), 0)
            kw = kc * tl.exp(total - cum)[:, None]
            state = state * tl.exp(total) + tl.dot(tl.trans(kw), delta,
                                                   input_precision=DOT_PRECISION)


@triton.jit
def _load_ring_row(ring_k_ptr, ring_v_ptr, ring_g_ptr, ring_beta_ptr, n, head, k_head, offs_k,
                   offs_v, k_ok, v_ok, HK: tl.constexpr, HV: tl.constexpr, KD: tl.constexpr,
                   VD: tl.constexpr):
    """Row ``n``'s saved key ``[K_PAD]``, v ``[BLOCK_V]``, g and beta."""
    k = tl.load(ring_k_ptr + (n * HK + k_head) * KD + offs_k, mask=k_ok, other=0.0)
    v = tl.load(ring_v_ptr + (n * HV + head) * VD + offs_v, mask=v_ok, other=0.0)
    return k, v, tl.load(ring_g_ptr + n * HV + head), tl.load(ring_beta_ptr + n * HV + head)


@triton.jit
def _gdn_commit_kernel(
        state_ptr, ring_k_ptr, ring_v_ptr, ring_g_ptr, ring_beta_ptr, query_start_loc_ptr,
        slots_ptr, accept_lens_ptr, num_slots, stride_s_slot, stride_s_head, stride_s_k,
        HK: tl.constexpr, HV: tl.constexpr, KD: tl.constexpr, VD: tl.constexpr,
        K_PAD: tl.constexpr, BLOCK_V: tl.constexpr, NUM_VB: tl.constexpr):
    """Replay the accepted rows of one (request, value head, channel block) onto the pool."""
    req = tl.program_id(0)
    head = tl.program_id(1) // NUM_VB
    vb = tl.program_id(1) % NUM_VB
    start = tl.load(query_start_loc_ptr + req)
    length = tl.load(query_start_loc_ptr + req + 1) - start
    accepted = tl.minimum(tl.maximum(tl.load(accept_lens_ptr + req), 0), length)
    slot = tl.load(slots_ptr + req).to(tl.int64)
    if (accepted <= 0) | (slot < 0) | (slot >= num_slots):
        return  # empty request, padding slot or nothing accepted: the state stays
    offs_k = tl.arange(0, K_PAD)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = offs_k < KD
    v_ok = offs_v < VD
    ptrs, state = _load_state(state_ptr, slot, num_slots, head, offs_k, offs_v, k_ok, v_ok,
                              stride_s_slot, stride_s_head, stride_s_k)
    k_head = head // (HV // HK)
    last = start + accepted - 1
    k, v, g, beta = _load_ring_row(ring_k_ptr, ring_v_ptr, ring_g_ptr, ring_beta_ptr,
                                   start.to(tl.int64), head, k_head, offs_k, offs_v, k_ok, v_ok,
                                   HK, HV, KD, VD)
    for t in range(accepted):
        n = (start + t).to(tl.int64)
        k_next, v_next, g_next, beta_next = _load_ring_row(  # prefetched, as in the forward
            ring_k_ptr, ring_v_ptr, ring_g_ptr, ring_beta_ptr,
            tl.minimum(n + 1, last).to(tl.int64), head, k_head, offs_k, offs_v, k_ok, v_ok,
            HK, HV, KD, VD)
        state = _delta_step(state, k, v, g, beta)
        k, v, g, beta = k_next, v_next, g_next, beta_next
    tl.debug_barrier()  # the whole tile is read before any warp writes it back
    tl.store(ptrs, state, mask=k_ok[:, None] & v_ok[None, :])


@dataclass(frozen=True)
class GdnPlan:
    """Tiles and grid of the GDN launches, derived from shapes and the device only."""

    k_pad: int
    """K rounded up to a power of two (a program holds every K row of its state slice)."""
    block_v: int
    """Value channels per program."""
    num_vb: int
    """Value-channel blocks per head: ``cdiv(V, block_v)``."""
    num_warps: int = _NUM_WARPS
    """Warps per program (``benchmarks/ssd_kernels.py --sweep`` times 1 to 8)."""


@functools.lru_cache(maxsize=1024)
def plan_gdn(num_requests: int, num_v_heads: int, k_dim: int, v_dim: int,
             sm_count: int) -> GdnPlan:
    """``BLOCK_V`` from host ints: at most ``_MAX_TILE / K_PAD`` channels (32 at K = 128, so
    the state slice stays in registers), halved (down to 16) while ``R * Hv * V / BLOCK_V``
    programs are fewer than two per multiprocessor. At 32 value heads, V = 128 on an H200 (132
    SMs): bs 1 runs 256 programs of 16 channels, bs >= 8 programs of 32."""
    k_pad = triton.next_power_of_2(max(k_dim, 1))
    v_pad = triton.next_power_of_2(max(v_dim, 1))
    block_v = min(v_pad, max(_MIN_BLOCK_V, _MAX_TILE // k_pad))
    while block_v > _MIN_BLOCK_V and \
            max(num_requests, 1) * num_v_heads * triton.cdiv(v_dim, block_v) < 2 * sm_count:
        block_v //= 2
    return GdnPlan(k_pad, block_v, triton.cdiv(v_dim, block_v))


def gated_delta_rule_triton(q, k, v, g, beta, recurrent_state, query_start_loc, slots, ring_k,
                            ring_v, ring_g, ring_beta, scale: float, use_qk_l2norm: bool,
                            plan: GdnPlan | None = None) -> torch.Tensor:
    """Triton ``dspark::gated_delta_rule``: same arguments and result as the reference.

    One launch, no host sync (CUDA-graph safe); ``plan`` overrides the tiles. Returns
    ``[N, Hv, V]`` in q's dtype; the pool is only read, the rings get the replay inputs.
    """
    rings = (ring_k, ring_v, ring_g, ring_beta)
    check_gdn(q, k, v, g, beta, recurrent_state, query_start_loc, slots, rings, scale,
              use_qk_l2norm)
    n, hk, kd = k.shape
    hv, vd = v.shape[1:]
    r = query_start_loc.shape[0] - 1
    out = torch.empty((n, hv, vd), dtype=q.dtype, device=q.device)
    if n == 0 or vd == 0:
        return out
    plan = plan or plan_gdn(r, hv, kd, vd, device_sm_count(q.device))
    st = recurrent_state
    launch(_gdn_forward_kernel, (r + 1, hv * plan.num_vb),
        out, q, k, v, g, beta, st, query_start_loc, slots, ring_k, ring_v, ring_g, ring_beta,
        float(scale), n, r, st.shape[0], q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), g.stride(0), beta.stride(0), out.stride(0), out.stride(1),
        st.stride(0), st.stride(1), st.stride(2), HK=hk, HV=hv, KD=kd, VD=vd, K_PAD=plan.k_pad,
        BLOCK_V=plan.block_v, NUM_VB=plan.num_vb, L2NORM=use_qk_l2norm, PAD_ROWS=_PAD_ROWS,
        CHUNK=_CHUNK, DOT_PRECISION=target_for_device(q.device).state_dot_precision, num_warps=plan.num_warps)
    return out


def gated_delta_rule_commit_triton(recurrent_state, ring_k, ring_v, ring_g, ring_beta,
                                   query_start_loc, slots, accept_lens,
                                   plan: GdnPlan | None = None) -> None:
    """Triton ``dspark::gated_delta_rule_commit``: mutates the pool in place, one launch, no
    host sync. Slots of requests with something accepted must be distinct."""
    rings = (ring_k, ring_v, ring_g, ring_beta)
    check_gdn_commit(recurrent_state, rings, query_start_loc, slots, accept_lens)
    st = recurrent_state
    _, hv, kd, vd = st.shape
    r = query_start_loc.shape[0] - 1
    if r == 0 or vd == 0:
        return
    plan = plan or plan_gdn(r, hv, kd, vd, device_sm_count(st.device))
    launch(_gdn_commit_kernel, (r, hv * plan.num_vb),
        st, ring_k, ring_v, ring_g, ring_beta, query_start_loc, slots, accept_lens,
        st.shape[0], st.stride(0), st.stride(1), st.stride(2), HK=ring_k.shape[1], HV=hv,
        KD=kd, VD=vd, K_PAD=plan.k_pad, BLOCK_V=plan.block_v, NUM_VB=plan.num_vb,
        num_warps=plan.num_warps)
