"""Step identity: which forward wrote each slot's provisional rows, and what a commit may keep.

A forward writes provisional KV rows past each request's committed length (and, in a hybrid
model, the replay rings); ``commit`` makes a prefix of them permanent. A commit is correct only
for the rows the *same* layout wrote, on the *same* state, since nothing else overwrote them::

    verify(L1); commit(L1)               kept
    commit(L)  with no verify of L       refused: no provisional rows of L exist
    verify(L1); verify(L2); commit(L1)   refused: L2 overwrote L1's rows in those slots
    verify(L) on state A; commit(L) on B refused: B holds none of L's rows
    commit(L); commit(L)                 refused: the committed length moved past L's context

Per slot the ledger keeps the id of the last forward over it (0: none since the slot was
released, -1: that forward raised); per id, the layout. ``commit`` accepts a layout only when
every one of its slots was last written by one forward of that layout (the same object, or one
with the same ``query_start_loc``, ``context_lens`` and ``slots``), and, for a state with
replay rings, only the state's last forward (the rings hold one forward's rows). The "once"
half of the rule is the committed length: a commit moves it past the layout's ``context_lens``,
and ``VerifierState.advance`` refuses a layout whose context is not the committed length.
(An engine that writes ``committed_lens`` itself, as the benchmarks' context fill does, takes
that bookkeeping into its own hands.)

Host bookkeeping only: a forward costs one NumPy scatter and a dict entry, a commit one gather
and a compare (~2 us at 256 requests).
"""

from __future__ import annotations

import itertools

import numpy as np

from ..layout import VerifyLayout

__all__ = ["StepLedger", "ProtocolError"]

_FAILED = -1


class ProtocolError(ValueError):
    """A verify/commit call out of the protocol's order (a ``ValueError``): the message names the
    request, the slot and the cause; the state is left as it was."""


class StepLedger:
    """Per slot, the forward that wrote its provisional rows (see the module docstring)."""

    def __init__(self, max_requests: int) -> None:
        self.writer = np.zeros(max_requests, np.int64)
        """Per slot: id of the last forward over it (0: none since release, -1: it raised)."""
        self.last = 0
        """Id of the state's last forward that completed (0: none)."""
        self._layouts: dict[int, VerifyLayout] = {}
        self._fresh: VerifyLayout | None = None  # the last forward's layout, nothing since
        self._ids = itertools.count(1)  # next() is atomic under the GIL
        self._bound = 32  # layouts kept before a prune (then twice the live ones, at least 32)

    # ------------------------------------------------------------------ forwards
    def begin(self, layout: VerifyLayout) -> int:
        """A forward over ``layout`` starts; returns its id. (Its slots' earlier rows are being
        overwritten: a forward that raises calls :meth:`failed`.)"""
        return next(self._ids)

    def failed(self, layout: VerifyLayout) -> None:
        """The forward over ``layout`` raised: its slots hold a partial overwrite, not
        committable by any layout until a forward over them completes."""
        self.writer[layout.host[2]] = _FAILED
        self._fresh = None

    def end(self, layout: VerifyLayout, step: int) -> None:
        """The forward ``step`` over ``layout`` completed: its rows are committable."""
        self.writer[layout.host[2]] = step
        self._layouts[step] = layout
        self.last = step
        self._fresh = layout
        if len(self._layouts) > self._bound:  # ~5 us at 256 slots, once per ~32 forwards
            live = set(np.unique(self.writer).tolist()) | {self.last}
            self._layouts = {k: v for k, v in self._layouts.items() if k in live}
            self._bound = max(32, 2 * len(self._layouts))

    def forget(self, slots: np.ndarray) -> None:
        """``slots`` were released: they hold no provisional rows."""
        self.writer[slots] = 0
        self._fresh = None

    def has_provisional(self) -> np.ndarray:
        """int64 slot ids that hold provisional rows (or a failed forward's)."""
        return np.flatnonzero(self.writer)

    # ------------------------------------------------------------------ commits
    def check_commit(self, layout: VerifyLayout, rings: bool) -> None:
        """Raise ``ProtocolError`` unless ``layout``'s slots hold the rows of one forward of
        ``layout`` (and, with ``rings``, that forward is the state's last)."""
        if layout is self._fresh:  # the last forward, nothing released since: its rows are there
            return
        slots = layout.host[2]
        w = self.writer[slots]
        step = int(w[0])
        if step > 0 and (w == step).all() and self._same(step, layout):
            if rings and step != self.last:
                raise ProtocolError(
                    f"commit: slots {slots.tolist()} were verified by this layout, but a later "
                    "forward on this state (of other slots) has since overwritten the replay "
                    "rings of its linear-attention layers; a hybrid model's state commits only "
                    "its last forward: commit each step before verifying the next")
            return
        for i, (slot, wrote) in enumerate(zip(slots.tolist(), w.tolist())):
            if wrote == 0:
                raise ProtocolError(
                    f"commit: request {i} (slot {slot}) holds no provisional rows: no forward of "
                    "this layout ran on this state since the slot was last released; a commit "
                    "must follow the verify of the same layout, on the same state")
            if wrote == _FAILED:
                raise ProtocolError(
                    f"commit: request {i} (slot {slot}): the last forward over this slot raised, "
                    "so its provisional rows are incomplete; verify the step again")
            if not self._same(wrote, layout):
                other = self._layouts.get(wrote)
                what = "" if other is None else (
                    f" (slots {other.host[2].tolist()}, context_lens "
                    f"{other.host[1].tolist()}, query_start_loc {other.host[0].tolist()})")
                raise ProtocolError(
                    f"commit: request {i} (slot {slot}): its provisional rows were written by a "
                    f"later forward of another layout{what}, not this one; commit the layout of "
                    "the last verify over these slots, once")
        raise ProtocolError(
            f"commit: the slots {slots.tolist()} were written by different forwards of equal "
            "layouts; commit the layout of the last verify over all of them")

    def _same(self, step: int, layout: VerifyLayout) -> bool:
        rec = self._layouts.get(step)
        if rec is layout:
            return True
        return rec is not None and rec.num_requests == layout.num_requests and all(
            np.array_equal(a, b) for a, b in zip(rec.host, layout.host))

    # ------------------------------------------------------------------ tests
    def snapshot(self) -> tuple:
        """Everything the ledger holds, for equality checks in tests."""
        return (self.writer.tolist(), self.last, sorted(self._layouts))
