"""A verify session: one verifier bound to one engine-owned state, with the tier graphs
captured over that state's pools.

``Verifier.capture(state)`` returns a session and installs it, so that the verifier's own
``verifier(input_ids, layout, state)`` and ``verifier.commit(layout, accept_lens, state)``
replay its graphs; the session's ``session(input_ids, layout)`` and ``session.commit(layout,
accept_lens)`` are the same calls with the state bound. The state itself holds only pools and
per-slot bookkeeping.

A session serves one thread at a time. Its calls share static buffers (token ids, metadata,
logits: the logits a verify returns are a view valid until the next call), so two threads that
interleave steps on one session, even on disjoint slots, read each other's inputs and logits: in
a trial 51 of 100 results were wrong, with no error. A verify claims the session for its thread
until the commit that follows it; a call from another thread meanwhile raises
``ConcurrentUseError`` (after the commit, any thread may take the session over). Give each
thread its own state and capture to verify in parallel.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch

from ..layout import VerifyLayout
from ..state import VerifierState
from .graphs import TierGraphs, TierReport

__all__ = ["VerifySession", "ConcurrentUseError"]


class ConcurrentUseError(RuntimeError):
    """A second thread called a session that another thread holds mid-step."""


class _Verifier(Protocol):  # what a session needs of the verifier that made it
    def __call__(self, input_ids: torch.Tensor, layout: VerifyLayout,
                 state: VerifierState) -> torch.Tensor: ...

    def commit(self, layout: VerifyLayout, accept_lens, state: VerifierState) -> None: ...


class VerifySession:
    """The verifier, a state and the tier graphs captured over the state's pools."""

    def __init__(self, verifier: _Verifier, state: VerifierState, graphs: TierGraphs,
                 reports: list[TierReport]) -> None:
        self.verifier = verifier
        self.state = state
        self.graphs = graphs
        """Per-tier replay (CUDA graphs on a GPU; the same static, padded path eagerly on
        the CPU)."""
        self.reports = reports
        """What capturing each tier cost (empty when nothing was captured)."""
        self._owner: int | None = None  # thread holding the session from a verify to its commit
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ one thread at a time
    def claim(self, call: str) -> int | None:
        """Hold the session for the calling thread; returns who held it before (for
        :meth:`restore`). Raises ``ConcurrentUseError`` if another thread holds it."""
        me = threading.get_ident()
        with self._lock:
            owner = self._owner
            if owner is not None and owner != me:
                names = {t.ident: t.name for t in threading.enumerate()}
                raise ConcurrentUseError(
                    f"{call}: this state's verify session is held by thread "
                    f"{names.get(owner, owner)!r} between its verify and its commit; a call "
                    f"from thread {threading.current_thread().name!r} would overwrite its static "
                    "buffers (ids, metadata, the logits it is reading). A captured state serves "
                    "one thread at a time: give each thread its own state and capture")
            self._owner = me
        return owner

    def restore(self, owner: int | None) -> None:
        """Undo a :meth:`claim` whose call was refused."""
        self._owner = owner

    def done(self) -> None:
        """The step committed: any thread may take the session."""
        self._owner = None

    def __call__(self, input_ids: torch.Tensor, layout: VerifyLayout) -> torch.Tensor:
        """``verifier(input_ids, layout, state)``: logits ``[N, V]``, a view of a static
        buffer valid until the next call."""
        return self.verifier(input_ids, layout, self.state)

    def commit(self, layout: VerifyLayout, accept_lens) -> None:
        """``verifier.commit(layout, accept_lens, state)``."""
        self.verifier.commit(layout, accept_lens, self.state)

    @property
    def ahead_seconds(self) -> float:
        """Seconds the capture spent compiling kernels ahead."""
        return self.graphs.ahead_seconds
