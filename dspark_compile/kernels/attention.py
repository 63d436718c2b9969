"""Triton lowering of ``dspark::ragged_attention``: paged KV write + ragged causal attention.

Kernels, then launch plan and host wrapper (the Triton tutorials' order); the oracle is
:func:`dspark_compile.ops.attention_reference.ragged_attention`. One launch, two when split:

- Grid ``(N // BLOCK_Q + R + 1, Hkv, splits)`` from shapes only. Request ``i`` owns q-block
  ids from ``qsl[i] // BLOCK_Q + i`` (strictly increasing, so a program finds its request by
  counting, empty requests included); ids past the last request hold the padding rows
  ``qsl[R] .. N - 1``, which come out as zeros. Surplus programs exit at once.
- A program's tile is ``BLOCK_Q`` query tokens x the query heads of one KV head, so each K/V
  load serves the whole group; at verify widths a request's KV is read once per KV head.
- Fused KV write: split 0 of each q-block writes its rows into the pool, and attention reads
  the request's own new keys from ``k``/``v`` (cast to the pool dtype), never a pool row
  written in the same launch. Precondition (``VerifierState.slot_mapping`` meets it): row
  ``qsl[i] + j`` maps to the pool row of position ``context_i + j`` in ``block_table[i]``.
- Containment: pool keys ``>= context`` are never loaded; scores of hidden keys are ``-inf``
  before the max; a non-finite V of a new key some row may not see is zeroed before
  ``P @ V`` (``0 * NaN`` is NaN) and reaches, as NaN, only the rows that see it (the
  reference gives NaN there, or Inf for an Inf).
- Split-KV: a q-block's key tiles are spread evenly over ``splits`` programs writing fp32
  partials; a reduce kernel merges them. The count comes from shapes (:func:`plan_attention`).
- Semantics switches, constexprs of the one kernel (all off: the plain causal build, whose
  instructions are those of the kernel before the switches; only its three new parameters
  differ): a sliding window (the work units start at the first tile the block's first query's
  window reaches, so neither those pages nor their block-table entries are read; the few tiles
  only some rows see take per-row masks and guarded V), a logit softcap (``tanh`` from
  ``exp2``), sinks a head or a row and head (split 0 starts the online softmax from them),
  relative logits (each key tile adds its row's logits of the tile's distances, masked past
  the extent), ALiBi slopes (a head's slope times the distance, no load) and a V head dim of
  its own (acc, partials and out have V's; the pools each
  their own row width).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..ops.attention_reference import check_alibi, check_rel, check_semantics
from .launch import dense, launch
from .pdl import pdl_enter, pdl_options, use_pdl
from .device import device_target, fp32_dot_precision, register_cap
from .targets import TargetConfig

__all__ = ["AttentionPlan", "plan_attention", "ragged_attention_triton"]

log = logging.getLogger("dspark_compile")

_LOG2E = 1.4426950408889634
_SEARCH_BUCKETS = (32, 256)
"""``query_start_loc`` entries per load below ``search_chunk``: few widths, so a tier set
compiles few kernel variants (the split count, N and R are runtime arguments, not
specialised, for the same reason: each variant costs ~1 s of capture)."""


@triton.jit
def _find_request(query_start_loc_ptr, seq_lens_ptr, block_id, num_requests,
                  BLOCK_Q: tl.constexpr, SEARCH: tl.constexpr, SEARCH_ONCE: tl.constexpr):
    """(i, qsl[i], qsl[i + 1], seq_lens[i]) for the largest ``i`` in ``0..R`` with
    ``qsl[i] // BLOCK_Q + i <= block_id`` (``i = R``: the padding rows; its ``qsl[i + 1]`` and
    ``seq_lens[i]`` are 0).

    ``qsl[i] // BLOCK_Q + i`` strictly increases, so ``i`` is the count of entries ``<=
    block_id``, minus one: ``SEARCH`` entries per load and one reduction, instead of a binary
    search's ~log2(R) dependent loads at the head of every program. With ``SEARCH_ONCE`` (all
    ``R + 1`` entries in one load) the request's bounds and its ``seq_lens`` entry come out of
    loads issued together, so the block-table and K/V loads wait one round trip, not two.
    """
    offs = tl.arange(0, SEARCH)
    if SEARCH_ONCE:
        start = tl.load(query_start_loc_ptr + offs, mask=offs <= num_requests, other=0)
        lens = tl.load(seq_lens_ptr + offs, mask=offs < num_requests, other=0)
        hit = (start // BLOCK_Q + offs <= block_id) & (offs <= num_requests)
        req = tl.sum(hit.to(tl.int32)) - 1
        req_start = tl.sum(tl.where(offs == req, start, 0))
        req_end = tl.sum(tl.where(offs == req + 1, start, 0))
        seq_len = tl.sum(tl.where(offs == req, lens, 0))
    else:
        count = 0
        for c in range(0, num_requests + 1, SEARCH):
            i = c + offs
            start = tl.load(query_start_loc_ptr + i, mask=i <= num_requests, other=0)
            count += tl.sum(((start // BLOCK_Q + i <= block_id)
                             & (i <= num_requests)).to(tl.int32))
        req = count - 1
        req_start = tl.load(query_start_loc_ptr + req)
        req_end = tl.load(query_start_loc_ptr + req + 1, mask=req < num_requests, other=0)
        seq_len = tl.load(seq_lens_ptr + req, mask=req < num_requests, other=0)
    return req, req_start, req_end, seq_len


@triton.jit
def _v_rows(rows, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr):
    """Element offsets in the V pool of the pool rows whose K-pool offsets are ``rows``
    (``(slot * Hkv + kv_head) * HEAD_DIM``, the pools contiguous): the same values when V's
    head dim is K's, so that build's code is the one without a V head dim of its own."""
    if HEAD_DIM_V == HEAD_DIM:
        v_rows = rows
    else:
        v_rows = rows // HEAD_DIM * HEAD_DIM_V
    return v_rows


@triton.jit
def _write_new_rows(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, row0, num_rows,
                    kv_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                    stride_cache_row, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
                    HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                    HEAD_DIM_V_PAD: tl.constexpr):
    """Pool rows ``slot_mapping[n]`` (skipped when < 0) <- ``k, v [n, kv_head, :]`` for rows
    ``row0 .. row0 + num_rows``. The k/v loads do not wait for the slots (one round trip).

    Done first: holding the rows in registers until the program's end (to store them last)
    measured the same on the H200 (71.7 against 71.8 us at bs 64) and spilled at 64-row tiles.
    """
    offs_r = tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    rows = (row0 + offs_r).to(tl.int64)  # [BLOCK_Q]
    slot = tl.load(slot_mapping_ptr + rows, mask=offs_r < num_rows, other=-1).to(tl.int64)
    mask = (offs_r < num_rows)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + rows[:, None] * stride_k_tok + kv_head * stride_k_head + offs_d[None, :],
                mask=mask, other=0.0)
    if HEAD_DIM_V == HEAD_DIM:
        v = tl.load(v_ptr + rows[:, None] * stride_v_tok + kv_head * stride_v_head
                    + offs_d[None, :], mask=mask, other=0.0)
        mask = mask & (slot >= 0)[:, None]  # [BLOCK_Q, HEAD_DIM_PAD]
        dst = slot[:, None] * stride_cache_row + kv_head * HEAD_DIM + offs_d[None, :]
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
    else:
        offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
        mask_v = (offs_r < num_rows)[:, None] & (offs_dv < HEAD_DIM_V)[None, :]
        v = tl.load(v_ptr + rows[:, None] * stride_v_tok + kv_head * stride_v_head
                    + offs_dv[None, :], mask=mask_v, other=0.0)
        mask = mask & (slot >= 0)[:, None]  # [BLOCK_Q, HEAD_DIM_PAD]
        mask_v = mask_v & (slot >= 0)[:, None]  # [BLOCK_Q, HEAD_DIM_V_PAD]
        dst = slot * stride_cache_row + kv_head * HEAD_DIM  # [BLOCK_Q] K-pool rows
        tl.store(k_cache_ptr + dst[:, None] + offs_d[None, :],
                 k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + _v_rows(dst, HEAD_DIM, HEAD_DIM_V)[:, None] + offs_dv[None, :],
                 v.to(v_cache_ptr.dtype.element_ty), mask=mask_v)


@triton.jit
def _pool_rows(block_table_row_ptr, pos, mask, kv_head, stride_cache_row,
               PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Element offset ``[TILE_N]`` of (key position ``pos``, ``kv_head``, channel 0) in a pool
    (rows only: the loops form the 2-D offsets at each load)."""
    page = tl.load(block_table_row_ptr + pos // PAGE_SIZE, mask=mask, other=0).to(tl.int64)
    return (page * PAGE_SIZE + pos % PAGE_SIZE) * stride_cache_row + kv_head * HEAD_DIM


@triton.jit
def _kv_tile(k_cache_ptr, v_cache_ptr, rows, key_ok, offs_d, d_mask, offs_dv, dv_mask,
             HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr):
    """K ``[TILE_N, HEAD_DIM_PAD]`` and V ``[TILE_N, HEAD_DIM_V_PAD]`` of pool rows ``rows``
    (K-pool element offsets from :func:`_pool_rows`); keys not ``key_ok`` are zeros and not
    read."""
    mask = key_ok[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :], mask=mask, other=0.0)
    if HEAD_DIM_V == HEAD_DIM:
        v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :], mask=mask, other=0.0)
    else:
        v = tl.load(v_cache_ptr + _v_rows(rows, HEAD_DIM, HEAD_DIM_V)[:, None]
                    + offs_dv[None, :], mask=key_ok[:, None] & dv_mask[None, :], other=0.0)
    return k, v


