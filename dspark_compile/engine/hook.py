"""The engine hook: how an external serving engine drives dspark_compile step by step.

An engine keeps its own scheduler, sampler and drafter; per step it asks the hook four
things, in this order::

    hook = DSparkHook(verifier, max_requests=256, max_context=4096, gamma=7, rate=sps_table)
    hook.capture()                                   # once: tier graphs (GPU), else a no-op
    lens = hook.plan(confidence)                     # [R] verify lengths from [R, gamma]
    logits = hook.verify(input_ids, layout)          # packed [N] -> [N, V]
    hook.commit(layout, accept_lens)                 # keep the accepted prefix per request
    hook.release(slots)                              # when requests finish

``VerifyHook`` is the protocol (what an engine may rely on); ``DSparkHook`` implements it over a
``Verifier`` and the DSpark planner. ``examples/engine_hook.py`` shows a whole loop.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np
import torch

from ..layout import VerifyLayout
from ..runtime import Planner, PlannerConfig, StepRateModel

__all__ = ["VerifyHook", "DSparkHook"]


class VerifyHook(Protocol):
    """What an engine calls each step (see the module docstring)."""

    def capture(self) -> list: ...

    def plan(self, confidence: torch.Tensor) -> torch.Tensor: ...

    def verify(self, input_ids: torch.Tensor, layout: VerifyLayout) -> torch.Tensor: ...

    def commit(self, layout: VerifyLayout, accept_lens) -> None: ...

    def release(self, slots: Sequence[int]) -> None: ...


class DSparkHook:
    """``VerifyHook`` over a compiled ``Verifier``: owns the state pool, plans with DSpark."""

    def __init__(self, verifier, max_requests: int, max_context: int, gamma: int,
                 rate: StepRateModel | None = None,
                 planner: PlannerConfig = PlannerConfig()) -> None:
        if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
            raise ValueError(f"DSparkHook: gamma={gamma!r}; it must be an int >= 1")
        self.verifier, self.gamma, self.rate, self.planner = verifier, gamma, rate, planner
        self.state = verifier.new_state(max_requests=max_requests, max_context=max_context)
        self._planner = Planner(rate, planner)  # PlannerConfig.quiet_steps's state

    def capture(self) -> list:
        """Capture tier graphs for up to ``gamma + 1`` tokens per request (GPU); on the CPU the
        static, padded path is set up and nothing is captured. Returns each tier's cost."""
        return self.verifier.capture(self.state, block=self.gamma + 1).reports

    def plan(self, confidence) -> torch.Tensor:
        """int32 [R] verify lengths in ``1..gamma + 1`` from draft confidence ``[R, gamma]``: a
        tensor (any device; copied to the host as float32) or a NumPy array (taken as it is)."""
        if not isinstance(confidence, (torch.Tensor, np.ndarray)):
            raise ValueError(f"DSparkHook.plan: confidence is a {type(confidence).__name__}; it "
                             f"must be a tensor or a numpy array [R, gamma={self.gamma}]")
        if confidence.ndim != 2 or confidence.shape[1] != self.gamma:
            raise ValueError(f"DSparkHook.plan: confidence has shape {tuple(confidence.shape)}; "
                             f"it must be [R, gamma={self.gamma}]")
        if isinstance(confidence, torch.Tensor):
            confidence = confidence.float().cpu()
        self._planner = self._planner.follow(self.rate, self.planner)  # a swap: a fresh one
        return self._planner(confidence).lens

    def verify(self, input_ids: torch.Tensor, layout: VerifyLayout) -> torch.Tensor:
        """Logits ``[N, V]`` of the packed step (writes provisional KV)."""
        return self.verifier(input_ids, layout, self.state)

    def commit(self, layout: VerifyLayout, accept_lens) -> None:
        """Keep the first ``accept_lens[i]`` rows of request ``i`` (anchor + accepted drafts)."""
        self.verifier.commit(layout, accept_lens, self.state)

    def release(self, slots: Sequence[int]) -> None:
        """Free the slots of finished requests (ints in ``0..max_requests-1``; see
        ``VerifierState.release``)."""
        self.state.release(slots if isinstance(slots, (np.ndarray, torch.Tensor, int))
                           else list(slots))
