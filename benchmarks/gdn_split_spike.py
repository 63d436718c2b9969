"""Spike (issue 25): the GDN block form split in two launches.

Launch A, one program a (request, value head), does everything that depends on the rows alone
(the Gram products, the decays, the unit-triangular inverse) and writes the mixed rows ``W X``
([8, K]) and ``C``; launch B streams the state once: ``out = (W X) S0 + C v``. No rings are
written (a spike). Rows from a request's first non-finite one on are dropped before any
product, as in the reverted block form (git history).

Each case is checked against the reference op, then timed beside the library's row form on the
same inputs (graph replays and back-to-back launches, us): A alone, B alone, A then B, and the
variants:
- ``gram16``: A takes the stacked [16, 16] Gram and cuts its blocks out by selects;
- ``inv_product``: the unit-triangular inverse as ``(I - N)(I + N^2)(I + N^4)``, not forward
  substitution;
- ``one_shot``: A loads the rows whole, once; its Gram products and ``W X`` are each one
  product over all of K, no loop;
- ``pair``: one A program for the two value heads of a key head: their Gram products once,
  their two chains of 8 x 8 algebra side by side;
- channel blocks, warps and K chunks.

``SPIKE_CASES="rows;split pair"`` times only the named cases.

Usage: ``python benchmarks/gdn_split_spike.py [BS ...]`` (an H200; default bs 8 64 128); writes
``gdn_split_spike.json`` to ``$OUT`` or ``benchmarks/results/``."""
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from common import time_calls, versions, write_json
from hybrid_kernels import _copies, _gdn_args, gdn_inputs
from ssd_kernels import SETTINGS, _rates, lengths

from dspark_compile.kernels import gdn as triton_gdn
from dspark_compile.ops import linear_attention_reference as ref


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
def _request_rows(k_ptr, q_ptr, start, length, k_head, stride_k_tok, stride_k_head,
                  stride_q_tok, stride_q_head, T: tl.constexpr):
    """A request's rows: ``(offs_t, rows, in_req)`` and the keys and queries stacked, row
    ``r < T`` key ``r`` and row ``r >= T`` query ``r - T``: ``(offs_r, r % T, row pointers)``."""
    offs_t = tl.arange(0, T)
    rows = start.to(tl.int64) + offs_t
    offs_r = tl.arange(0, 2 * T)
    r_t = offs_r % T
    r_rows = start.to(tl.int64) + r_t
    x_rows = tl.where(offs_r < T, k_ptr + r_rows * stride_k_tok + k_head * stride_k_head,
                      q_ptr + r_rows * stride_q_tok + k_head * stride_q_head)
    return offs_t, rows, offs_t < length, offs_r, r_t, x_rows


@triton.jit
def _gram(k_ptrs, q_ptrs, in_req, K_PAD: tl.constexpr, KD: tl.constexpr, T: tl.constexpr,
          KC: tl.constexpr):
    """``k_t . k_s``, ``q_t . k_s`` ([T, T]), ``|k_t|^2`` and ``|q_t|^2`` of the raw rows at
    ``k_ptrs`` and ``q_ptrs``, K in chunks of ``KC``."""
    f32: tl.constexpr = tl.float32
    offs_c = tl.arange(0, KC)
    gkk = tl.zeros([T, T], f32)
    gqk = tl.zeros([T, T], f32)
    nq = tl.zeros([T], f32)
    for k0 in range(0, K_PAD, KC):
        kk = k0 + offs_c
        m = in_req[:, None] & (kk < KD)[None, :]
        xk = tl.load(k_ptrs[:, None] + kk[None, :], mask=m, other=0.0).to(f32)
        xq = tl.load(q_ptrs[:, None] + kk[None, :], mask=m, other=0.0).to(f32)
        gkk = tl.dot(xk, tl.trans(xk), gkk, input_precision="ieee")
        gqk = tl.dot(xq, tl.trans(xk), gqk, input_precision="ieee")
        nq += tl.sum(xq * xq, 1)
    offs_t = tl.arange(0, T)
    return gkk, gqk, tl.sum(tl.where(offs_t[:, None] == offs_t[None, :], gkk, 0.0), 1), nq


