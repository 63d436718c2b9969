"""Online acceptance estimator for drafts without a confidence head.

The planner needs ``c[r, k]``, the probability that draft ``k`` is accepted given that drafts
``0..k-1`` were. Without a trained head we model it as a logistic function of the draft's own
certainty::

    p_k = sigmoid(slope * x_k + bias_k),   x_k = logit(q_max_k) clamped to [-40, 40]

where ``q_max_k`` is the top probability of the temperature-scaled draft distribution at
position ``k`` (greedy rows use T = 1): one slope shared by all positions, one intercept each.

Each verified step labels the accepted drafts 1 and the first rejected one 0 (drafts after it
were never judged) and adds their Newton (IRLS) statistics; every ``refit_every`` calls one
damped, ridge-regularised Newton step is taken, bounded per parameter (``max_step``), dropped
if not finite, and with a slope step that would turn the slope negative halved (up to 8 times)
or dropped. The statistics then restart at the new parameters. Everything stays on the device
with no host sync: the call counter is a tensor and the refit is applied with ``torch.where``. The
Hessian is an arrow matrix (the slope couples to every intercept, intercepts not to each other),
so the step is solved in closed form with elementwise ops, ready for a Triton port.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import check_outcomes, positive_int

__all__ = ["EstimatorConfig", "AcceptanceEstimator", "draft_logit_qmax"]

_X_CLAMP = 40.0


@dataclass(frozen=True)
class EstimatorConfig:
    """Model size and the refit schedule."""

    gamma: int
    """Draft positions per step (one intercept each)."""
    initial_slope: float = 1.0
    """Slope before any refit (1.0: trust the draft's q_max as a calibrated probability)."""
    initial_bias: float = 0.0
    """Intercept of every position before any refit."""
    refit_every: int = 100
    """Observe calls between Newton steps."""
    ridge: float = 1e-3
    """Added to the Hessian diagonal, so that an unseen position has a finite step."""
    damping: float = 50.0
    """A step is scaled by ``n / (n + damping)``, ``n`` the labelled drafts since the last refit."""
    slope_halvings: int = 8
    """Halvings of a slope step that would turn the slope negative before it is dropped."""
    max_step: float = 2.0
    """Largest change of any one parameter per refit (logit units). Newton overshoots where
    predictions saturate (p(1-p) -> 0): from slope 3 on slope-1 data the deepest intercept went
    -4.3, 8.8, -958, 33717 over four refits without this bound."""

    def __post_init__(self) -> None:
        positive_int("EstimatorConfig.gamma", self.gamma)
        positive_int("EstimatorConfig.refit_every", self.refit_every)
        if self.initial_slope < 0:
            raise ValueError(f"EstimatorConfig.initial_slope={self.initial_slope!r} is negative; "
                             "more draft certainty cannot mean less acceptance (pass >= 0)")
        if not self.ridge > 0 or not self.damping >= 0 or not self.max_step > 0:
            raise ValueError(f"EstimatorConfig ridge={self.ridge!r} and max_step="
                             f"{self.max_step!r} must be > 0, damping={self.damping!r} >= 0")
        if not isinstance(self.slope_halvings, int) or self.slope_halvings < 0:
            raise ValueError(f"EstimatorConfig.slope_halvings={self.slope_halvings!r} is not an "
                             "int >= 0")


def draft_logit_qmax(draft_logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """x [R, gamma] = logit(q_max) of ``softmax(draft_logits / T)``, clamped to ±40.

    ``draft_logits [R, gamma, V]``; ``temperature [R]`` with 0 for greedy rows (scored at T=1).
    Computed as ``max(z) - logsumexp(z without its max)``, which stays finite where
    ``q_max`` rounds to 1.
    """
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))  # [R]
    z = draft_logits.float() / t.float()[:, None, None]  # [R, gamma, V]
    top, arg = z.max(dim=-1, keepdim=True)  # [R, gamma, 1]
    rest = z.scatter(-1, arg, float("-inf"))  # [R, gamma, V]: the max left out
    x = top[..., 0] - torch.logsumexp(rest, dim=-1)  # [R, gamma]; +inf when V == 1
    return x.clamp(-_X_CLAMP, _X_CLAMP)


def _labels(accepted: torch.Tensor, verified: torch.Tensor, positions: torch.Tensor):
    """weight [R, gamma] (1 where a draft was judged) and label [R, gamma] (1 where accepted)."""
    k = positions[None, :]  # [1, gamma]
    acc = accepted[:, None]
    judged = k < torch.minimum(acc + 1, verified[:, None])  # [R, gamma]
    return judged.to(torch.float64), (k < acc).to(torch.float64)


