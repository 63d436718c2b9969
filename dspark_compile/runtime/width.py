"""Per-step uniform width policy: every request verifies the same ``w`` tokens this step.

Uniform verify needs no packing and replays a plain ``(bs * w, bs)`` tier, so an engine can use
it before (or instead of) the ragged planner. The policy estimates the hazard ``h_j`` (draft ``j``
accepted given that it was reached) from decayed counts, and picks among the captured widths::

    E(w)     = 1 + sum_{j < w - 1} prod_{m <= j} h_m      expected tokens per request
    score(w) = bs * E(w) * SPS(bs * w)                     expected tokens per second

Counts come from a device histogram of accepted drafts per request that the engine writes every
step; the policy reads it ``histogram_lag`` steps later, when the step that wrote it is long done,
so reading it does not stall the pipeline. A step at width ``w`` observes positions ``j < w - 1``
only: deeper positions keep their old counts, and the full width runs until every position has
been seen and every ``refresh_every``-th step after, so that no hazard goes stale for good.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from ._checks import fraction, positive_int
from .sps import SpsTable, StepRateModel, TierRate, check_rates

__all__ = ["WidthPolicyConfig", "WidthPolicy", "expected_tokens"]


@dataclass(frozen=True)
class WidthPolicyConfig:
    """Captured widths and the policy's knobs."""

    gamma: int
    """Draft tokens per request per step; the full width is ``gamma + 1`` (anchor included)."""
    widths: tuple[int, ...]
    """Uniform widths with a captured tier, each in ``1..gamma+1``; must include ``gamma + 1``."""
    decay: float = 0.9
    """Weight of the old counts at each folded step (0.9: ~10 steps of memory)."""
    switch_margin: float = 0.02
    """Switch width only when the best score beats the current one by more than this fraction."""
    refresh_every: int = 64
    """Every this-many steps the full width runs, to re-measure positions narrow widths skip."""
    histogram_lag: int = 2
    """Steps between writing an acceptance histogram on the device and reading it here."""
    forced_width: int | None = None
    """Always use this width (A/B runs); it must be one of ``widths``."""

    def __post_init__(self) -> None:
        gamma = positive_int("WidthPolicyConfig.gamma", self.gamma)
        widths = tuple(sorted(set(self.widths)))
        for w in widths:
            if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= gamma + 1:
                raise ValueError(f"WidthPolicyConfig.widths contains {w!r}; a width must be an "
                                 f"int in 1..gamma+1 = 1..{gamma + 1} (drop it or raise gamma)")
        if gamma + 1 not in widths:
            raise ValueError(f"WidthPolicyConfig.widths={widths} lacks the full width "
                             f"{gamma + 1}; capture it (the policy falls back to it)")
        if self.forced_width is not None and self.forced_width not in widths:
            raise ValueError(f"WidthPolicyConfig.forced_width={self.forced_width!r} is not a "
                             f"captured width {widths}; force one of them or capture it")
        fraction("WidthPolicyConfig.decay", self.decay)
        if not 0 <= self.switch_margin < 1:
            raise ValueError(f"WidthPolicyConfig.switch_margin={self.switch_margin!r} is not in "
                             "[0, 1); pass a fraction such as 0.02")
        positive_int("WidthPolicyConfig.refresh_every", self.refresh_every)
        if not isinstance(self.histogram_lag, int) or self.histogram_lag < 0:
            raise ValueError(f"WidthPolicyConfig.histogram_lag={self.histogram_lag!r} is not an "
                             "int >= 0; pass the number of steps to wait before reading")
        object.__setattr__(self, "widths", widths)


def expected_tokens(hazards: torch.Tensor) -> torch.Tensor:
    """float64 [gamma + 1]: ``E(w) = 1 + sum_{j < w-1} prod_{m <= j} h_m`` at index ``w - 1``,
    for hazards ``[gamma]``."""
    return torch.from_numpy(_expected(hazards.detach().to("cpu", torch.float64).numpy()))


def _expected(hazards: np.ndarray) -> np.ndarray:
    """:func:`expected_tokens` on a float64 NumPy array (the per-step path: small torch ops on
    the CPU cost microseconds each, and a step makes ~30 of them)."""
    out = np.ones(hazards.size + 1)
    np.cumsum(np.cumprod(hazards), out=out[1:])
    out[1:] += 1.0
    return out


def _fixed_rates(rate: StepRateModel) -> bool:
    """The model's rates cannot change after it is built (``SpsTable`` is frozen; ``TierRate``
    fills its table once), so the policy may keep what it read. Another model is read every
    step: an online estimator may move its rates."""
    return type(rate) in (SpsTable, TierRate)