@triton.jit
def _mm(a, b):
    """``a @ b`` of two small tiles, as a broadcast sum."""
    return tl.sum(a[:, :, None] * b[None, :, :], 1)


@triton.jit
def _weights(gkk, gqk, nk, nq, g, beta, in_req, scale, offs_t, offs_r, r_t, T: tl.constexpr,
             INV_PRODUCT: tl.constexpr):
    """A value head's ``W`` ([T, 2T]) and ``C`` ([T, T]) from its rows' Gram products, gates
    and betas; ``ok_r``: the stacked rows kept."""
    f32: tl.constexpr = tl.float32
    tt = offs_t[:, None]
    ss = offs_t[None, :]
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
    if INV_PRODUCT:  # (I + N)^-1 = (I - N)(I + N^2)(I + N^4): N is strictly lower, N^8 = 0
        eye = tl.where(tt == ss, 1.0, 0.0)
        n2 = _mm(lower, lower)
        inv = _mm(_mm(eye - lower, eye + n2), eye + _mm(n2, n2))
    else:
        inv = tl.zeros([T, T], f32)
        for t in tl.static_range(T):
            l_t = _row_select(lower, t, offs_t)  # [T] over u
            row = tl.where(offs_t == t, 1.0, 0.0) - tl.sum(l_t[:, None] * inv, 0)
            inv = tl.where(tt == t, row[None, :], inv)
    # out = diag(decay * rq) Q S0 - C diag(decay * rk) K S0 + C v, C = mq inv diag(beta);
    # as [T, 2T] weights of the stacked rows: w = [-C diag(decay * rk) | diag(decay * rq)]
    c = tl.sum(mq[:, :, None] * inv[None, :, :], 1) * beta[None, :]
    w = _spread(-c * (decay * rk)[None, :], offs_r, offs_t) \
        + tl.where(offs_r[None, :] == tt + T, (decay * rq)[:, None], 0.0)
    return w, c, ok_r, ok


