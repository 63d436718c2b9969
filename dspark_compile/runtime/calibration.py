"""Temperature calibration of a draft confidence head, online or static.

A confidence head's ``c[r, k]`` (conditional acceptance of draft ``k``) is often over- or
under-confident, and differently so at each position. Temperature scaling maps
``c -> sigmoid(logit(c) / T_k)``; the online fit picks ``T_k`` from what verification showed:

- position ``k`` of a request is a *trial* if ``k < min(accepted + 1, verified)`` (it was
  judged: an accepted draft or the first rejected one) and a *hit* if ``k < accepted``;
- trials and hits go into 16 bins of ``logit(c)`` over ``[-8, 8]``, decayed by 0.999 per step;
- per position, ``T`` is the point of a 49-point log grid from 1/8 to 8 that minimises
  ``sum_bins trials * |sigmoid(mid / T) - hits / trials|``;
- ``log T_k`` is blended toward the pooled fit (all positions' bins summed) with weight
  ``n_k / (n_k + 64)``, and the pooled ``log T`` toward 0 the same way, so a cold start is the
  identity and a rarely reached deep position borrows the pooled temperature.

Saturated confidences (exactly 0 or 1, e.g. a sigmoid head that underflowed in half
precision) have infinite logits. They are clamped to the binned range ``[-8, 8]`` both when
counted (they land in the end bins instead of falling out of the histogram) and when calibrated
(a 0 becomes ``sigmoid(-8 / T)``, a low-ranked draft the planner can still verify, not one it
drops without a trace). A NaN confidence stays NaN, which the planner refuses.

All state lives on the tensors' device and no method syncs with the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import check_outcomes, fraction, positive_int

__all__ = ["CalibrationConfig", "TemperatureCalibrator"]


@dataclass(frozen=True)
class CalibrationConfig:
    """Binning, grid and blending of the temperature fit."""

    gamma: int
    """Draft positions per step (one temperature each)."""
    static_temperature: float | None = None
    """Use this temperature at every position and never fit (None: fit online)."""
    decay: float = 0.999
    """Weight of the old bin counts at each observed step (~1000 steps of memory)."""
    num_bins: int = 16
    """Bins of ``logit(c)`` over ``[-logit_range, logit_range]``."""
    logit_range: float = 8.0
    """Half-width of the binned logit range; logits beyond it are clamped into the end bins."""
    grid_points: int = 49
    """Temperatures tried, log-spaced from ``1 / grid_span`` to ``grid_span`` (49: 8 per octave)."""
    grid_span: float = 8.0
    """Largest temperature on the grid; the smallest is its inverse."""
    prior_trials: float = 64.0
    """Trials at which a position's own fit and the pooled fit weigh the same."""

    def __post_init__(self) -> None:
        positive_int("CalibrationConfig.gamma", self.gamma)
        positive_int("CalibrationConfig.num_bins", self.num_bins)
        positive_int("CalibrationConfig.grid_points", self.grid_points)
        fraction("CalibrationConfig.decay", self.decay)
        if self.static_temperature is not None and not 0 < self.static_temperature < float("inf"):
            raise ValueError(f"CalibrationConfig.static_temperature={self.static_temperature!r} "
                             "is not a finite temperature > 0; pass e.g. 1.5, or None to fit")
        for name in ("logit_range", "prior_trials"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"CalibrationConfig.{name}={getattr(self, name)!r} must be "
                                 "finite and > 0")
        if not 1 < self.grid_span < float("inf"):
            raise ValueError(f"CalibrationConfig.grid_span={self.grid_span!r} must be finite "
                             "and > 1 (the grid spans 1/grid_span .. grid_span)")


def _grid_fit(trials: torch.Tensor, hits: torch.Tensor, sig: torch.Tensor,
              log_grid: torch.Tensor) -> torch.Tensor:
    """log T [P] minimising the trial-weighted calibration gap of ``P`` bin histograms.

    ``trials, hits [P, bins]``; ``sig [grid, bins]`` = sigmoid(mid / T) per grid point.
    """
    rate = hits / trials.clamp(min=1e-12)  # [P, bins]; bins without trials weigh 0 below
    gap = (sig[None, :, :] - rate[:, None, :]).abs()  # [P, grid, bins]
    loss = (gap * trials[:, None, :]).sum(-1)  # [P, grid]
    return log_grid[torch.argmin(loss, dim=1)]  # [P]; first minimum on ties