@triton.jit
def _tanh(x):
    """``tanh(x) = 1 - 2 / (exp(2x) + 1)``: exact limits at +-inf (``exp2`` gives inf or 0),
    NaN stays NaN; one ``exp2`` and no libdevice call, so CUDA and ROCm build it alike. Its
    absolute error is ~1 ulp of 1 (the softcap scales it to ~1e-7 x softcap of a logit)."""
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)  # 2 * log2(e)


@triton.jit
def _bias_tile(rel_ptr, rel_rows, row_ok, qpos, kpos, rel_extent, slopes,
              POS_BIAS: tl.constexpr):
    """A score tile's position bias in the log2 domain. ``POS_BIAS`` bit 1: relative logits
    ``rel[row, h, qpos - kpos]`` where ``0 <= qpos - kpos < rel_extent``, else 0 (``rel_rows
    [BLOCK_M]``: each row's element offset of distance 0); bit 2: ALiBi, ``slopes[row] * (kpos
    - qpos)`` (``slopes [BLOCK_M]`` already in the log2 domain). ``qpos [BLOCK_M]``, ``kpos
    [TILE]``; 0 without either."""
    dist = qpos[:, None] - kpos[None, :]  # [BLOCK_M, TILE]
    if (POS_BIAS & 1) != 0:
        near = (dist >= 0) & (dist < rel_extent) & row_ok[:, None]
        bias = tl.load(rel_ptr + rel_rows[:, None] + dist, mask=near, other=0.0)
        bias = bias.to(tl.float32) * 1.4426950408889634  # log2(e)
        if (POS_BIAS & 2) != 0:
            bias = bias - slopes[:, None] * dist.to(tl.float32)
    elif (POS_BIAS & 2) != 0:
        bias = -slopes[:, None] * dist.to(tl.float32)
    else:
        bias = 0.0
    return bias


@triton.jit
def _softmax_step(q, k, v, s_mask, m_i, l_i, acc, scale_log2, softcap_log2,
                  DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                  bias=0.0, POS_BIAS: tl.constexpr = 0):
    """One online-softmax step over a key tile (scores in the log2 domain, fp32 state).

    ``HAS_SOFTCAP``: ``scale_log2`` is ``scale / softcap`` and ``softcap_log2`` is ``softcap *
    log2(e)``, so the score is ``softcap * tanh(scale * q.k / softcap)`` in the log2 domain,
    capped before the mask (Gemma 2's order). ``POS_BIAS`` (nonzero): ``bias [BLOCK_M, TILE_N]``
    (relative logits and/or ALiBi in the log2 domain, :func:`_bias_tile`) is added after the
    scaling."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, TILE_N]
    if HAS_SOFTCAP:
        s = _tanh(s) * softcap_log2
    if POS_BIAS:
        s = s + bias
    if MASKED:
        s = tl.where(s_mask, s, float("-inf"))  # before the max: hidden keys never count
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: no NaN
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _context_loop(q, k_cache_ptr, v_cache_ptr, bt_row_ptr, t_lo, t_end, context, kv_head,
                  offs_n, offs_d, d_mask, offs_dv, dv_mask, m_i, l_i, acc, scale_log2,
                  softcap_log2, stride_cache_row, rel_ptr, rel_rows, row_ok, qpos, rel_extent,
                  slopes,
                  PAGE_SIZE: tl.constexpr,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, TILE_N: tl.constexpr,
                  UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  HAS_SOFTCAP: tl.constexpr, POS_BIAS: tl.constexpr):
    """Key tiles ``t_lo .. t_end`` of the committed context (keys ``< context``, in the pool).

    Every such key is visible to every row of the q-block (with a window: these are the tiles
    past the band, :func:`_window_band`), so the only mask is ``< context`` (loads and scores):
    pool rows past it are never read. The next tile's page ids are fetched one iteration
    ahead, so the K/V loads depend on a loop-carried offset, not on a load of the same
    iteration: Triton then multi-buffers them (``num_stages - 1`` tiles in flight).
    """
    pos = t_lo * TILE_N + offs_n  # [TILE_N]
    rows = _pool_rows(bt_row_ptr, pos, pos < context, kv_head, stride_cache_row, PAGE_SIZE,
                      HEAD_DIM)
    for t in range(t_lo, t_end):
        key_ok = pos < context
        k, v = _kv_tile(k_cache_ptr, v_cache_ptr, rows, key_ok, offs_d, d_mask, offs_dv,
                        dv_mask, HEAD_DIM, HEAD_DIM_V)
        bias = _bias_tile(rel_ptr, rel_rows, row_ok, qpos, pos, rel_extent, slopes, POS_BIAS)
        pos = (t + 1) * TILE_N + offs_n
        rows = _pool_rows(bt_row_ptr, pos, pos < context, kv_head, stride_cache_row,
                          PAGE_SIZE, HEAD_DIM)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        m_i, l_i, acc = _softmax_step(q, k, v, key_ok[None, :], m_i, l_i, acc, scale_log2,
                                      softcap_log2, DOT_PRECISION, True, HAS_SOFTCAP, bias,
                                      POS_BIAS)
    return m_i, l_i, acc


@triton.jit
def _guarded_step(q, k, v, visible, m_i, l_i, acc, scale_log2, softcap_log2,
                  UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  HAS_SOFTCAP: tl.constexpr, bias=0.0, POS_BIAS: tl.constexpr = 0):
    """A softmax step over keys that some rows see and others do not (``visible [BLOCK_M,
    TILE]``): a non-finite V is zeroed before ``P @ V`` (``0 * NaN`` is NaN) and given back, as
    NaN, only to the rows that see it (the reference gives NaN there, or Inf for an Inf)."""
    bad = ~(tl.abs(v.to(tl.float32)) < float("inf"))  # [TILE, HEAD_DIM_V_PAD] NaN or Inf
    v = tl.where(bad, 0.0, v)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    m_i, l_i, acc = _softmax_step(q, k, v, visible, m_i, l_i, acc, scale_log2, softcap_log2,
                                  DOT_PRECISION, True, HAS_SOFTCAP, bias, POS_BIAS)
    hits = tl.dot(visible.to(tl.float16), bad.to(tl.float16), out_dtype=tl.float32)
    return m_i, l_i, tl.where(hits > 0, float("nan"), acc)


@triton.jit
def _first_key(pos, window, CHUNKED: tl.constexpr):
    """The first key a query at ``pos`` sees: ``pos - window + 1`` (a sliding window; may be
    < 0) or, with ``CHUNKED`` (``window`` then holds the chunk size), ``pos - pos % window``,
    the start of its chunk. Either is nondecreasing along a q-block's rows."""
    if CHUNKED:
        return pos - pos % window
    return pos - window + 1


