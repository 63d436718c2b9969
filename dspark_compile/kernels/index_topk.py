"""GPU lowering of ``dspark::index_topk`` (DeepSeek-V4's CSA lightning indexer): a Triton
scoring kernel, then ``torch.topk`` on the device; no host sync (it runs inside a CUDA graph).

``_scores``: program ``(t, b)`` scores packed query ``t`` against entries ``b * BLOCK_E ..`` of
its request: ``sum_h weights[t, h] * relu(q[t, h] . entry[s]) * softmax_scale`` (float32, HF's
order of operations) for the entries the query may see (``s < (p + 1) // rate``), ``-inf``
elsewhere, into a ``[N, E]`` buffer whose ``E`` is every entry a slot can hold (the block
table's pages times the page size, over the rate: static per state); it also writes each row's
bound ``(p + 1) // rate`` (0 for a padding row). Then ``torch.topk`` keeps the
``min(topk, E)`` best of each row and picks at or past the bound become -1.

Equal scores: the reference (and HF) run ``torch.topk`` over a row of the request's
``seq_len // rate`` entries; this runs it over the longer, padded row on the GPU, whose
``topk`` may order equal scores differently. Where no two of a query's candidate scores tie at
its top-k boundary the picks are the reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch, zeros_when_warming

__all__ = ["index_topk_triton"]

BLOCK_E = 16
CHUNK = 128


@triton.jit
def _scores(q_ptr, w_ptr, entry_ptr, qsl_ptr, seq_lens_ptr, table_ptr, out_ptr, bound_ptr,
            num_reqs, stride_table, page_size, heads, dim, rate, num_entries, softmax_scale,
            H_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_E: tl.constexpr,
            CHUNK: tl.constexpr):
    t = tl.program_id(0)
    b = tl.program_id(1)
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
    bound = tl.where(real, (pos + 1) // rate, 0)
    if b == 0:
        tl.store(bound_ptr + t, bound)
    e = b * BLOCK_E + tl.arange(0, BLOCK_E)
    ok = e < bound
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    h_ok, d_ok = h < heads, d < dim
    q = tl.load(q_ptr + t.to(tl.int64) * heads * dim + h[:, None] * dim + d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    w = tl.load(w_ptr + t.to(tl.int64) * heads + h, mask=h_ok, other=0.0).to(tl.float32)
    table_row = table_ptr + req.to(tl.int64) * stride_table
    safe = tl.where(ok, e, 0)
    page = tl.load(table_row + safe // page_size, mask=ok, other=0).to(tl.int64)
    rows = page * page_size + safe % page_size
    k = tl.load(entry_ptr + rows[:, None] * dim + d[None, :], mask=ok[:, None] & d_ok[None, :],
                other=0.0).to(tl.float32)
    dots = tl.dot(q, tl.trans(k), input_precision="ieee")  # [H_PAD, BLOCK_E]
    s = tl.maximum(dots, 0.0) * softmax_scale
    s = tl.sum(s * w[:, None], 0)
    s = tl.where(ok, s, float("-inf"))
    tl.store(out_ptr + t.to(tl.int64) * num_entries + e, s, mask=e < num_entries)


def index_topk_triton(q: torch.Tensor, weights: torch.Tensor, entry_pool: torch.Tensor,
                      fresh: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, block_table: torch.Tensor, rate: int, topk: int,
                      softmax_scale: float) -> torch.Tensor:
    """``dspark::index_topk`` on the GPU (module docstring): int64 ``[N, topk]``."""
    from ..ops.compressed_reference import check_index

    check_index("index_topk_triton", q, weights, entry_pool, fresh, rate, topk, 1)
    for name, t in dict(q=q, weights=weights, entry_pool=entry_pool,
                        query_start_loc=query_start_loc, seq_lens=seq_lens,
                        block_table=block_table).items():
        if t.device != q.device or not t.is_contiguous():
            raise ValueError(f"index_topk_triton: {name} is on {t.device} "
                             f"({'' if t.is_contiguous() else 'not '}contiguous); every tensor "
                             f"must be contiguous on {q.device}")
    n, heads, dim = q.shape
    out = torch.full((n, topk), -1, dtype=torch.int64, device=q.device)
    entries = block_table.shape[1] * entry_pool.shape[1] // rate
    if n == 0 or entries == 0:
        return out
    scores = torch.empty(n, entries, dtype=torch.float32, device=q.device)
    bound = torch.empty(n, dtype=torch.int32, device=q.device)
    launch(_scores, (n, triton.cdiv(entries, BLOCK_E)), q, weights, entry_pool,
           query_start_loc, seq_lens, block_table, scores, bound, seq_lens.shape[0],
           block_table.stride(0), entry_pool.shape[1], heads, dim, int(rate), entries,
           float(softmax_scale), H_PAD=max(16, triton.next_power_of_2(heads)),
           D_PAD=max(16, triton.next_power_of_2(dim)), BLOCK_E=BLOCK_E, CHUNK=CHUNK)
    k = min(topk, entries)
    picks = scores.topk(k, dim=-1).indices
    out[:, :k] = torch.where(picks >= bound[:, None].long(), -1, picks)
    return zeros_when_warming(out)
