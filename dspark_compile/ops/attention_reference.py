"""Pure-torch reference implementations of the ``dspark::`` ops.

These are the CPU execution path and the oracle that every kernel is tested against. They
favour clarity over speed: a Python loop over requests is fine here.

Containment: a query reads only the keys it is allowed to see (its request's committed context
and its own block up to itself; with a window, only the last ``window`` of those). Keys outside
that are never touched, so whatever a padding position, a rejected draft or a page left behind
by a sliding window holds (NaN included) cannot reach an accepted row.

Attention semantics (Hugging Face's conventions, checked against transformers 5.24):

- ``window > 0``: a query at position ``p`` sees keys at ``p - window < kpos <= p``
  (``masking_utils.sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``, plus causal);
  ``window == 0``: plain causal.
- ``chunk > 0``: a query at position ``p`` sees keys at ``p - p % chunk <= kpos <= p``, its own
  chunk of ``chunk`` positions (``masking_utils.chunked_overlay`` with no left padding:
  ``kv_idx // chunk == q_idx // chunk``, plus causal; Llama 4); at most one of ``window`` and
  ``chunk`` is set.
- ``softcap > 0``: ``s = softcap * tanh(scale * q.k / softcap)`` (Gemma 2's
  ``eager_attention_forward``: after the scaling, before mask and softmax); 0: none.
- ``sinks`` ``[H]``: one extra logit per query head joins the softmax denominator, unscaled and
  not softcapped, and is dropped from the output (GPT-OSS's ``s_aux``); ``[N, H]`` (the
  attention ops only): one per query row and head (Inkling 2's, projected from each token).
- ``rel`` ``[N, H, E]`` (relative logits, one row of ``E`` per query row and head): a query at
  ``p`` adds ``rel[row, h, p - kpos]`` to its score of a key at ``kpos`` when ``0 <= p - kpos <
  E``, nothing past that (Inkling's relative position bias: HF's eager ``attn_weights +
  position_bias`` after the scaling, before mask and softmax); not with ``softcap``.
- ``alibi`` ``[H]`` (ALiBi slopes): a query at ``p`` adds ``alibi[h] * (kpos - p)`` to its score
  of a key at ``kpos`` (Bloom adds ``alibi[h] * kpos``: the same softmax); not with
  ``softcap``.
- V's head dim may differ from q/k's (DeepSeek MLA expanded: 192 / 128); out has V's.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["kv_write", "ragged_attention", "dense_cached_attention", "check_semantics",
           "check_alibi", "check_rel", "visible_from"]

_SINK_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_semantics(op: str, window, softcap, sinks, num_heads: int, device=None,
                    chunk=0, row_sinks: tuple | None = None) -> None:
    """Raise ``ValueError`` naming the argument, its value and the rule, for the attention
    switches: ``window`` and ``chunk`` python ints >= 0, not both set, ``softcap`` a finite
    number >= 0, ``sinks`` None or a float tensor ``[num_heads]`` or, where the op takes one a
    row, of shape ``row_sinks`` (on ``device``, when given)."""
    if type(window) is not int or window < 0:
        raise ValueError(f"{op}: window={window!r}; it must be an int >= 0 (0: no window; w: "
                         f"a query at p sees keys p - w < kpos <= p)")
    if type(chunk) is not int or chunk < 0:
        raise ValueError(f"{op}: chunk={chunk!r}; it must be an int >= 0 (0: no chunks; c: a "
                         f"query at p sees keys p - p % c <= kpos <= p)")
    if window and chunk:
        raise ValueError(f"{op}: window={window} and chunk={chunk}; at most one may be set")
    if (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
            or not math.isfinite(softcap) or softcap < 0):
        raise ValueError(f"{op}: softcap={softcap!r}; it must be a finite float >= 0 (0: none)")
    if sinks is None:
        return
    shape = tuple(getattr(sinks, "shape", ()))
    if not isinstance(sinks, torch.Tensor) or sinks.dtype not in _SINK_DTYPES \
            or not (_same(shape, (num_heads,)) or
                    (row_sinks is not None and _same(shape, tuple(row_sinks)))):
        rows = "" if row_sinks is None else \
            f" or {list(row_sinks)} (one logit per query row and head)"
        raise ValueError(f"{op}: sinks is {getattr(sinks, 'dtype', type(sinks).__name__)} of "
                         f"shape {shape}; it must be None or a float tensor [H] = [{num_heads}] "
                         f"(one logit per query head){rows}")
    if device is not None and sinks.device != device:
        raise ValueError(f"{op}: sinks is on {sinks.device} but q is on {device}; move it there")


def _same(shape: tuple, want: tuple) -> bool:
    """``shape == want``, lengths first: a tuple compares items before lengths, and a symbolic
    size compared with another tuple's item would guard the capture on it."""
    return len(shape) == len(want) and shape == want