@triton.jit
def _window_band(q, k_cache_ptr, v_cache_ptr, bt_row_ptr, t_lo, t_end, context, key_lo, row_lo,
                 kv_head, offs_n, offs_d, d_mask, offs_dv, dv_mask, m_i, l_i, acc, scale_log2,
                 softcap_log2, stride_cache_row, rel_ptr, rel_rows, row_ok, qpos, rel_extent,
                 slopes,
                 PAGE_SIZE: tl.constexpr,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, TILE_N: tl.constexpr,
                 UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 HAS_SOFTCAP: tl.constexpr, POS_BIAS: tl.constexpr):
    """Context tiles ``t_lo .. t_end`` of a windowed q-block's band: keys the first row's window
    reaches but a later row's does not (``row_lo [BLOCK_M]``: each row's first key). Keys below
    ``key_lo`` (the first row's) are not read, nor their page ids; at verify widths the band is
    one or two tiles, so these loads are not pipelined."""
    for t in range(t_lo, t_end):
        pos = t * TILE_N + offs_n  # [TILE_N]
        key_ok = (pos < context) & (pos >= key_lo)
        rows = _pool_rows(bt_row_ptr, pos, key_ok, kv_head, stride_cache_row, PAGE_SIZE,
                          HEAD_DIM)
        k, v = _kv_tile(k_cache_ptr, v_cache_ptr, rows, key_ok, offs_d, d_mask, offs_dv,
                        dv_mask, HEAD_DIM, HEAD_DIM_V)
        visible = key_ok[None, :] & (pos[None, :] >= row_lo[:, None])
        bias = _bias_tile(rel_ptr, rel_rows, row_ok, qpos, pos, rel_extent, slopes, POS_BIAS)
        m_i, l_i, acc = _guarded_step(q, k, v, visible, m_i, l_i, acc, scale_log2,
                                      softcap_log2, UPCAST, DOT_PRECISION, HAS_SOFTCAP, bias,
                                      POS_BIAS)
    return m_i, l_i, acc


@triton.jit
def _new_keys_step(q, k_ptr, v_ptr, cache_ty: tl.constexpr, row0, e0, n_keys, q_own,
                   kv_head, offs_e, offs_d, d_mask, offs_dv, dv_mask, m_i, l_i, acc,
                   scale_log2, softcap_log2, window, context, stride_k_tok, stride_k_head,
                   stride_v_tok, stride_v_head, rel_ptr, rel_rows, row_ok, qpos, rel_extent, slopes,
                   UPCAST: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   HAS_SOFTCAP: tl.constexpr, CHUNKED: tl.constexpr, POS_BIAS: tl.constexpr):
    """The request's own new keys ``e0 ..`` (rows ``row0 + e`` of ``k``/``v``), causal.

    Read from the inputs rather than the pool (no program reads a pool row written in this
    launch), cast to the pool's dtype as the pool would hold them. Row ``r`` sees new key ``e``
    iff ``e <= q_own[r]`` (and, with a window, ``e > q_own[r] - window``; with chunks, key
    position ``context + e`` at or past the start of the row's chunk); V is guarded
    (:func:`_guarded_step`).
    """
    e = e0 + offs_e  # [NEW_N]
    rows = (row0 + e).to(tl.int64)
    mask = (e < n_keys)[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + rows[:, None] * stride_k_tok + kv_head * stride_k_head
                + offs_d[None, :], mask=mask, other=0.0).to(cache_ty)
    v = tl.load(v_ptr + rows[:, None] * stride_v_tok + kv_head * stride_v_head
                + offs_dv[None, :], mask=(e < n_keys)[:, None] & dv_mask[None, :],
                other=0.0).to(cache_ty)
    # _guarded_step's body, with the mask made after the upcast: the plain build's code order
    bad = ~(tl.abs(v.to(tl.float32)) < float("inf"))  # [NEW_N, HEAD_DIM_V_PAD] NaN or Inf
    v = tl.where(bad, 0.0, v)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    visible = (e[None, :] <= q_own[:, None]) & (e < n_keys)[None, :]  # [BLOCK_M, NEW_N]
    if HAS_WINDOW:  # key position context + e at or past the row's first key
        visible = visible & (context + e[None, :] >= _first_key(context + q_own[:, None],
                                                                 window, CHUNKED))
    bias = _bias_tile(rel_ptr, rel_rows, row_ok, qpos, context + e, rel_extent, slopes,
                      POS_BIAS)
    m_i, l_i, acc = _softmax_step(q, k, v, visible, m_i, l_i, acc, scale_log2, softcap_log2,
                                  DOT_PRECISION, True, HAS_SOFTCAP, bias, POS_BIAS)
    hits = tl.dot(visible.to(tl.float16), bad.to(tl.float16), out_dtype=tl.float32)
    return m_i, l_i, tl.where(hits > 0, float("nan"), acc)


