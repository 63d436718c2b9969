"""Pure-torch references of the compressed-attention ops (DeepSeek-V4's HCA and CSA layers).

A compressed layer keeps, per request, the raw per-token rows its compressor projects
(``kv``, ``gate``) and the compressed *entries* made from them; every piece of that state is a
pure function of the per-token rows, so it is stored the way KV is stored and the committed
length decides what is valid (rollback by length, no commit work):

- raw pools ``[pages, page_size, W]``: token ``p``'s ``kv`` and ``gate`` rows at position
  ``p`` through the block table (the same slot mapping as the KV pool);
- entry pool ``[pages, page_size, D]``: entry ``w`` at "position" ``w`` through the block table
  (a request has at most ``context // rate`` entries, so its pages already cover them).

Window ``w`` covers tokens ``[w * rate, (w + 1) * rate)`` and closes at token
``(w + 1) * rate - 1``. A step computes every window that closes inside its new tokens
(reading earlier tokens of the window from the raw pool) and writes the entry at index ``w``.
An entry whose closing token is rejected lies at an index >= the new committed count
(``committed_len // rate``) and is overwritten when that window closes again, so the committed
regions stay what a run that never saw the draft would hold.

Entry ``w`` (Hugging Face's ``DeepseekV4HCACompressor`` / ``DeepseekV4CSACompressor`` over a
whole sequence, transformers 5.24)::

    HCA: e = sum_j softmax_j(gate_j + bias_j) * kv_j                       j in window w
    CSA: e = sum_j softmax_j(g_j) * c_j over 2 * rate slots: window w-1's first half
         (c = kv[:D], g = gate[:D] + bias[:D]) then window w's second half (kv[D:], gate[D:] +
         bias[D:]); for w = 0 the first half is zero kv with weight 0
    entry = rotary(rms_norm(e) * norm_weight, position w * rate)

The softmax runs over the window axis in float32 (per channel), its weights cast to kv's dtype;
the rotary is the interleaved one on the trailing ``2 * len(inv_freq)`` channels with cos/sin
times ``rope_scale`` in the entry's dtype, as the HF module computes them.

A query at position ``p`` may see entry ``s`` only when ``s < (p + 1) // rate`` (its window
closed at or before ``p``). HCA attends to all of those; CSA to the indexer's top-k of them.
"""

from __future__ import annotations

from typing import Optional

import torch

from .attention_reference import _gather_keys, check_semantics, kv_write

__all__ = ["compress", "index_topk", "compressed_attention", "entry_rotary", "check_compress",
           "check_index", "check_entries"]


# ---------------------------------------------------------------------------- checks
def check_compress(op: str, kv, gate, kv_pool, gate_pool, entry_pool, position_bias,
                   norm_weight, inv_freq, rate, overlap, rows_dim: int) -> None:
    """Raise ``ValueError`` naming the argument, its value and the rule."""
    if type(rate) is not int or rate < 1:
        raise ValueError(f"{op}: rate={rate!r}; it must be an int >= 1 (tokens per window)")
    if type(overlap) is not bool:
        raise ValueError(f"{op}: overlap={overlap!r}; it must be a bool (True: CSA's two "
                         "half-series over 2 * rate slots, False: HCA's one window)")
    if kv.dim() != rows_dim or gate.shape != kv.shape:
        raise ValueError(f"{op}: kv {tuple(kv.shape)}, gate {tuple(gate.shape)}; they must be "
                         f"the same {rows_dim}-D shape (rows, then W channels)")
    d = entry_pool.shape[-1]
    width = kv.shape[-1]
    if width != (2 * d if overlap else d):
        raise ValueError(f"{op}: kv has {width} channels but the entry pool {d}; W must be "
                         f"{'2 * D (CSA: overlap)' if overlap else 'D (HCA)'}")
    for name, pool, want in (("kv_pool", kv_pool, width), ("gate_pool", gate_pool, width),
                             ("entry_pool", entry_pool, d)):
        if pool.dim() != 3 or pool.shape[-1] != want:
            raise ValueError(f"{op}: {name} is {tuple(pool.shape)}; it must be [pages, "
                             f"page_size, {want}]")
    if tuple(position_bias.shape) != (rate, width):
        raise ValueError(f"{op}: position_bias is {tuple(position_bias.shape)}; it must be "
                         f"[rate, W] = [{rate}, {width}]")
    if tuple(norm_weight.shape) != (d,):
        raise ValueError(f"{op}: norm_weight is {tuple(norm_weight.shape)}; it must be [D] = "
                         f"[{d}]")
    if inv_freq.dim() != 1 or 2 * inv_freq.shape[0] > d:
        raise ValueError(f"{op}: inv_freq is {tuple(inv_freq.shape)}; it must be [R / 2] with "
                         f"R <= D = {d} (the rotary slice is the trailing R channels)")