def check_rel(op: str, rel, lead: tuple, softcap, device=None) -> None:
    """``rel`` is None or a float tensor ``[*lead, E]`` with ``E >= 1`` (``lead``: ``(N, H)`` for
    the ragged op, ``(bs, H, T)`` for the dense one) and a dense last dim, on ``device`` when
    given, and ``softcap`` is 0; else ``ValueError`` naming the argument and the rule."""
    if rel is None:
        return
    shape = tuple(getattr(rel, "shape", ()))
    if not isinstance(rel, torch.Tensor) or rel.dtype not in _SINK_DTYPES or \
            not _same(shape[:-1], tuple(lead)) or len(shape) != len(lead) + 1 or shape[-1] < 1:
        raise ValueError(f"{op}: rel is {getattr(rel, 'dtype', type(rel).__name__)} of shape "
                         f"{shape}; it must be None or a float tensor [{', '.join(map(str, lead))}"
                         f", E] with E >= 1 (q's rows and heads, one logit a distance)")
    if rel.stride(-1) != 1:
        raise ValueError(f"{op}: rel has stride {rel.stride(-1)} in its last dim; it must be 1")
    if softcap:
        raise ValueError(f"{op}: rel with softcap={softcap}; a relative bias is defined "
                         "without a logit softcap only")
    if device is not None and rel.device != device:
        raise ValueError(f"{op}: rel is on {rel.device} but q is on {device}; move it there")


def check_alibi(op: str, alibi, num_heads: int, softcap, device=None) -> None:
    """``alibi`` is None or a float tensor ``[num_heads]`` (on ``device`` when given) and
    ``softcap`` is 0; else ``ValueError`` naming the argument and the rule."""
    if alibi is None:
        return
    shape = tuple(getattr(alibi, "shape", ()))
    if not isinstance(alibi, torch.Tensor) or alibi.dtype not in _SINK_DTYPES or \
            not _same(shape, (num_heads,)):
        raise ValueError(f"{op}: alibi is {getattr(alibi, 'dtype', type(alibi).__name__)} of "
                         f"shape {shape}; it must be None or a float tensor [H] = [{num_heads}] "
                         "(one slope per query head)")
    if softcap:
        raise ValueError(f"{op}: alibi with softcap={softcap}; ALiBi is defined without a logit "
                         "softcap only")
    if device is not None and alibi.device != device:
        raise ValueError(f"{op}: alibi is on {alibi.device} but q is on {device}; move it there")


def kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write packed ``k [N, Hkv, Dk]``, ``v [N, Hkv, Dv]`` into pool rows ``slot_mapping [N]``
    (< 0: skip)."""
    page_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    rows = slot_mapping[keep].long()
    flat_k = k_cache.view(-1, *k_cache.shape[2:])  # [pages * page_size, Hkv, Dk]
    flat_v = v_cache.view(-1, *v_cache.shape[2:])  # [pages * page_size, Hkv, Dv]
    assert flat_k.shape[0] == k_cache.shape[0] * page_size, "pool must be contiguous"
    flat_k.index_copy_(0, rows, k[keep].to(k_cache.dtype))
    flat_v.index_copy_(0, rows, v[keep].to(v_cache.dtype))


def _gather_keys(cache: torch.Tensor, block_row: torch.Tensor, start: int,
                 end: int) -> torch.Tensor:
    """Positions ``start .. end - 1`` of one request's pages: ``[end - start, Hkv, D]``. Only
    the pages holding them are indexed (a window's earlier pages may be gone)."""
    page_size = cache.shape[1]
    first, last = start // page_size, -(-end // page_size)
    rows = cache[block_row[first:last].long()].flatten(0, 1)
    return rows[start - first * page_size: end - first * page_size]


def visible_from(pos: int, window: int, chunk: int) -> int:
    """The first key position a query at ``pos`` sees (the module docstring's rules)."""
    if window:
        return max(0, pos - window + 1)  # p - window < kpos <= p
    return pos - pos % chunk if chunk else 0


def _attend_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_key: int,
                context: int, scale: float, window: int, softcap: float,
                sinks: Optional[torch.Tensor], chunk: int = 0,
                rel: Optional[torch.Tensor] = None,
                alibi: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of ``q [L, H, Dk]`` at positions ``context + j`` over ``keys [S, Hkv, Dk]``,
    ``values [S, Hkv, Dv]`` holding positions ``first_key ..`` (``rel [L, H, E]``: the rows'
    relative logits); returns fp32 ``[L, H, Dv]``."""
    num_q, num_heads, _ = q.shape
    group = num_heads // keys.shape[1]
    kh = keys.float().repeat_interleave(group, dim=1)  # [S, H, Dk]
    vh = values.float().repeat_interleave(group, dim=1)  # [S, H, Dv]
    out = torch.empty(num_q, num_heads, values.shape[2], dtype=torch.float32, device=q.device)
    for j in range(num_q):
        pos = context + j
        lo = visible_from(pos, window, chunk)
        seen = slice(lo - first_key, pos + 1 - first_key)  # only these keys are read at all
        scores = torch.einsum("hd,shd->hs", q[j].float(), kh[seen]) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        dist = pos - torch.arange(lo, pos + 1, device=q.device)  # each seen key's distance
        if rel is not None:  # in range for the nearest E
            near = dist < rel.shape[2]
            scores[:, near] += rel[j][:, dist[near]].float()
        if alibi is not None:  # the head's slope times kpos - pos
            scores -= alibi.float()[:, None] * dist.float()
        if sinks is not None:  # one more logit per head in the denominator, then dropped
            sink = sinks[j] if sinks.dim() == 2 else sinks  # [L, H]: the row's own
            logits = torch.cat([scores, sink.float()[:, None]], dim=1)
            probs = torch.softmax(logits, dim=-1)[:, :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[j] = torch.einsum("hs,shd->hd", probs, vh[seen])
    return out


def ragged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                     seq_lens: torch.Tensor, block_table: torch.Tensor,
                     slot_mapping: torch.Tensor, scale: float, window: int = 0,
                     softcap: float = 0.0, sinks: Optional[torch.Tensor] = None,
                     chunk: int = 0, rel: Optional[torch.Tensor] = None,
                     alibi: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Write the new K/V, then causal paged attention for packed queries.

    q ``[N, H, Dk]``; k ``[N, Hkv, Dk]``, v ``[N, Hkv, Dv]``; pools ``[pages, page_size, Hkv,
    Dk or Dv]``; query_start_loc ``[R + 1]``; seq_lens ``[R]`` (context + own length);
    block_table ``[R, pages_per_request]``; slot_mapping ``[N]`` (< 0 for padding rows);
    ``window``, ``softcap``, ``sinks``, ``chunk``, ``rel``, ``alibi``: the module docstring. Returns
    ``[N, H, Dv]`` in q's dtype; rows past ``query_start_loc[R]`` are zeros.
    """
    check_semantics("ragged_attention", window, softcap, sinks, q.shape[1], chunk=chunk,
                    row_sinks=tuple(q.shape[:2]))
    check_rel("ragged_attention", rel, tuple(q.shape[:2]), softcap)
    check_alibi("ragged_attention", alibi, q.shape[1], softcap)
    kv_write(k, v, k_cache, v_cache, slot_mapping)
    out = torch.zeros(*q.shape[:2], v.shape[2], dtype=torch.float32, device=q.device)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i in range(len(qsl) - 1):
        start, end = qsl[i], qsl[i + 1]
        if end == start:
            continue
        context = lens[i] - (end - start)
        first = visible_from(context, window, chunk)  # the first query's first key
        keys = _gather_keys(k_cache, block_table[i], first, lens[i])
        values = _gather_keys(v_cache, block_table[i], first, lens[i])
        out[start:end] = _attend_one(q[start:end], keys, values, first, context, scale,
                                     window, softcap,
                                     sinks[start:end] if sinks is not None and sinks.dim() == 2
                                     else sinks, chunk,
                                     None if rel is None else rel[start:end], alibi)
    return out.to(q.dtype)


def dense_cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, window: int = 0, softcap: float = 0.0,
                           sinks: Optional[torch.Tensor] = None,
                           chunk: int = 0, rel: Optional[torch.Tensor] = None,
                           alibi: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dense verify attention: every one of ``bs`` requests runs ``T`` tokens.

    q ``[bs, H, T, Dk]``, k ``[bs, Hkv, T, Dk]``, v ``[bs, Hkv, T, Dv]`` (the layout HF attention
    functions receive), rel ``[bs, H, T, E]``, sinks ``[H]`` or ``[bs, H, T]``; returns
    ``[bs, T, H, Dv]``. Token ``t`` of request ``b`` sits at
    ``context_lens[b] + t``, writes its K/V there and attends keys ``0 .. context_lens[b] + t``
    (the last ``window`` of them with a window, those of its own chunk with ``chunk``). Defined
    as the ragged op on ``bs`` requests
    of length ``T`` so the two can never disagree.
    """
    bs, num_heads, t, d = q.shape
    page_size = k_cache.shape[1]
    lens = torch.full((bs,), t, dtype=torch.int64, device=q.device)
    qsl = torch.zeros(bs + 1, dtype=torch.int64, device=q.device)
    qsl[1:] = torch.cumsum(lens, 0)
    pos = context_lens.long().unsqueeze(1) + torch.arange(t, device=q.device)  # [bs, T]
    page = block_table.long().gather(1, pos // page_size)
    slot_mapping = (page * page_size + pos % page_size).flatten()
    dv = v.shape[3]
    check_semantics("dense_cached_attention", window, softcap, sinks, num_heads, chunk=chunk,
                    row_sinks=(bs, num_heads, t))
    check_rel("dense_cached_attention", rel, (bs, num_heads, t), softcap)
    rows = None if rel is None else rel.transpose(1, 2).reshape(bs * t, num_heads, -1)
    if sinks is not None and sinks.dim() == 3:  # [bs, H, T] -> a row's own [N, H]
        sinks = sinks.transpose(1, 2).reshape(bs * t, num_heads)
    out = ragged_attention(
        q.transpose(1, 2).reshape(bs * t, num_heads, d),
        k.transpose(1, 2).reshape(bs * t, k.shape[1], d),
        v.transpose(1, 2).reshape(bs * t, v.shape[1], dv),
        k_cache, v_cache, qsl, context_lens.long() + t, block_table, slot_mapping, scale,
        window, softcap, sinks, chunk, rows, alibi,
    )
    return out.view(bs, t, num_heads, dv)