@triton.jit
def _split_units(context, q0, n_q, split, num_splits, window, TILE_N: tl.constexpr,
                 NEW_N: tl.constexpr, HAS_WINDOW: tl.constexpr, CHUNKED: tl.constexpr):
    """This split's share of a q-block's keys: work units ``u_lo .. u_hi`` (context tiles of
    TILE_N keys ``0 .. n_ctx``, then new-key tiles of NEW_N keys; the block's last query sees
    ``q0 + n_q`` new keys), equal runs of units per split, and ``e_skip``.

    With a window, the tiles wholly below the block's first query's window are no units: the
    context's start at unit ``c_skip`` (units count from there), and unit ``n_ctx + j`` is
    new-key tile ``e_skip + j``. Without, ``c_skip = e_skip = 0``."""
    n_ctx = tl.cdiv(context, TILE_N)
    units = n_ctx + tl.cdiv(q0 + n_q, NEW_N)
    if HAS_WINDOW:
        key_lo = _first_key(context + q0, window, CHUNKED)  # the block's first query's (< 0 ok)
        c_skip = tl.where(key_lo >= context, n_ctx, tl.maximum(key_lo, 0) // TILE_N)
        e_skip = tl.maximum(key_lo - context, 0) // NEW_N
        units = units - c_skip - e_skip
        u_lo = c_skip + split * units // num_splits
        u_hi = c_skip + (split + 1) * units // num_splits
    else:
        e_skip = 0
        u_lo = split * units // num_splits
        u_hi = (split + 1) * units // num_splits
    return n_ctx, u_lo, u_hi, e_skip


@triton.jit
def _first_tile(k_cache_ptr, v_cache_ptr, bt_row_ptr, context, key_lo, u_lo, u_hi, n_ctx,
                kv_head, offs_d, d_mask, offs_dv, dv_mask, stride_cache_row,
                PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                TILE_N: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """K, V and key mask of the split's first context tile (all masked when its run holds
    none; with a window, keys below ``key_lo`` too). It reads only what the launch before this
    one does not write (the request's block-table row and committed pool rows), so with
    ``EARLY`` it is loaded before the PDL wait (:func:`_ragged_attention_kernel`)."""
    pos = u_lo * TILE_N + tl.arange(0, TILE_N)
    key_ok = (pos < context) & (pos < tl.minimum(u_hi, n_ctx) * TILE_N)  # in the run
    if HAS_WINDOW:
        key_ok = key_ok & (pos >= key_lo)
    rows = _pool_rows(bt_row_ptr, pos, key_ok, kv_head, stride_cache_row, PAGE_SIZE, HEAD_DIM)
    k, v = _kv_tile(k_cache_ptr, v_cache_ptr, rows, key_ok, offs_d, d_mask, offs_dv, dv_mask,
                    HEAD_DIM, HEAD_DIM_V)
    return k, v, key_ok


@triton.jit
def _attend(q, k0, v0, key_ok0, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, bt_row_ptr, context,
            key_lo, req_start, q0, n_q, q_idx, kv_head, n_ctx, u_lo, u_hi, e_skip, offs_d,
            d_mask, offs_dv, dv_mask, m_i, l_i, acc, scale_log2, softcap_log2, window,
            stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_cache_row,
            rel_ptr, rel_rows, row_ok, rel_extent, slopes,
            PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
            TILE_N: tl.constexpr, NEW_N: tl.constexpr, UPCAST: tl.constexpr,
            DOT_PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
            CHUNKED: tl.constexpr, POS_BIAS: tl.constexpr):
    """This split's units ``u_lo .. u_hi`` (:func:`_split_units`): the first context tile,
    already loaded (``k0``, ``v0``, ``key_ok0``: :func:`_first_tile`; an all-masked tile
    leaves the state as it was), the rest of the context, then the new keys.

    With a window, row ``r`` sees keys from its first key (:func:`_first_key`: ``key_lo +
    q_idx[r]`` for a sliding window, its chunk's start with chunks): the first tile and the band (tiles below the last row's
    first key) take per-row masks and guarded V (:func:`_window_band`); the tiles after the
    band are today's loop."""
    offs_n = tl.arange(0, TILE_N)
    t_end = tl.minimum(u_hi, n_ctx)
    qpos = context + q0 + q_idx  # [BLOCK_M] each row's position (the relative logits')
    bias0 = _bias_tile(rel_ptr, rel_rows, row_ok, qpos, u_lo * TILE_N + offs_n, rel_extent,
                      slopes, POS_BIAS)
    if HAS_WINDOW:
        row_lo = _first_key(context + q0 + q_idx, window, CHUNKED)  # [BLOCK_M]
        last_lo = _first_key(context + q0 + n_q - 1, window, CHUNKED)  # the last row's
        pos0 = u_lo * TILE_N + offs_n
        visible0 = key_ok0[None, :] & (pos0[None, :] >= row_lo[:, None])
        m_i, l_i, acc = _guarded_step(q, k0, v0, visible0, m_i, l_i, acc, scale_log2,
                                      softcap_log2, UPCAST, DOT_PRECISION, HAS_SOFTCAP, bias0,
                                      POS_BIAS)
        band_end = tl.cdiv(tl.maximum(last_lo, 0), TILE_N)
        m_i, l_i, acc = _window_band(q, k_cache_ptr, v_cache_ptr, bt_row_ptr, u_lo + 1,
                                     tl.minimum(t_end, band_end), context, key_lo, row_lo,
                                     kv_head, offs_n, offs_d, d_mask, offs_dv, dv_mask, m_i,
                                     l_i, acc, scale_log2, softcap_log2, stride_cache_row,
                                     rel_ptr, rel_rows, row_ok, qpos, rel_extent, slopes,
                                     PAGE_SIZE, HEAD_DIM, HEAD_DIM_V, TILE_N, UPCAST,
                                     DOT_PRECISION, HAS_SOFTCAP, POS_BIAS)
        t_lo = tl.maximum(u_lo + 1, band_end)
    else:
        if UPCAST:
            k0 = k0.to(tl.float32)
            v0 = v0.to(tl.float32)
        m_i, l_i, acc = _softmax_step(q, k0, v0, key_ok0[None, :], m_i, l_i, acc, scale_log2,
                                      softcap_log2, DOT_PRECISION, True, HAS_SOFTCAP, bias0,
                                      POS_BIAS)
        t_lo = u_lo + 1
    m_i, l_i, acc = _context_loop(q, k_cache_ptr, v_cache_ptr, bt_row_ptr, t_lo, t_end,
                                  context, kv_head, offs_n, offs_d, d_mask, offs_dv, dv_mask,
                                  m_i, l_i, acc, scale_log2, softcap_log2, stride_cache_row,
                                  rel_ptr, rel_rows, row_ok, qpos, rel_extent, slopes,
                                  PAGE_SIZE, HEAD_DIM, HEAD_DIM_V, TILE_N, UPCAST,
                                  DOT_PRECISION, HAS_SOFTCAP, POS_BIAS)
    for u in range(tl.maximum(u_lo, n_ctx), u_hi):
        if HAS_WINDOW:
            e0 = (u - n_ctx + e_skip) * NEW_N
        else:
            e0 = (u - n_ctx) * NEW_N
        m_i, l_i, acc = _new_keys_step(
            q, k_ptr, v_ptr, k_cache_ptr.dtype.element_ty, req_start, e0, q0 + n_q,
            q0 + q_idx, kv_head, tl.arange(0, NEW_N), offs_d, d_mask, offs_dv, dv_mask, m_i,
            l_i, acc, scale_log2, softcap_log2, window, context, stride_k_tok, stride_k_head,
            stride_v_tok, stride_v_head, rel_ptr, rel_rows, row_ok, qpos, rel_extent, slopes,
            UPCAST,
            DOT_PRECISION, HAS_WINDOW, HAS_SOFTCAP, CHUNKED, POS_BIAS)
    return m_i, l_i, acc


@triton.jit
def _store_rows(out_ptr, part_acc_ptr, part_ml_ptr, acc, m_i, l_i, tokens, heads, row_ok,
                offs_d, d_mask, split, num_tokens, stride_out_tok, stride_out_head,
                NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr):
    """Final rows (``acc / l`` in the output dtype) or, when split, fp32 partials."""
    mask = row_ok[:, None] & d_mask[None, :]
    if not SPLIT:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        ptrs = out_ptr + tokens[:, None] * stride_out_tok + heads[:, None] * stride_out_head
        tl.store(ptrs + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        row = (split * num_tokens + tokens) * NUM_HEADS + heads  # [BLOCK_M] in [S, N, H]
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=mask)
        tl.store(part_ml_ptr + row * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _merge_splits(out_ptr, part_acc_ptr, part_ml_ptr, tokens, heads, row_ok, offs_d, d_mask,
                  num_splits, num_tokens, stride_out_tok, stride_out_head,
                  NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                  HEAD_DIM_PAD: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """Final rows of a q-block from the fp32 partials of its ``num_splits`` programs.

    Run by the program that finished last (folded) or by the reduce kernel, one token row at a
    time (``tokens`` all equal, ``heads`` 0..H-1). Every partial is loaded at once (``MAX_SPLITS``
    unrolled, masked: one round trip, not one per split) and past L1 (``.cg``): other
    programs wrote them from other multiprocessors.
    """
    offs_s = tl.arange(0, MAX_SPLITS)
    s_ok = offs_s < num_splits
    rows = (offs_s[:, None] * num_tokens + tokens[None, :]) * NUM_HEADS + heads[None, :]
    ml_mask = s_ok[:, None] & row_ok[None, :]  # [MAX_SPLITS, BLOCK_M]
    m_all = tl.load(part_ml_ptr + rows * 2, mask=ml_mask, other=float("-inf"),
                    cache_modifier=".cg")
    l_all = tl.load(part_ml_ptr + rows * 2 + 1, mask=ml_mask, other=0.0, cache_modifier=".cg")
    m_max = tl.max(m_all, 0)  # [BLOCK_M]
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    w_all = tl.exp2(m_all - m_use[None, :])  # 0 for a split that saw no key
    l_sum = tl.sum(w_all * l_all, 0)
    mask = row_ok[:, None] & d_mask[None, :]
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for s in tl.static_range(MAX_SPLITS):
        row = (s * num_tokens + tokens) * NUM_HEADS + heads  # [BLOCK_M]
        live = (row_ok & (tl.zeros_like(heads) + s < num_splits))[:, None] & d_mask[None, :]
        part = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=live,
                       other=0.0, cache_modifier=".cg")
        w = tl.sum(tl.where(offs_s[:, None] == s, w_all, 0.0), 0)  # [BLOCK_M]
        acc += w[:, None] * part
    out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    ptrs = out_ptr + tokens[:, None] * stride_out_tok + heads[:, None] * stride_out_head
    tl.store(ptrs + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_tokens", "num_requests", "num_splits", "window",
                             "rel_extent"])
def _ragged_attention_kernel(
        out_ptr, part_acc_ptr, part_ml_ptr, counter_ptr, q_ptr, k_ptr, v_ptr, k_cache_ptr,
        v_cache_ptr, query_start_loc_ptr, seq_lens_ptr, block_table_ptr, slot_mapping_ptr,
        sinks_ptr, rel_ptr, alibi_ptr, scale_log2, softcap_log2, window, rel_extent,
        stride_rel_tok,
        stride_rel_head, stride_sink_tok,
        num_tokens, num_requests, num_splits, stride_q_tok, stride_q_head, stride_k_tok,
        stride_k_head,
        stride_v_tok, stride_v_head, stride_out_tok, stride_out_head, stride_bt_req,
        stride_cache_row, NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
        PAGE_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        TILE_N: tl.constexpr, NEW_N: tl.constexpr, SEARCH: tl.constexpr,
        SEARCH_ONCE: tl.constexpr, SPLIT: tl.constexpr, FOLD: tl.constexpr,
        MAX_SPLITS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
        EARLY: tl.constexpr, PDL: tl.constexpr, HAS_WINDOW: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, CHUNKED: tl.constexpr,
        POS_BIAS: tl.constexpr):
    """One (q-block, KV head, split): fused KV write, then attention over the paged context.

    ``FOLD`` (with ``SPLIT``): the last of a q-block's programs to finish merges the partials
    (:func:`_merge_splits`), so there is no reduce launch. It is found with a counter per
    (q-block, KV head) in ``counter_ptr``, which it sets back to 0 for the next launch.
    ``PDL``: launched with programmatic dependent launch (``kernels/pdl.py``). ``EARLY``: the
    request lookup, the block-table row and the first context tile's K/V are read before the
    PDL wait, so that chain of dependent loads runs while the launch before this one finishes;
    the caller vouches that that launch writes none of them (``ragged_attention_triton``).

    Semantics switches (all off: the plain causal build, its code unchanged): ``HAS_WINDOW``
    (a query at ``p`` sees keys ``p - window < kpos <= p``; tiles below the block's first
    window are no work units; with ``CHUNKED`` it sees ``p - p % window <= kpos <= p``, its
    chunk, ``window`` holding the chunk size), ``HAS_SOFTCAP`` (:func:`_softmax_step`), ``HAS_SINKS``
    (``sinks_ptr [H]``, or ``[N, H]`` with ``stride_sink_tok`` (0 for ``[H]``), any float dtype:
    split 0 starts each row's online softmax from the sink logit, ``m = sink``, ``l = 1``, so the merge of partials counts it exactly once).
    ``POS_BIAS`` bit 1 (``rel_ptr [N, H, rel_extent]``, any float dtype, last dim dense: each
    score gains its row's logit of the key's distance), bit 2 (``alibi_ptr [H]``: each score
    gains its head's slope times ``kpos - qpos``), :func:`_bias_tile`.
    ``HEAD_DIM_V`` may differ from ``HEAD_DIM`` (q/k): acc, partials and out have V's.
    """
    if not EARLY:
        pdl_enter(PDL)
    block_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req, req_start, req_end, seq_len = _find_request(query_start_loc_ptr, seq_lens_ptr,
                                                     block_id, num_requests, BLOCK_Q, SEARCH,
                                                     SEARCH_ONCE)
    is_pad = req >= num_requests
    req_len = tl.where(is_pad, num_tokens - req_start, req_end - req_start)
    q0 = (block_id - (req_start // BLOCK_Q + req)) * BLOCK_Q  # first own query of the block
    if q0 >= req_len:  # nothing to write, so it may leave before the wait: a launch (N > 0)
        return  # always has a program with rows, which waits before letting the next start
    n_q = tl.minimum(req_len - q0, BLOCK_Q)
    context = tl.where(is_pad, 0, seq_len - req_len)
    bt_row_ptr = block_table_ptr + tl.where(is_pad, 0, req).to(tl.int64) * stride_bt_req
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    if HEAD_DIM_V == HEAD_DIM:
        offs_dv = offs_d
        dv_mask = d_mask
    else:
        offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
        dv_mask = offs_dv < HEAD_DIM_V
    n_ctx, u_lo, u_hi, e_skip = _split_units(context, q0, n_q, split, num_splits, window,
                                             TILE_N, NEW_N, HAS_WINDOW, CHUNKED)
    key_lo = _first_key(context + q0, window, CHUNKED)  # the block's first query's (window)
    k0, v0, key_ok0 = _first_tile(k_cache_ptr, v_cache_ptr, bt_row_ptr, context, key_lo, u_lo,
                                  u_hi, n_ctx, kv_head, offs_d, d_mask, offs_dv, dv_mask,
                                  stride_cache_row, PAGE_SIZE, HEAD_DIM, HEAD_DIM_V, TILE_N,
                                  HAS_WINDOW)
    if EARLY:
        pdl_enter(PDL)
    # split 0 writes the block's rows into the pool (the others touch nothing: 0 rows). Done
    # last instead measured the same at bs 1 and 8 (9.2-9.5 against 9.2 us, folded splits).
    _write_new_rows(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, req_start + q0,
                    tl.where(split == 0, n_q, 0), kv_head, stride_k_tok, stride_k_head,
                    stride_v_tok, stride_v_head, stride_cache_row, BLOCK_Q, HEAD_DIM,
                    HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD)
    offs_m = tl.arange(0, BLOCK_M)  # row r: query r // GROUP_PAD, head r % GROUP_PAD
    q_idx = offs_m // GROUP_PAD
    row_ok = (q_idx < n_q) & (offs_m % GROUP_PAD < GROUP)  # [BLOCK_M]
    tokens = (req_start + q0 + q_idx).to(tl.int64)
    heads = kv_head * GROUP + offs_m % GROUP_PAD
    rel_rows = tokens * stride_rel_tok + heads * stride_rel_head  # POS_BIAS bit 1 only
    if (POS_BIAS & 2) != 0:  # ALiBi: each row's head's slope, in the log2 domain
        slopes = tl.load(alibi_ptr + heads, mask=row_ok, other=0.0).to(tl.float32)
        slopes = slopes * 1.4426950408889634
    else:
        slopes = 0.0
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V_PAD], tl.float32)
    if is_pad:  # padding rows: zeros (the reduce writes them when split and not folded)
        if not SPLIT or (FOLD and split == 0):
            _store_rows(out_ptr, part_acc_ptr, part_ml_ptr, acc, m_i, l_i, tokens, heads,
                        row_ok, offs_dv, dv_mask, split, num_tokens, stride_out_tok,
                        stride_out_head, NUM_HEADS, HEAD_DIM_V, False)
        return
    q = tl.load(q_ptr + tokens[:, None] * stride_q_tok + heads[:, None] * stride_q_head
                + offs_d[None, :], mask=row_ok[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    if HAS_SINKS:  # the sink logit (natural units) in the log2 domain, counted by split 0 only
        sink = tl.load(sinks_ptr + tokens * stride_sink_tok + heads, mask=row_ok,
                       other=0.0).to(tl.float32)
        sink = sink * 1.4426950408889634  # log2(e)
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    m_i, l_i, acc = _attend(q, k0, v0, key_ok0, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr,
                            bt_row_ptr, context, key_lo, req_start, q0, n_q, q_idx, kv_head,
                            n_ctx, u_lo, u_hi, e_skip, offs_d, d_mask, offs_dv, dv_mask, m_i,
                            l_i, acc, scale_log2, softcap_log2, window, stride_k_tok,
                            stride_k_head, stride_v_tok, stride_v_head, stride_cache_row,
                            rel_ptr, rel_rows, row_ok, rel_extent, slopes,
                            PAGE_SIZE, HEAD_DIM, HEAD_DIM_V, TILE_N, NEW_N, UPCAST,
                            DOT_PRECISION, HAS_WINDOW, HAS_SOFTCAP, CHUNKED, POS_BIAS)
    _store_rows(out_ptr, part_acc_ptr, part_ml_ptr, acc, m_i, l_i, tokens, heads, row_ok,
                offs_dv, dv_mask, split, num_tokens, stride_out_tok, stride_out_head,
                NUM_HEADS, HEAD_DIM_V, SPLIT)
    if SPLIT and FOLD:
        tl.debug_barrier()  # every thread's partial stores are issued before the release
        counter = counter_ptr + block_id * tl.num_programs(1) + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel") == num_splits - 1:
            tl.store(counter, 0)  # the last one: reset for the next launch, then merge
            _merge_splits(out_ptr, part_acc_ptr, part_ml_ptr, tokens, heads, row_ok, offs_dv,
                          dv_mask, num_splits, num_tokens, stride_out_tok, stride_out_head,
                          NUM_HEADS, HEAD_DIM_V, BLOCK_M, HEAD_DIM_V_PAD, MAX_SPLITS)


@triton.jit(do_not_specialize=["num_tokens", "num_requests", "num_splits"])
def _split_reduce_kernel(out_ptr, part_acc_ptr, part_ml_ptr, query_start_loc_ptr, num_tokens,
                         num_requests, num_splits, stride_out_tok, stride_out_head,
                         NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                         HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                         MAX_SPLITS: tl.constexpr, PDL: tl.constexpr):
    """Merge the split partials of one token row ``[H, D]`` (:func:`_merge_splits`, as a
    folded launch does for its q-block); padding rows become zeros."""
    pdl_enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    tokens = token + tl.zeros([HEADS_PAD], tl.int64)
    if token >= tl.load(query_start_loc_ptr + num_requests):
        mask = (offs_h < NUM_HEADS)[:, None] & d_mask[None, :]
        out_ptrs = (out_ptr + token * stride_out_tok + offs_h[:, None] * stride_out_head
                    + offs_d[None, :])  # [HEADS_PAD, HEAD_DIM_PAD]
        tl.store(out_ptrs, tl.zeros([HEADS_PAD, HEAD_DIM_PAD], out_ptr.dtype.element_ty),
                 mask=mask)
        return
    _merge_splits(out_ptr, part_acc_ptr, part_ml_ptr, tokens, offs_h, offs_h < NUM_HEADS,
                  offs_d, d_mask, num_splits, num_tokens, stride_out_tok, stride_out_head,
                  NUM_HEADS, HEAD_DIM, HEADS_PAD, HEAD_DIM_PAD, MAX_SPLITS)


@dataclass(frozen=True)
class AttentionPlan:
    """Tiles, split count and grid of one launch, derived from shapes and a target only.

    ``block_q`` query tokens x ``group_pad`` (query heads per KV head, a power of two) =
    ``block_m`` rows per program; ``tile_n`` keys per step over the paged context, ``new_n``
    per step over a request's own new keys; ``search`` ``query_start_loc`` entries per load
    when a program looks up its request; ``num_splits`` programs share a q-block's keys (1: no
    reduce kernel); ``grid = (N // block_q + R + 1, Hkv, num_splits)``; ``num_warps``,
    ``max_registers`` (``maxnreg``, None: the compiler's choice) and ``num_stages`` of the
    attention kernel.
    """

    block_q: int
    group_pad: int
    block_m: int
    tile_n: int
    new_n: int
    search: int
    num_splits: int
    grid: tuple[int, int, int]
    num_warps: int
    max_registers: int | None
    num_stages: int


def attention_smem(block_m: int, tile_n: int, stages: int, head_dim_pad: int,
                   elem_bytes: int) -> int:
    """Bytes of shared memory ``plan_attention`` counts for one program: ``stages`` K and V
    tiles of ``tile_n`` keys (both at the wider padded head dim), the Q tile, and the
    probabilities tile."""
    return elem_bytes * (2 * stages * tile_n * head_dim_pad + block_m * head_dim_pad
                         + block_m * tile_n)


def fit_tiles(block_m: int, tile_n: int, stages: int, head_dim_pad: int, elem_bytes: int,
              budget: int) -> tuple[int, int]:
    """``(tile_n, stages)`` whose :func:`attention_smem` fits ``budget``: fewer stages (down to
    2), then narrower tiles (down to 16), then one stage; ``ValueError`` naming the shapes when
    even 16 keys in one stage do not fit."""
    while attention_smem(block_m, tile_n, stages, head_dim_pad, elem_bytes) > budget:
        if stages > 2:
            stages -= 1
        elif tile_n > 16:
            tile_n //= 2
        elif stages > 1:
            stages -= 1
        else:
            raise ValueError(
                f"ragged_attention_triton: a program of {block_m} rows (query tokens x heads per "
                f"KV head) at head dim {head_dim_pad} in {elem_bytes}-byte elements needs "
                f"{attention_smem(block_m, 16, 1, head_dim_pad, elem_bytes)} bytes of shared "
                f"memory with 16 keys in one stage; the target allows {budget}")
    return tile_n, stages


def head_dim_pad(head_dim: int) -> int:
    """Head dim as the kernels tile it: a power of two, at least 16 (``tl.dot`` needs K >= 16
    on a GPU; the interpreter does not check it)."""
    return max(16, triton.next_power_of_2(head_dim))


_COUNTER_SLOTS = 1 << 14
"""Entries of a split-merge counter buffer: (q-blocks x KV heads) of one split launch. A split
only runs when those programs are too few to fill the GPU (``plan_attention``), so a launch
needs a few hundred; 64 KB a buffer."""
_counter_buffers: dict[tuple, torch.Tensor] = {}
_counter_fallbacks_logged: set[str] = set()


def split_counters(device: torch.device, needed: int,
              fallback: str = "ragged_attention_triton: {why}; this launch merges its splits "
                              "in a separate reduce kernel") -> torch.Tensor | None:
    """The zeroed int32 counters a folded split launch on ``device`` and the current stream
    uses (None: too many tiles, or no buffer yet inside a capture; the caller then takes its
    other path, and ``fallback`` (formatted with ``why``) is logged once).

    Every folded launch leaves its counters at 0 (the last program of each q-block resets
    its own), so one buffer serves every launch of one stream in turn, CUDA-graph replays
    included, and is allocated once (zeros, outside any capture: the first call, which
    ``TierGraphs`` makes before capturing). Launches that may run at the same time must come
    from different streams. Buffers are never freed: captured graphs hold their address.
    """
    cuda = device.type == "cuda"
    key = (device, torch.cuda.current_stream(device).cuda_stream if cuda else 0)
    buf = _counter_buffers.get(key)
    why = None
    if needed > _COUNTER_SLOTS:
        why = f"{needed} counters needed, {_COUNTER_SLOTS} held"
    elif buf is None and cuda and torch.cuda.is_current_stream_capturing():
        why = "first split launch of this stream is inside a CUDA-graph capture"
    if why is not None:
        line = fallback.format(why=why)
        if line not in _counter_fallbacks_logged:
            log.info("%s", line)
            _counter_fallbacks_logged.add(line)
        return None
    if buf is None:
        buf = _counter_buffers[key] = torch.zeros(_COUNTER_SLOTS, dtype=torch.int32,
                                                  device=device)
    return buf


def _max_splits(num_splits: int) -> int:
    """Partials a merge loads (unrolled, the surplus masked): 8 covers every split count the
    rule gives a verify step, so a tier set compiles one variant, not one per power of two
    (~1 s of capture each)."""
    return max(8, triton.next_power_of_2(num_splits))


@functools.lru_cache(maxsize=1024)  # a pure function of ints: ~10 us of Python per call saved
def plan_attention(num_tokens: int, num_requests: int, num_heads: int, num_kv_heads: int,
                   max_keys: int, max_query_len: int, cfg: TargetConfig, sm_count: int,
                   num_splits: int | None = None, window: int = 0,
                   head_dim_pad: int = 128, elem_bytes: int = 2) -> AttentionPlan:
    """Choose tiles and the split count from host ints (no device value is read).

    ``BLOCK_Q`` covers ``max_query_len`` (a verify block is one tile, so its KV is read once
    per KV head) within ``cfg.attn_max_block_m`` rows, and at least 16 rows (``tl.dot``).
    Split rule: when the programs that have work, ``min(R, N) * ceil(max_query_len / BLOCK_Q)
    * Hkv``, are fewer than ``cfg.split_waves * sm_count``, split each q-block's keys into
    enough parts to reach that, rounded up to a power of two, at most ``cfg.split_max`` and at
    least ``cfg.split_min_keys`` keys (``max_keys``: the block table's width in tokens) per
    part. At 16/8 heads on an H200
    (132 SMs) this splits bs 1 and 8 and leaves bs >= 64 whole. With a ``window`` (> 0) a
    q-block reads at most ``window + BLOCK_Q - 1`` keys, and those are what the rule splits: a
    windowed layer at a long context plans like a short one. ``head_dim_pad``: the wider of
    q/k's and v's padded head dims (:func:`head_dim_pad`). Past 128, the key tile and the
    pipeline's stages are cut until :func:`attention_smem` fits ``cfg.attn_max_smem``
    (``elem_bytes``: the KV pool's element size): at 64 heads on one KV head of 512 in bf16,
    the table's 32 keys x 3 stages asked 320 KB of the H200's 227 (triton 3.6).
    """
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    block_m = max(16, group_pad, min(triton.next_power_of_2(max_query_len) * group_pad,
                                     cfg.attn_max_block_m))
    block_q = block_m // group_pad
    if num_splits is None:
        busy = max(1, min(num_requests, num_tokens)) * num_kv_heads * -(-max_query_len // block_q)
        keys = min(max_keys, window + block_q - 1) if window > 0 else max_keys
        most = max(1, min(cfg.split_max, keys // cfg.split_min_keys))
        # a power of two: a power-of-two context splits into whole tiles (1024 keys in 5 parts
        # do not), and 8 splits at bs 8 measured 16.4 us against 17.5 for 5 (targets.py)
        num_splits = min(most, triton.next_power_of_2(
            max(1, -(-cfg.split_waves * sm_count // busy))))
    grid = (num_tokens // block_q + num_requests + 1, num_kv_heads, num_splits)
    new_n = max(16, min(cfg.attn_tile_n, triton.next_power_of_2(block_q)))
    search = next((b for b in _SEARCH_BUCKETS if b < cfg.search_chunk and num_requests < b),
                  cfg.search_chunk)
    # The table's warps and register cap are for 16-row (verify) tiles; wider tiles get more
    # warps and no cap: at 32/64 rows a 128-register cap spilled 16-672 B a thread (ptxas,
    # triton 3.6), and 64 rows on 4 warps took 255 registers and spilled anyway. Head dims past
    # 128 get no cap either: at 16 rows under 128 registers, Dk 192 / Dv 128 spilled 64 B and
    # 256 / 256 276 B a thread (ptxas sm_90, triton 3.9); uncapped, 218 and 246 registers, no
    # spill. Nothing changes at head dims up to 128.
    num_warps = cfg.attn_num_warps * max(1, block_m // 32)
    max_registers = cfg.attn_max_registers if block_m <= 16 and head_dim_pad <= 128 else None
    tile_n, stages = cfg.attn_tile_n, cfg.attn_num_stages
    if head_dim_pad > 128:
        tile_n, stages = fit_tiles(block_m, tile_n, stages, head_dim_pad, elem_bytes,
                                   cfg.attn_max_smem)
        new_n = min(new_n, tile_n)
    return AttentionPlan(block_q, group_pad, block_m, tile_n, new_n, search,
                         num_splits, grid, num_warps, max_registers, stages)


_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INTS = (torch.int32, torch.int64)
_ARG_RULES = (("q", 3, _FLOATS), ("k", 3, _FLOATS), ("v", 3, _FLOATS), ("k_cache", 4, _FLOATS),
              ("v_cache", 4, _FLOATS), ("query_start_loc", 1, _INTS), ("seq_lens", 1, _INTS),
              ("block_table", 2, _INTS), ("slot_mapping", 1, _INTS), ("out", 3, _FLOATS))


class _Invalid(ValueError):
    """A broken rule of :func:`_check_inputs`, named with the op by its caller."""


def _fail(msg: str) -> None:
    raise _Invalid(msg)


def _check_inputs(tensors: tuple, max_query_len, window, softcap, sinks, chunk=0,
                  op: str = "ragged_attention_triton", row_sinks: bool = False) -> None:
    """Raise ``ValueError`` naming ``op``, the argument, its value and the rule it breaks.

    ``tensors``: the ragged attention's tensor arguments in order, then ``out`` (None:
    allocated); ``sparse_attention_triton`` takes the same ones. ``row_sinks``: sinks may also
    be ``[N, H]``. Messages are formatted only on failure: this runs on every call.
    """
    try:
        _check_tensors(tensors, max_query_len, window, softcap, sinks, chunk, op, row_sinks)
    except _Invalid as err:
        raise ValueError(f"{op}: {err}") from None


def _check_tensors(tensors: tuple, max_query_len, window, softcap, sinks, chunk, op,
                   row_sinks: bool = False) -> None:
    device = tensors[0].device if isinstance(tensors[0], torch.Tensor) else None
    for (name, dims, dtypes), t in zip(_ARG_RULES, tensors):
        if name == "out" and t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dim() != dims or t.dtype not in dtypes:
            _fail(f"{name} is {getattr(t, 'dtype', type(t).__name__)} of shape "
                  f"{tuple(getattr(t, 'shape', ()))}; it must be a {dims}-D tensor of {dtypes}")
        if t.device != device:
            _fail(f"{name} is on {t.device} but q is on {device}; move every argument there")
    _check_shapes(*tensors)
    if max_query_len is not None and (type(max_query_len) is not int or max_query_len < 1):
        _fail(f"max_query_len={max_query_len!r}; it must be None or a python int >= 1")
    check_semantics(op, window, softcap, sinks, tensors[0].shape[1], device, chunk=chunk,
                    row_sinks=tuple(tensors[0].shape[:2]) if row_sinks else None)
    if sinks is not None and sinks.stride(-1) != 1:
        _fail(f"sinks has stride {sinks.stride(-1)} in its last dim; it must be 1")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        _fail("CPU tensors need TRITON_INTERPRET=1 set before triton kernels are imported; "
              "for the CPU path call dspark_compile.ops.attention_reference.ragged_attention")


def _check_shapes(q, k, v, k_cache, v_cache, query_start_loc, seq_lens, block_table,
                  slot_mapping, out) -> None:
    """Head counts and dims of q/k/v, pools and out agree (Dk from q, Dv from v); the
    metadata describes R requests of N rows."""
    (n, h, d), (pages, page_size, hkv, dc), r = q.shape, k_cache.shape, \
        query_start_loc.shape[0] - 1
    dv = v.shape[2]
    if k.shape != (n, hkv, d) or v.shape[:2] != (n, hkv):
        _fail(f"k {tuple(k.shape)} must be [N, Hkv, Dk] = {(n, hkv, d)} and v {tuple(v.shape)} "
              f"[N, Hkv, Dv] = {(n, hkv, 'Dv')} (N, Dk from q, Hkv from k_cache)")
    if dc != d or h % hkv:
        _fail(f"k_cache {tuple(k_cache.shape)} must have head dim {d} (q's) and a number of "
              f"KV heads that divides q's {h} heads")
    if v_cache.shape != (pages, page_size, hkv, dv) or v_cache.dtype != k_cache.dtype:
        _fail(f"v_cache {tuple(v_cache.shape)} {v_cache.dtype} must match k_cache "
              f"{tuple(k_cache.shape)} {k_cache.dtype} but for v's head dim {dv}: "
              f"{(pages, page_size, hkv, dv)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or any(
            t.stride(-1) != 1 for t in (q, k, v, block_table, out) if t is not None):
        _fail("the KV pools must be contiguous; q, k, v, block_table, out need a dense last dim")
    if r < 0 or seq_lens.shape[0] != r or block_table.shape[0] != r or slot_mapping.shape[0] != n:
        _fail(f"query_start_loc {tuple(query_start_loc.shape)} describes R={r} requests, q N={n} "
              f"rows: seq_lens {tuple(seq_lens.shape)} and block_table "
              f"{tuple(block_table.shape)} need R rows, slot_mapping "
              f"{tuple(slot_mapping.shape)} N")
    if out is not None and (out.shape != (n, h, dv) or out.dtype != q.dtype):
        _fail(f"out {tuple(out.shape)} {out.dtype} must match q {tuple(q.shape)} {q.dtype} but "
              f"for v's head dim {dv}: {(n, h, dv)}")


def ragged_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            block_table: torch.Tensor, slot_mapping: torch.Tensor, scale: float,
                            window: int = 0, softcap: float = 0.0,
                            sinks: torch.Tensor | None = None, chunk: int = 0,
                            rel: torch.Tensor | None = None,
                            alibi: torch.Tensor | None = None,
                            max_query_len: int | None = None, num_splits: int | None = None,
                            config: TargetConfig | None = None,
                            out: torch.Tensor | None = None,
                            fold_reduce: bool | None = None,
                            early_reads: bool = False) -> torch.Tensor:
    """Triton ``dspark::ragged_attention``: same arguments and result as the reference.

    ``window``, ``softcap``, ``sinks``, ``chunk``, ``rel``, ``alibi``: the reference's switches,
    checked on the host before anything launches; each turns on a constexpr of the one kernel (all off: the
    plain causal build; a chunk runs the window's code with ``CHUNKED``, the chunk size in
    ``window``). A window or chunk that reaches past the block table's width (no key is ever
    outside it) is plain causal. ``max_query_len``: a host bound on any request's length (default ``N``, always
    safe); a tighter bound lets one program cover a whole verify block. ``num_splits`` and
    ``config`` override the split rule and the target entry (benchmarks, tests); ``out`` is an
    optional ``[N, H, Dv]`` buffer of q's dtype to write (every element is written).
    ``fold_reduce`` (default: the target's ``attn_fold_reduce``) merges split partials in the
    attention launch instead of a second one (:func:`split_counters`). ``early_reads`` (with
    PDL): the caller vouches that the kernel launched just before this one writes neither
    ``query_start_loc``, ``seq_lens``, ``block_table`` nor the pools' committed rows (those
    below each request's context), so they are read before the PDL wait; ``lower`` sets it
    where the graph shows it (:func:`dspark_compile.passes.lower.early_attention_reads`).
    Mutates the pools; no host sync, so it can be captured in a CUDA graph. Returns
    ``[N, H, Dv]`` in q's dtype.
    """
    _check_inputs((q, k, v, k_cache, v_cache, query_start_loc, seq_lens, block_table,
                   slot_mapping, out), max_query_len, window, softcap, sinks, chunk,
                  row_sinks=True)
    check_rel("ragged_attention_triton", rel, tuple(q.shape[:2]), softcap, q.device)
    check_alibi("ragged_attention_triton", alibi, q.shape[1], softcap, q.device)
    alibi, = dense(alibi)
    n, h, d = q.shape
    dv = v.shape[2]
    r = query_start_loc.shape[0] - 1
    hkv, page_size = k_cache.shape[2], k_cache.shape[1]
    max_keys = block_table.shape[1] * page_size
    chunked = 0 < chunk < max_keys  # every position < max_keys <= chunk: one chunk, causal
    window = chunk if chunked else window if window < max_keys else 0  # ... <= window: causal
    cfg, sm_count = device_target(q.device)
    cfg = config or cfg
    pdl = use_pdl(q.device, cfg)
    plan = plan_attention(n, r, h, hkv, max_keys, max(1, max_query_len or n), cfg, sm_count,
                          num_splits, window, max(head_dim_pad(d), head_dim_pad(dv)),
                          k_cache.element_size())
    if out is None:
        out = q.new_empty((n, h, dv))  # [N, H, Dv]
    if n == 0:
        return out
    split = plan.num_splits > 1
    fold = cfg.attn_fold_reduce if fold_reduce is None else bool(fold_reduce)
    counters = split_counters(q.device, plan.grid[0] * plan.grid[1]) if split and fold else None
    part_acc, part_ml = out, out  # never touched without a split (the branch compiles out)
    if split:
        part_acc = q.new_empty((plan.num_splits, n, h, dv), dtype=torch.float32)
        part_ml = q.new_empty((plan.num_splits, n, h, 2), dtype=torch.float32)
    dv_pad = head_dim_pad(dv)
    max_splits = _max_splits(plan.num_splits)
    regs = register_cap(plan.max_registers, cfg, q.device)
    # softcap: the scores' multiplier becomes the tanh argument's, softcap * log2(e) the cap's
    qk_scale = scale / softcap if softcap > 0 else scale * _LOG2E
    launch(_ragged_attention_kernel, plan.grid,
        out, part_acc, part_ml, out if counters is None else counters, q, k, v, k_cache,
        v_cache, query_start_loc, seq_lens,
        block_table, slot_mapping, q if sinks is None else sinks, q if rel is None else rel,
        q if alibi is None else alibi,
        qk_scale, float(softcap) * _LOG2E, window, 0 if rel is None else rel.shape[2],
        0 if rel is None else rel.stride(0), 0 if rel is None else rel.stride(1),
        sinks.stride(0) if sinks is not None and sinks.dim() == 2 else 0,
        n, r, plan.num_splits, q.stride(0),
        q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        block_table.stride(0), hkv * d, NUM_HEADS=h, GROUP=h // hkv, GROUP_PAD=plan.group_pad,
        HEAD_DIM=d, HEAD_DIM_PAD=head_dim_pad(d), HEAD_DIM_V=dv, HEAD_DIM_V_PAD=dv_pad,
        PAGE_SIZE=page_size, BLOCK_Q=plan.block_q,
        BLOCK_M=plan.block_m, TILE_N=plan.tile_n, NEW_N=plan.new_n, SEARCH=plan.search,
        SEARCH_ONCE=r + 1 <= plan.search, SPLIT=split, FOLD=counters is not None,
        MAX_SPLITS=max_splits, UPCAST=q.dtype != k_cache.dtype,
        DOT_PRECISION=fp32_dot_precision(cfg), EARLY=pdl and early_reads and cfg.attn_early_reads,
        PDL=pdl, HAS_WINDOW=window > 0, HAS_SOFTCAP=softcap > 0,
        HAS_SINKS=sinks is not None, CHUNKED=chunked, 
        POS_BIAS=(rel is not None) + 2 * (alibi is not None),
        num_warps=plan.num_warps, num_stages=plan.num_stages, **regs, **pdl_options(pdl))
    if split and counters is None:
        launch(_split_reduce_kernel, (n,),
            out, part_acc, part_ml, query_start_loc, n, r, plan.num_splits, out.stride(0),
            out.stride(1), NUM_HEADS=h, HEADS_PAD=triton.next_power_of_2(h), HEAD_DIM=dv,
            HEAD_DIM_PAD=dv_pad, MAX_SPLITS=max_splits, PDL=pdl, num_warps=cfg.reduce_num_warps,
            **pdl_options(pdl))
    return out
