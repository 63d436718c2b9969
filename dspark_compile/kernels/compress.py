"""Triton lowering of ``dspark::compress`` (DeepSeek-V4's HCA / CSA compressor step).

Two launches, no host sync (it runs inside a CUDA graph):

1. ``rows.store_rows_triton`` copies each packed row's raw ``kv`` and ``gate`` into the raw
   pools at ``slot_mapping[t]`` (nothing for ``-1``);
2. ``_entries``: program ``t`` finds its request (the number of requests whose rows end at or
   before ``t``, as ``kernels/metadata.py`` counts them) and its position ``p``. A row that
   closes no window (``(p + 1) % rate != 0``, or a padding row) writes a zero ``fresh`` row.
   The closing row of window ``w`` reads the window's slots from the raw pools through the
   request's block-table row (the first launch has written this step's rows), pools them per
   channel with the softmax over the slots (float32; two passes over slot chunks: the maximum,
   then the exp-weighted sums), applies the RMS norm with its weight and the interleaved rotary
   at position ``w * rate`` to the trailing channels, and writes the entry to its ``fresh`` row
   and to entry ``w`` of the entry pool.

Channels are handled as pairs ``(2i, 2i + 1)`` so that the rotary's pairs sit in one lane.
Semantics (and the oracle): ``ops/compressed_reference.compress``; the pooled sum divides once
by the exp sum where the reference multiplies by softmax weights, so results agree within
float rounding, not bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch, zeros_when_warming
from .metadata import row_request
from .rows import store_rows_triton

__all__ = ["compress_triton"]

CHUNK = 128
"""Requests counted per step when a row looks for its request."""


@triton.jit
def _slot_gates(gate_pool_ptr, bias_ptr, table_row, s0, w, rate, page_size, width, dim, pair,
                pair_ok, OVERLAP: tl.constexpr, SLOT_BLOCK: tl.constexpr,
                NUM_SLOTS: tl.constexpr):
    """Slots ``s0 ..`` of window ``w``'s pooling: their raw-pool offsets ``[SLOT_BLOCK,
    PAIRS]`` (even channels; odd ones at ``+ 1``), validity, and gate logits with the position
    bias (even, odd) as fp32. With ``OVERLAP`` slots below ``rate`` are window ``w - 1``'s first
    half, the rest window ``w``'s second half (none before window 0)."""
    j = s0 + tl.arange(0, SLOT_BLOCK)
    if OVERLAP:
        second = j >= rate
        tok = tl.where(second, w * rate + j - rate, (w - 1) * rate + j)
        off = tl.where(second, dim, 0)
        brow = tl.where(second, j - rate, j)
        ok_j = (j < NUM_SLOTS) & (second | (j * 0 + w >= 1))
    else:
        tok = w * rate + j
        off = j * 0
        brow = j
        ok_j = j < NUM_SLOTS
    tok = tl.where(ok_j, tok, 0)
    page = tl.load(table_row + tok // page_size, mask=ok_j, other=0).to(tl.int64)
    row = page * page_size + tok % page_size
    ok = ok_j[:, None] & pair_ok[None, :]
    base = row[:, None] * width + off[:, None] + 2 * pair[None, :]
    bbase = brow[:, None] * width + off[:, None] + 2 * pair[None, :]
    g_e = tl.load(gate_pool_ptr + base, mask=ok, other=0.0).to(tl.float32) + \
        tl.load(bias_ptr + bbase, mask=ok, other=0.0).to(tl.float32)
    g_o = tl.load(gate_pool_ptr + base + 1, mask=ok, other=0.0).to(tl.float32) + \
        tl.load(bias_ptr + bbase + 1, mask=ok, other=0.0).to(tl.float32)
    return base, ok, g_e, g_o


@triton.jit
def _entries(kv_pool_ptr, gate_pool_ptr, entry_pool_ptr, fresh_ptr, qsl_ptr, seq_lens_ptr,
             table_ptr, raw_table_ptr, bias_ptr, weight_ptr, inv_freq_ptr, num_reqs,
             stride_table, stride_raw_table, page_size, width, dim, rate, eps, rope_scale,
             OVERLAP: tl.constexpr, PAIRS: tl.constexpr, ROPE_PAIRS: tl.constexpr,
             SLOT_BLOCK: tl.constexpr, NUM_SLOTS: tl.constexpr, CHUNK: tl.constexpr):
    t = tl.program_id(0)
    req, pos, real = row_request(qsl_ptr, seq_lens_ptr, t, num_reqs, CHUNK)
    closes = real & ((pos + 1) % rate == 0)

    pair = tl.arange(0, PAIRS)
    pair_ok = pair < dim // 2
    out_row = fresh_ptr + t.to(tl.int64) * dim
    if closes:
        w = (pos + 1) // rate - 1
        table_row = table_ptr + req.to(tl.int64) * stride_table
        raw_row = raw_table_ptr + req.to(tl.int64) * stride_raw_table
        # pass 1: per channel, the largest logit over the slots
        m_e = tl.full([PAIRS], float("-inf"), tl.float32)
        m_o = tl.full([PAIRS], float("-inf"), tl.float32)
        for s0 in range(0, NUM_SLOTS, SLOT_BLOCK):
            base, ok, g_e, g_o = _slot_gates(gate_pool_ptr, bias_ptr, raw_row, s0, w, rate,
                                             page_size, width, dim, pair, pair_ok, OVERLAP,
                                             SLOT_BLOCK, NUM_SLOTS)
            m_e = tl.maximum(m_e, tl.max(tl.where(ok, g_e, float("-inf")), 0))
            m_o = tl.maximum(m_o, tl.max(tl.where(ok, g_o, float("-inf")), 0))
        # pass 2: exp-weighted sums
        s_e = tl.zeros([PAIRS], tl.float32)
        s_o = tl.zeros([PAIRS], tl.float32)
        a_e = tl.zeros([PAIRS], tl.float32)
        a_o = tl.zeros([PAIRS], tl.float32)
        for s0 in range(0, NUM_SLOTS, SLOT_BLOCK):
            base, ok, g_e, g_o = _slot_gates(gate_pool_ptr, bias_ptr, raw_row, s0, w, rate,
                                             page_size, width, dim, pair, pair_ok, OVERLAP,
                                             SLOT_BLOCK, NUM_SLOTS)
            p_e = tl.where(ok, tl.exp(g_e - m_e[None, :]), 0.0)
            p_o = tl.where(ok, tl.exp(g_o - m_o[None, :]), 0.0)
            k_e = tl.load(kv_pool_ptr + base, mask=ok, other=0.0).to(tl.float32)
            k_o = tl.load(kv_pool_ptr + base + 1, mask=ok, other=0.0).to(tl.float32)
            s_e += tl.sum(p_e, 0)
            s_o += tl.sum(p_o, 0)
            a_e += tl.sum(p_e * k_e, 0)
            a_o += tl.sum(p_o * k_o, 0)
        dtype = fresh_ptr.dtype.element_ty
        x_e = (a_e / tl.where(pair_ok, s_e, 1.0)).to(dtype).to(tl.float32)
        x_o = (a_o / tl.where(pair_ok, s_o, 1.0)).to(dtype).to(tl.float32)
        x_e = tl.where(pair_ok, x_e, 0.0)
        x_o = tl.where(pair_ok, x_o, 0.0)
        rstd = 1.0 / tl.sqrt((tl.sum(x_e * x_e, 0) + tl.sum(x_o * x_o, 0)) / dim + eps)
        w_e = tl.load(weight_ptr + 2 * pair, mask=pair_ok, other=0.0).to(tl.float32)
        w_o = tl.load(weight_ptr + 2 * pair + 1, mask=pair_ok, other=0.0).to(tl.float32)
        y_e = (w_e * (x_e * rstd)).to(dtype).to(tl.float32)
        y_o = (w_o * (x_o * rstd)).to(dtype).to(tl.float32)
        first_rope = dim // 2 - ROPE_PAIRS  # pairs at or past it are rotated
        r = pair - first_rope
        is_rope = (r >= 0) & pair_ok
        freq = tl.load(inv_freq_ptr + tl.where(is_rope, r, 0), mask=is_rope,
                       other=0.0).to(tl.float32)
        angle = (w * rate).to(tl.float32) * freq
        cos = (tl.cos(angle) * rope_scale).to(dtype).to(tl.float32)
        sin = (tl.sin(angle) * rope_scale).to(dtype).to(tl.float32)
        z_e = tl.where(is_rope, y_e * cos - y_o * sin, y_e)
        z_o = tl.where(is_rope, y_o * cos + y_e * sin, y_o)
        entry_page = tl.load(table_row + w // page_size).to(tl.int64)
        entry_row = entry_pool_ptr + (entry_page * page_size + w % page_size) * dim
        out_e, out_o = z_e.to(dtype), z_o.to(dtype)
        tl.store(out_row + 2 * pair, out_e, mask=pair_ok)
        tl.store(out_row + 2 * pair + 1, out_o, mask=pair_ok)
        tl.store(entry_row + 2 * pair, out_e.to(entry_pool_ptr.dtype.element_ty), mask=pair_ok)
        tl.store(entry_row + 2 * pair + 1, out_o.to(entry_pool_ptr.dtype.element_ty),
                 mask=pair_ok)
    else:
        zero = tl.zeros([PAIRS], fresh_ptr.dtype.element_ty)
        tl.store(out_row + 2 * pair, zero, mask=pair_ok)
        tl.store(out_row + 2 * pair + 1, zero, mask=pair_ok)


def _check(kv, gate, kv_pool, gate_pool, entry_pool, query_start_loc, seq_lens, block_table,
           slot_mapping, position_bias, norm_weight, inv_freq, raw_block_table=None,
           raw_slot_mapping=None) -> None:
    """Host-side checks (no device value is read): ``ValueError`` naming what is wrong.

    ``kv`` and ``gate`` may be row-strided views (slices of one projection's output); their
    channels must be contiguous. Every other tensor must be contiguous."""
    dev = kv.device
    for name, t in (("kv", kv), ("gate", gate)):
        if t.device != dev or t.stride(-1) != 1:
            raise ValueError(f"compress_triton: {name} is on {t.device} with strides "
                             f"{tuple(t.stride())}; it must be on {dev} with contiguous channels "
                             "(last stride 1)")
    named = dict(kv_pool=kv_pool, gate_pool=gate_pool, entry_pool=entry_pool,
                 query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table,
                 slot_mapping=slot_mapping, position_bias=position_bias,
                 norm_weight=norm_weight, inv_freq=inv_freq)
    named.update((name, t) for name, t in (("raw_block_table", raw_block_table),
                                           ("raw_slot_mapping", raw_slot_mapping))
                 if t is not None)
    for name, t in named.items():
        if t.device != dev or not t.is_contiguous():
            raise ValueError(f"compress_triton: {name} is on {t.device} "
                             f"({'' if t.is_contiguous() else 'not '}contiguous); every tensor "
                             f"must be contiguous on {dev}")
    if entry_pool.shape[-1] % 2 or 2 * inv_freq.shape[0] > entry_pool.shape[-1]:
        raise ValueError(f"compress_triton: entry width {entry_pool.shape[-1]} with "
                         f"{inv_freq.shape[0]} rotary frequencies; the width must be even and "
                         "hold the rotary pairs")
    if kv_pool.dtype != kv.dtype or gate_pool.dtype != gate.dtype:
        raise ValueError(f"compress_triton: pools {kv_pool.dtype} / {gate_pool.dtype} but rows "
                         f"{kv.dtype} / {gate.dtype}; the raw pools hold the rows' dtype")


def compress_triton(kv: torch.Tensor, gate: torch.Tensor, kv_pool: torch.Tensor,
                    gate_pool: torch.Tensor, entry_pool: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_table: torch.Tensor, slot_mapping: torch.Tensor,
                    position_bias: torch.Tensor, norm_weight: torch.Tensor,
                    inv_freq: torch.Tensor, rate: int, overlap: bool, eps: float,
                    rope_scale: float, raw_block_table: torch.Tensor | None = None,
                    raw_slot_mapping: torch.Tensor | None = None) -> torch.Tensor:
    """``dspark::compress`` in two launches (module docstring); returns ``fresh [N, D]``.
    ``raw_block_table`` / ``raw_slot_mapping`` (None: ``block_table`` / ``slot_mapping``):
    where the raw rows live when their pools are rings; entries follow ``block_table``."""
    from ..ops.compressed_reference import check_compress, check_raw_layout

    check_compress("compress_triton", kv, gate, kv_pool, gate_pool, entry_pool, position_bias,
                   norm_weight, inv_freq, rate, overlap, 2)
    raw_table, raw_slots = check_raw_layout("compress_triton", block_table, slot_mapping,
                                            raw_block_table, raw_slot_mapping)
    _check(kv, gate, kv_pool, gate_pool, entry_pool, query_start_loc, seq_lens, block_table,
           slot_mapping, position_bias, norm_weight, inv_freq, raw_block_table,
           raw_slot_mapping)
    n, width = kv.shape
    dim = entry_pool.shape[-1]
    fresh = torch.empty(n, dim, dtype=kv.dtype, device=kv.device)
    if n == 0:
        return fresh
    num_reqs = seq_lens.shape[0]
    store_rows_triton(kv, kv_pool, raw_slots, gate, gate_pool)
    slots = 2 * rate if overlap else rate
    launch(_entries, (n,), kv_pool, gate_pool, entry_pool, fresh, query_start_loc, seq_lens,
           block_table, raw_table, position_bias, norm_weight, inv_freq, num_reqs,
           block_table.stride(0), raw_table.stride(0),
           kv_pool.shape[1], width, dim, rate, float(eps), float(rope_scale),
           OVERLAP=bool(overlap), PAIRS=triton.next_power_of_2(dim // 2),
           ROPE_PAIRS=inv_freq.shape[0], SLOT_BLOCK=min(triton.next_power_of_2(slots), 16),
           NUM_SLOTS=slots, CHUNK=CHUNK)
    return zeros_when_warming(fresh)
