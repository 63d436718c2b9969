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

Forward, block form (``GdnPlan.block_rows``; :func:`plan_gdn` says when, from the launch's
shape: many requests at a mean of nearly the whole verify width): a request of up to 8 rows
is taken at once from the state before it, with no update of the state,

    out = W [K S0; Q S0] + C v

(raw key and query rows stacked, 16 x K; ``W`` and ``C`` from the rows' Gram products, norms,
window sums of the log gates and a unit-triangular inverse, :func:`_block_weights`). One
launch holds two kinds of program (:func:`_gdn_block_kernel`): a weight program a (request,
key head) makes ``W`` and ``C`` of the key head's value heads (their Gram products once; for
16-bit rows as one product on tensor cores, :func:`_gram_native`); a
stream program a (request, value head, channel block) reads its state slice once into the
rows' products (one multiply-add a state element a row, against the walk's four; for 16-bit
inputs on NVIDIA on tensor cores, the state as a TF32 head and its float32 rest,
:func:`_stream_dot`) and mixes.
It reads a flag (an acquire) before its stream and, if still unset, up to
``GdnPlan.block_wait_polls`` times after it; then it takes the weight program's results, or
makes its own with the same code (the same bits either way). The bound means no order of
dispatch can deadlock the launch. Rows
from a request's first non-finite one on enter the products as zeros (selects) and come out
NaN. Longer requests walk their rows inside the same launch, ``walk_v`` channels at a time;
its register cap makes that path spill, not the rest.

