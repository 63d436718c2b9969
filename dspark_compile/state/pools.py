"""Engine-owned verify state: the paged KV pool, its block tables and committed lengths.

Each state-pool row (a *slot*) owns ``pages_per_request`` pages of ``page_size`` tokens. The
pages of a slot are spread over the pool by a fixed permutation, so the block table is always
exercised (no kernel may assume a slot's pages are contiguous).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..layout import VerifyLayout
from ..specs import AttentionSpec, compress_pools, index_pools
from . import checks
from .linear import LinearPools
from .steps import StepLedger

__all__ = ["VerifierState", "entry_pages", "ring_spans", "window_rings"]


def window_rings(specs: list[AttentionSpec], pages_per_request: int, page_size: int,
                 max_step_tokens: int | None) -> dict[int, int]:
    """Pages per slot of each span's ring (``ring_spans``): ``{span: pages}``.

    A pool of span ``w`` is read, in a step of at most ``max_step_tokens`` tokens per request,
    no further back than ``w - 1`` positions before the step; a ring of ``ceil((w +
    max_step_tokens - 1) / page_size)`` pages per slot, position ``p`` at ring row ``p mod
    (pages * page_size)``, holds every row read, and a step's writes only overwrite positions
    that no read of it or of a later step reaches (nor can a rejected draft's rows). Spans
    whose ring would not be smaller than the block table keep full pools, as does every pool
    without ``max_step_tokens``."""
    if max_step_tokens is None:
        return {}
    out = {}
    for span in {w for spans in ring_spans(specs).values() for w in spans if w}:
        pages = -(-(span + max_step_tokens - 1) // page_size)
        if pages < pages_per_request:
            out[span] = pages
    return out


def ring_spans(specs: list[AttentionSpec]) -> dict[int, tuple[int, int]]:
    """``{layer: (kv span, raw span)}`` (0: none) of the layers whose recent rows may live in
    rings: a sliding window's KV (span ``window``) and a compressor's raw rows (span ``rate``,
    ``2 * rate`` with overlap: the oldest row a step's closing windows pool)."""
    out = {}
    for i, s in enumerate(specs):
        raw = 0 if s.compress is None else s.compress.rate * (2 if s.compress.overlap else 1)
        if s.window > 0 or raw:
            out[i] = (max(s.window, 0), raw)
    return out


def entry_pages(specs: list[AttentionSpec], pages_per_request: int, page_size: int,
                max_context: int) -> dict[int, int]:
    """Pages per slot of the entry pools of each compression rate: ``{rate: pages}``, entry
    ``w < ceil(max_context / rate)`` at column ``w // page_size`` (rates whose pages would not
    be fewer than the block table's are left out)."""
    out = {}
    for s in specs:
        if s.compress is not None:
            pages = -(-(-(-max_context // s.compress.rate)) // page_size)
            if pages < pages_per_request:
                out[s.compress.rate] = pages
    return out


def _page_map(block_table: torch.Tensor, pages: int) -> torch.Tensor:
    """int32 ``[num_pages]``: page ``c`` of slot ``r`` (``block_table[r, c]``) -> page
    ``r * pages + c mod pages`` of a pool of ``pages`` pages a slot."""
    slots, cols = block_table.shape
    compact = torch.arange(slots, dtype=torch.int32)[:, None] * pages + \
        torch.arange(cols, dtype=torch.int32) % pages  # [R, pages_per_request]
    page_map = torch.empty(block_table.numel(), dtype=torch.int32)
    page_map[block_table.long().view(-1)] = compact.view(-1)
    return page_map


@dataclass(eq=False)  # compared and hashed by identity: a verifier keys its sessions by state
class VerifierState:
    """KV pool and bookkeeping for up to ``max_requests`` requests of ``max_context`` tokens."""

    max_requests: int
    """State-pool rows (slots)."""
    max_context: int
    """Tokens a slot can hold (committed plus provisional)."""
    page_size: int
    """Tokens per KV page."""
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    """Per attention layer: K and V pools ``[num_pages, page_size, kv_heads, head_dim]`` (V:
    the layer's value head dim); one tensor twice for a K=V layer (``AttentionSpec.shared_kv``),
    an earlier layer's pair for a KV-shared one (``AttentionSpec.kv_from``)."""
    block_table: torch.Tensor
    """int32 ``[max_requests, pages_per_request]`` on the pool's device: page ids per slot."""
    committed_lens: torch.Tensor = field(default=None)  # type: ignore[assignment]
    """int32 ``[max_requests]`` on the CPU: tokens committed per slot."""
    linear: LinearPools | None = field(default=None, repr=False)
    """Conv/recurrent pools and replay rings of the linear-attention layers (hybrid models)."""
    compress_pools: list[torch.Tensor] = field(default_factory=list, repr=False)
    """Compressed-attention layers (DeepSeek-V4 HCA / CSA), in ``specs.compress_pools`` order:
    raw ``kv`` / ``gate`` rows and entries ``[num_pages, page_size, channels]``, paged like the
    KV pool (token ``p``'s rows and entry ``w`` at positions ``p`` and ``w`` of the slot's
    pages). Nothing to commit or roll back: the committed length says which rows and entries
    (``committed // rate``) are valid, and a step rewrites whatever lies past it. The entry
    pools use ``1 / rate`` of their rows (a known waste, kept for one page geometry); with
    ``window_rings`` the raw pools are rings (``window_maps``)."""
    index_pools: list[torch.Tensor] = field(default_factory=list, repr=False)
    """Sparse-attention layers with their own indexer (DSA), in ``specs.index_pools`` order:
    one indexer key per token ``[num_pages, page_size, channels]``, paged like the KV pool.
    Nothing to commit or roll back, as for the compressor pools."""
    window_maps: dict[int, torch.Tensor | None] = field(default_factory=dict, repr=False)
    """By span (``ring_spans``: plain sliding windows, compressors' raw rows): int32
    ``[num_pages]``, the ring page that holds each page of the block table
    (``window_rings``), or None where those pools are full."""
    entry_maps: dict[int, torch.Tensor | None] = field(default_factory=dict, repr=False)
    """Compressed layers, by rate: int32 ``[num_pages]``, the entry-pool page that holds each
    page of the block table (``entry_pages``: only a slot's first pages hold entries), or None
    where the entry pools are full."""
    max_step_tokens: int | None = None
    """Most rows one step may carry, as ``new_state`` was told (None: not bounded); engines
    prefill long prompts in chunks of it."""
    window_step_tokens: int = 0
    """Most tokens of one request in one step that the rings were sized for (0: no ring)."""

    def __post_init__(self) -> None:
        if self.committed_lens is None:
            self.committed_lens = torch.zeros(self.max_requests, dtype=torch.int32)
        self.steps = StepLedger(self.max_requests)
        """Which forward wrote each slot's provisional rows (``state/steps.py``)."""

    @classmethod
    def allocate(
        cls,
        specs: list[AttentionSpec],
        max_requests: int,
        max_context: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_step_tokens: int | None = None,
    ) -> "VerifierState":
        """Pools for ``specs``. With ``max_step_tokens``, a plain sliding-window layer's K/V
        (``window_rings``) holds only the pages its window and one step can reach."""
        for name, value in (("max_requests", max_requests), ("max_context", max_context),
                            ("page_size", page_size)):
            checks.positive_size("new_state", name, value)
        pages_per_request = -(-max_context // page_size)
        num_pages = max_requests * pages_per_request
        rings = window_rings(specs, pages_per_request, page_size, max_step_tokens)
        spans = ring_spans(specs)
        entries = entry_pages(specs, pages_per_request, page_size, max_context) \
            if max_step_tokens is not None else {}

        def slot_pages(span: int) -> int:  # pages of a pool of this span (0: full)
            return max_requests * rings.get(span, pages_per_request)

        pages = [slot_pages(spans.get(i, (0, 0))[0]) for i in range(len(specs))]
        widths, compress_pages, seen = [], [], {}
        for layer, width in compress_pools(specs):  # per layer: raw kv, raw gate, entries, ...
            kind = seen[layer] = seen.get(layer, -1) + 1
            widths.append(width)
            rate = specs[layer].compress.rate
            compress_pages.append(max_requests * entries.get(rate, pages_per_request)
                                  if kind % 3 == 2 else slot_pages(spans[layer][1]))
        index_widths = [w for _, w in index_pools(specs)]
        itemsize = torch.empty(0, dtype=dtype).element_size()
        checks.check_memory("new_state", page_size * itemsize * (sum(
            n * s.num_kv_heads * (s.head_dim + (0 if s.shared_kv else s.value_dim))
            for n, s in zip(pages, specs) if s.kv_from is None)
            + sum(n * w for n, w in zip(compress_pages, widths))
            + num_pages * sum(index_widths)),
            device,
            f"a KV pool of max_requests={max_requests} x max_context={max_context} tokens")
        # A fixed permutation (not random per run): the same state layout on every rank.
        perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(0))
        block_table = perm.view(max_requests, pages_per_request).to(torch.int32)
        kv = []
        for n, s in zip(pages, specs):
            if s.kv_from is not None:  # an earlier layer's pools, handed on (kv_from)
                kv.append(kv[s.kv_from])
                continue
            k = torch.zeros(n, page_size, s.num_kv_heads, s.head_dim, dtype=dtype,
                            device=device)
            # K=V layers: one pool passed as both; the step writes the same rows through
            # either name, and every read sees them
            kv.append((k, k) if s.shared_kv else (k, torch.zeros(
                n, page_size, s.num_kv_heads, s.value_dim, dtype=dtype, device=device)))
        compressed = [torch.zeros(n, page_size, w, dtype=dtype, device=device)
                      for n, w in zip(compress_pages, widths)]
        keys = [torch.zeros(num_pages, page_size, w, dtype=dtype, device=device)
                for w in index_widths]
        maps = {w: None for pair in spans.values() for w in pair if w}
        maps.update({w: _page_map(block_table, n).to(device) for w, n in rings.items()})
        entry_maps = {s.compress.rate: None for s in specs if s.compress is not None}
        entry_maps.update({rate: _page_map(block_table, n).to(device)
                           for rate, n in entries.items()})
        return cls(max_requests, max_context, page_size, kv, block_table.to(device),
                   compress_pools=compressed, index_pools=keys, window_maps=maps,
                   entry_maps=entry_maps,
                   window_step_tokens=max_step_tokens if rings else 0)

    # ------------------------------------------------------------------ per-step metadata
    def check_layout(self, layout: VerifyLayout, num_tokens: int) -> None:
        """Validate a layout against this pool (host-side, before any launch): its geometry,
        and each request's ``context_lens`` equal to its slot's committed length (less would
        overwrite committed KV rows, more would read rows never committed)."""
        if not isinstance(layout, VerifyLayout):
            raise ValueError(f"layout is a {type(layout).__name__}; it must be a VerifyLayout")
        layout.check_intact()
        layout.validate(num_tokens, self.max_requests, self.max_context)
        if self.linear is not None:
            self.linear.check_rows(num_tokens)
        qsl, ctx, slots = layout.host
        lens = np.diff(qsl) if self.window_step_tokens else None  # [R]: only rings bound it
        if lens is not None and len(lens) and int(lens.max()) > self.window_step_tokens:
            i = int(np.argmax(lens))
            raise ValueError(
                f"request {i} has {int(lens[i])} tokens in this step but the sliding-window "
                f"layers' KV rings were sized for at most {self.window_step_tokens} "
                "(new_state's max_step_tokens): more would overwrite keys still in the "
                "window. Split the step, or make the state with a larger max_step_tokens")
        committed = self.committed_lens.numpy()[slots]  # [R]
        if (ctx != committed).any():
            i = int(np.flatnonzero(ctx != committed)[0])
            if ctx[i] > committed[i]:
                raise ValueError(
                    f"request {i}: context_lens={int(ctx[i])} but slot "
                    f"{int(slots[i])} has only {int(committed[i])} committed tokens; a verify "
                    "step may only read committed context"
                )
            raise ValueError(
                f"request {i}: context_lens={int(ctx[i])} but slot {int(slots[i])} has "
                f"{int(committed[i])} committed tokens: the step would overwrite committed KV "
                "rows (a rewind). context_lens must equal the committed length; to start a "
                "request over, release its slot"
            )

    def device_metadata(self, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                        slots: torch.Tensor, num_tokens: int,
                        mrope_deltas: torch.Tensor | None = None,
                        triton: bool = False) -> dict[str, torch.Tensor]:
        """Per-row and per-request metadata of a packed batch, computed on the pool's device.

        Torch ops only, no host sync, so it runs inside a CUDA graph. Inputs may be padded:
        rows at or past ``query_start_loc[-1]`` belong to no request (position 0, slot mapping
        -1), and requests of length 0 read nothing. Returns ``positions [N]``, ``seq_lens [R]``,
        ``block_table [R, pages]`` and ``slot_mapping [N]``; with ``mrope_deltas [R]`` also
        ``mrope_positions [3, N]``: ``positions + mrope_deltas[request]`` in all three rows
        (padding rows take delta 0). ``triton``: the same in one Triton launch
        (``kernels/metadata.py``; int32 inputs, as the layout and the tier buffers
        hold them).
        """
        if triton:
            from ..kernels.metadata import device_metadata_triton

            return self._window_metadata(device_metadata_triton(
                query_start_loc, context_lens, slots, self.block_table, self.page_size,
                num_tokens, mrope_deltas))
        qsl = query_start_loc.long()
        rows = torch.arange(num_tokens, device=qsl.device)
        # request of each row: the last request whose start is <= row.
        req = torch.searchsorted(qsl[1:], rows, right=True).clamp(max=qsl.numel() - 2)
        valid = rows < qsl[-1]
        positions = torch.where(valid, context_lens.long()[req] + rows - qsl[req], 0)
        table = self.block_table[slots.long()]  # [R, pages]
        page = table[req, positions // self.page_size].long()
        slot_mapping = torch.where(valid, page * self.page_size + positions % self.page_size, -1)
        lens = (qsl[1:] - qsl[:-1]).to(torch.int32)
        out = {"positions": positions, "seq_lens": context_lens + lens, "block_table": table,
               "slot_mapping": slot_mapping, "query_start_loc": query_start_loc, "slots": slots}
        if mrope_deltas is not None:
            delta = torch.where(valid, mrope_deltas.long()[req], 0)
            out["mrope_positions"] = (positions + delta).expand(3, num_tokens)
        return self._window_metadata(out)

    @property
    def compact(self) -> bool:
        """Whether some pool is a ring or a compact entry pool (``window_rings``)."""
        return any(m is not None for m in self.window_maps.values()) or \
            any(m is not None for m in self.entry_maps.values())

    def _window_metadata(self, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``out`` plus each ring's block table and slot mapping (``window_block_table_<w>``,
        ``window_slot_mapping_<w>``: the batch's pages and rows mapped to ring pages; padding
        rows keep slot -1) and each compression rate's entry table (``entry_block_table_<r>``).
        Torch ops only (CUDA-graph safe)."""
        table, slot = out["block_table"], out["slot_mapping"]
        for window, page_map in self.window_maps.items():
            if page_map is None:  # full pools: the batch's own table and rows
                out[f"window_block_table_{window}"] = table
                out[f"window_slot_mapping_{window}"] = slot
                continue
            out[f"window_block_table_{window}"] = page_map[table.long()]
            page = page_map[slot.clamp(min=0) // self.page_size].long()
            out[f"window_slot_mapping_{window}"] = torch.where(
                slot >= 0, page * self.page_size + slot % self.page_size, -1)
        for rate, page_map in self.entry_maps.items():
            out[f"entry_block_table_{rate}"] = table if page_map is None else \
                page_map[table.long()]
        return out

    def slot_mapping(self, layout: VerifyLayout) -> torch.Tensor:
        """int64 [N]: pool row (page * page_size + offset) that each packed token writes."""
        pos = layout.positions
        req = layout.request_of_token
        table = self.block_table.cpu()[layout.slots.long()][req]  # [N, pages_per_request]
        page = table.gather(1, (pos // self.page_size).unsqueeze(1)).squeeze(1).long()
        return page * self.page_size + pos % self.page_size

    def advance(self, layout: VerifyLayout, accept_lens) -> torch.Tensor:
        """Make the first ``accept_lens[i]`` tokens of request ``i`` permanent.

        Checks ``accept_lens`` and advances the committed lengths (host bookkeeping); returns
        the checked int64 ``accept_lens`` (CPU). Linear-attention state is advanced by
        ``Verifier.commit``, which knows the lowering of the commit ops.

        The layout must be the one whose forward last wrote its slots (``StepLedger``), and each
        request's ``context_lens`` its slot's committed length (so a step commits once); a
        refused call changes nothing.
        """
        if not isinstance(layout, VerifyLayout):
            raise ValueError(f"commit: layout is a {type(layout).__name__}; it must be the "
                             "VerifyLayout of the verify being committed")
        layout.check_intact()
        self.steps.check_commit(layout, rings=self.linear is not None)
        acc, a = checks.accept_lens(accept_lens, layout.num_requests)
        qsl, ctx, slots = layout.host
        lens = qsl[1:] - qsl[:-1]
        if a.min() < 1 or (a > lens).any():
            i = int(np.flatnonzero((a < 1) | (a > lens))[0])
            raise ValueError(
                f"commit: accept_lens[{i}]={int(a[i])}; it must be in 1..{int(lens[i])} "
                "(the verify length of that request)"
            )
        committed = self.committed_lens.numpy()
        stale = committed[slots] != ctx
        if stale.any():
            i = int(np.flatnonzero(stale)[0])
            raise ValueError(
                f"commit: request {i} was verified over context_lens={int(ctx[i])} but slot "
                f"{int(slots[i])} now has {int(committed[slots[i]])} committed tokens: this "
                "step was already committed; commit each step once"
            )
        committed[slots] = ctx + a  # writes through to committed_lens (a NumPy view)
        return acc

    def release(self, slots) -> None:
        """Forget the requests in ``slots`` (their rows may be reused by new requests): an int
        or a 1-D sequence, NumPy array or tensor of int slot ids in ``0..max_requests-1``
        (bools, floats and negative ids are refused, not converted)."""
        ids = checks.slot_ids("release", slots, self.max_requests)
        index = torch.from_numpy(ids)
        self.committed_lens[index] = 0
        self.steps.forget(ids)
        if self.linear is not None:
            self.linear.release(index)
