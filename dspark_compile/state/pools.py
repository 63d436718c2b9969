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
from ..specs import AttentionSpec, compress_pools
from . import checks
from .linear import LinearPools
from .steps import StepLedger

__all__ = ["VerifierState"]


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
    the layer's value head dim); one tensor twice for a K=V layer (``AttentionSpec.shared_kv``)."""
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
    pools use ``1 / rate`` of their rows (a known waste, kept for one page geometry)."""

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
    ) -> "VerifierState":
        for name, value in (("max_requests", max_requests), ("max_context", max_context),
                            ("page_size", page_size)):
            checks.positive_size("new_state", name, value)
        pages_per_request = -(-max_context // page_size)
        num_pages = max_requests * pages_per_request
        itemsize = torch.empty(0, dtype=dtype).element_size()
        widths = [w for _, w in compress_pools(specs)]
        checks.check_memory("new_state", num_pages * page_size * itemsize * (sum(
            s.num_kv_heads * (s.head_dim + (0 if s.shared_kv else s.value_dim)) for s in specs)
            + sum(widths)), device,
            f"a KV pool of max_requests={max_requests} x max_context={max_context} tokens")
        # A fixed permutation (not random per run): the same state layout on every rank.
        perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(0))
        block_table = perm.view(max_requests, pages_per_request).to(torch.int32)
        kv = []
        for s in specs:
            k = torch.zeros(num_pages, page_size, s.num_kv_heads, s.head_dim, dtype=dtype,
                            device=device)
            # K=V layers: one pool passed as both; the step writes the same rows through
            # either name, and every read sees them
            kv.append((k, k) if s.shared_kv else (k, torch.zeros(
                num_pages, page_size, s.num_kv_heads, s.value_dim, dtype=dtype,
                device=device)))
        compressed = [torch.zeros(num_pages, page_size, w, dtype=dtype, device=device)
                      for w in widths]
        return cls(max_requests, max_context, page_size, kv, block_table.to(device),
                   compress_pools=compressed)

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
        _, ctx, slots = layout.host
        committed = self.committed_lens.numpy()[slots]
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

            return device_metadata_triton(query_start_loc, context_lens, slots,
                                          self.block_table, self.page_size, num_tokens,
                                          mrope_deltas)
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