@triton.jit
def _mix_kernel(q_ptr, k_ptr, g_ptr, beta_ptr, qsl_ptr, xs_ptr, cs_ptr, scale,
                stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_g_tok,
                stride_beta_tok, HK: tl.constexpr, HV: tl.constexpr, KD: tl.constexpr,
                K_PAD: tl.constexpr, T: tl.constexpr, KC: tl.constexpr,
                GRAM16: tl.constexpr, INV_PRODUCT: tl.constexpr, ONE_SHOT: tl.constexpr):
    req = tl.program_id(0)
    head = tl.program_id(1)
    f32: tl.constexpr = tl.float32
    start = tl.load(qsl_ptr + req)
    length = tl.load(qsl_ptr + req + 1) - start
    if length <= 0:
        return
    k_head = head // (HV // HK)
    offs_t, rows, in_req, offs_r, r_t, x_rows = _request_rows(
        k_ptr, q_ptr, start, length, k_head, stride_k_tok, stride_k_head, stride_q_tok,
        stride_q_head, T)
    offs_c = tl.arange(0, KC)
    # Gram products of the raw rows: gkk[t, s] = k_t . k_s, gqk[t, s] = q_t . k_s
    tt = offs_t[:, None]
    ss = offs_t[None, :]
    if GRAM16:  # the stacked rows' [2T, 2T] Gram, its blocks taken by selects
        gram = tl.zeros([2 * T, 2 * T], f32)
        for k0 in range(0, K_PAD, KC):
            kk = k0 + offs_c
            x_g = tl.load(x_rows[:, None] + kk[None, :],
                          mask=(r_t < length)[:, None] & (kk < KD)[None, :], other=0.0).to(f32)
            gram = tl.dot(x_g, tl.trans(x_g), gram, input_precision="ieee")
        gk_rows = _rows_of(gram, offs_r, offs_t, 0)  # [T, 2T]: key rows
        gq_rows = _rows_of(gram, offs_r, offs_t, T)  # [T, 2T]: query rows
        gkk = _cols_of(gk_rows, offs_r, offs_t, 0)  # [T, T]: k_t . k_s
        gqk = _cols_of(gq_rows, offs_r, offs_t, 0)  # [T, T]: q_t . k_s
        nk = tl.sum(tl.where(tt == ss, gkk, 0.0), 1)
        nq = tl.sum(tl.where(tt == ss, _cols_of(gq_rows, offs_r, offs_t, T), 0.0), 1)
    elif ONE_SHOT:  # the rows loaded once, whole: two [T, T] products over all of K
        offs_k = tl.arange(0, K_PAD)
        m = in_req[:, None] & (offs_k < KD)[None, :]
        xk_all = tl.load(k_ptr + rows[:, None] * stride_k_tok + k_head * stride_k_head
                         + offs_k[None, :], mask=m, other=0.0).to(f32)
        xq_all = tl.load(q_ptr + rows[:, None] * stride_q_tok + k_head * stride_q_head
                         + offs_k[None, :], mask=m, other=0.0).to(f32)
        gkk = tl.dot(xk_all, tl.trans(xk_all), input_precision="ieee")
        gqk = tl.dot(xq_all, tl.trans(xk_all), input_precision="ieee")
        nk = tl.sum(tl.where(tt == ss, gkk, 0.0), 1)
        nq = tl.sum(xq_all * xq_all, 1)
    else:  # two [T, T] products and the queries' norms, no selects
        gkk, gqk, nk, nq = _gram(k_ptr + rows * stride_k_tok + k_head * stride_k_head,
                                 q_ptr + rows * stride_q_tok + k_head * stride_q_head, in_req,
                                 K_PAD, KD, T, KC)
    g = tl.load(g_ptr + rows * stride_g_tok + head, mask=in_req, other=0.0).to(f32)
    beta = tl.load(beta_ptr + rows * stride_beta_tok + head, mask=in_req, other=0.0).to(f32)
    w, c, ok_r, ok = _weights(gkk, gqk, nk, nq, g, beta, in_req, scale, offs_t, offs_r, r_t, T,
                              INV_PRODUCT)
    unit = (req * HV + head).to(tl.int64)
    if ONE_SHOT:  # the stacked rows from the loaded ones: [k rows; q rows], dropped rows 0
        stacked = tl.reshape(tl.permute(tl.join(tl.where(ok[:, None], xk_all, 0.0),
                                                tl.where(ok[:, None], xq_all, 0.0)),
                                        (2, 0, 1)), (2 * T, K_PAD))
        tl.store(xs_ptr + (unit * T + offs_t[:, None]) * K_PAD + offs_k[None, :],
                 tl.dot(w, stacked, input_precision="ieee"))
    else:
        for k0 in range(0, K_PAD, KC):
            kk = k0 + offs_c
            kc_ok = kk < KD
            x = tl.load(x_rows[:, None] + kk[None, :], mask=ok_r[:, None] & kc_ok[None, :],
                        other=0.0).to(f32)
            tl.store(xs_ptr + (unit * T + offs_t[:, None]) * K_PAD + kk[None, :],
                     tl.dot(w, x, input_precision="ieee"))
    tl.store(cs_ptr + (unit * T + offs_t[:, None]) * (2 * T) + offs_r[None, :],
             _spread(c, offs_r, offs_t))


