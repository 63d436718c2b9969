"""Replay of a packed verify forward per token tier, with static buffers and padding.

The forward is captured once per tier into one shared CUDA-graph memory pool. A call copies
its inputs into static buffers sized for the largest tier (token ids, and one int32 row holding
query_start_loc, context lengths, slots and mRoPE deltas, so the host does two copies), pads
them, replays the smallest tier that holds the batch, and returns the real rows of a static
logits buffer.
Per-row metadata (positions, slot mapping, block-table rows) is computed on the device inside
the graph, so there is no host-side packing beyond those two copies.

Padding contract: padded requests have length 0 (their query_start_loc entries repeat the real
token count) and read nothing; padded rows belong to no request, write no KV (slot mapping -1)
and come out of attention as zeros; their logits are never returned.

Before the first capture, every tier's forward (and commit) runs once with the Triton launches
turned into compiles on a thread pool (``kernels/launch.py``), so the kernels the tier set needs
compile side by side rather than one after another inside the captures.

Models with linear-attention layers also get one commit graph per request-slot count: a commit
stages ``query_start_loc``, slots and accept lengths into the same row (padded requests accept
nothing, so the commit kernels leave every state alone for them) and replays the commit of every
layer in one graph instead of two eager launches per layer.

Without a GPU (or with ``use_graphs=False``) the same code runs the forward and the commit
eagerly on the static buffers: that is how the static-buffer and padding path is tested on the
CPU.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..layout import VerifyLayout
from .tiers import Tier, format_tiers, select_tier

__all__ = ["TierGraphs", "TierReport"]

log = logging.getLogger("dspark_compile")
_warned_no_ahead = False


@dataclass(frozen=True)
class TierReport:
    """What capturing one tier cost."""

    tier: Tier
    seconds: float
    pool_bytes: int
    """Growth of the shared graph pool while capturing this tier (largest tier first; the
    sum over tiers is the pool's size)."""


class TierGraphs:
    """Per-tier replay of ``forward(input_ids [T], qsl [S+1], ctx [S], slots [S],
    mrope_deltas [S]) -> [T, V]``."""

    def __init__(self, forward: Callable, tiers: tuple[Tier, ...], vocab: int,
                 dtype: torch.dtype, device: torch.device, use_graphs: bool | None = None,
                 debug: bool = False, commit: Callable | None = None) -> None:
        if not tiers:
            raise ValueError("TierGraphs: the tier set is empty")
        self.forward, self.tiers, self.debug = forward, tuple(sorted(tiers)), debug
        self.commit_fn = commit  # (qsl [S+1], slots [S], accept_lens [S]) -> None, or None
        self.commit_slots = tuple(sorted({t.request_slots for t in tiers}))
        self.device = device
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        self.max_tokens = max(t.tokens for t in tiers)
        self.max_slots = max(t.request_slots for t in tiers)
        s = self.max_slots
        self.ids = torch.zeros(self.max_tokens, dtype=torch.int64, device=device)
        # [qsl S+1 | context S | slots S | mRoPE deltas S | accept lens S]
        self.meta = torch.zeros(5 * s + 1, dtype=torch.int32, device=device)
        self.logits = torch.zeros(self.max_tokens, vocab, dtype=dtype, device=device)
        # Two pinned staging rows used in turn: a row is rewritten only after the copy that
        # read it has run (its event), so a step can be packed while the last one runs.
        pinned = device.type == "cuda"
        self._host_meta = [torch.zeros(5 * s + 1, dtype=torch.int32, pin_memory=pinned)
                           for _ in range(2)]
        # NumPy views of the rows, made once: slice writes cost ~1 us, not ~5, and .numpy()
        # itself ~2 us per call on a 2-core Xeon.
        self._host_meta_view = [row.numpy() for row in self._host_meta]
        self._copied = [torch.cuda.Event() if pinned else None for _ in range(2)]
        self._turn = 0
        self.graphs: dict[Tier, torch.cuda.CUDAGraph] = {}
        self.commit_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._addresses = self._buffer_addresses()
        self._warned_eager = False
        self._tier_of: dict[tuple[int, int], Tier | None] = {}
        self.ahead_seconds = 0.0
        """Seconds the last capture spent compiling kernels ahead (``capture``)."""

    def _buffer_addresses(self) -> tuple[int, ...]:
        return (self.ids.data_ptr(), self.meta.data_ptr(), self.logits.data_ptr())

    def views(self, tier: Tier) -> tuple[torch.Tensor, ...]:
        """The static inputs of ``tier``: ids [T], qsl [S+1], context lens [S], slots [S],
        mRoPE deltas [S]."""
        s, base, m = tier.request_slots, self.max_slots + 1, self.max_slots
        return (self.ids[:tier.tokens], self.meta[:s + 1], self.meta[base:base + s],
                self.meta[base + m:base + m + s], self.meta[base + 2 * m:base + 2 * m + s])

    def commit_views(self, slots: int) -> tuple[torch.Tensor, ...]:
        """The static commit inputs of ``slots`` request slots: qsl [S+1], slots [S], accept
        lens [S]."""
        base, m = self.max_slots + 1, self.max_slots
        return (self.meta[:slots + 1], self.meta[base + m:base + m + slots],
                self.meta[base + 3 * m:base + 3 * m + slots])

    def fill(self, tier: Tier, input_ids: torch.Tensor, layout: VerifyLayout) -> None:
        """Copy a batch into the static buffers of ``tier`` and pad the rest."""
        self._stage(layout, tier.request_slots)
        n = layout.num_tokens
        self.ids[:n].copy_(input_ids, non_blocking=True)
        if n < tier.tokens:  # a full tier (every uniform width has one) has no padding rows
            self.ids[n:tier.tokens].zero_()

    def _stage(self, layout: VerifyLayout, s: int, accept_lens: torch.Tensor | None = None
               ) -> None:
        """Write the layout (and accept lengths; zeros without them) of ``s`` request slots into
        a pinned row and copy it to the static metadata."""
        n, r = layout.num_tokens, layout.num_requests
        turn = self._turn = 1 - self._turn
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()
        host, base, m = self._host_meta[turn], self.max_slots + 1, self.max_slots
        h, (qsl, ctx, slots) = self._host_meta_view[turn], layout.host
        h[:r + 1] = qsl
        h[r + 1:s + 1] = n  # empty padded requests
        h[base:base + r] = ctx
        h[base + r:base + s] = 0
        h[base + m:base + m + r] = slots
        h[base + m + r:base + m + s] = 0
        h[base + 2 * m:base + 2 * m + s] = 0  # padded requests (and no mRoPE deltas): delta 0
        if layout.mrope_deltas is not None:
            h[base + 2 * m:base + 2 * m + r] = layout.mrope_deltas.numpy()
        h[base + 3 * m:base + 3 * m + s] = 0  # padded requests accept nothing
        if accept_lens is not None:
            h[base + 3 * m:base + 3 * m + r] = accept_lens.numpy()
        self.meta.copy_(host, non_blocking=True)
        if self._copied[turn] is not None:
            self._copied[turn].record()

    def _fill_empty(self) -> None:
        """All rows padding: what a capture runs on (it must not write any KV)."""
        self.meta.zero_()
        self.ids.zero_()

    # ------------------------------------------------------------------ capture
    def capture(self, progress: bool = True, compile_ahead: bool = True) -> list[TierReport]:
        """Capture every tier (largest first) into one pool; returns the cost of each.

        ``compile_ahead``: first run every tier's forward (and commit) once with the Triton
        launches turned into compiles on a thread pool (``kernels/launch.py``), so that the
        kernels a tier set needs compile side by side instead of one after another during the
        captures; ``ahead_seconds`` keeps what that took. Without Triton's AsyncCompileMode it
        is skipped, with a log line.

        The allocator cache is emptied once, before the first tier, not per tier as
        ``torch.cuda.graph`` does: per-tier emptying makes later tiers re-reserve memory and
        hides what the pool holds. Pool bytes are read from the allocator's segments that
        belong to the pool.
        """
        if not self.use_graphs:
            raise RuntimeError("TierGraphs.capture: CUDA graphs need a CUDA or ROCm device")
        order = sorted(self.tiers, reverse=True)
        if compile_ahead:
            self._compile_ahead(order)
        pool, reports = torch.cuda.graph_pool_handle(), []
        stream = torch.cuda.Stream(self.device)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        held = _pool_bytes(pool, self.device)
        for i, tier in enumerate(order):
            if progress:
                _progress(i, len(order), tier)
            start = time.perf_counter()
            self._fill_empty()
            self.graphs[tier] = self._capture_one(
                stream, pool, lambda t=tier: self.logits[:t.tokens].copy_(
                    self.forward(*self.views(t))))
            now = _pool_bytes(pool, self.device)
            reports.append(TierReport(tier, time.perf_counter() - start, now - held))
            held = now
        if self.commit_fn is not None:  # all-zero metadata: every request empty, no state moves
            self.meta.zero_()
            for slots in sorted(self.commit_slots, reverse=True):
                self.commit_graphs[slots] = self._capture_one(
                    stream, pool, lambda s=slots: self.commit_fn(*self.commit_views(s)))
        if progress:
            _progress(len(order), len(order), None)
        return reports

    def _compile_ahead(self, order: list[Tier]) -> None:
        """Run every tier's forward and every commit once inside ``launch.compile_ahead``:
        the Triton kernels they launch compile on a thread pool and nothing of ours runs
        (no KV or state is written; all rows are padding anyway)."""
        from ..kernels import launch

        if not launch.can_compile_ahead():
            global _warned_no_ahead
            if not _warned_no_ahead:
                log.warning("dspark_compile: this Triton has no AsyncCompileMode "
                            "(triton.runtime._async_compile); tier captures compile their "
                            "kernels one after another")
                _warned_no_ahead = True
            return
        start = time.perf_counter()
        with launch.compile_ahead():
            self._fill_empty()
            for tier in order:
                self.forward(*self.views(tier))
            if self.commit_fn is not None:
                for slots in self.commit_slots:
                    self.commit_fn(*self.commit_views(slots))
        torch.cuda.synchronize(self.device)
        self.ahead_seconds = time.perf_counter() - start

    def _capture_one(self, stream: torch.cuda.Stream, pool, fn: Callable) -> torch.cuda.CUDAGraph:
        """``fn`` run once on ``stream`` (compiles, allocator warm-up), then captured into
        ``pool``."""
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            fn()
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=pool)
            try:
                fn()
            finally:
                graph.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        return graph

    # ------------------------------------------------------------------ replay
    def __call__(self, input_ids: torch.Tensor, layout: VerifyLayout) -> torch.Tensor:
        """Logits ``[N, V]`` of the batch: a view of the static buffer, valid until the next
        call."""
        n, r = layout.num_tokens, layout.num_requests
        tier = self._tier_of.get((n, r), False)
        if tier is False:  # a scan of the tier set, once per geometry
            tier = self._tier_of[(n, r)] = select_tier(self.tiers, n, r)
        if tier is None:
            if not self._warned_eager:
                log.warning("dspark_compile: batch of %d tokens over %d requests is past the "
                            "largest tier (%d tokens, %d slots); running without a graph", n, r,
                            self.max_tokens, self.max_slots)
                self._warned_eager = True
            dev = self.device
            deltas = layout.mrope_deltas if layout.mrope_deltas is not None else \
                torch.zeros(r, dtype=torch.int32)
            return self.forward(input_ids, layout.query_start_loc.to(dev),
                                layout.context_lens.to(dev), layout.slots.to(dev),
                                deltas.to(dev))
        if self.debug:
            self._check(tier, n, r)
        self.fill(tier, input_ids, layout)
        if tier in self.graphs:
            self.graphs[tier].replay()
        else:
            self.logits[:tier.tokens].copy_(self.forward(*self.views(tier)))
        return self.logits[:n]

    def replay_commit(self, layout: VerifyLayout, accept_lens: torch.Tensor) -> bool:
        """Replay the linear-state commit of ``layout`` (``accept_lens``: int64 [R], CPU,
        checked) on the smallest commit graph that holds its requests; False (nothing done) when
        there is no commit function or the batch is past the largest tier."""
        if self.commit_fn is None:
            return False
        r = layout.num_requests
        slots = next((s for s in self.commit_slots if s >= r), None)
        if slots is None:
            return False
        self._stage(layout, slots, accept_lens)
        if slots in self.commit_graphs:
            self.commit_graphs[slots].replay()
        else:
            self.commit_fn(*self.commit_views(slots))
        return True

    def _check(self, tier: Tier, n: int, r: int) -> None:
        if self._buffer_addresses() != self._addresses:
            raise RuntimeError("TierGraphs: a static buffer moved since capture")
        if not tier.fits(n, r):
            raise RuntimeError(f"TierGraphs: {tier} cannot hold {n} tokens over {r} requests")

    def table(self) -> str:
        return format_tiers(self.tiers)


def _pool_bytes(pool, device: torch.device) -> int:
    """Bytes the caching allocator has reserved for graph memory pool ``pool``."""
    pool = tuple(pool)
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if seg.get("device", device.index) == (device.index or 0)
               and tuple(seg.get("segment_pool_id", ())) == pool)


def _progress(done: int, total: int, tier: Tier | None) -> None:
    bar = "#" * (20 * done // total) + "-" * (20 - 20 * done // total)
    what = f" tokens={tier.tokens} slots={tier.request_slots}" if tier else " done"
    end = "\n" if tier is None else ""
    sys.stderr.write(f"\rcapturing tiers [{bar}] {done}/{total}{what:<28}{end}")
    sys.stderr.flush()
