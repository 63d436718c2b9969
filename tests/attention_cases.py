"""Ragged paged attention inputs and a naive dense oracle, shared by the attention tests
(``tests/ops/test_attention_semantics.py``, ``tests/kernels/test_triton_attention_semantics.py``).

The oracle is written independently of ``ops/attention_reference.py``: it gathers every
position of a request token by token and applies one dense boolean mask (causal, window),
the softcap and the sink column to a full score matrix, as Hugging Face's eager attention does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class AttentionCase:
    """Inputs of one ragged attention call."""

    q: torch.Tensor  # [N, H, Dk]
    k: torch.Tensor  # [N, Hkv, Dk]
    v: torch.Tensor  # [N, Hkv, Dv]
    k_cache: torch.Tensor  # [P, page, Hkv, Dk]
    v_cache: torch.Tensor  # [P, page, Hkv, Dv]
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    lens: list[int]
    contexts: list[int]

    def args(self) -> list:
        """Positional tensor arguments, with fresh copies of the pools (the op mutates them)."""
        return [self.q, self.k, self.v, self.k_cache.clone(), self.v_cache.clone(),
                self.query_start_loc, self.seq_lens, self.block_table, self.slot_mapping]

    @property
    def num_real(self) -> int:
        return sum(self.lens)


def make_case(lens, contexts, heads, kv_heads, dk, dv=None, page=4, num_pad=0, seed=0,
              dtype=torch.float32, device="cpu") -> AttentionCase:
    """Random packed layout: request ``i`` has ``lens[i]`` new tokens after ``contexts[i]``
    committed ones; pages of a request are scattered; ``num_pad`` padding rows (slot -1)."""
    dv = dk if dv is None else dv
    g = torch.Generator().manual_seed(seed)
    r, n = len(lens), sum(lens) + num_pad
    per_req = max([-(-(c + n_) // page) for c, n_ in zip(contexts, lens)] + [1]) + 1
    num_pages = r * per_req + 3
    table = torch.randperm(num_pages, generator=g)[: r * per_req].view(r, per_req)
    qsl = torch.zeros(r + 1, dtype=torch.int64)
    qsl[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)
    slots = torch.full((n,), -1, dtype=torch.int64)
    for i, (c, length) in enumerate(zip(contexts, lens)):
        pos = torch.arange(c, c + length)
        slots[qsl[i]: qsl[i] + length] = table[i, pos // page] * page + pos % page

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    return AttentionCase(
        rnd(n, heads, dk), rnd(n, kv_heads, dk), rnd(n, kv_heads, dv),
        rnd(num_pages, page, kv_heads, dk), rnd(num_pages, page, kv_heads, dv),
        qsl.to(torch.int32).to(device),
        torch.tensor([c + n_ for c, n_ in zip(contexts, lens)], dtype=torch.int32,
                     device=device),
        table.to(torch.int32).to(device), slots.to(device), list(lens), list(contexts))


def naive_attention(case: AttentionCase, scale: float, window: int = 0, softcap: float = 0.0,
                    sinks: Optional[torch.Tensor] = None, chunk: int = 0,
                    rel: Optional[torch.Tensor] = None,
                    alibi: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 ``[N, H, Dv]``: per request, every position's K/V (pool, then this step's rows),
    one dense masked softmax. Padding rows are zeros. Reads every position of the request, so
    it is the oracle for values, not for containment. ``sinks``: ``[H]`` or a row's own
    ``[N, H]``. ``rel [N, H, E]``: HF's materialised
    position bias, gathered by distance and zero past ``E`` (Inkling's)."""
    q, k, v = case.q.float(), case.k.float(), case.v.float()
    page = case.k_cache.shape[1]
    heads, group = q.shape[1], q.shape[1] // k.shape[1]
    flat_k = case.k_cache.float().flatten(0, 1)
    flat_v = case.v_cache.float().flatten(0, 1)
    out = torch.zeros(q.shape[0], heads, v.shape[2])
    qsl = case.query_start_loc.tolist()
    for i, (ctx, length) in enumerate(zip(case.contexts, case.lens)):
        if length == 0:
            continue
        s, e = qsl[i], qsl[i + 1]
        rows = [int(case.block_table[i, p // page]) * page + p % page for p in range(ctx)]
        keys = torch.cat([flat_k[rows], k[s:e]]).repeat_interleave(group, 1)  # [S, H, Dk]
        vals = torch.cat([flat_v[rows], v[s:e]]).repeat_interleave(group, 1)  # [S, H, Dv]
        scores = torch.einsum("qhd,khd->hqk", q[s:e], keys) * scale  # [H, L, S]
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        qpos = ctx + torch.arange(length)[:, None]
        kpos = torch.arange(ctx + length)[None, :]
        mask = kpos <= qpos
        if rel is not None:
            dist = (qpos - kpos).expand(length, ctx + length)  # [L, S]
            extent = rel.shape[2]
            table = rel[s:e].float().transpose(0, 1)  # [H, L, E]
            bias = table.gather(2, dist.clamp(0, extent - 1).expand(heads, -1, -1))
            scores = scores + bias.masked_fill((dist < 0) | (dist >= extent), 0.0)
        if alibi is not None:  # BLOOM's form: slope * kpos (a row's constant from kpos - qpos)
            scores = scores + alibi.float().view(heads, 1, 1) * kpos.float()[None]
        if window > 0:
            mask &= kpos > qpos - window
        if chunk > 0:  # transformers' chunked_overlay: the same chunk of positions
            mask &= kpos // chunk == qpos // chunk
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            sink_col = sinks[s:e].float().t()[:, :, None] if sinks.dim() == 2 else \
                sinks.float().view(heads, 1, 1).expand(heads, length, 1)  # [H, L, 1]
            probs = torch.cat([scores, sink_col], -1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[s:e] = torch.einsum("hqk,khd->qhd", probs, vals)
    return out