@triton.jit
def _mix_pair_kernel(q_ptr, k_ptr, g_ptr, beta_ptr, qsl_ptr, xs_ptr, cs_ptr, scale,
                     stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_g_tok,
                     stride_beta_tok, HK: tl.constexpr, HV: tl.constexpr, KD: tl.constexpr,
                     K_PAD: tl.constexpr, T: tl.constexpr, KC: tl.constexpr,
                     INV_PRODUCT: tl.constexpr):
    """Launch A for the two value heads of one key head (``HV == 2 HK``): their Gram products
    once, their two independent chains of 8 x 8 algebra in one program."""
    req = tl.program_id(0)
    k_head = tl.program_id(1)
    f32: tl.constexpr = tl.float32
    start = tl.load(qsl_ptr + req)
    length = tl.load(qsl_ptr + req + 1) - start
    if length <= 0:
        return
    offs_t, rows, in_req, offs_r, r_t, x_rows = _request_rows(
        k_ptr, q_ptr, start, length, k_head, stride_k_tok, stride_k_head, stride_q_tok,
        stride_q_head, T)
    offs_c = tl.arange(0, KC)
    gkk, gqk, nk, nq = _gram(k_ptr + rows * stride_k_tok + k_head * stride_k_head,
                             q_ptr + rows * stride_q_tok + k_head * stride_q_head, in_req,
                             K_PAD, KD, T, KC)
    h0 = 2 * k_head
    g0 = tl.load(g_ptr + rows * stride_g_tok + h0, mask=in_req, other=0.0).to(f32)
    b0 = tl.load(beta_ptr + rows * stride_beta_tok + h0, mask=in_req, other=0.0).to(f32)
    g1 = tl.load(g_ptr + rows * stride_g_tok + h0 + 1, mask=in_req, other=0.0).to(f32)
    b1 = tl.load(beta_ptr + rows * stride_beta_tok + h0 + 1, mask=in_req, other=0.0).to(f32)
    w0, c0, ok0, _ = _weights(gkk, gqk, nk, nq, g0, b0, in_req, scale, offs_t, offs_r, r_t, T,
                              INV_PRODUCT)
    w1, c1, ok1, _ = _weights(gkk, gqk, nk, nq, g1, b1, in_req, scale, offs_t, offs_r, r_t, T,
                              INV_PRODUCT)
    unit0 = (req * HV + h0).to(tl.int64)
    unit1 = unit0 + 1
    for k0 in range(0, K_PAD, KC):
        kk = k0 + offs_c
        x = tl.load(x_rows[:, None] + kk[None, :],
                    mask=(r_t < length)[:, None] & (kk < KD)[None, :], other=0.0).to(f32)
        tl.store(xs_ptr + (unit0 * T + offs_t[:, None]) * K_PAD + kk[None, :],
                 tl.dot(w0, tl.where(ok0[:, None], x, 0.0), input_precision="ieee"))
        tl.store(xs_ptr + (unit1 * T + offs_t[:, None]) * K_PAD + kk[None, :],
                 tl.dot(w1, tl.where(ok1[:, None], x, 0.0), input_precision="ieee"))
    tl.store(cs_ptr + (unit0 * T + offs_t[:, None]) * (2 * T) + offs_r[None, :],
             _spread(c0, offs_r, offs_t))
    tl.store(cs_ptr + (unit1 * T + offs_t[:, None]) * (2 * T) + offs_r[None, :],
             _spread(c1, offs_r, offs_t))


