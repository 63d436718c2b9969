"""Triton lowering of ``dspark::compressed_attention`` (DeepSeek-V4's HCA / CSA attention: one
K=V head, a sliding window, compressed entries, per-head sinks).

Two launches, no host sync (it runs inside a CUDA graph):

1. the step's K and V rows into the paged pools at ``slot_mapping`` (``compress._raw_write``);
2. ``_attend``: program ``t`` finds its request and position ``p`` (a padding row writes zeros)
   and runs one online softmax for all ``H`` heads over, in order, the sink (its logit starts
   the running maximum, with weight 1), the window's keys ``max(0, p - window + 1) .. p`` read
   through the request's block-table row, and the entries the query may see: every
   ``s < (p + 1) // rate`` (HCA) or the valid entries of its ``topk`` row (CSA). An entry is
   key and value; the scores are ``q . k * scale`` as float32 ``tl.dot`` products over tiles of
   ``BLOCK_K`` keys. One KV head (DeepSeek-V4's K = V MQA), no softcap.

This is the straightforward kernel (one program per query row, every head at once); it is
exact against the reference within float rounding and captures into CUDA graphs, and it is not
tuned. Semantics and the oracle: ``ops/compressed_reference.compressed_attention``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .compress import _raw_write
from .launch import launch, zeros_when_warming

__all__ = ["compressed_attention_triton"]

BLOCK_K = 16
CHUNK = 128


@triton.jit
def _tile(q, m, l_sum, acc, keys_ptr, values_ptr, rows, ok, dim, scale,
          D_PAD: tl.constexpr):
    """One online-softmax step over the rows ``rows`` (``ok``: real) of the key and value
    pools (the same pool for entries)."""
    d = tl.arange(0, D_PAD)
    offs = rows[:, None] * dim + d[None, :]
    mask = ok[:, None] & (d < dim)[None, :]
    k = tl.load(keys_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(values_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [H_PAD, BLOCK_K]
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    l_sum = l_sum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    return m_new, l_sum, acc


@triton.jit
def _attend(q_ptr, out_ptr, k_cache_ptr, v_cache_ptr, entries_ptr, topk_ptr, sinks_ptr,
            qsl_ptr, seq_lens_ptr, table_ptr, num_reqs, stride_table, page_size, heads, dim,
            scale, window, rate, num_picks,
            H_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
            CHUNK: tl.constexpr, PICKS: tl.constexpr, HAS_SINKS: tl.constexpr):
    t = tl.program_id(0)
    req = t * 0
    for c in range(0, num_reqs, CHUNK):
        i = c + tl.arange(0, CHUNK)
        ends = tl.load(qsl_ptr + 1 + i, mask=i < num_reqs, other=2147483647)
        req += tl.sum((ends <= t).to(tl.int32), 0)
    req = tl.minimum(req, num_reqs - 1)
    start = tl.load(qsl_ptr + req)
    end = tl.load(qsl_ptr + req + 1)
    pos = tl.load(seq_lens_ptr + req) - (end - start) + (t - start)
    real = t < tl.load(qsl_ptr + num_reqs)

    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    h_ok, d_ok = h < heads, d < dim
    out_rows = out_ptr + t.to(tl.int64) * heads * dim + h[:, None] * dim + d[None, :]
    if real:
        q = tl.load(q_ptr + t.to(tl.int64) * heads * dim + h[:, None] * dim + d[None, :],
                    mask=h_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        if HAS_SINKS:
            m = tl.load(sinks_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
            l_sum = tl.full([H_PAD], 1.0, tl.float32)
        else:
            m = tl.full([H_PAD], float("-inf"), tl.float32)
            l_sum = tl.zeros([H_PAD], tl.float32)
        acc = tl.zeros([H_PAD, D_PAD], tl.float32)
        table_row = table_ptr + req.to(tl.int64) * stride_table
        lo = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)
        for k0 in range(lo, pos + 1, BLOCK_K):  # the window's keys
            kp = k0 + tl.arange(0, BLOCK_K)
            ok = kp <= pos
            page = tl.load(table_row + tl.where(ok, kp, 0) // page_size, mask=ok,
                           other=0).to(tl.int64)
            rows = page * page_size + kp % page_size
            m, l_sum, acc = _tile(q, m, l_sum, acc, k_cache_ptr, v_cache_ptr, rows, ok, dim,
                                  scale, D_PAD)
        if PICKS:  # CSA: the query's valid picks
            for k0 in range(0, num_picks, BLOCK_K):
                j = k0 + tl.arange(0, BLOCK_K)
                e = tl.load(topk_ptr + t.to(tl.int64) * num_picks + j, mask=j < num_picks,
                            other=-1)
                ok = e >= 0
                page = tl.load(table_row + tl.where(ok, e, 0) // page_size, mask=ok,
                               other=0).to(tl.int64)
                rows = page * page_size + tl.where(ok, e, 0) % page_size
                m, l_sum, acc = _tile(q, m, l_sum, acc, entries_ptr, entries_ptr, rows, ok,
                                      dim, scale, D_PAD)
        else:  # HCA: every closed entry
            count = (pos + 1) // rate
            for k0 in range(0, count, BLOCK_K):
                e = k0 + tl.arange(0, BLOCK_K)
                ok = e < count
                page = tl.load(table_row + tl.where(ok, e, 0) // page_size, mask=ok,
                               other=0).to(tl.int64)
                rows = page * page_size + e % page_size
                m, l_sum, acc = _tile(q, m, l_sum, acc, entries_ptr, entries_ptr, rows, ok,
                                      dim, scale, D_PAD)
        out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
        tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])
    else:
        tl.store(out_rows, tl.zeros([H_PAD, D_PAD], out_ptr.dtype.element_ty),
                 mask=h_ok[:, None] & d_ok[None, :])


def compressed_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                k_cache: torch.Tensor, v_cache: torch.Tensor,
                                query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                                block_table: torch.Tensor, slot_mapping: torch.Tensor,
                                scale: float, window: int, softcap: float,
                                sinks: torch.Tensor | None, entries: torch.Tensor,
                                fresh: torch.Tensor, rate: int,
                                topk: torch.Tensor | None = None) -> torch.Tensor:
    """``dspark::compressed_attention`` in two launches (module docstring): ``[N, H, D]``."""
    from ..ops.attention_reference import check_semantics
    from ..ops.compressed_reference import check_entries

    check_semantics("compressed_attention_triton", window, softcap, sinks, q.shape[1])
    check_entries("compressed_attention_triton", q, entries, fresh, rate, topk, 1)
    n, heads, dim = q.shape
    if k.shape[1] != 1 or v.shape[2] != dim or softcap:
        raise ValueError(f"compressed_attention_triton: k {tuple(k.shape)}, v "
                         f"{tuple(v.shape)}, softcap {softcap}; the kernel takes one K=V head "
                         "of q's head dim and no softcap")
    named = dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, entries=entries,
                 query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table,
                 slot_mapping=slot_mapping)
    if topk is not None:
        named["topk"] = topk
    for name, t in named.items():
        if t.device != q.device or not t.is_contiguous():
            raise ValueError(f"compressed_attention_triton: {name} is on {t.device} "
                             f"({'' if t.is_contiguous() else 'not '}contiguous); every tensor "
                             f"must be contiguous on {q.device}")
    out = torch.empty_like(q)
    if n == 0:
        return out
    width = dim
    launch(_raw_write, (n,), k, v, k_cache, v_cache, slot_mapping, width,
           BLOCK_W=min(triton.next_power_of_2(width), 1024))
    picks = topk is not None
    num_picks = topk.shape[1] if picks else 1
    launch(_attend, (n,), q, out, k_cache, v_cache, entries, topk if picks else q,
           sinks if sinks is not None else q, query_start_loc, seq_lens, block_table,
           seq_lens.shape[0], block_table.stride(0), k_cache.shape[1], heads, dim,
           float(scale), int(window), int(rate), num_picks,
           H_PAD=max(16, triton.next_power_of_2(heads)),
           D_PAD=max(16, triton.next_power_of_2(dim)), BLOCK_K=BLOCK_K, CHUNK=CHUNK,
           PICKS=picks, HAS_SINKS=sinks is not None)
    return zeros_when_warming(out)
