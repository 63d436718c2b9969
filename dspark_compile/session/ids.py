"""Token ids outside the vocabulary: refused before the forward, or contained in it.

An id outside ``0..vocab-1`` reaching the embedding is an ``IndexError`` naming nothing on the
CPU and a device-side assert that kills the process on a GPU. Two schemes, one per id location
(``Verifier.id_check``):

``"host"``   (ids on the CPU) the ids are checked before anything launches: one reduction
             over a uint64 view (a negative id wraps past any vocabulary), ~3 us for 768 ids;
             a bad one raises ``TokenIdError`` naming the request, its row, the id and the
             vocabulary size.
``"device"`` (ids on the GPU; reading them on the host would sync every step) the forward
             clamps the ids into the vocabulary, so nothing reads out of bounds, and records
             per slot whether its request had an out-of-vocabulary row (the first such row and
             its id), in a device array that a non-blocking copy brings to pinned host memory
             after the forward. ``commit`` reads that copy (the step's result was already on
             the host, so the copy has landed; an event makes sure) and refuses a request with
             a flagged row with ``TokenIdError``, before anything is committed: the clamped
             forward's rows are never kept. On a GPU the guard is one Triton launch
             (``kernels/ids.py``), elsewhere torch ops; either runs inside the tier graphs,
             and the CPU tests run this scheme too.
"""

from __future__ import annotations

import numpy as np
import torch

from ..layout import VerifyLayout

__all__ = ["TokenIdError", "check_ids_host", "DeviceIdGuard"]


def _interpreting() -> bool:
    import os
    return os.environ.get("TRITON_INTERPRET") == "1"


class TokenIdError(ValueError):
    """A token id outside the vocabulary. ``request`` is the request's index in the layout."""

    def __init__(self, message: str, request: int) -> None:
        super().__init__(message)
        self.request = request


def _message(where: str, request: int, slot: int, row: int, token: int, vocab: int) -> str:
    return (f"{where}: request {request} (slot {slot}) has token id {token} at its row {row}, "
            f"outside the vocabulary 0..{vocab - 1} (vocab_size={vocab}); fix that request's "
            "tokens (a drafter or tokenizer of another vocabulary?)")


def check_ids_host(input_ids: torch.Tensor, layout: VerifyLayout, vocab: int) -> None:
    """Raise ``TokenIdError`` if a CPU ``input_ids [N]`` holds an id outside ``0..vocab-1``."""
    ids = input_ids.numpy()
    if ids.size and int(ids.view(np.uint64).max()) >= vocab:
        row = int(np.flatnonzero((ids < 0) | (ids >= vocab))[0])
        qsl, _, slots = layout.host
        i = int(np.searchsorted(qsl[1:], row, side="right"))
        raise TokenIdError(_message("verify", i, int(slots[i]), row - int(qsl[i]),
                                    int(ids[row]), vocab), i)


class DeviceIdGuard:
    """Per-slot out-of-vocabulary flags of one state (the ``"device"`` scheme above)."""

    def __init__(self, max_requests: int, device: torch.device) -> None:
        # [max_requests + 1]: slot max_requests takes the padded requests of a tier (their slot
        # entries are 0, a real slot, and must not clear its flag).
        self.flags = torch.zeros(2, max_requests + 1, dtype=torch.int64, device=device)
        """Rows ``rows`` and ``tokens`` below, one tensor so one copy brings both."""
        self.rows = self.flags[0]
        """Per slot: 1 + the first out-of-vocabulary row of its request in the last forward over
        it (0: none)."""
        self.tokens = self.flags[1]
        """Per slot: that row's id."""
        pinned = device.type == "cuda"
        self._host = torch.zeros(2, max_requests + 1, dtype=torch.int64, pin_memory=pinned)
        self._host_view = self._host.numpy()
        self._copied = torch.cuda.Event() if pinned else None

    def guard(self, input_ids: torch.Tensor, query_start_loc: torch.Tensor,
              slots: torch.Tensor, vocab: int) -> torch.Tensor:
        """Record each request's first out-of-vocabulary row; return the ids clamped into the
        vocabulary. No host sync (it runs inside the tier graphs): one Triton launch on a GPU
        (``kernels/ids.py``), :meth:`guard_reference`'s torch ops elsewhere."""
        if input_ids.device.type in ("cuda", "hip") and not _interpreting():
            from ..kernels.ids import ids_guard_triton
            return ids_guard_triton(input_ids, query_start_loc, slots, self.flags, vocab)
        return self.guard_reference(input_ids, query_start_loc, slots, vocab)

    def guard_reference(self, input_ids: torch.Tensor, query_start_loc: torch.Tensor,
                        slots: torch.Tensor, vocab: int) -> torch.Tensor:
        """:meth:`guard` as torch ops (the CPU path and the kernel's oracle)."""
        n = input_ids.shape[0]
        qsl = query_start_loc.long()
        r = qsl.numel() - 1
        rows = torch.arange(n, device=input_ids.device)
        req = torch.searchsorted(qsl[1:], rows, right=True).clamp(max=r - 1)
        bad = ((input_ids < 0) | (input_ids >= vocab)) & (rows < qsl[-1])
        local = torch.where(bad, rows - qsl[req], n)
        first = torch.full((r,), n, dtype=torch.int64, device=input_ids.device)
        first = first.scatter_reduce(0, req, local, "amin")  # [R]: n where none
        hit = first < n
        token = input_ids[(qsl[:-1] + first).clamp(max=max(n - 1, 0))]
        lens = qsl[1:] - qsl[:-1]
        index = torch.where(lens > 0, slots.long(), self.rows.numel() - 1)
        self.rows.index_copy_(0, index, torch.where(hit, first + 1, 0))
        self.tokens.index_copy_(0, index, torch.where(hit, token, 0))
        return input_ids.clamp(0, vocab - 1)

    def publish(self) -> None:
        """After a forward: start the copy of the flags to the host (non-blocking)."""
        self._host.copy_(self.flags, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def check(self, layout: VerifyLayout, vocab: int) -> None:
        """Before a commit: refuse a request whose last forward had an out-of-vocabulary row."""
        if self._copied is not None:
            self._copied.synchronize()  # done already: the step's result reached the host
        _, _, slots = layout.host
        rows = self._host_view[0][slots]
        if rows.any():
            i = int(np.flatnonzero(rows)[0])
            raise TokenIdError(_message("commit", i, int(slots[i]), int(rows[i]) - 1,
                                        int(self._host_view[1][slots[i]]), vocab) +
                               "; its verify ran on clamped ids and is not committed", i)