class TemperatureCalibrator:
    """Per-position temperature scaling of draft confidences, fitted online or fixed."""

    def __init__(self, config: CalibrationConfig, device: torch.device | str = "cpu"):
        c = config
        self.config = config
        f64 = dict(dtype=torch.float64, device=device)
        self.trials = torch.zeros(c.gamma, c.num_bins, **f64)  # [gamma, bins] decayed counts
        self.hits = torch.zeros(c.gamma, c.num_bins, **f64)  # [gamma, bins] decayed counts
        start = 0.0 if c.static_temperature is None else float(c.static_temperature)
        self.log_temperature = torch.full((c.gamma,), start, **f64)  # [gamma]
        if c.static_temperature is not None:
            self.log_temperature.log_()
        width = 2.0 * c.logit_range / c.num_bins
        mids = -c.logit_range + width * (torch.arange(c.num_bins, **f64) + 0.5)  # [bins]
        self._log_grid = torch.linspace(-1.0, 1.0, c.grid_points, **f64) * torch.log(
            torch.tensor(c.grid_span, **f64))  # [grid]
        self._sig = torch.sigmoid(mids[None, :] / self._log_grid.exp()[:, None])  # [grid, bins]
        self._positions = torch.arange(c.gamma, device=device)  # [gamma]
        self._bin_ids = torch.arange(c.num_bins, device=device)  # [bins]

    def temperatures(self) -> torch.Tensor:
        """float64 [gamma]: the temperature applied at each draft position."""
        return self.log_temperature.exp()

    def _clamped_logit(self, confidence: torch.Tensor) -> torch.Tensor:
        """float64 logit of ``confidence`` clamped to the binned range (0 and 1 included)."""
        r = self.config.logit_range
        return torch.logit(confidence.to(torch.float64)).clamp(-r, r)  # NaN stays NaN

    def calibrate(self, confidence: torch.Tensor) -> torch.Tensor:
        """Calibrated conditional acceptance [R, gamma] (float32) for ``confidence [R, gamma]``."""
        z = self._clamped_logit(confidence)  # [R, gamma]
        return torch.sigmoid(z / self.temperatures()).float()

    def observe(self, confidence: torch.Tensor, accepted: torch.Tensor,
                verified: torch.Tensor) -> None:
        """Add one verified step: the raw ``confidence [R, gamma]`` the drafts had, ``accepted
        [R]`` drafts accepted and ``verified [R]`` drafts verified; then refit (unless static)."""
        c = self.config
        check_outcomes("TemperatureCalibrator.observe", confidence, accepted, verified, c.gamma)
        if c.static_temperature is not None:
            return
        z = self._clamped_logit(confidence)  # [R, gamma]
        k = self._positions[None, :]  # [1, gamma]
        acc = accepted[:, None]
        trial = (k < torch.minimum(acc + 1, verified[:, None])) & ~torch.isnan(z)  # [R, gamma]
        hit = trial & (k < acc)  # [R, gamma]
        width = 2.0 * c.logit_range / c.num_bins
        bins = ((torch.nan_to_num(z) + c.logit_range) / width).floor().long()
        bins = bins.clamp_(0, c.num_bins - 1)  # [R, gamma]; z = +range lands in the last bin
        # One-hot sums rather than index_add_: a plain reduction is deterministic on CUDA too.
        onehot = (bins[..., None] == self._bin_ids).double()  # [R, gamma, bins]
        self.trials.mul_(c.decay).add_((onehot * trial[..., None]).sum(0))
        self.hits.mul_(c.decay).add_((onehot * hit[..., None]).sum(0))
        self._refit()

    def _refit(self) -> None:
        """Grid-fit every position and the pooled bins, then blend (see the module docstring)."""
        prior = self.config.prior_trials
        n = self.trials.sum(1)  # [gamma]
        pooled_n = n.sum()
        own = _grid_fit(self.trials, self.hits, self._sig, self._log_grid)  # [gamma]
        pooled = _grid_fit(self.trials.sum(0, keepdim=True), self.hits.sum(0, keepdim=True),
                           self._sig, self._log_grid)[0]  # []
        pooled = pooled * (pooled_n / (pooled_n + prior))  # toward log T = 0 (identity)
        weight = n / (n + prior)  # [gamma]
        self.log_temperature.copy_(weight * own + (1.0 - weight) * pooled)
