"""GPU lowering of ``dspark::index_topk`` (DeepSeek-V4's CSA lightning indexer): a Triton
scoring kernel, then ``torch.topk`` on the device; no host sync (it runs inside a CUDA graph).

``_scores``: program ``(t, split)`` scores packed query ``t`` against entry blocks ``split,
split + splits, ..`` of its request (``q`` and the weights loaded once): ``sum_h weights[t, h] *
relu(q[t, h] . entry[s]) * softmax_scale`` (float32, HF's order of operations) for the entries
the query may see (``s < (p + 1) // rate``), into a ``[N, E]`` buffer whose ``E`` is every
entry a slot can hold (the block table's pages times the page size, over the rate: static per
state); past :data:`ENTRY_CHUNK` entries, one launch a chunk of them into a ``[N, chunk]``
buffer, each chunk's top ``topk`` kept for a last ``torch.topk``. Each element is one int64 key: the score's order-preserving integer (``-0.0`` taken as
``+0.0``) in the high 32 bits and ``E - 1 - s`` in the low ones; an entry the query may not see
gets the lowest high half, and a block it sees nothing of is written without a load. Keys are
distinct, so ``torch.topk`` of a row is one order on every device: higher score first, equal
scores by lower entry index; picks of hidden entries become -1.

Equal scores: the reference (and HF) run ``torch.topk`` over a row of the request's
``seq_len // rate`` float scores, which leaves the choice among equal scores to the device's
``topk`` (CUDA's radix select takes the lower indices, as far as its source reads; the CPU's
need not). Here the lower indices win on every device, so where a query's scores tie at its
top-k boundary the picks are the reference's wherever its ``topk`` prefers lower indices; a
row's picks are in the reference's order up to the order among equal scores. Float32 dots take
``ieee`` on every target: a pick is discrete, and a TF32 rounding that swaps two close entries
would change a row by far more than TF32 noise.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .device import device_sm_count
from .launch import launch, zeros_when_warming
from .metadata import row_request

__all__ = ["index_topk_triton", "plan_index"]

CHUNK = 128
"""Requests counted per step when a row looks for its request."""
ENTRY_CHUNK = 16384
"""Entries scored into the key buffer at a time: past it, each chunk keeps its top ``topk``
keys and one more ``torch.topk`` picks among them, so the buffer is ``[N, 16384]`` and the
candidates ``[N, chunks * topk]`` instead of ``[N, every entry]`` (a DSA indexer over 128K
positions at 2048 rows: 0.27 GB and 0.27 GB instead of 2.1 GB)."""
_HIDDEN_BELOW = -(1 << 63) + (1 << 32)
"""Keys of entries a query may see are at least this (hidden ones have the high half -2**31)."""


@triton.jit
def _scores(q_ptr, w_ptr, entry_ptr, qsl_ptr, seq_lens_ptr, table_ptr, out_ptr, num_reqs,
            stride_table, page_size, heads, dim, rate, num_entries, softmax_scale, first, width,
            stride_out, H_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_E: tl.constexpr,
            CHUNK: tl.constexpr):
    """Keys of entries ``first .. first + width - 1`` (of ``num_entries``) into the first
    ``width`` columns of ``out`` (rows ``stride_out`` apart)."""
    t = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    req, pos, real = row_request(qsl_ptr, seq_lens_ptr, t, num_reqs, CHUNK)
    bound = tl.where(real, (pos + 1) // rate, 0)
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    h_ok, d_ok = h < heads, d < dim
    live = (h * 0 + bound) > first + split * BLOCK_E  # this program sees an entry ([H_PAD])
    q = tl.load(q_ptr + t.to(tl.int64) * heads * dim + h[:, None] * dim + d[None, :],
                mask=(h_ok & live)[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    w = tl.load(w_ptr + t.to(tl.int64) * heads + h, mask=h_ok & live, other=0.0).to(tl.float32)
    table_row = table_ptr + req.to(tl.int64) * stride_table
    for b in range(split, tl.cdiv(width, BLOCK_E), splits):
        e = first + b * BLOCK_E + tl.arange(0, BLOCK_E)
        ok = e < bound
        high = tl.full([BLOCK_E], -2147483648, tl.int32)
        if first + b * BLOCK_E < bound:
            safe = tl.where(ok, e, 0)
            page = tl.load(table_row + safe // page_size, mask=ok, other=0).to(tl.int64)
            rows = page * page_size + safe % page_size
            k = tl.load(entry_ptr + rows[:, None] * dim + d[None, :],
                        mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            dots = tl.dot(q, tl.trans(k), input_precision="ieee")  # [H_PAD, BLOCK_E]
            s = tl.maximum(dots, 0.0) * softmax_scale
            s = tl.sum(s * w[:, None], 0)
            s = tl.where(s == 0.0, 0.0, s)  # -0.0 ties +0.0, as the float comparison does
            bits = s.to(tl.int32, bitcast=True)
            high = tl.where(ok, tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits), high)
        key = (high.to(tl.int64) << 32) | (num_entries - 1 - e).to(tl.int64)
        tl.store(out_ptr + t.to(tl.int64) * stride_out + (e - first), key,
                 mask=e < first + width)


@functools.lru_cache(maxsize=256)
def plan_index(num_tokens: int, num_entries: int, block_e: int, sm_count: int) -> int:
    """Programs per query row: enough for about two per multiprocessor, at most one per entry
    block (each loads its row's ``q`` once and loops over every ``splits``-th block)."""
    blocks = max(1, triton.cdiv(num_entries, block_e))
    return max(1, min(blocks, triton.cdiv(2 * sm_count, max(1, num_tokens))))


def index_topk_triton(q: torch.Tensor, weights: torch.Tensor, entry_pool: torch.Tensor,
                      fresh: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, block_table: torch.Tensor, rate: int, topk: int,
                      softmax_scale: float, entry_chunk: int | None = None) -> torch.Tensor:
    """``dspark::index_topk`` on the GPU (module docstring): int64 ``[N, topk]``.
    ``entry_chunk`` overrides :data:`ENTRY_CHUNK` (tests)."""
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
    block_e = 16
    chunk = entries if entries <= (entry_chunk or ENTRY_CHUNK) else (entry_chunk or ENTRY_CHUNK)
    keys = torch.empty(n, chunk, dtype=torch.int64, device=q.device)
    best = []  # each chunk's top keys; keys are distinct, so the top of their union is the top
    for first in range(0, entries, chunk):
        width = min(chunk, entries - first)
        launch(_scores, (n, plan_index(n, width, block_e, device_sm_count(q.device))), q,
               weights, entry_pool, query_start_loc, seq_lens, block_table, keys,
               seq_lens.shape[0], block_table.stride(0), entry_pool.shape[1], heads, dim,
               int(rate), entries, float(softmax_scale), first, width, keys.stride(0),
               H_PAD=max(16, triton.next_power_of_2(heads)),
               D_PAD=max(16, triton.next_power_of_2(dim)), BLOCK_E=block_e, CHUNK=CHUNK)
        part = keys[:, :width]
        best.append(part if width == entries else part.topk(min(topk, width), dim=-1).values)
    pool = best[0] if len(best) == 1 else torch.cat(best, dim=1)
    k = min(topk, entries)
    top = pool.topk(k, dim=-1).values
    out[:, :k] = torch.where(top >= _HIDDEN_BELOW, (entries - 1) - (top & 0xFFFFFFFF), -1)
    return zeros_when_warming(out)
