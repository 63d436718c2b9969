"""Triton lowering of ``dspark::gated_delta_rule`` and ``dspark::gated_delta_rule_commit``.

Kernels first, then the launch plan and the host wrappers; the oracle is
:mod:`dspark_compile.ops.linear_attention_reference`, schemas and the ring layout are in
``linear_ops``.

Forward (grid ``(R + 1, Hv * cdiv(V, BLOCK_V))``, from shapes only): one program per
(request, value head, block of ``BLOCK_V`` value channels) holds its ``[K, BLOCK_V]`` slice of
the fp32 state in registers and walks the request's rows in order (the recurrent form: at
verify widths, T <= 16, the state read dominates, and each row costs 3 K x BLOCK_V FMAs):

    k, q <- l2norm;  S <- S * exp(g);  delta = beta * (v - S^T k);  S <- S + k delta^T;
    out = S^T (q * scale)

(with ``CHANNEL_GATES``, Kimi Linear's KDA, g is a ``[K]`` vector and row k of S decays by
``exp(g[k])``; the rings keep the vector).

Each value-channel block is independent (every reduction is over K), which is what lets a
small batch spread over the GPU (see :func:`plan_gdn`). Each step issues the next row's loads
before its own arithmetic (the last row reloads itself), so their latency overlaps the update
instead of adding to the token-serial chain. One warp a program: with more, the two
reductions over K cross warps every step (``benchmarks/ssd_kernels.py --sweep`` on an H200, all
8 rows, ``BLOCK_V`` 32: 87 / 161 us at bs 64 / 128 on 1 warp against 190 / 372 on 4). The pool is
only read; the state never leaves registers. A row only ever sees earlier rows of its own request, so a NaN or Inf
in a rejected draft reaches that row's and later rows' outputs only, never an earlier row:
there is no causal mask term to get wrong. The program of value head ``h`` and channel block
0 saves ``g``, ``beta`` (and, for the first head of each key group, the normalized key) into
the replay rings; every channel block saves its slice of ``v``. Program row ``R`` is the
padding pseudo-request: it zeroes rows ``query_start_loc[R] .. N-1``. Empty requests exit.

Commit (grid ``(R, Hv * cdiv(V, BLOCK_V))``): the same update, fed from the rings for the
first ``clamp(accept_lens[i], 0, len_i)`` rows, then one store of the tile into the pool. The
update is the shared ``_delta_step``, so the committed state is the forward's own arithmetic.

Registers (sm_90, K = V = 128, BLOCK_V = 32, bf16, one warp; ``cuobjdump --dump-resource-usage``
of triton 3.9's cubin): forward 229 per thread and no stack, commit 254 and 16 bytes of stack
(the commit on one warp still measured faster: 105 / 209 against 123 / 229 us on 4). Token-serial by design: a long prefill runs ``len`` dependent steps per
program (correct, not fast; a chunked kernel would be the prefill path).
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

__all__ = ["GdnPlan", "plan_gdn", "gated_delta_rule_triton", "gated_delta_rule_commit_triton"]

_NUM_WARPS = 1  # module docstring: the sweep's best at every tile
_MAX_TILE = 4096  # fp32 state elements per program: 128 registers per thread on one warp of 32
_MIN_BLOCK_V = 16
_PAD_ROWS = 16  # padding rows zeroed per store by the pseudo-request


@triton.jit
def _l2norm(x):
    """``x / sqrt(sum(x^2) + 1e-6)`` over a ``[K_PAD]`` vector (padding lanes hold 0)."""
    return x * tl.rsqrt(tl.sum(x * x, 0) + 1e-6)


@triton.jit
def _delta_step(state, k, v, g, beta, CHANNEL_GATES: tl.constexpr):
    """One gated delta-rule update of a ``[K_PAD, BLOCK_V]`` fp32 state tile (HF's op order);
    g is a scalar, or a ``[K_PAD]`` vector with ``CHANNEL_GATES`` (row k decays by g[k])."""
    if CHANNEL_GATES:
        state = state * tl.exp(g)[:, None]
    else:
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
def _save_ring(ring_k_ptr, ring_v_ptr, ring_g_ptr, ring_beta_ptr, n, head, k_head, vb, k, v, g,
               beta, offs_k, offs_v, k_ok, v_ok, HK: tl.constexpr, HV: tl.constexpr,
               KD: tl.constexpr, VD: tl.constexpr, CHANNEL_GATES: tl.constexpr):
    """Row ``n``'s replay inputs: one writer per key head (its first value head, block 0) for
    the normalized key, per value head (block 0) for g and beta, per block for v."""
    if (head % (HV // HK) == 0) & (vb == 0):
        tl.store(ring_k_ptr + (n * HK + k_head) * KD + offs_k, k, mask=k_ok)
    tl.store(ring_v_ptr + (n * HV + head) * VD + offs_v, v, mask=v_ok)
    if vb == 0:
        if CHANNEL_GATES:
            tl.store(ring_g_ptr + (n * HV + head) * KD + offs_k, g, mask=k_ok)
        else:
            tl.store(ring_g_ptr + n * HV + head, g)
        tl.store(ring_beta_ptr + n * HV + head, beta)


@triton.jit
def _load_row(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, n, head, k_head, offs_k, offs_v, k_ok,
              v_ok, stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok,
              stride_v_head, stride_g_tok, stride_g_head, stride_beta_tok,
              CHANNEL_GATES: tl.constexpr):
    """Row ``n``'s q, k ``[K_PAD]`` (its key head), v ``[BLOCK_V]``, g (``[K_PAD]`` with
    ``CHANNEL_GATES``) and beta, as fp32."""
    k = tl.load(k_ptr + n * stride_k_tok + k_head * stride_k_head + offs_k, mask=k_ok,
                other=0.0)
    q = tl.load(q_ptr + n * stride_q_tok + k_head * stride_q_head + offs_k, mask=k_ok,
                other=0.0)
    v = tl.load(v_ptr + n * stride_v_tok + head * stride_v_head + offs_v, mask=v_ok, other=0.0)
    if CHANNEL_GATES:
        g = tl.load(g_ptr + n * stride_g_tok + head * stride_g_head + offs_k, mask=k_ok,
                    other=0.0)
    else:
        g = tl.load(g_ptr + n * stride_g_tok + head)
    beta = tl.load(beta_ptr + n * stride_beta_tok + head)
    return (q.to(tl.float32), k.to(tl.float32), v.to(tl.float32), g.to(tl.float32),
            beta.to(tl.float32))


@triton.jit
def _gdn_forward_kernel(
        out_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, query_start_loc_ptr,
        slots_ptr, ring_k_ptr, ring_v_ptr, ring_g_ptr, ring_beta_ptr, scale, num_tokens,
        num_requests, num_slots, stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
        stride_v_tok, stride_v_head, stride_g_tok, stride_g_head, stride_beta_tok,
        stride_out_tok, stride_out_head, stride_s_slot, stride_s_head, stride_s_k,
        HK: tl.constexpr, HV: tl.constexpr, KD: tl.constexpr, VD: tl.constexpr,
        K_PAD: tl.constexpr, BLOCK_V: tl.constexpr, NUM_VB: tl.constexpr, L2NORM: tl.constexpr,
        PAD_ROWS: tl.constexpr, CHANNEL_GATES: tl.constexpr):
    """One (request, value head, value-channel block): the request's rows, in order."""
    req = tl.program_id(0)
    head = tl.program_id(1) // NUM_VB
    vb = tl.program_id(1) % NUM_VB
    offs_k = tl.arange(0, K_PAD)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
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
    last = start + length - 1
    q, k, v, g, beta = _load_row(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, start.to(tl.int64), head,
                                 k_head, offs_k, offs_v, k_ok, v_ok, stride_q_tok,
                                 stride_q_head, stride_k_tok, stride_k_head, stride_v_tok,
                                 stride_v_head, stride_g_tok, stride_g_head, stride_beta_tok,
                                 CHANNEL_GATES)
    for t in range(length):
        n = (start + t).to(tl.int64)
        # the next row's loads go out before this row's arithmetic (the last row reloads
        # itself): their latency overlaps the update instead of stalling the next step
        q_next, k_next, v_next, g_next, beta_next = _load_row(
            q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, tl.minimum(n + 1, last).to(tl.int64), head,
            k_head, offs_k, offs_v, k_ok, v_ok, stride_q_tok, stride_q_head, stride_k_tok,
            stride_k_head, stride_v_tok, stride_v_head, stride_g_tok, stride_g_head,
            stride_beta_tok, CHANNEL_GATES)
        if L2NORM:
            k = _l2norm(k)
            q = _l2norm(q)
        state = _delta_step(state, k, v, g, beta, CHANNEL_GATES)
        out = tl.sum(state * (q * scale)[:, None], 0)  # [BLOCK_V]
        tl.store(out_ptr + n * stride_out_tok + head * stride_out_head + offs_v,
                 out.to(out_ptr.dtype.element_ty), mask=v_ok)
        _save_ring(ring_k_ptr, ring_v_ptr, ring_g_ptr, ring_beta_ptr, n, head, k_head, vb, k,
                   v, g, beta, offs_k, offs_v, k_ok, v_ok, HK, HV, KD, VD, CHANNEL_GATES)
        q, k, v, g, beta = q_next, k_next, v_next, g_next, beta_next


