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
_MAX_BLOCK_V = 128  # channels of one block-form program
_BLOCK_T = 8  # rows of the block form: a DSpark verify block


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
def _save_ring(ring_k_ptr, ring_v_ptr, ring_g_ptr, ring_beta_ptr, n, head, k_head, writer, k, v,
               g, beta, offs_k, offs_v, k_ok, v_ok, HK: tl.constexpr, HV: tl.constexpr,
               KD: tl.constexpr, VD: tl.constexpr, CHANNEL_GATES: tl.constexpr):
    """Row ``n``'s replay inputs: one writer per key head (its first value head, channel block
    0) for the normalized key, per value head (block 0: ``writer``) for g and beta, per block
    for v."""
    if (head % (HV // HK) == 0) & writer:
        tl.store(ring_k_ptr + (n * HK + k_head) * KD + offs_k, k, mask=k_ok)
    tl.store(ring_v_ptr + (n * HV + head) * VD + offs_v, v, mask=v_ok)
    if writer:
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
def _gdn_walk(out_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, ring_k_ptr, ring_v_ptr,
              ring_g_ptr, ring_beta_ptr, start, length, slot, num_slots, head, k_head, writer,
              offs_v, scale, stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
              stride_v_tok, stride_v_head, stride_g_tok, stride_g_head, stride_beta_tok,
              stride_out_tok, stride_out_head, stride_s_slot, stride_s_head, stride_s_k,
              HK: tl.constexpr, HV: tl.constexpr, KD: tl.constexpr, VD: tl.constexpr,
              K_PAD: tl.constexpr, L2NORM: tl.constexpr, CHANNEL_GATES: tl.constexpr):
    """The row form: one channel slice ``offs_v`` of the state in registers, the request's rows
    in order; ``writer`` (0 / 1) is the channel block that saves g, beta and the key."""
    offs_k = tl.arange(0, K_PAD)
    k_ok = offs_k < KD
    v_ok = offs_v < VD
    _, state = _load_state(state_ptr, slot, num_slots, head, offs_k, offs_v, k_ok, v_ok,
                           stride_s_slot, stride_s_head, stride_s_k)
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
        _save_ring(ring_k_ptr, ring_v_ptr, ring_g_ptr, ring_beta_ptr, n, head, k_head, writer,
                   k, v, g, beta, offs_k, offs_v, k_ok, v_ok, HK, HV, KD, VD, CHANNEL_GATES)
        q, k, v, g, beta = q_next, k_next, v_next, g_next, beta_next


@triton.jit
def _row_select(m, t, offs):
    """Row ``t`` of a ``[T, X]`` tile, as a ``[X]`` vector (a select: no NaN crosses rows)."""
    return tl.sum(tl.where((offs == t)[:, None], m, 0.0), 0)


@triton.jit
def _rows_of(m, offs_r, offs_t, first):
    """Rows ``first .. first + T - 1`` of a ``[2T, X]`` tile, as ``[T, X]`` (selects)."""
    sel = offs_r[None, :, None] == (offs_t + first)[:, None, None]
    return tl.sum(tl.where(sel, m[None, :, :], 0.0), 1)


@triton.jit
def _cols_of(m, offs_r, offs_t, first):
    """Columns ``first .. first + T - 1`` of a ``[T, 2T]`` tile, as ``[T, T]`` (selects)."""
    sel = offs_r[None, None, :] == (offs_t + first)[None, :, None]
    return tl.sum(tl.where(sel, m[:, None, :], 0.0), 2)


@triton.jit
def _spread(m, offs_r, offs_t):
    """A ``[T, T]`` tile as the first ``T`` columns of a ``[T, 2T]`` one (the rest zeros)."""
    sel = offs_r[None, :, None] == offs_t[None, None, :]
    return tl.sum(tl.where(sel, m[:, None, :], 0.0), 2)


@triton.jit
def _gdn_block(out_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, ring_k_ptr, ring_v_ptr,
               ring_g_ptr, ring_beta_ptr, start, length, slot, num_slots, head, k_head, vb,
               scale, stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok,
               stride_v_head, stride_g_tok, stride_g_head, stride_beta_tok, stride_out_tok,
               stride_out_head, stride_s_slot, stride_s_head, stride_s_k,
               HK: tl.constexpr, HV: tl.constexpr, KD: tl.constexpr, VD: tl.constexpr,
               K_PAD: tl.constexpr, BLOCK_V: tl.constexpr, T: tl.constexpr,
               KC: tl.constexpr, PROBE: tl.constexpr = 0):
    """The block form (module docstring): a request of at most ``T`` rows from the state
    before it, which is read once and never updated; l2-normalized keys, scalar gates."""
    f32: tl.constexpr = tl.float32
    offs_t = tl.arange(0, T)
    offs_c = tl.arange(0, KC)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = offs_v < VD
    rows = start.to(tl.int64) + offs_t
    in_req = offs_t < length
    # the keys and queries stacked: row r < T is key t = r, row r >= T query t = r - T (every
    # product below has K >= 16, as triton 3.6 asks of float32 dots)
    offs_r = tl.arange(0, 2 * T)
    r_t = offs_r % T
    r_rows = start.to(tl.int64) + r_t
    x_rows = tl.where(offs_r < T, k_ptr + r_rows * stride_k_tok + k_head * stride_k_head,
                      q_ptr + r_rows * stride_q_tok + k_head * stride_q_head)
    # Gram products of the raw rows: gram[i, j] = x_i . x_j
    if PROBE == 4:
        gram = tl.zeros([2 * T, 2 * T], f32)
        for k0 in range(0, K_PAD, KC):
            kk = k0 + offs_c
            x_g = tl.load(x_rows[:, None] + kk[None, :],
                          mask=(r_t < length)[:, None] & (kk < KD)[None, :], other=0.0).to(f32)
            gram = tl.dot(x_g, tl.trans(x_g), gram, input_precision="ieee")
    else:
        offs_k = tl.arange(0, K_PAD)
        in_r = r_t < length
        k_in = offs_k < KD
        x_all = tl.load(x_rows[:, None] + offs_k[None, :], mask=in_r[:, None] & k_in[None, :],
                        other=0.0).to(f32)
        x_all_t = tl.load(x_rows[None, :] + offs_k[:, None], mask=k_in[:, None] & in_r[None, :],
                          other=0.0).to(f32)
        gram = tl.dot(x_all, x_all_t, input_precision="ieee")
    tt = offs_t[:, None]
    ss = offs_t[None, :]
    gk_rows = _rows_of(gram, offs_r, offs_t, 0)  # [T, 2T]: key rows
    gq_rows = _rows_of(gram, offs_r, offs_t, T)  # [T, 2T]: query rows
    gkk = _cols_of(gk_rows, offs_r, offs_t, 0)  # [T, T]: k_t . k_s
    gqk = _cols_of(gq_rows, offs_r, offs_t, 0)  # [T, T]: q_t . k_s
    nk = tl.sum(tl.where(tt == ss, gkk, 0.0), 1)
    nq = tl.sum(tl.where(tt == ss, _cols_of(gq_rows, offs_r, offs_t, T), 0.0), 1)
    g = tl.load(g_ptr + rows * stride_g_tok + head, mask=in_req, other=0.0).to(f32)
    beta = tl.load(beta_ptr + rows * stride_beta_tok + head, mask=in_req, other=0.0).to(f32)
    # rows from the request's first unusable one on (NaN / Inf in k, q or beta, NaN or +Inf
    # in g) are dropped: every later product then sees finite zeros, never 0 * NaN
    fine = in_req & (nk == nk) & (nk < float("inf")) & (nq == nq) & (nq < float("inf")) \
        & (g == g) & (g < float("inf")) & (beta == beta) & (tl.abs(beta) < float("inf"))
    ok = tl.sum(tl.where((ss <= tt) & (fine[None, :] == 0), 1, 0), 1) == 0
    ok_r = tl.sum(tl.where((r_t[:, None] == ss) & ok[None, :], 1, 0), 1) > 0  # [2T]
    rk = tl.where(ok, tl.rsqrt(nk + 1e-6), 0.0)
    rq = tl.where(ok, tl.rsqrt(nq + 1e-6) * scale, 0.0)
    pair = ok[:, None] & ok[None, :]
    akk = tl.where(pair, gkk * (rk[:, None] * rk[None, :]), 0.0)
    aqk = tl.where(pair, gqk * (rq[:, None] * rk[None, :]), 0.0)
    g = tl.where(ok, g, 0.0)
    beta = tl.where(ok, beta, 0.0)
    # decays as sums of log gates over windows (s, t] (never a difference: -inf gives 0)
    ii = offs_t[None, None, :]
    win = tl.sum(tl.where((ii > ss[:, :, None]) & (ii <= tt[:, :, None]), g[None, None, :], 0.0), 2)
    dec = tl.exp(win)
    decay = tl.exp(tl.sum(tl.where(ss <= tt, g[None, :], 0.0), 1))  # [T]: exp(g_1 + .. + g_t)
    mk = tl.where(ss < tt, dec * akk, 0.0)
    mq = tl.where(ss <= tt, dec * aqk, 0.0)
    # delta = (I + diag(beta) mk)^-1 diag(beta) (v - decay * S0^T k): the unit lower
    # triangular inverse by forward substitution, row by row
    lower = beta[:, None] * mk
    inv = tl.zeros([T, T], f32)
    for t in tl.static_range(T if (PROBE == 0) or (PROBE == 4) else 0):
        l_t = _row_select(lower, t, offs_t)  # [T] over u
        row = tl.where(offs_t == t, 1.0, 0.0) - tl.sum(l_t[:, None] * inv, 0)
        inv = tl.where(tt == t, row[None, :], inv)
    # out = diag(decay * rq) Q S0 - C diag(decay * rk) K S0 + C v, C = mq inv diag(beta);
    # as [T, 2T] weights of the stacked rows: w = [-C diag(decay * rk) | diag(decay * rq)]
    c = tl.sum(mq[:, :, None] * inv[None, :, :], 1) * beta[None, :]
    w = _spread(-c * (decay * rk)[None, :], offs_r, offs_t) \
        + tl.where(offs_r[None, :] == tt + T, (decay * rq)[:, None], 0.0)
    v = tl.load(v_ptr + r_rows[:, None] * stride_v_tok + head * stride_v_head + offs_v[None, :],
                mask=((offs_r < T) & (r_t < length))[:, None] & v_ok[None, :], other=0.0)
    vz = tl.where((ok_r & (offs_r < T))[:, None] & (v == v) & (tl.abs(v) < float("inf")), v, 0.0)
    acc = tl.dot(_spread(c, offs_r, offs_t), vz.to(f32), input_precision="ieee")
    slot_c = offs_c.to(tl.int64) * 0 + slot
    s_ok = (slot_c >= 0) & (slot_c < num_slots)
    s_base = state_ptr + slot * stride_s_slot + head * stride_s_head
    for k0 in range(0, K_PAD, KC):
        kk = k0 + offs_c
        kc_ok = kk < KD
        x = tl.load(x_rows[:, None] + kk[None, :], mask=ok_r[:, None] & kc_ok[None, :],
                    other=0.0).to(f32)
        s_t = tl.load(s_base + kk[:, None] * stride_s_k + offs_v[None, :],
                      mask=(s_ok & kc_ok)[:, None] & v_ok[None, :], other=0.0)
        if PROBE == 3:
            acc = tl.dot(_rows_of(x, offs_r, offs_t, 0), s_t, acc, input_precision="ieee")
        else:
            acc = tl.dot(tl.dot(w, x, input_precision="ieee"), s_t, acc, input_precision="ieee")
    tl.store(out_ptr + rows[:, None] * stride_out_tok + head * stride_out_head + offs_v[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=in_req[:, None] & v_ok[None, :])
    # the replay rings: v by every channel block, g and beta by block 0, the normalized key
    # (the row form's own l2norm, so the commit replays the same bits) by one program a key head
    tl.store(ring_v_ptr + (r_rows[:, None] * HV + head) * VD + offs_v[None, :], v,
             mask=((offs_r < T) & (r_t < length))[:, None] & v_ok[None, :])
    if vb == 0:
        tl.store(ring_g_ptr + rows * HV + head,
                 tl.load(g_ptr + rows * stride_g_tok + head, mask=in_req, other=0.0), mask=in_req)
        tl.store(ring_beta_ptr + rows * HV + head,
                 tl.load(beta_ptr + rows * stride_beta_tok + head, mask=in_req, other=0.0),
                 mask=in_req)
        if head % (HV // HK) == 0:
            offs_k = tl.arange(0, K_PAD)
            k_ok = offs_k < KD
            for j in range(length):
                n = start.to(tl.int64) + j
                kr = tl.load(k_ptr + n * stride_k_tok + k_head * stride_k_head + offs_k,
                             mask=k_ok, other=0.0).to(f32)
                tl.store(ring_k_ptr + (n * HK + k_head) * KD + offs_k, _l2norm(kr), mask=k_ok)


@triton.jit
def _gdn_forward_kernel(
        out_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, query_start_loc_ptr,
        slots_ptr, ring_k_ptr, ring_v_ptr, ring_g_ptr, ring_beta_ptr, scale, num_tokens,
        num_requests, num_slots, stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
        stride_v_tok, stride_v_head, stride_g_tok, stride_g_head, stride_beta_tok,
        stride_out_tok, stride_out_head, stride_s_slot, stride_s_head, stride_s_k,
        HK: tl.constexpr, HV: tl.constexpr, KD: tl.constexpr, VD: tl.constexpr,
        K_PAD: tl.constexpr, BLOCK_V: tl.constexpr, NUM_VB: tl.constexpr, ROW_V: tl.constexpr,
        BLOCK_T: tl.constexpr, KC: tl.constexpr, L2NORM: tl.constexpr, PAD_ROWS: tl.constexpr,
        CHANNEL_GATES: tl.constexpr, PROBE: tl.constexpr):
    """One (request, value head, value-channel block): the block form for a request of at
    most ``BLOCK_T`` rows (0: never), else the row form over slices of ``ROW_V`` channels."""
    req = tl.program_id(0)
    head = tl.program_id(1) // NUM_VB
    vb = tl.program_id(1) % NUM_VB
    start = tl.load(query_start_loc_ptr + req)
    if req == num_requests:
        _zero_padding_rows(out_ptr, start, num_tokens, head, vb * BLOCK_V + tl.arange(0, BLOCK_V),
                           vb * BLOCK_V + tl.arange(0, BLOCK_V) < VD, stride_out_tok,
                           stride_out_head, BLOCK_V, PAD_ROWS)
        return
    length = tl.load(query_start_loc_ptr + req + 1) - start
    if length <= 0:
        return
    slot = tl.load(slots_ptr + req).to(tl.int64)
    k_head = head // (HV // HK)
    if BLOCK_T > 0:
        if length <= BLOCK_T:
            _gdn_block(out_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, ring_k_ptr,
                       ring_v_ptr, ring_g_ptr, ring_beta_ptr, start, length, slot, num_slots,
                       head, k_head, vb, scale, stride_q_tok, stride_q_head, stride_k_tok,
                       stride_k_head, stride_v_tok, stride_v_head, stride_g_tok, stride_g_head,
                       stride_beta_tok, stride_out_tok, stride_out_head, stride_s_slot,
                       stride_s_head, stride_s_k, HK, HV, KD, VD, K_PAD, BLOCK_V, BLOCK_T, KC,
                       PROBE)
            return
    for sb in tl.static_range(BLOCK_V // ROW_V):
        _gdn_walk(out_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, ring_k_ptr,
                  ring_v_ptr, ring_g_ptr, ring_beta_ptr, start, length, slot, num_slots, head,
                  k_head, vb * BLOCK_V + sb * ROW_V == 0,
                  vb * BLOCK_V + sb * ROW_V + tl.arange(0, ROW_V), scale, stride_q_tok,
                  stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                  stride_g_tok, stride_g_head, stride_beta_tok, stride_out_tok, stride_out_head,
                  stride_s_slot, stride_s_head, stride_s_k, HK, HV, KD, VD, K_PAD, L2NORM,
                  CHANNEL_GATES)


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
    row_v: int = 0
    """Channels the row form holds in registers at a time (0: ``block_v``); ``block_v`` is a
    multiple of it."""
    block_t: int = 0
    """Rows of the block form: requests of at most this many rows take it (0: the row form
    only). Only the forward with l2-normalized keys and scalar gates has it."""
    k_chunk: int = 16
    """K rows of the state (and key columns) per step of the block form's loops."""


@functools.lru_cache(maxsize=1024)
def plan_gdn(num_requests: int, num_v_heads: int, k_dim: int, v_dim: int,
             sm_count: int) -> GdnPlan:
    """Channels a program: the whole head (up to 128) for the block form, halved (down to 16)
    while ``R * Hv * V / block_v`` programs are fewer than two per multiprocessor; the row form
    walks them ``_MAX_TILE / K_PAD`` channels at a time (32 at K = 128, so the state slice
    stays in registers). At 32 value heads, V = 128 on an H200 (132 SMs): bs 1 runs 256
    programs of 16 channels, bs 8 512 of 64, bs >= 64 one program a (request, head)."""
    k_pad = triton.next_power_of_2(max(k_dim, 1))
    v_pad = triton.next_power_of_2(max(v_dim, 1))
    row_v = min(v_pad, max(_MIN_BLOCK_V, _MAX_TILE // k_pad))
    block_v = min(v_pad, _MAX_BLOCK_V)
    while block_v > _MIN_BLOCK_V and \
            max(num_requests, 1) * num_v_heads * triton.cdiv(v_dim, block_v) < 2 * sm_count:
        block_v //= 2
    return GdnPlan(k_pad, block_v, triton.cdiv(v_dim, block_v), row_v=min(row_v, block_v),
                   block_t=_BLOCK_T)


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
        K_PAD=plan.k_pad, BLOCK_V=plan.block_v, NUM_VB=plan.num_vb,
        ROW_V=plan.row_v or plan.block_v,
        BLOCK_T=plan.block_t if use_qk_l2norm and g.dim() == 2 else 0, KC=plan.k_chunk,
        L2NORM=use_qk_l2norm, PAD_ROWS=_PAD_ROWS, CHANNEL_GATES=g.dim() == 3,
        PROBE=int(__import__("os").environ.get("GDN_PROBE", "0")), num_warps=plan.num_warps)
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
    block_v = plan.row_v or plan.block_v  # the commit holds its slice in registers
    num_vb = triton.cdiv(vd, block_v)
    launch(_gdn_commit_kernel, (r, hv * num_vb),
        st, ring_k, ring_v, ring_g, ring_beta, query_start_loc, slots, accept_lens,
        st.shape[0], st.stride(0), st.stride(1), st.stride(2), HK=ring_k.shape[1], HV=hv,
        KD=kd, VD=vd, K_PAD=plan.k_pad, BLOCK_V=block_v, NUM_VB=num_vb,
        CHANNEL_GATES=ring_g.dim() == 3, num_warps=plan.num_warps)