Commit (grid ``(R, Hv * cdiv(V, BLOCK_V))``): the same update, fed from the rings for the
first ``clamp(accept_lens[i], 0, len_i)`` rows, then one store of the tile into the pool. The
update is the shared ``_delta_step``, so the committed state is the row walk's own arithmetic
(the block form's outputs agree with it to float32 rounding).

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

from .launch import descriptor_ok, launch, tensor_descriptor
from ..ops.linear_attention_reference import check_gdn, check_gdn_commit
from .device import device_sm_count, device_target, register_cap
from .pdl import pdl_enter, pdl_options, pdl_wait, use_pdl

__all__ = ["GdnPlan", "plan_gdn", "gated_delta_rule_triton", "gated_delta_rule_commit_triton"]

_NUM_WARPS = 1  # module docstring: the sweep's best at every tile
_MAX_TILE = 4096  # fp32 state elements per program: 128 registers per thread on one warp of 32
_MIN_BLOCK_V = 16
_PAD_ROWS = 16  # padding rows zeroed per store by the pseudo-request
_BLOCK_ROWS = 8  # the block form's request width (the verify width measured and tested)
_BLOCK_KC = 16  # K (and V) a block-form step takes: triton 3.6's float32 dots ask K >= 16
_BLOCK_FORM_V = 64  # channels a block-form program streams, before the fill rule halves it
_BLOCK_WAIT_POLLS = 64  # a stream program's further reads of its flag (GdnPlan.block_wait_polls)
_BLOCK_FORM_REGISTERS = 128  # maxnreg of the block form's launch (its long walk spills)
_TMA_STAGES = 4  # the block form's pipelining depth where its state goes through TMA
_BLOCK_MIN_REQUESTS = 8  # plan_gdn's default: the block form from this many requests on ...
_BLOCK_MIN_WIDTH = 6  # ... at a mean of this many rows a request or more (tokens / requests)


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
def _request_span(query_start_loc_ptr, req, num_requests, out_ptr, num_tokens, head, offs_v,
                  v_ok, stride_out_tok, stride_out_head, BLOCK_V: tl.constexpr,
                  PAD_ROWS: tl.constexpr):
    """``(start, length)`` of request ``req``'s rows. Program row ``R`` (the padding
    pseudo-request) zeroes rows ``query_start_loc[R] .. N-1`` of its channels; its length is 0."""
    start = tl.load(query_start_loc_ptr + req)
    if req == num_requests:
        _zero_padding_rows(out_ptr, start, num_tokens, head, offs_v, v_ok, stride_out_tok,
                           stride_out_head, BLOCK_V, PAD_ROWS)
    return start, tl.load(query_start_loc_ptr + tl.minimum(req + 1, num_requests)) - start


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
def _walk_rows(out_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, ring_k_ptr, ring_v_ptr,
               ring_g_ptr, ring_beta_ptr, scale, start, length, slot, num_slots, head, vb,
               offs_v, stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok,
               stride_v_head, stride_g_tok, stride_g_head, stride_beta_tok, stride_out_tok,
               stride_out_head, stride_s_slot, stride_s_head, stride_s_k, HK: tl.constexpr,
               HV: tl.constexpr, KD: tl.constexpr, VD: tl.constexpr, K_PAD: tl.constexpr,
               L2NORM: tl.constexpr, CHANNEL_GATES: tl.constexpr):
    """A request's rows in order over the value channels ``offs_v`` of one head (``vb == 0``:
    the head's first channel block, which writes the per-head rings)."""
    offs_k = tl.arange(0, K_PAD)
    k_ok = offs_k < KD
    v_ok = offs_v < VD
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
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    start, length = _request_span(query_start_loc_ptr, req, num_requests, out_ptr, num_tokens,
                                  head, offs_v, offs_v < VD, stride_out_tok, stride_out_head,
                                  BLOCK_V, PAD_ROWS)
    if length <= 0:
        return
    slot = tl.load(slots_ptr + req).to(tl.int64)
    _walk_rows(out_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, ring_k_ptr, ring_v_ptr,
               ring_g_ptr, ring_beta_ptr, scale, start, length, slot, num_slots, head, vb,
               offs_v, stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok,
               stride_v_head, stride_g_tok, stride_g_head, stride_beta_tok, stride_out_tok,
               stride_out_head, stride_s_slot, stride_s_head, stride_s_k, HK, HV, KD, VD, K_PAD,
               L2NORM, CHANNEL_GATES)


# ------------------------------------------------- block form (one launch, two program kinds)

@triton.jit
def _stream_dot(x, s, acc, HOW: tl.constexpr, BF16_DOTS: tl.constexpr):
    """``acc + x s`` for raw rows ``x`` (their own dtype) and a float32 state chunk ``s``, as
    ``HOW`` says (``GdnPlan.block_stream_dot``): ``"ieee"`` float32 FMAs; ``"bf16x3"`` ``s`` as
    the sum of three bfloat16 parts (each the rounding of what the ones before leave) against
    bfloat16 ``x`` on tensor cores, every product exact and float32 sums; ``"tf32x2"`` ``s`` as
    a TF32 head (its low 13 bits cleared) and the float32 rest against ``x`` (16-bit, so exact
    in TF32); ``"tf32x3"`` triton's three TF32 products. A row of ``x`` reaches only its own row
    of the result, whichever way. Without ``BF16_DOTS`` (the interpreter: triton 3.9's reads a
    bfloat16 operand's raw bits) the bfloat16 parts enter their dots as float32, the same
    values."""
    f32: tl.constexpr = tl.float32
    if HOW == "bf16x3":
        part: tl.constexpr = tl.bfloat16 if BF16_DOTS else f32
        xb = x.to(tl.bfloat16).to(part)
        hi = s.to(tl.bfloat16)
        rest = s - hi.to(f32)
        mid = rest.to(tl.bfloat16)
        acc = tl.dot(xb, (rest - mid.to(f32)).to(tl.bfloat16).to(part), acc)
        acc = tl.dot(xb, mid.to(part), acc)
        acc = tl.dot(xb, hi.to(part), acc)
    elif HOW == "tf32x2":
        xf = x.to(f32)
        hi = (s.to(tl.int32, bitcast=True) & -8192).to(f32, bitcast=True)
        acc = tl.dot(xf, s - hi, acc, input_precision="tf32")
        acc = tl.dot(xf, hi, acc, input_precision="tf32")
    else:
        acc = tl.dot(x.to(f32), s, acc, input_precision=HOW)
    return acc


@triton.jit
def _row_select(m, t, offs):
    """Row ``t`` of a ``[T, X]`` tile as a ``[X]`` vector (a select: no NaN crosses rows)."""
    return tl.sum(tl.where((offs == t)[:, None], m, 0.0), 0)


@triton.jit
def _spread(x, offs_r, offs_t):
    """A ``[T]`` vector as the first ``T`` entries of a ``[2T]`` one (the rest zeros)."""
    return tl.sum(tl.where(offs_r[:, None] == offs_t[None, :], x[None, :], 0.0), 1)


@triton.jit
def _gram(k_rows, q_rows, in_req, K_PAD: tl.constexpr, KD: tl.constexpr, T: tl.constexpr,
          KC: tl.constexpr):
    """Of a request's raw rows at ``k_rows`` / ``q_rows`` (``[T]`` pointers): ``k_t . k_s`` and
    ``q_t . k_s`` (``[T, T]``), ``|k_t|^2`` and ``|q_t|^2``, K in chunks of ``KC`` (a float32
    dot's operands are held whole in each thread: a chunk bounds them)."""
    f32: tl.constexpr = tl.float32
    offs_c = tl.arange(0, KC)
    gkk = tl.zeros([T, T], f32)
    gqk = tl.zeros([T, T], f32)
    nq = tl.zeros([T], f32)
    for k0 in range(0, K_PAD, KC):
        kk = k0 + offs_c
        m = in_req[:, None] & (kk < KD)[None, :]
        xk = tl.load(k_rows[:, None] + kk[None, :], mask=m, other=0.0).to(f32)
        xq = tl.load(q_rows[:, None] + kk[None, :], mask=m, other=0.0).to(f32)
        gkk = tl.dot(xk, tl.trans(xk), gkk, input_precision="ieee")
        gqk = tl.dot(xq, tl.trans(xk), gqk, input_precision="ieee")
        nq += tl.sum(xq * xq, 1)
    offs_t = tl.arange(0, T)
    return gkk, gqk, tl.sum(tl.where(offs_t[:, None] == offs_t[None, :], gkk, 0.0), 1), nq


@triton.jit
def _gram_native(x, T: tl.constexpr, BF16_DOTS: tl.constexpr):
    """:func:`_gram` of 16-bit rows in one product on tensor cores: of ``x``, the key rows over
    the query rows (``[2T, K_PAD]``, zeros past the request and past K), ``G = X X^T`` in
    float32 (a product of two 16-bit values is exact in float32), its blocks and diagonal taken
    apart by reshapes (no select mixes entries: a NaN stays in its rows). Without ``BF16_DOTS``
    (the interpreter) the rows enter as float32, the same values."""
    f32: tl.constexpr = tl.float32
    if BF16_DOTS:
        gram = tl.dot(x, tl.trans(x), out_dtype=f32)
    else:
        xf = x.to(f32)
        gram = tl.dot(xf, tl.trans(xf), input_precision="ieee")
    offs_r = tl.arange(0, 2 * T)
    norms = tl.sum(tl.where(offs_r[:, None] == offs_r[None, :], gram, 0.0), 1)
    nk, nq = tl.split(tl.permute(tl.reshape(norms, [2, T]), [1, 0]))
    # gram[h T + t, h' T + s] -> [t, s, h, h']: the key columns (h' = 0) of the key rows (h = 0)
    # and of the query rows (h = 1)
    keys, _ = tl.split(tl.permute(tl.reshape(gram, [2, T, 2, T]), [1, 3, 0, 2]))
    gkk, gqk = tl.split(keys)
    return gkk, gqk, nk, nq


@triton.jit
def _block_weights(gkk, gqk, nk, nq, g, beta, fine, scale, offs_t, offs_r,
                   T: tl.constexpr, L2NORM: tl.constexpr):
    """A value head's weights of the stacked products ``[K S0; Q S0]`` (``W``, ``[T, 2T]``) and
    of its values (``C``, ``[T, 2T]``, its last ``T`` columns zero), and how many rows are kept
    (those before the request's first unusable one, ``fine`` false):

        out = W [K S0; Q S0] + C v
        W = [-C' diag(decay * rk) | diag(decay * rq)],   C' = Mq (I + diag(beta) Mk)^-1 diag(beta)

    with ``rk``, ``rq`` the rows' inverse norms (``L2NORM``; ``rq`` times ``scale``), ``decay_t =
    exp(g_1 + .. + g_t)``, ``Mk[t, s] = [s < t] exp(g_(s+1) + .. + g_t) k_t . k_s`` and ``Mq[t, s]
    = [s <= t] exp(..) q_t . k_s`` (normalized rows)."""
    f32: tl.constexpr = tl.float32
    tt = offs_t[:, None]
    ss = offs_t[None, :]
    # the kept rows: a prefix. Dropped rows get exact zeros everywhere below (selects), so no
    # later product ever sees 0 * NaN
    ok = tl.sum(tl.where((ss <= tt) & (fine[None, :] == 0), 1, 0), 1) == 0
    if L2NORM:
        rk = tl.where(ok, tl.rsqrt(nk + 1e-6), 0.0)
        rq = tl.where(ok, tl.rsqrt(nq + 1e-6) * scale, 0.0)
    else:
        rk = tl.where(ok, 1.0, 0.0)
        rq = tl.where(ok, scale, 0.0)
    pair = ok[:, None] & ok[None, :]
    akk = tl.where(pair, gkk * (rk[:, None] * rk[None, :]), 0.0)
    aqk = tl.where(pair, gqk * (rq[:, None] * rk[None, :]), 0.0)
    g = tl.where(ok, g, 0.0)
    beta = tl.where(ok, beta, 0.0)
    # decays as sums of log gates over windows (s, t], never differences: -inf gives 0
    ii = offs_t[None, None, :]
    win = tl.sum(tl.where((ii > ss[:, :, None]) & (ii <= tt[:, :, None]), g[None, None, :], 0.0),
                 2)
    dec = tl.exp(win)
    decay = tl.exp(tl.sum(tl.where(ss <= tt, g[None, :], 0.0), 1))
    mk = tl.where(ss < tt, dec * akk, 0.0)
    mq = tl.where(ss <= tt, dec * aqk, 0.0)
    # (I + diag(beta) Mk)^-1, unit lower triangular, by forward substitution row by row, its
    # rows 2T wide (the last T columns stay zero: W's and C's layout, no [T, 2T, T] spread),
    # and Mq times it as its rows come
    lower = beta[:, None] * mk
    inv = tl.zeros([T, 2 * T], f32)
    c = tl.zeros([T, 2 * T], f32)
    for t in tl.static_range(T):
        l_t = _row_select(lower, t, offs_t)
        row = tl.where(offs_r == t, 1.0, 0.0) - tl.sum(l_t[:, None] * inv, 0)
        inv = tl.where(tt == t, row[None, :], inv)
        c += tl.sum(tl.where(ss == t, mq, 0.0), 1)[:, None] * row[None, :]
    c = c * _spread(beta, offs_r, offs_t)[None, :]
    w = -c * _spread(decay * rk, offs_r, offs_t)[None, :] \
        + tl.where(offs_r[None, :] == tt + T, (decay * rq)[:, None], 0.0)
    return w, c, tl.sum(ok.to(tl.int32), 0)


@triton.jit
def _stacked_rows(q_ptr, k_ptr, start, k_head, stride_q_tok, stride_q_head, stride_k_tok,
                  stride_k_head, T: tl.constexpr):
    """Pointers to a request's key rows over its query rows (``[2T]``: row ``r`` is key row
    ``r`` for ``r < T``, else query row ``r - T``) of key head ``k_head``, from row ``start``."""
    offs_r = tl.arange(0, 2 * T)
    rows = start.to(tl.int64) + offs_r % T
    return tl.where(offs_r < T, k_ptr + rows * stride_k_tok + k_head * stride_k_head,
                    q_ptr + rows * stride_q_tok + k_head * stride_q_head)


@triton.jit
def _block_gram(q_ptr, k_ptr, start, length, k_head, stride_q_tok, stride_q_head, stride_k_tok,
                stride_k_head, KD: tl.constexpr, K_PAD: tl.constexpr, T: tl.constexpr,
                KC: tl.constexpr, GRAM_NATIVE: tl.constexpr, BF16_DOTS: tl.constexpr):
    """The Gram products of a request's (up to T) key and query rows of key head ``k_head``
    (``gkk``, ``gqk``, ``nk``, ``nq``): with ``GRAM_NATIVE`` (16-bit rows) the key rows over the
    query rows loaded whole (``[2T, K_PAD]``) into :func:`_gram_native`, else :func:`_gram`
    over chunks."""
    if GRAM_NATIVE:
        offs_k = tl.arange(0, K_PAD)
        x_rows = _stacked_rows(q_ptr, k_ptr, start, k_head, stride_q_tok, stride_q_head,
                               stride_k_tok, stride_k_head, T)
        x = tl.load(x_rows[:, None] + offs_k[None, :],
                    mask=(tl.arange(0, 2 * T) % T < length)[:, None] & (offs_k < KD)[None, :],
                    other=0.0)
        return _gram_native(x, T, BF16_DOTS)
    rows_t = start.to(tl.int64) + tl.arange(0, T)
    return _gram(k_ptr + rows_t * stride_k_tok + k_head * stride_k_head,
                 q_ptr + rows_t * stride_q_tok + k_head * stride_q_head,
                 tl.arange(0, T) < length, K_PAD, KD, T, KC)


@triton.jit
def _head_inputs(v_ptr, g_ptr, beta_ptr, start, length, head, stride_v_tok, stride_v_head,
                 stride_g_tok, stride_beta_tok, VD: tl.constexpr, V_PAD: tl.constexpr,
                 T: tl.constexpr, KC: tl.constexpr):
    """Value head ``head``'s loads for a request of 1..T rows: its gates, betas and how many
    non-finite values each row has (a row with one is unusable). The values ``KC`` columns at a
    time (a whole row, ``[T, V]`` at once, set the build's registers: 156 against 96, triton
    3.6, sm_90), unrolled: no store between the loads, so they can all be in flight."""
    f32: tl.constexpr = tl.float32
    offs_t = tl.arange(0, T)
    rows = start.to(tl.int64) + offs_t
    in_req = offs_t < length
    g = tl.load(g_ptr + rows * stride_g_tok + head, mask=in_req, other=0.0).to(f32)
    beta = tl.load(beta_ptr + rows * stride_beta_tok + head, mask=in_req, other=0.0).to(f32)
    bad = tl.zeros([T, KC], tl.int32)  # summed over the chunks elementwise, then over a row once
    for v0 in tl.static_range(0, V_PAD, KC):
        vv = v0 + tl.arange(0, KC)
        x = tl.load(v_ptr + rows[:, None] * stride_v_tok + head * stride_v_head + vv[None, :],
                    mask=in_req[:, None] & (vv < VD)[None, :], other=0.0).to(f32)
        bad += tl.where((x == x) & (tl.abs(x) < float("inf")), 0, 1)
    return g, beta, tl.sum(bad, 1)


@triton.jit
def _head_weights(g, beta, v_bad, length, gkk, gqk, nk, nq, scale, T: tl.constexpr,
                  L2NORM: tl.constexpr):
    """A value head's ``W``, ``C`` (:func:`_block_weights`) and kept-row count from its key
    head's Gram products and its :func:`_head_inputs`."""
    offs_t = tl.arange(0, T)
    fine = (offs_t < length) & (v_bad == 0) & (nk == nk) & (nk < float("inf")) & (nq == nq) \
        & (nq < float("inf")) & (g == g) & (g < float("inf")) & (beta == beta) \
        & (tl.abs(beta) < float("inf"))
    return _block_weights(gkk, gqk, nk, nq, g, beta, fine, scale, offs_t, tl.arange(0, 2 * T),
                          T, L2NORM)


@triton.jit
def _block_head(v_ptr, g_ptr, beta_ptr, scale, start, length, head, gkk, gqk, nk, nq,
                stride_v_tok, stride_v_head, stride_g_tok, stride_beta_tok, VD: tl.constexpr,
                V_PAD: tl.constexpr, T: tl.constexpr, KC: tl.constexpr, L2NORM: tl.constexpr):
    """Value head ``head`` of a request of 1..T rows: its ``W``, ``C`` and kept-row count
    (:func:`_head_inputs`, then :func:`_head_weights`)."""
    g, beta, v_bad = _head_inputs(v_ptr, g_ptr, beta_ptr, start, length, head, stride_v_tok,
                                  stride_v_head, stride_g_tok, stride_beta_tok, VD, V_PAD, T, KC)
    return _head_weights(g, beta, v_bad, length, gkk, gqk, nk, nq, scale, T, L2NORM)


@triton.jit
def _ring_keys(k_ptr, ring_k_ptr, start, length, k_head, nk, stride_k_tok, stride_k_head,
               HK: tl.constexpr, KD: tl.constexpr, K_PAD: tl.constexpr, T: tl.constexpr,
               L2NORM: tl.constexpr):
    """A request's key rows of key head ``k_head``, normalized, into the replay ring (``nk``:
    their squared norms): whole rows in one load and one store."""
    offs_t = tl.arange(0, T)
    offs_k = tl.arange(0, K_PAD)
    rows = start.to(tl.int64) + offs_t
    m = (offs_t < length)[:, None] & (offs_k < KD)[None, :]
    x = tl.load(k_ptr + rows[:, None] * stride_k_tok + k_head * stride_k_head + offs_k[None, :],
                mask=m, other=0.0).to(tl.float32)
    if L2NORM:
        x = x * tl.rsqrt(nk + 1e-6)[:, None]
    tl.store(ring_k_ptr + (rows[:, None] * HK + k_head) * KD + offs_k[None, :], x, mask=m)


@triton.jit
def _weight_program(a, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, query_start_loc_ptr, w_ptr, c_ptr,
                    ready_ptr, ring_k_ptr, ring_g_ptr, ring_beta_ptr, scale, num_requests,
                    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok,
                    stride_v_head, stride_g_tok, stride_beta_tok, HK: tl.constexpr,
                    HV: tl.constexpr, KD: tl.constexpr, VD: tl.constexpr, K_PAD: tl.constexpr,
                    V_PAD: tl.constexpr, T: tl.constexpr, KC: tl.constexpr,
                    L2NORM: tl.constexpr, GRAM_NATIVE: tl.constexpr, BF16_DOTS: tl.constexpr):
    """Weight program ``a`` (request ``a % R``, key head ``a // R``), for a request of 1..T rows:
    the rows' Gram products once, the ring keys, then for each of the key head's value heads
    its ``W``, ``C`` and kept-row count into scratch, its gate and beta rings, then its flag
    (``kept + 1``, a release)."""
    req = a % num_requests
    k_head = a // num_requests
    start = tl.load(query_start_loc_ptr + req)
    length = tl.load(query_start_loc_ptr + req + 1) - start
    if (length > 0) & (length <= T):
        # the first value head's loads go out with the Gram's, each next head's before this
        # head's stores: no load waits behind a store or a release
        g, beta, v_bad = _head_inputs(v_ptr, g_ptr, beta_ptr, start, length, k_head * (HV // HK),
                                      stride_v_tok, stride_v_head, stride_g_tok,
                                      stride_beta_tok, VD, V_PAD, T, KC)
        gkk, gqk, nk, nq = _block_gram(q_ptr, k_ptr, start, length, k_head, stride_q_tok,
                                       stride_q_head, stride_k_tok, stride_k_head, KD, K_PAD, T,
                                       KC, GRAM_NATIVE, BF16_DOTS)
        _ring_keys(k_ptr, ring_k_ptr, start, length, k_head, nk, stride_k_tok, stride_k_head,
                   HK, KD, K_PAD, T, L2NORM)
        rows = start.to(tl.int64) + tl.arange(0, T)
        in_req = tl.arange(0, T) < length
        for j in tl.static_range(HV // HK):
            head = k_head * (HV // HK) + j
            w, c, kept = _head_weights(g, beta, v_bad, length, gkk, gqk, nk, nq, scale, T,
                                       L2NORM)
            g_ring = g
            beta_ring = beta
            if j + 1 < HV // HK:
                g, beta, v_bad = _head_inputs(v_ptr, g_ptr, beta_ptr, start, length, head + 1,
                                              stride_v_tok, stride_v_head, stride_g_tok,
                                              stride_beta_tok, VD, V_PAD, T, KC)
            tl.store(ring_g_ptr + rows * HV + head, g_ring, mask=in_req)
            tl.store(ring_beta_ptr + rows * HV + head, beta_ring, mask=in_req)
            unit = (req * HV + head).to(tl.int64)
            tile = (unit * T + tl.arange(0, T)[:, None]) * (2 * T) + tl.arange(0, 2 * T)[None, :]
            tl.store(w_ptr + tile, w)
            tl.store(c_ptr + tile, c)
            tl.debug_barrier()  # every thread's stores before the flag (CUTLASS's semaphore)
            tl.atomic_xchg(ready_ptr + unit, kept + 1, sem="release", scope="gpu")


@triton.jit
def _gdn_block_weights_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, query_start_loc_ptr, w_ptr, c_ptr, ready_ptr,
        ring_k_ptr, ring_g_ptr, ring_beta_ptr, scale, num_requests, stride_q_tok,
        stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_g_tok,
        stride_beta_tok, HK: tl.constexpr, HV: tl.constexpr, KD: tl.constexpr,
        VD: tl.constexpr, K_PAD: tl.constexpr, V_PAD: tl.constexpr, T: tl.constexpr,
        KC: tl.constexpr, L2NORM: tl.constexpr, GRAM_NATIVE: tl.constexpr,
        BF16_DOTS: tl.constexpr, PDL: tl.constexpr):
    """The block form's weight programs in a launch of their own (``GdnPlan.
    block_weights_launch``), built for their own registers, one a (request, key head). With
    PDL they let the stream launch start at once (their flags hand the weights over)."""
    pdl_enter(PDL)
    _weight_program(tl.program_id(0), q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,
                    query_start_loc_ptr, w_ptr, c_ptr, ready_ptr, ring_k_ptr, ring_g_ptr,
                    ring_beta_ptr, scale, num_requests, stride_q_tok, stride_q_head,
                    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_g_tok,
                    stride_beta_tok, HK, HV, KD, VD, K_PAD, V_PAD, T, KC, L2NORM, GRAM_NATIVE,
                    BF16_DOTS)


@triton.jit
def _gdn_block_kernel(
        out_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, state_desc, query_start_loc_ptr,
        slots_ptr, w_ptr, c_ptr, ready_ptr, ring_k_ptr, ring_v_ptr, ring_g_ptr, ring_beta_ptr,
        scale, num_tokens, num_requests, num_slots, stride_q_tok, stride_q_head, stride_k_tok,
        stride_k_head, stride_v_tok, stride_v_head, stride_g_tok, stride_g_head,
        stride_beta_tok, stride_out_tok, stride_out_head, stride_s_slot, stride_s_head,
        stride_s_k, HK: tl.constexpr, HV: tl.constexpr, KD: tl.constexpr, VD: tl.constexpr,
        K_PAD: tl.constexpr, V_PAD: tl.constexpr, BLOCK_V: tl.constexpr,
        NUM_VB: tl.constexpr, WALK_V: tl.constexpr, T: tl.constexpr, KC: tl.constexpr,
        L2NORM: tl.constexpr, PAD_ROWS: tl.constexpr, WEIGHTS_FIRST: tl.constexpr,
        POLLS: tl.constexpr, WEIGHTS: tl.constexpr, STREAM_DOT: tl.constexpr,
        STREAM_KC: tl.constexpr, BF16_DOTS: tl.constexpr, STATE_DESC: tl.constexpr,
        GRAM_NATIVE: tl.constexpr, PDL: tl.constexpr):
    """The block form in one launch of two kinds of program (a 1-D grid, the first kind
    first unless not ``WEIGHTS_FIRST``):

    - ``R * Hk`` weight programs, one a (request of 1..T rows, key head): the rows' Gram
      products, then for each of the key head's value heads its ``W``, ``C`` and kept-row
      count into scratch, the rows' rings, then its ``ready`` (a release);
    - ``(R + 1) * Hv * NUM_VB`` stream programs, one a (request, value head, block of
      ``BLOCK_V`` channels): the state slice streamed once into ``[K S0; Q S0]`` (raw rows:
      nothing of the weight program is needed yet), then ``out = W [K S0; Q S0] + C v`` with
      the weight program's ``W`` and ``C`` if it has set ``ready`` (an acquire before the
      stream; if unset, up to ``POLLS`` more after it), else with its own (the same
      arithmetic on the same inputs, so the same bits). The wait is bounded, so no order of
      dispatch deadlocks. Requests over ``T`` rows walk their rows, ``WALK_V`` channels at a
      time; program row ``R`` zeroes the padding rows."""
    pid = tl.program_id(0)
    f32: tl.constexpr = tl.float32
    if WEIGHTS:
        pdl_enter(PDL)
        units = num_requests * HK  # weight programs: one a (request, key head)
        streams = (num_requests + 1) * HV * NUM_VB
        if WEIGHTS_FIRST:
            weights = pid < units
            b = pid - units
            a = pid
        else:
            weights = pid >= streams
            b = pid
            a = pid - streams
        if weights:  # a weight program: one key head's value heads (their Gram products once)
            _weight_program(a, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, query_start_loc_ptr,
                            w_ptr, c_ptr, ready_ptr, ring_k_ptr, ring_g_ptr, ring_beta_ptr,
                            scale, num_requests, stride_q_tok, stride_q_head, stride_k_tok,
                            stride_k_head, stride_v_tok, stride_v_head, stride_g_tok,
                            stride_beta_tok, HK, HV, KD, VD, K_PAD, V_PAD, T, KC, L2NORM,
                            GRAM_NATIVE, BF16_DOTS)
            return
    else:
        # the weight programs are the launch before this one (with PDL it starts as soon as
        # they all have): nothing here waits for it but the padding program, so that this
        # launch ends after it (what comes next waits for this launch)
        b = pid
    req = b % (num_requests + 1)
    head = b // (num_requests + 1) // NUM_VB
    vb = b // (num_requests + 1) % NUM_VB
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = offs_v < VD
    # the slot goes out with the span's loads: it does not wait for them
    slot = tl.load(slots_ptr + req, mask=req < num_requests, other=0).to(tl.int64)
    start, length = _request_span(query_start_loc_ptr, req, num_requests, out_ptr, num_tokens,
                                  head, offs_v, v_ok, stride_out_tok, stride_out_head, BLOCK_V,
                                  PAD_ROWS)
    if length <= 0:
        if not WEIGHTS:
            if req == num_requests:
                pdl_wait(PDL)
        return
    if length > T:
        for sub in tl.static_range(BLOCK_V // WALK_V):
            _walk_rows(out_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, ring_k_ptr,
                       ring_v_ptr, ring_g_ptr, ring_beta_ptr, scale, start, length, slot,
                       num_slots, head, vb * (BLOCK_V // WALK_V) + sub,
                       vb * BLOCK_V + sub * WALK_V + tl.arange(0, WALK_V), stride_q_tok,
                       stride_q_head, stride_k_tok, stride_k_head, stride_v_tok,
                       stride_v_head, stride_g_tok, stride_g_head, stride_beta_tok,
                       stride_out_tok, stride_out_head, stride_s_slot, stride_s_head,
                       stride_s_k, HK, HV, KD, VD, K_PAD, L2NORM, False)
        return
    k_head = head // (HV // HK)
    offs_t = tl.arange(0, T)
    offs_r = tl.arange(0, 2 * T)
    r_t = offs_r % T
    rows_r = start.to(tl.int64) + r_t
    x_rows = _stacked_rows(q_ptr, k_ptr, start, k_head, stride_q_tok, stride_q_head,
                           stride_k_tok, stride_k_head, T)
    x_in = r_t < length
    # the slot test as a [BLOCK_V] vector (the interpreter rejects scalar & tensor masks)
    slot_v = offs_v.to(tl.int64) * 0 + slot
    s_ok = v_ok & (slot_v >= 0) & (slot_v < num_slots)
    s_base = state_ptr + slot * stride_s_slot + head * stride_s_head
    # the flag before the stream: where the weights are ready (past the first wave of
    # programs, mostly), their loads overlap the stream instead of following it
    unit = (req * HV + head).to(tl.int64)
    tile = (unit * T + offs_t[:, None]) * (2 * T) + offs_r[None, :]
    ready = tl.atomic_add(ready_ptr + unit, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()  # the acquire for every thread's loads below
    early = (tile * 0 + ready) > 0  # a tensor mask (the interpreter rejects scalar masks)
    w = tl.load(w_ptr + tile, mask=early, other=0.0)
    c = tl.load(c_ptr + tile, mask=early, other=0.0)
    kept = ready - 1
    acc = tl.zeros([2 * T, BLOCK_V], f32)
    offs_sc = tl.arange(0, STREAM_KC)
    for k0 in range(0, K_PAD, STREAM_KC):
        kk = k0 + offs_sc
        kc_ok = kk < KD
        x = tl.load(x_rows[:, None] + kk[None, :], mask=x_in[:, None] & kc_ok[None, :],
                    other=0.0)
        if STATE_DESC:  # a bad slot or a row past K or V is outside the tensor: zeros
            s_t = state_desc.load([slot.to(tl.int32), head, k0, vb * BLOCK_V]) \
                .reshape(STREAM_KC, BLOCK_V)
        else:
            s_t = tl.load(s_base + kk[:, None] * stride_s_k + offs_v[None, :],
                          mask=kc_ok[:, None] & s_ok[None, :], other=0.0)
        acc = _stream_dot(x, s_t, acc, STREAM_DOT, BF16_DOTS)
    # the values (raw) into the replay ring, this program's channels of them
    top = (offs_r < T) & x_in
    vals = tl.load(v_ptr + rows_r[:, None] * stride_v_tok + head * stride_v_head
                   + offs_v[None, :], mask=top[:, None] & v_ok[None, :], other=0.0).to(f32)
    tl.store(ring_v_ptr + (rows_r[:, None] * HV + head) * VD + offs_v[None, :], vals,
             mask=top[:, None] & v_ok[None, :])
    if ready == 0:
        # the weight programs run first in the grid and mostly finish while the first wave
        # of stream programs streams: more reads of the flag (up to POLLS) beat making the
        # weights again, and the bound keeps any order of dispatch free of deadlock
        polls = 0
        while (ready == 0) & (polls < POLLS):
            ready = tl.atomic_add(ready_ptr + unit, 0, sem="acquire", scope="gpu")
            polls += 1
        tl.debug_barrier()
        if ready > 0:
            w = tl.load(w_ptr + tile)
            c = tl.load(c_ptr + tile)
            kept = ready - 1
        else:  # the weight program has not finished: the same arithmetic here
            gkk, gqk, nk, nq = _block_gram(q_ptr, k_ptr, start, length, k_head, stride_q_tok,
                                           stride_q_head, stride_k_tok, stride_k_head, KD,
                                           K_PAD, T, KC, GRAM_NATIVE, BF16_DOTS)
            w, c, kept = _block_head(v_ptr, g_ptr, beta_ptr, scale, start, length, head, gkk,
                                     gqk, nk, nq, stride_v_tok, stride_v_head, stride_g_tok,
                                     stride_beta_tok, VD, V_PAD, T, KC, L2NORM)
    # rows from the first unusable one on: zeros into the products (selects), NaN out
    y = tl.where((r_t < kept)[:, None], acc, 0.0)
    vals = tl.where((r_t < kept)[:, None], vals, 0.0)
    o = tl.dot(w, y, input_precision="ieee")
    o = tl.dot(c, vals, o, input_precision="ieee")
    o = tl.where((offs_t < kept)[:, None], o, float("nan"))
    rows = start.to(tl.int64) + offs_t
    tl.store(out_ptr + rows[:, None] * stride_out_tok + head * stride_out_head + offs_v[None, :],
             o.to(out_ptr.dtype.element_ty), mask=(offs_t < length)[:, None] & v_ok[None, :])


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
    block_rows: int = 0
    """The forward takes requests of 1..``block_rows`` rows in the block form (weight programs
    and stream programs in one launch, the state read once); 0: every request walks its rows.
    0 or 8 (the width measured and tested on the GPU). Longer requests walk in that launch."""
    block_form_v: int = _BLOCK_FORM_V
    """Value channels a block-form program streams (a power of two, at least 16)."""
    block_form_warps: int = _NUM_WARPS
    """Warps of a block-form program."""
    walk_v: int = _MIN_BLOCK_V
    """Channels a long request's walk takes at a time inside a block-form program (its state
    slice in registers; it divides ``block_form_v``)."""
    block_weights_first: bool = True
    """The weight programs first in the block form's grid, so they mostly finish before the
    stream programs that use them; False puts them last, so that (with ``block_wait_polls``
    0) every stream program makes its own (slower; the tests use it to show both paths give
    the same bits)."""
    block_wait_polls: int = _BLOCK_WAIT_POLLS
    """Times a stream program reads its weight program's flag again (an acquire, about an L2
    round trip each) before it makes the weights itself; 0: it reads the flag once. The bound
    keeps the launch free of deadlock whatever order the programs are dispatched in; waiting
    beats making them again (``gdn_block_probe.json``: a weight program's chain is ~50k cycles,
    and at bs 64 the first stream programs reach the flag before it is set)."""
    block_weights_launch: bool = False
    """The weight programs in a launch of their own before the stream programs' (with PDL the
    stream launch starts once they all have, and their flags hand the weights over; only the
    padding programs wait for them, so that the op ends after them), built for their own
    registers (``block_weights_registers``): a weight program then holds no more of a
    multiprocessor's registers than it needs (``gdn_block_probe.json``: their slot time is
    what they cost). False: one launch of both kinds."""
    block_weights_registers: int = 0
    """``maxnreg`` of that launch (NVIDIA; 0: the compiler's choice)."""
    block_weights_warps: int = 0
    """Warps of a weight program in that launch (0: ``block_form_warps``). More are slower on an
    H200 (bf16, bs 64, all 8 rows: 65.7 / 73.6 / 89.8 / 121 us at 1 / 2 / 4 / 8 warps,
    ``ssd_kernels_gdn_weights_warps.json``): a program's chain does not shorten, and it holds
    that many warps' slots."""
    block_stream_dot: str = ""
    """How a stream program takes its products with the state (:func:`_stream_dot`): ``""``
    (the default, from the inputs' dtype and the target: :func:`_stream_dot_for`),
    ``"ieee"``, ``"bf16x3"`` (bfloat16 inputs), ``"tf32x2"`` (16-bit inputs, NVIDIA) or
    ``"tf32x3"`` (NVIDIA)."""
    block_gram: str = ""
    """How a weight program takes its rows' Gram products: ``""`` (the default, from the
    inputs' dtype: :func:`_gram_for`), ``"ieee"`` (float32 FMAs, ``KC`` key channels at a time)
    or ``"native"`` (16-bit inputs: one product of the whole rows in their own type on tensor
    cores, float32 sums, :func:`_gram_native`)."""
    block_stream_kc: int = _BLOCK_KC
    """State rows a stream program's step takes (a power of two, at least 16)."""
    block_state_tma: bool = True
    """A stream program's state chunks through a tensor descriptor (TMA), where the target has
    it and the pool allows it (:func:`_state_tma`); else pointer loads. On an H200 (bf16, all
    8 rows, ``ssd_kernels_gdn_state_tma.json``): 56.4 against 57.8 us at bs 64, 103.3 against
    106.6 at bs 128."""
    block_form_stages: int = 0
    """``num_stages`` of the block form's launch (its stream loop's pipelining depth); 0: 4
    where the state goes through TMA (56.2 against 56.4 us at bs 64 there), triton's default
    with pointer loads (where 4 measured slower: 58.5 against 57.7,
    ``ssd_kernels_gdn_stages.json``)."""
    block_form_registers: int = _BLOCK_FORM_REGISTERS
    """Registers a thread of the block form's launch may use (``maxnreg``, NVIDIA; 0: the
    compiler's choice). Uncapped, its build has 212 at 64 channels (triton 3.6, sm_90), set by
    the long-request walk; capped at 128, only that walk spills (136 bytes), and the launch runs
    16 programs a multiprocessor (``ssd_kernels_gdn_block_plans.json``: 67.2 against 76.7 us
    uncapped at bs 64, all 8 rows)."""


def _fill_block(block: int, minimum: int, units: int, channels: int, sm_count: int
                ) -> int:
    """A channel block halved (down to ``minimum``) while ``units`` (requests times heads) times
    ``cdiv(channels, block)`` programs are fewer than two per multiprocessor: the GDN and
    Mamba-2 plans' rule, so that a small batch still fills the GPU."""
    while block > minimum and units * triton.cdiv(channels, block) < 2 * sm_count:
        block //= 2
    return block


@functools.lru_cache(maxsize=1024)
def plan_gdn(num_requests: int, num_v_heads: int, k_dim: int, v_dim: int,
             sm_count: int, block_form: bool | None = None, channel_gates: bool = False,
             num_tokens: int | None = None) -> GdnPlan:
    """``BLOCK_V`` from host ints: at most ``_MAX_TILE / K_PAD`` channels (32 at K = 128, so
    the state slice stays in registers), halved (down to 16) while ``R * Hv * V / BLOCK_V``
    programs are fewer than two per multiprocessor. At 32 value heads, V = 128 on an H200 (132
    SMs): bs 1 runs 256 programs of 16 channels, bs >= 8 programs of 32.

    ``block_form``: requests of up to ``_BLOCK_ROWS`` rows take the block form, where gates are
    a head's (``channel_gates``, Kimi's KDA, always walks) and K and V have at least 16
    channels (its float32 dots). ``None`` (the default): from ``_BLOCK_MIN_REQUESTS`` requests
    on, where ``num_tokens`` (the launch's rows, padding included: a tier's width times its
    requests) is at least ``_BLOCK_MIN_WIDTH`` rows a request. The block form's time hardly
    depends on the rows and the walk's grows with them; on the H200 at Qwen3-Next's shapes
    (docs/benchmarks.md) they cross at about 5 rows a request at bs 64 and 128; at a mean of 7
    the block form is 16.1 / 21.6 / 35.2 us at bs 8 / 16 / 32 against the walk's 18.7 / 27.6
    / 44.0 (``ssd_kernels_gdn_small_mean7.json``), and at bs 1 slower (11.8 against 7.7 with all
    8 rows)."""
    def filled(block: int) -> int:
        return _fill_block(block, _MIN_BLOCK_V, max(num_requests, 1) * num_v_heads, v_dim,
                           sm_count)

    k_pad = triton.next_power_of_2(max(k_dim, 1))
    v_pad = triton.next_power_of_2(max(v_dim, 1))
    block_v = filled(min(v_pad, max(_MIN_BLOCK_V, _MAX_TILE // k_pad)))
    if block_form is None:
        block_form = num_requests >= _BLOCK_MIN_REQUESTS and num_tokens is not None \
            and num_tokens >= _BLOCK_MIN_WIDTH * num_requests
    fits = not channel_gates and k_pad >= _BLOCK_KC and v_dim >= _MIN_BLOCK_V
    return GdnPlan(k_pad, block_v, triton.cdiv(v_dim, block_v),
                   block_rows=_BLOCK_ROWS if block_form and fits else 0,
                   block_form_v=filled(max(min(v_pad, _BLOCK_FORM_V), _MIN_BLOCK_V)))


_STREAM_DOTS = ("ieee", "bf16x3", "tf32x2", "tf32x3")
_SIXTEEN_BIT = (torch.bfloat16, torch.float16)  # exact in TF32, their products in float32


def _stream_dot_for(plan: GdnPlan, dtype: torch.dtype, backend: str) -> str:
    """The stream programs' :func:`_stream_dot`: ``plan.block_stream_dot``, or by default
    ``"tf32x2"`` for 16-bit inputs on NVIDIA (the fastest of the four on an H200, bf16:
    ``ssd_kernels_gdn_stream_dots.json``), float32 FMAs otherwise (float32 rows are exact in
    no tensor-core type; ``"bf16x3"`` is not measured on an AMD GPU). ``ValueError`` naming
    the value and the rule where the plan asks for one the inputs or the target cannot take."""
    how = plan.block_stream_dot
    if not how:
        return "tf32x2" if dtype in _SIXTEEN_BIT and backend == "cuda" else "ieee"
    rule = None
    if how not in _STREAM_DOTS:
        rule = f"one of {_STREAM_DOTS} or '' (by the inputs and the target)"
    elif how == "bf16x3" and dtype != torch.bfloat16:
        rule = f"bf16x3 only with bfloat16 q and k (here {dtype}: not exact in bfloat16)"
    elif how == "tf32x2" and dtype not in _SIXTEEN_BIT:
        rule = f"tf32x2 only with 16-bit q and k (here {dtype}: not exact in TF32)"
    elif how.startswith("tf32") and backend != "cuda":
        rule = f"{how} only on NVIDIA targets (here {backend})"
    if rule:
        raise ValueError(f"dspark::gated_delta_rule: GdnPlan.block_stream_dot={how!r}: must "
                         f"be {rule}")
    return how


_GRAMS = ("ieee", "native")


def _gram_for(plan: GdnPlan, dtype: torch.dtype) -> bool:
    """Whether the weight programs take their Gram products as one 16-bit product
    (:func:`_gram_native`): ``plan.block_gram``, by default for 16-bit q and k (a product of two
    is exact in float32; float32 rows are exact in no tensor-core type). ``ValueError`` naming
    the value and the rule where the plan asks for what the inputs cannot take."""
    how = plan.block_gram or ("native" if dtype in _SIXTEEN_BIT else "ieee")
    rule = None
    if how not in _GRAMS:
        rule = f"one of {_GRAMS} or '' (by the inputs' dtype)"
    elif how == "native" and dtype not in _SIXTEEN_BIT:
        rule = f"native only with 16-bit q and k (here {dtype}: not exact on tensor cores)"
    if rule:
        raise ValueError(f"dspark::gated_delta_rule: GdnPlan.block_gram={how!r}: must be "
                         f"{rule}")
    return how == "native"


def _state_tma(plan: GdnPlan, state: torch.Tensor, cfg) -> bool:
    """The stream programs read the state through a tensor descriptor: the plan asks for it,
    the target has TMA (``TargetConfig.has_tma``) and the pool allows one
    (:func:`launch.descriptor_ok`)."""
    return plan.block_state_tma and cfg.has_tma and descriptor_ok(state)


def _check_plan(plan: GdnPlan, channel_gates: bool) -> None:
    """The block form's knobs, before any launch: ``ValueError`` naming the value and the rule."""
    def dot_size(v: int) -> bool:  # the block form's float32 dots: a power of two, >= 16
        return v >= _MIN_BLOCK_V and v & (v - 1) == 0

    rules = [(plan.block_rows in (0, _BLOCK_ROWS), "block_rows", plan.block_rows,
              f"0 or {_BLOCK_ROWS}")]
    if plan.block_rows:
        pow2 = f"a power of two of at least {_MIN_BLOCK_V} (the block form's float32 dots)"
        rules += [(not channel_gates, "block_rows", plan.block_rows,
                   "0 where g has one gate a key channel (the block form takes a head's)"),
                  (plan.k_pad >= _BLOCK_KC, "k_pad", plan.k_pad,
                   f"at least {_BLOCK_KC} in the block form"),
                  (dot_size(plan.block_form_v), "block_form_v", plan.block_form_v, pow2),
                  (dot_size(plan.walk_v) and plan.block_form_v % plan.walk_v == 0, "walk_v",
                   plan.walk_v, pow2 + " dividing block_form_v"),
                  (isinstance(plan.block_form_stages, int) and plan.block_form_stages >= 0,
                   "block_form_stages", plan.block_form_stages, "an int >= 0"),
                  (dot_size(plan.block_stream_kc) and plan.block_stream_kc <= plan.k_pad,
                   "block_stream_kc", plan.block_stream_kc, pow2 + " up to k_pad"),
                  (isinstance(plan.block_wait_polls, int) and plan.block_wait_polls >= 0,
                   "block_wait_polls", plan.block_wait_polls, "an int >= 0"),
                  (plan.block_weights_registers == 0 or plan.block_weights_registers >= 32,
                   "block_weights_registers", plan.block_weights_registers,
                   "0 (the compiler's choice) or at least 32"),
                  (plan.block_weights_warps in (0, 1, 2, 4, 8), "block_weights_warps",
                   plan.block_weights_warps, "0 (block_form_warps), 1, 2, 4 or 8")]
    for ok, name, value, rule in rules:
        if not ok:
            raise ValueError(f"dspark::gated_delta_rule: GdnPlan.{name}={value!r}: must be "
                             f"{rule}")


def gated_delta_rule_triton(q, k, v, g, beta, recurrent_state, query_start_loc, slots, ring_k,
                            ring_v, ring_g, ring_beta, scale: float, use_qk_l2norm: bool,
                            plan: GdnPlan | None = None) -> torch.Tensor:
    """Triton ``dspark::gated_delta_rule``: same arguments and result as the reference.

    One launch (the block form: and the zeroing of its flags), no host sync (CUDA-graph safe);
    ``plan`` overrides the tiles and the form. Returns ``[N, Hv, V]`` in q's dtype; the pool is
    only read, the rings get the replay inputs.
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
    channel_gates = g.dim() == 3
    cfg, sm_count = device_target(q.device)
    plan = plan or plan_gdn(r, hv, kd, vd, sm_count, channel_gates=channel_gates,
                            num_tokens=n)
    _check_plan(plan, channel_gates)
    st = recurrent_state
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               g.stride(0), g.stride(1), beta.stride(0), out.stride(0), out.stride(1),
               st.stride(0), st.stride(1), st.stride(2))
    shapes = dict(HK=hk, HV=hv, KD=kd, VD=vd, K_PAD=plan.k_pad, L2NORM=use_qk_l2norm,
                  PAD_ROWS=_PAD_ROWS)
    if not plan.block_rows:
        launch(_gdn_forward_kernel, (r + 1, hv * plan.num_vb),
               out, q, k, v, g, beta, st, query_start_loc, slots, ring_k, ring_v, ring_g,
               ring_beta, float(scale), n, r, st.shape[0], *strides, **shapes,
               BLOCK_V=plan.block_v, NUM_VB=plan.num_vb, CHANNEL_GATES=channel_gates,
               num_warps=plan.num_warps)
        return out
    t = plan.block_rows
    regs = register_cap(plan.block_form_registers, cfg, q.device)
    pdl = use_pdl(q.device, cfg)
    # per (request, value head): W and C, [T, 2T] each
    w, c = torch.empty(2, r * hv * t * 2 * t, dtype=torch.float32, device=q.device)
    ready = torch.zeros(max(r * hv, 1), dtype=torch.int32, device=q.device)
    num_vb = triton.cdiv(vd, plan.block_form_v)
    v_pad = max(triton.next_power_of_2(vd), _BLOCK_KC)
    stream_dot = _stream_dot_for(plan, q.dtype, cfg.backend)
    weights = dict(GRAM_NATIVE=_gram_for(plan, q.dtype), BF16_DOTS=q.device.type != "cpu")
    split = plan.block_weights_launch and r > 0
    if split:
        wregs = register_cap(plan.block_weights_registers, cfg, q.device)
        launch(_gdn_block_weights_kernel, (r * hk,), q, k, v, g, beta, query_start_loc, w, c,
               ready, ring_k, ring_g, ring_beta, float(scale), r, *strides[:7], strides[8],
               HK=hk, HV=hv, KD=kd, VD=vd, K_PAD=plan.k_pad, V_PAD=v_pad, T=t, KC=_BLOCK_KC,
               L2NORM=use_qk_l2norm, PDL=pdl, **weights,
               num_warps=plan.block_weights_warps or plan.block_form_warps, **wregs,
               **pdl_options(pdl))
    tma = _state_tma(plan, st, cfg)
    state_arg = tensor_descriptor(st, [1, 1, plan.block_stream_kc, plan.block_form_v]) \
        if tma else st
    stages = plan.block_form_stages or (_TMA_STAGES if tma else 0)
    launch(_gdn_block_kernel, ((0 if split else r * hk) + (r + 1) * hv * num_vb,),
           out, q, k, v, g, beta, st, state_arg, query_start_loc, slots, w, c, ready, ring_k,
           ring_v, ring_g, ring_beta, float(scale), n, r, st.shape[0], *strides, **shapes,
           V_PAD=v_pad, BLOCK_V=plan.block_form_v, NUM_VB=num_vb, WALK_V=plan.walk_v, T=t,
           KC=_BLOCK_KC, WEIGHTS_FIRST=plan.block_weights_first,
           POLLS=plan.block_wait_polls, WEIGHTS=not split, STREAM_DOT=stream_dot,
           STREAM_KC=plan.block_stream_kc, STATE_DESC=tma, PDL=pdl, **weights,
           num_warps=plan.block_form_warps, **regs, **pdl_options(pdl),
           **({"num_stages": stages} if stages else {}))
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