def check_index(op: str, q, weights, entry_pool, fresh, rate, topk, rows_dim: int) -> None:
    if type(rate) is not int or rate < 1:
        raise ValueError(f"{op}: rate={rate!r}; it must be an int >= 1")
    if type(topk) is not int or topk < 1:
        raise ValueError(f"{op}: topk={topk!r}; it must be an int >= 1 (entries per query)")
    if q.dim() != rows_dim + 2 or weights.shape != q.shape[:-1]:
        raise ValueError(f"{op}: q {tuple(q.shape)}, weights {tuple(weights.shape)}; q must "
                         f"be [rows, Hi, Di] (dense: [bs, T, Hi, Di]) and weights q's shape "
                         "without Di")
    if entry_pool.dim() != 3 or entry_pool.shape[-1] != q.shape[-1]:
        raise ValueError(f"{op}: entry_pool is {tuple(entry_pool.shape)}; it must be [pages, "
                         f"page_size, Di] = [.., .., {q.shape[-1]}]")
    if fresh.shape != (*q.shape[:-2], q.shape[-1]):
        raise ValueError(f"{op}: fresh is {tuple(fresh.shape)}; it must be the indexer "
                         f"compress op's rows {(*q.shape[:-2], q.shape[-1])}")


def check_entries(op: str, q, entries, fresh, rate, topk, rows_dim: int) -> None:
    """The compressed arguments of the attention ops (q rows first: ``rows_dim`` row axes)."""
    if type(rate) is not int or rate < 1:
        raise ValueError(f"{op}: rate={rate!r}; it must be an int >= 1")
    d = q.shape[-1]
    if entries.dim() != 3 or entries.shape[-1] != d:
        raise ValueError(f"{op}: entries is {tuple(entries.shape)}; it must be [pages, "
                         f"page_size, D] with D = q's head dim {d} (an entry is key and value)")
    rows = tuple(q.shape[:rows_dim]) if rows_dim == 1 else (q.shape[0], q.shape[2])
    if tuple(fresh.shape) != (*rows, d):
        raise ValueError(f"{op}: fresh is {tuple(fresh.shape)}; it must be the compress op's "
                         f"rows {(*rows, d)}")
    if topk is not None and (topk.dim() != rows_dim + 1 or tuple(topk.shape[:-1]) != rows
                             or topk.is_floating_point()):
        raise ValueError(f"{op}: topk is {topk.dtype} {tuple(topk.shape)}; it must be None "
                         f"(HCA: every closed entry) or integer {(*rows, 'k')} (CSA: picks, "
                         "-1 for none)")