@triton.jit
def _load_ring_row(ring_k_ptr, ring_v_ptr, ring_g_ptr, ring_beta_ptr, n, head, k_head, offs_k,
                   offs_v, k_ok, v_ok, HK: tl.constexpr, HV: tl.constexpr, KD: tl.constexpr,
                   VD: tl.constexpr, CHANNEL_GATES: tl.constexpr):
    """Row ``n``'s saved key ``[K_PAD]``, v ``[BLOCK_V]``, g and beta."""
    k = tl.load(ring_k_ptr + (n * HK + k_head) * KD + offs_k, mask=k_ok, other=0.0)
    v = tl.load(ring_v_ptr + (n * HV + head) * VD + offs_v, mask=v_ok, other=0.0)
    if CHANNEL_GATES:
        g = tl.load(ring_g_ptr + (n * HV + head) * KD + offs_k, mask=k_ok, other=0.0)
    else:
        g = tl.load(ring_g_ptr + n * HV + head)
    return k, v, g, tl.load(ring_beta_ptr + n * HV + head)


@triton.jit
def _gdn_commit_kernel(
        state_ptr, ring_k_ptr, ring_v_ptr, ring_g_ptr, ring_beta_ptr, query_start_loc_ptr,
        slots_ptr, accept_lens_ptr, num_slots, stride_s_slot, stride_s_head, stride_s_k,
        HK: tl.constexpr, HV: tl.constexpr, KD: tl.constexpr, VD: tl.constexpr,
        K_PAD: tl.constexpr, BLOCK_V: tl.constexpr, NUM_VB: tl.constexpr,
        CHANNEL_GATES: tl.constexpr):
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
                                   HK, HV, KD, VD, CHANNEL_GATES)
    for t in range(accepted):
        n = (start + t).to(tl.int64)
        k_next, v_next, g_next, beta_next = _load_ring_row(  # prefetched, as in the forward
            ring_k_ptr, ring_v_ptr, ring_g_ptr, ring_beta_ptr,
            tl.minimum(n + 1, last).to(tl.int64), head, k_head, offs_k, offs_v, k_ok, v_ok,
            HK, HV, KD, VD, CHANNEL_GATES)
        state = _delta_step(state, k, v, g, beta, CHANNEL_GATES)
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
        v.stride(0), v.stride(1), g.stride(0), g.stride(1), beta.stride(0), out.stride(0),
        out.stride(1), st.stride(0), st.stride(1), st.stride(2), HK=hk, HV=hv, KD=kd, VD=vd,
        K_PAD=plan.k_pad, BLOCK_V=plan.block_v, NUM_VB=plan.num_vb, L2NORM=use_qk_l2norm,
        PAD_ROWS=_PAD_ROWS, CHANNEL_GATES=g.dim() == 3, num_warps=plan.num_warps)
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
        CHANNEL_GATES=ring_g.dim() == 3, num_warps=plan.num_warps)
