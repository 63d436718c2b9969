"""A verify session: one verifier bound to one engine-owned state, with the tier graphs
captured over that state's pools.

``Verifier.capture(state)`` returns a session and installs it, so that the verifier's own
``verifier(input_ids, layout, state)`` and ``verifier.commit(layout, accept_lens, state)``
replay its graphs; the session's ``session(input_ids, layout)`` and ``session.commit(layout,
accept_lens)`` are the same calls with the state bound. The state itself holds only pools and
per-slot bookkeeping.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..layout import VerifyLayout
from ..state import VerifierState
from .graphs import TierGraphs, TierReport

__all__ = ["VerifySession"]


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