# ---------------------------------------------------------------------------- helpers
def _rows_at(pool: torch.Tensor, block_row: torch.Tensor, positions: torch.Tensor):
    """Flat pool rows of ``positions`` (int64 [n]) through one request's block-table row."""
    page_size = pool.shape[1]
    return block_row.long()[positions // page_size] * page_size + positions % page_size


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``DeepseekV4RMSNorm``: float32 statistics, times the (float32) weight, in x's dtype."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype)


def entry_rotary(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                 rope_scale: float) -> torch.Tensor:
    """Interleaved rotary on the trailing ``2 * len(inv_freq)`` channels of ``x [n, D]`` at
    ``positions [n]`` (cos/sin times ``rope_scale``, in x's dtype)."""
    freqs = positions[:, None].float() * inv_freq.to(device=x.device, dtype=torch.float)
    cos = (freqs.cos() * rope_scale).to(x.dtype).repeat_interleave(2, dim=-1)
    sin = (freqs.sin() * rope_scale).to(x.dtype).repeat_interleave(2, dim=-1)
    r = cos.shape[-1]
    nope, rope = x[..., :-r], x[..., -r:]
    half = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = ((rope.float() * cos) + (half.float() * sin)).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def _pool_entries(kv: torch.Tensor, gate: torch.Tensor, first: int, count: int, rate: int,
                  overlap: bool, position_bias: torch.Tensor) -> torch.Tensor:
    """Pooled (not yet normed) entries ``first .. first + count - 1`` from raw rows ``kv``,
    ``gate`` ``[n, W]`` that start at token ``lo = max(0, first - overlap) * rate``."""
    width = kv.shape[-1]
    lo_window = max(0, first - 1) if overlap else first
    start = (first - lo_window) * rate
    cur_kv = kv[start:start + count * rate].view(count, rate, width)
    cur_gate = gate[start:start + count * rate].view(count, rate, width) + position_bias
    if not overlap:
        weights = cur_gate.softmax(dim=1, dtype=torch.float32).to(cur_kv.dtype)
        return (cur_kv * weights).sum(dim=1)
    d = width // 2
    slots_kv = cur_kv.new_zeros(count, 2 * rate, d)
    slots_gate = cur_gate.new_full((count, 2 * rate, d), float("-inf"))
    slots_kv[:, rate:] = cur_kv[..., d:]
    slots_gate[:, rate:] = cur_gate[..., d:]
    # window w - 1's first half (Ca) feeds entry w; window -1 does not exist
    prev = [w - 1 for w in range(first, first + count)]
    for i, w in enumerate(prev):
        if w < 0:
            continue
        rows = slice((w - lo_window) * rate, (w - lo_window + 1) * rate)
        slots_kv[i, :rate] = kv[rows, :d]
        slots_gate[i, :rate] = (gate[rows] + position_bias)[:, :d]
    weights = slots_gate.softmax(dim=1, dtype=torch.float32).to(slots_kv.dtype)
    return (slots_kv * weights).sum(dim=1)


# ---------------------------------------------------------------------------- ops
def check_raw_layout(op: str, block_table: torch.Tensor, slot_mapping: torch.Tensor,
                     raw_block_table: torch.Tensor | None,
                     raw_slot_mapping: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The raw rows' table and write slots: both given, shaped like ``block_table`` and
    ``slot_mapping``, or neither (then those two); ``ValueError`` naming what is wrong."""
    if (raw_block_table is None) != (raw_slot_mapping is None):
        raise ValueError(f"{op}: raw_block_table and raw_slot_mapping come together; one of "
                         "them is None")
    if raw_block_table is None:
        return block_table, slot_mapping
    if raw_block_table.shape != block_table.shape or \
            raw_slot_mapping.shape != slot_mapping.shape:
        raise ValueError(f"{op}: raw_block_table {tuple(raw_block_table.shape)} / "
                         f"raw_slot_mapping {tuple(raw_slot_mapping.shape)} must be shaped like "
                         f"block_table {tuple(block_table.shape)} / slot_mapping "
                         f"{tuple(slot_mapping.shape)}")
    return raw_block_table, raw_slot_mapping


def compress(kv: torch.Tensor, gate: torch.Tensor, kv_pool: torch.Tensor,
             gate_pool: torch.Tensor, entry_pool: torch.Tensor,
             query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
             slot_mapping: torch.Tensor, position_bias: torch.Tensor,
             norm_weight: torch.Tensor, inv_freq: torch.Tensor, rate: int, overlap: bool,
             eps: float, rope_scale: float, raw_block_table: torch.Tensor | None = None,
             raw_slot_mapping: torch.Tensor | None = None) -> torch.Tensor:
    """Write packed raw rows ``kv``, ``gate`` ``[N, W]`` at ``slot_mapping`` (< 0: skip), then
    make every entry whose window closes inside a request's new tokens and write it at its
    index (module docstring). Returns ``[N, D]``: at the row of a window's closing token its
    entry, zeros elsewhere (rows past ``query_start_loc[R]`` too). ``raw_block_table`` /
    ``raw_slot_mapping`` (None: ``block_table`` / ``slot_mapping``): where the raw rows live
    when the raw pools are rings (``VerifierState.window_maps``); entries always follow
    ``block_table``."""
    check_compress("compress", kv, gate, kv_pool, gate_pool, entry_pool, position_bias,
                   norm_weight, inv_freq, rate, overlap, 2)
    raw_table, raw_slots = check_raw_layout("compress", block_table, slot_mapping,
                                            raw_block_table, raw_slot_mapping)
    d = entry_pool.shape[-1]
    kv_write(kv.unsqueeze(1), gate.unsqueeze(1), kv_pool.unsqueeze(2), gate_pool.unsqueeze(2),
             raw_slots)
    fresh = torch.zeros(kv.shape[0], d, dtype=kv.dtype, device=kv.device)
    flat_entries = entry_pool.view(-1, d)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i in range(len(qsl) - 1):
        start, end = qsl[i], qsl[i + 1]
        if end == start:
            continue
        context = lens[i] - (end - start)
        first, last = context // rate, lens[i] // rate  # windows closing in this step
        if last <= first:
            continue
        lo = (max(0, first - 1) if overlap else first) * rate
        raw_kv = _gather_keys(kv_pool, raw_table[i], lo, last * rate).to(kv.dtype)
        raw_gate = _gather_keys(gate_pool, raw_table[i], lo, last * rate).to(gate.dtype)
        pooled = _pool_entries(raw_kv, raw_gate, first, last - first, rate, overlap,
                               position_bias)
        windows = torch.arange(first, last, device=kv.device)
        entries = entry_rotary(_rms_norm(pooled, norm_weight, eps), windows * rate, inv_freq,
                               rope_scale)
        flat_entries.index_copy_(0, _rows_at(entry_pool, block_table[i], windows),
                                 entries.to(entry_pool.dtype))
        fresh[start + (windows + 1) * rate - 1 - context] = entries
    return fresh


def index_topk(q: torch.Tensor, weights: torch.Tensor, entry_pool: torch.Tensor,
               fresh: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
               block_table: torch.Tensor, rate: int, topk: int,
               softmax_scale: float) -> torch.Tensor:
    """CSA's lightning indexer over the indexer's entries: ``q [N, Hi, Di]`` (rotated),
    ``weights [N, Hi]`` (float32, already times HF's ``weights_scaling``) -> int64
    ``[N, topk]``.

    ``score[t, s] = sum_h weights[t, h] * relu(q[t, h] . entry[s]) * softmax_scale`` over the
    entries ``s < (p + 1) // rate`` a query at position ``p`` may see; a query keeps the
    ``min(topk, that count)`` best, the rest of its row is -1. Equal scores (a ReLU zero in every
    head is common) are resolved as HF's indexer resolves them over the same sequence: the
    scores of the request's ``seq_len // rate`` entries, computed with HF's op shapes, future
    ones -inf, through ``torch.topk`` with ``k = min(topk, seq_len // rate)`` (HF's cached decode
    and its whole-sequence forward see the same row). ``fresh`` (the indexer compress op's
    rows) orders this read after that op's writes."""
    check_index("index_topk", q, weights, entry_pool, fresh, rate, topk, 1)
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int64, device=q.device)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i in range(len(qsl) - 1):
        start, end = qsl[i], qsl[i + 1]
        count = lens[i] // rate
        if end == start or count == 0:
            continue
        context = lens[i] - (end - start)
        keys = _gather_keys(entry_pool, block_table[i], 0, count)  # [E, Di]
        # HF's scorer, shapes included: [1, L, Hi, Di] @ [1, 1, Di, E] -> [1, L, Hi, E]
        scores = torch.matmul(q[start:end].float()[None],
                              keys.transpose(-1, -2).float()[None, None])
        scores = torch.relu(scores) * softmax_scale
        weighted = weights[start:end].float()[None]
        scores = (scores * weighted.unsqueeze(-1)).sum(dim=2)[0]  # [L, E]
        seen = (context + torch.arange(end - start, device=q.device) + 1) // rate  # [L]
        future = torch.arange(count, device=q.device)[None] >= seen[:, None]
        scores = scores.masked_fill(future, float("-inf"))
        k = min(topk, count)
        picks = scores.topk(k, dim=-1).indices
        out[start:end, :k] = torch.where(picks >= seen[:, None], -1, picks)
    return out


def _attend_compressed(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       first_key: int, context: int, scale: float, window: int,
                       sinks: Optional[torch.Tensor], entries: torch.Tensor, rate: int,
                       picks: Optional[torch.Tensor]) -> torch.Tensor:
    """``attention_reference._attend_one`` with the request's entries ``[E, D]`` (key and
    value, one head for all) joining each query's softmax: all closed ones (``picks`` None) or
    the valid picks of its row."""
    num_q, num_heads, _ = q.shape
    group = num_heads // keys.shape[1]
    kh = keys.float().repeat_interleave(group, dim=1)
    vh = values.float().repeat_interleave(group, dim=1)
    ent = entries.float()
    out = torch.empty(num_q, num_heads, values.shape[2], dtype=torch.float32, device=q.device)
    for j in range(num_q):
        pos = context + j
        lo = max(0, pos - window + 1) if window else 0
        seen = slice(lo - first_key, pos + 1 - first_key)
        if picks is None:
            chosen = ent[: (pos + 1) // rate]
        else:
            row = picks[j]
            chosen = ent[row[row >= 0].long()]
        qj = q[j].float()
        scores = torch.cat([torch.einsum("hd,shd->hs", qj, kh[seen]),
                            torch.einsum("hd,sd->hs", qj, chosen)], dim=1) * scale
        vals = torch.cat([vh[seen], chosen.unsqueeze(1).expand(-1, num_heads, -1)], dim=0)
        if sinks is not None:
            logits = torch.cat([scores, sinks.float()[:, None]], dim=1)
            probs = torch.softmax(logits, dim=-1)[:, :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[j] = torch.einsum("hs,shd->hd", probs, vals)
    return out


def compressed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor,
                         query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                         block_table: torch.Tensor, slot_mapping: torch.Tensor, scale: float,
                         window: int, softcap: float, sinks: Optional[torch.Tensor],
                         entries: torch.Tensor, fresh: torch.Tensor, rate: int,
                         topk: Optional[torch.Tensor] = None,
                         entry_block_table: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``attention_reference.ragged_attention`` whose softmax also spans the compressed
    entries a query may see: with ``topk`` None every entry ``s < (p + 1) // rate`` (HCA),
    else the valid (>= 0) indices of its ``topk`` row (CSA; the indexer keeps them below that
    bound). Entries are read from ``entries`` (``fresh``: the compress op's rows, taken so the
    read follows its write) through ``entry_block_table`` (None: ``block_table``, which the
    window's keys always follow)."""
    if entry_block_table is not None and entry_block_table.shape != block_table.shape:
        raise ValueError(f"compressed_attention: entry_block_table "
                         f"{tuple(entry_block_table.shape)} must be shaped like block_table "
                         f"{tuple(block_table.shape)}")
    entry_table = block_table if entry_block_table is None else entry_block_table
    check_semantics("compressed_attention", window, softcap, sinks, q.shape[1])
    check_entries("compressed_attention", q, entries, fresh, rate, topk, 1)
    if softcap:
        raise ValueError("compressed_attention: softcap must be 0 (no compressed layer uses "
                         "one, and the entries' logits would need it too)")
    kv_write(k, v, k_cache, v_cache, slot_mapping)
    out = torch.zeros(*q.shape[:2], v.shape[2], dtype=torch.float32, device=q.device)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i in range(len(qsl) - 1):
        start, end = qsl[i], qsl[i + 1]
        if end == start:
            continue
        context = lens[i] - (end - start)
        first = max(0, context - window + 1) if window else 0
        keys = _gather_keys(k_cache, block_table[i], first, lens[i])
        values = _gather_keys(v_cache, block_table[i], first, lens[i])
        count = lens[i] // rate
        ent = _gather_keys(entries, entry_table[i], 0, count) if count else \
            entries.new_zeros(0, entries.shape[-1])
        out[start:end] = _attend_compressed(
            q[start:end], keys, values, first, context, scale, window, sinks, ent, rate,
            None if topk is None else topk[start:end])
    return out.to(q.dtype)


# ---------------------------------------------------------------------------- dense forms
def dense_layout(bs: int, t: int, context_lens: torch.Tensor, block_table: torch.Tensor,
                 page_size: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(query_start_loc, seq_lens, slot_mapping)`` of ``bs`` requests of ``T`` tokens over
    ``context_lens`` (the dense ops are the ragged ones on that layout)."""
    qsl = torch.arange(bs + 1, device=device, dtype=torch.int64) * t
    pos = context_lens.long().unsqueeze(1) + torch.arange(t, device=device)  # [bs, T]
    page = block_table.long().gather(1, pos // page_size)
    slot_mapping = (page * page_size + pos % page_size).flatten()
    return qsl, context_lens.long() + t, slot_mapping