class AcceptanceEstimator:
    """Logistic acceptance model ``sigmoid(slope * x + bias_k)`` refitted online by IRLS."""

    def __init__(self, config: EstimatorConfig, device: torch.device | str = "cpu"):
        g = config.gamma
        self.config = config
        f64 = dict(dtype=torch.float64, device=device)
        self.slope = torch.tensor(float(config.initial_slope), **f64)  # []
        self.bias = torch.full((g,), float(config.initial_bias), **f64)  # [gamma]
        self.calls = torch.zeros((), dtype=torch.int64, device=device)  # []
        # Newton statistics since the last refit (float64: sums over ~10^5 drafts).
        self.count = torch.zeros(g, **f64)  # [gamma] labelled drafts per position
        self.grad = torch.zeros(g + 1, **f64)  # [1 + gamma]: d/dslope, d/dbias_k
        self.h_xx = torch.zeros(g, **f64)  # [gamma] sum w x^2 per position
        self.h_x1 = torch.zeros(g, **f64)  # [gamma] sum w x per position
        self.h_11 = torch.zeros(g, **f64)  # [gamma] sum w per position
        # Constants, built once rather than on every step.
        self._positions = torch.arange(g, device=device)  # [gamma]
        self._halves = torch.pow(0.5, torch.arange(config.slope_halvings + 1, **f64))  # [H + 1]

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Conditional acceptance [R, gamma] (float32) for features ``x [R, gamma]``."""
        return torch.sigmoid(self.slope * x.to(torch.float64) + self.bias).float()

    def observe(self, x: torch.Tensor, accepted: torch.Tensor, verified: torch.Tensor) -> None:
        """Add one verified step: ``x [R, gamma]`` the features the drafts were scored with,
        ``accepted [R]`` drafts accepted, ``verified [R]`` drafts verified (``len - 1``)."""
        g = self.config.gamma
        check_outcomes("AcceptanceEstimator.observe", x, accepted, verified, g)
        weight, label = _labels(accepted, verified, self._positions)  # [R, gamma] each
        xd = x.to(torch.float64)
        p = torch.sigmoid(self.slope * xd + self.bias)  # [R, gamma]
        resid = weight * (label - p)  # [R, gamma]
        curv = weight * p * (1.0 - p)  # [R, gamma]
        self.count += weight.sum(0)
        self.grad[0] += (resid * xd).sum()
        self.grad[1:] += resid.sum(0)
        self.h_xx += (curv * xd * xd).sum(0)
        self.h_x1 += (curv * xd).sum(0)
        self.h_11 += curv.sum(0)
        self.calls += 1
        self._maybe_refit()

    def _newton_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Ridge Newton step (slope [], bias [gamma]) from the arrow Hessian, by Schur complement.

        H = [[a, b^T], [b, D]] with a = sum h_xx + ridge, b = h_x1, D = diag(h_11 + ridge).
        """
        ridge = self.config.ridge
        d = self.h_11 + ridge  # [gamma]
        a = self.h_xx.sum() + ridge
        schur = a - (self.h_x1 * self.h_x1 / d).sum()
        d_slope = (self.grad[0] - (self.h_x1 * self.grad[1:] / d).sum()) / schur
        d_bias = (self.grad[1:] - self.h_x1 * d_slope) / d  # [gamma]
        return d_slope, d_bias

    def _maybe_refit(self) -> None:
        """On every ``refit_every``-th call, take the guarded Newton step and restart the window.

        The step is computed on every call and applied with ``torch.where``: reading the call
        counter on the host to branch would be a device sync per step.
        """
        cfg = self.config
        due = self.calls.remainder(cfg.refit_every) == 0  # [] bool, stays on the device
        d_slope, d_bias = self._newton_step()
        n = self.count.sum()
        damp = n / (n + cfg.damping)
        bound = cfg.max_step
        d_slope = (d_slope * damp).clamp(-bound, bound)  # NaN stays NaN and is dropped below
        d_bias = (d_bias * damp).clamp(-bound, bound)  # [gamma]
        finite = torch.isfinite(d_slope) & torch.isfinite(d_bias).all()
        # Halve a slope step that would turn the slope negative, up to slope_halvings times.
        tries = d_slope * self._halves  # [H + 1]
        ok = self.slope + tries >= 0  # [H + 1]
        first = torch.argmax(ok.to(torch.int8))  # first try that keeps slope >= 0
        kept = tries.gather(0, first.reshape(1)).reshape(())  # gather: no host read of first
        d_slope = torch.where(ok.any(), kept, torch.zeros_like(d_slope))
        apply = due & finite
        # In place, so that a captured graph keeps reading the same buffers.
        self.slope.copy_(torch.where(apply, self.slope + d_slope, self.slope))
        self.bias.copy_(torch.where(apply, self.bias + d_bias, self.bias))
        for stats in (self.count, self.grad, self.h_xx, self.h_x1, self.h_11):
            stats.masked_fill_(due, 0.0)  # a new window starts at the (possibly new) parameters