@triton.jit
def _stream_kernel(out_ptr, v_ptr, state_ptr, qsl_ptr, slots_ptr, xs_ptr, cs_ptr,
                   stride_v_tok, stride_v_head, stride_out_tok, stride_out_head, stride_s_slot,
                   stride_s_head, stride_s_k, HV: tl.constexpr, KD: tl.constexpr,
                   VD: tl.constexpr, K_PAD: tl.constexpr, BLOCK_V: tl.constexpr,
                   NUM_VB: tl.constexpr, T: tl.constexpr, KC: tl.constexpr):
    req = tl.program_id(0)
    head = tl.program_id(1) // NUM_VB
    vb = tl.program_id(1) % NUM_VB
    f32: tl.constexpr = tl.float32
    start = tl.load(qsl_ptr + req)
    length = tl.load(qsl_ptr + req + 1) - start
    if length <= 0:
        return
    slot = tl.load(slots_ptr + req).to(tl.int64)
    offs_t = tl.arange(0, T)
    offs_r = tl.arange(0, 2 * T)
    offs_c = tl.arange(0, KC)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = offs_v < VD
    unit = (req * HV + head).to(tl.int64)
    c = tl.load(cs_ptr + (unit * T + offs_t[:, None]) * (2 * T) + offs_r[None, :])
    r_rows = start.to(tl.int64) + offs_r % T
    v = tl.load(v_ptr + r_rows[:, None] * stride_v_tok + head * stride_v_head + offs_v[None, :],
                mask=((offs_r < T) & (offs_r < length))[:, None] & v_ok[None, :],
                other=0.0).to(f32)
    v = tl.where((v == v) & (tl.abs(v) < float("inf")), v, 0.0)
    acc = tl.dot(c, v, input_precision="ieee")
    s_base = state_ptr + slot * stride_s_slot + head * stride_s_head
    for k0 in range(0, K_PAD, KC):
        kk = k0 + offs_c
        kc_ok = kk < KD
        x = tl.load(xs_ptr + (unit * T + offs_t[:, None]) * K_PAD + kk[None, :])
        s_t = tl.load(s_base + kk[:, None] * stride_s_k + offs_v[None, :],
                      mask=kc_ok[:, None] & v_ok[None, :], other=0.0)
        acc = tl.dot(x, s_t, acc, input_precision="ieee")
    rows = start.to(tl.int64) + offs_t
    tl.store(out_ptr + rows[:, None] * stride_out_tok + head * stride_out_head + offs_v[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=(offs_t < length)[:, None] & v_ok[None, :])


def split_forward(c, s, block_v=128, warps_a=1, warps_b=1, kc=16, parts="ab", gram16=False,
                  inv_product=False, one_shot=False, pair=False):
    q, k, v, g, beta, st, qsl = c["q"], c["k"], c["v"], c["g"], c["beta"], c["state"], c["qsl"]
    r, (n, hk, kd), (hv, vd) = qsl.shape[0] - 1, k.shape, v.shape[1:]
    k_pad = triton.next_power_of_2(kd)
    if "scratch" not in c:
        c["scratch"] = (torch.empty(r * hv * 8 * k_pad, device=q.device),
                        torch.empty(r * hv * 8 * 16, device=q.device),
                        torch.empty(n, hv, vd, dtype=q.dtype, device=q.device))
    xs, cs, out = c["scratch"]
    if "a" in parts and pair:
        assert hv == 2 * hk, "pair: two value heads a key head"
        _mix_pair_kernel[(r, hk)](q, k, g, beta, qsl, xs, cs, s["k_dim"] ** -0.5, q.stride(0),
                                  q.stride(1), k.stride(0), k.stride(1), g.stride(0),
                                  beta.stride(0), HK=hk, HV=hv, KD=kd, K_PAD=k_pad, T=8, KC=kc,
                                  INV_PRODUCT=inv_product, num_warps=warps_a)
    elif "a" in parts:
        _mix_kernel[(r, hv)](q, k, g, beta, qsl, xs, cs, s["k_dim"] ** -0.5, q.stride(0),
                             q.stride(1), k.stride(0), k.stride(1), g.stride(0), beta.stride(0),
                             HK=hk, HV=hv, KD=kd, K_PAD=k_pad, T=8, KC=kc, GRAM16=gram16,
                             INV_PRODUCT=inv_product, ONE_SHOT=one_shot, num_warps=warps_a)
    if "b" in parts:
        nvb = triton.cdiv(vd, block_v)
        _stream_kernel[(r, hv * nvb)](out, v, st, qsl, c["slots"], xs, cs, v.stride(0),
                                      v.stride(1), out.stride(0), out.stride(1), st.stride(0),
                                      st.stride(1), st.stride(2), HV=hv, KD=kd, VD=vd,
                                      K_PAD=k_pad, BLOCK_V=block_v, NUM_VB=nvb, T=8, KC=kc,
                                      num_warps=warps_b)
    return out


def main():
    s = SETTINGS
    rows = []
    out = os.environ.get("OUT") or str(Path(__file__).parent / "results")
    for bs in [int(a) for a in sys.argv[1:]] or (8, 64, 128):
        for mix in (True, False):
            lens = lengths(bs, mix, s)
            floor = bs * s["num_v_heads"] * s["k_dim"] * s["v_dim"] * 4
            sets = [gdn_inputs(lens, s, "cuda", seed=bs + i) for i in range(_copies(floor, s))]
            c0 = sets[0]
            f32 = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                   for k, v in c0.items()}
            want = ref.gated_delta_rule(*_gdn_args(f32, s))
            cases = [("rows", dict(), None)]
            for bv, wb, kc in ((128, 1, 16), (64, 1, 16), (128, 2, 16), (128, 4, 16),
                               (128, 1, 32)):
                cases.append((f"split bv{bv} wb{wb} kc{kc}", dict(block_v=bv, warps_b=wb, kc=kc),
                              "ab"))
            cases.append(("split gram16", dict(gram16=True), "ab"))
            cases.append(("split inv product", dict(inv_product=True), "ab"))
            cases.append(("split inv product bv64", dict(inv_product=True, block_v=64), "ab"))
            cases.append(("split pair", dict(pair=True), "ab"))
            cases.append(("split pair bv64", dict(pair=True, block_v=64), "ab"))
            cases.append(("split one shot", dict(one_shot=True), "ab"))
            cases.append(("split one shot 2 warps", dict(one_shot=True, warps_a=2), "ab"))
            cases.append(("split one shot 4 warps", dict(one_shot=True, warps_a=4), "ab"))
            cases += [("A alone", dict(), "a"), ("A alone gram16", dict(gram16=True), "a"),
                      ("A alone inv product", dict(inv_product=True), "a"),
                      ("A alone pair", dict(pair=True), "a"),
                      ("A alone pair 2 warps", dict(pair=True, warps_a=2), "a"),
                      ("A alone one shot", dict(one_shot=True), "a"),
                      ("A alone one shot 2 warps", dict(one_shot=True, warps_a=2), "a"),
                      ("A alone one shot 4 warps", dict(one_shot=True, warps_a=4), "a"),
                      ("A alone 2 warps", dict(warps_a=2), "a"),
                      ("A alone kc32", dict(kc=32), "a"), ("B alone", dict(), "b"),
                      ("B alone bv64", dict(block_v=64), "b")]
            only = os.environ.get("SPIKE_CASES")  # e.g. "rows;A alone": only these
            for name, kw, parts in [x for x in cases if not only or x[0] in only.split(";")]:
                if parts is None:
                    fns = [lambda c=c: triton_gdn.gated_delta_rule_triton(*_gdn_args(c, s))
                           for c in sets]
                else:
                    got = split_forward(c0, s, **kw)
                    real = sum(lens)
                    err = (got[:real].float() - want[:real]).abs().max().item()
                    if err > 3e-2:
                        raise AssertionError(f"{name}: max abs error {err}")
                    fns = [lambda c=c, kw=kw, parts=parts: split_forward(c, s, parts=parts, **kw)
                           for c in sets]
                rows.append(dict(bs=bs, lengths="mix_mean3" if mix else "all8", form=name,
                                 **_rates(floor, time_calls(fns, s, "cuda"), s)))
                print(rows[-1], flush=True)
                report = dict(versions(), command=" ".join(sys.argv), rows=rows)
                write_json(out, "gdn_split_spike.json", report)


if __name__ == "__main__":
    main()