class WidthPolicy:
    """Chooses the uniform verify width of each step from measured hazards and an SPS model."""

    def __init__(self, config: WidthPolicyConfig, rate: StepRateModel):
        self.config = config
        self.rate = rate
        self.reached = torch.zeros(config.gamma, dtype=torch.float64)  # [gamma] decayed counts
        self.accepted = torch.zeros(config.gamma, dtype=torch.float64)  # [gamma] decayed counts
        self.width: int | None = None  # the policy's current choice (None before the first)
        self.steps = 0
        self._widths = np.array(config.widths, dtype=np.int64)
        self._reached, self._accepted = self.reached.numpy(), self.accepted.numpy()  # views
        self._pending: deque[tuple[int, torch.Tensor]] = deque()
        # rates of a model whose rates never change (its type is known here), per batch size:
        # read once, not a torch lookup a step
        self._rates: dict[int, np.ndarray] | None = {} if _fixed_rates(rate) else None

    # ------------------------------------------------------------------ observations
    def observe(self, width: int, accept_hist: torch.Tensor) -> None:
        """Queue the histogram of a step run at ``width``; fold the one ``histogram_lag`` old.

        ``accept_hist [gamma + 1]``: requests of the step that accepted ``a`` drafts, at index
        ``a``. It may live on the device; it is read (and a corrupt one refused) only once
        ``histogram_lag`` more steps have been queued.
        """
        gamma = self.config.gamma
        if width not in self.config.widths:
            raise ValueError(f"WidthPolicy.observe: width={width!r} is not a captured width "
                             f"{self.config.widths}; pass the width the step ran at")
        if accept_hist.shape != (gamma + 1,):
            raise ValueError(f"WidthPolicy.observe: accept_hist has shape "
                             f"{tuple(accept_hist.shape)}; it must be [gamma + 1 = {gamma + 1}]")
        self._pending.append((width, accept_hist.detach().clone()))
        while len(self._pending) > self.config.histogram_lag:
            self._fold(*self._pending.popleft())

    def _fold(self, width: int, accept_hist: torch.Tensor) -> None:
        """Decay the counts and add one step's reached / accepted drafts per position. The
        histogram has ``gamma + 1`` entries: plain Python over them costs less than NumPy's
        per-call overhead on arrays this small."""
        hist = accept_hist.tolist()  # [gamma + 1]
        if not all(0 <= x < math.inf for x in hist):  # NaN fails both comparisons
            raise ValueError(f"WidthPolicy: accept_hist={hist} has a negative or "
                             "non-finite count; the engine's histogram is corrupt")
        if any(hist[width:]):
            raise ValueError(f"WidthPolicy: accept_hist={hist} counts more than "
                             f"{width - 1} accepted drafts in a step of width {width}; pass "
                             "the width that step actually ran at")
        tail = list(itertools.accumulate(reversed(hist)))[::-1]  # requests accepting >= j
        seen = width - 1  # positions 0 .. width - 2 were verified
        decay = self.config.decay
        reached, accepted = self._reached, self._accepted  # views of the tensors: in place
        reached *= decay
        accepted *= decay
        if seen:
            reached[:seen] += tail[:seen]
            accepted[:seen] += tail[1:seen + 1]

    def hazards(self) -> torch.Tensor:
        """float64 [gamma]: accepted / reached per draft position; NaN where never reached."""
        return torch.from_numpy(self._hazards())

    def _hazards(self) -> np.ndarray:
        reached, accepted = self._reached, self._accepted
        out = np.full(reached.size, np.nan)
        np.divide(accepted, reached, out=out, where=reached > 0)
        return out

    # ------------------------------------------------------------------ decisions
    def scores(self, batch_size: int) -> dict[int, float]:
        """Expected tokens per second at every captured width (needs every hazard measured)."""
        h = self._hazards()
        if np.isnan(h).any():
            raise ValueError(f"WidthPolicy.scores: hazards {h.tolist()} are not all measured; "
                             "run the full width until every position has been reached")
        widths = self._widths  # [W]
        rates = None if self._rates is None else self._rates.get(batch_size)
        if rates is None:
            rates = self.rate.steps_per_second(torch.from_numpy(widths * batch_size), batch_size)
            rates = np.asarray(check_rates(f"{type(self.rate).__name__}.steps_per_second",
                                           rates, widths.size), dtype=np.float64)
            if self._rates is not None:
                self._rates[batch_size] = rates
        scores = batch_size * _expected(h)[widths - 1] * rates
        return dict(zip(self.config.widths, scores.tolist()))

    def choose(self, batch_size: int, *, full: bool = False) -> int:
        """Width of this step for ``batch_size`` requests; ``full=True`` for steps that need the
        whole block (grammar-constrained or logprob requests)."""
        positive_int("WidthPolicy.choose: batch_size", batch_size)
        cfg = self.config
        step, self.steps = self.steps, self.steps + 1
        if full:
            return cfg.gamma + 1
        if cfg.forced_width is not None:
            return cfg.forced_width
        if not self._reached.min() > 0 or step % cfg.refresh_every == 0:
            return cfg.gamma + 1
        scores = self.scores(batch_size)
        best = max(cfg.widths, key=lambda w: (scores[w], -w))  # ties to the narrower width
        if self.width is None or scores[best] > (1.0 + cfg.switch_margin) * scores[self.width]:
            self.width = best
        return self.width
