"""Additive step-time model ``T = bias + a(R) + t(R + k)``, fitted from pinned-budget runs.

A table keyed by ``(R, B)`` needs a measurement at every pair. Runs that pin the draft budget
``k`` (so ``B = R + k``) and sweep ``R`` separate a per-request cost ``a(R)`` (sampling,
bookkeeping, attention over each request's context) from a per-token cost ``t(B)`` (the linear
layers). Each is a clamped linear interpolant over its knots; the fit is ordinary least squares
in float64 with ``a(first knot) = t(first knot) = 0`` so that ``bias`` carries the constant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from ._checks import positive_int

__all__ = ["AdditiveStepModel", "fit_additive_model"]


def _segments(x: torch.Tensor, knots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Left knot index and fraction toward the right knot of each ``x``, clamped to the knots."""
    x = x.to(torch.float64).clamp(float(knots[0]), float(knots[-1]))  # [S]
    left = (torch.searchsorted(knots, x, right=True) - 1).clamp_(0, knots.numel() - 2)  # [S]
    frac = (x - knots[left]) / (knots[left + 1] - knots[left])  # [S]
    return left, frac


def _hat_basis(x: torch.Tensor, knots: torch.Tensor) -> torch.Tensor:
    """[S, K] weights of each knot value in the clamped linear interpolant at each ``x``."""
    basis = torch.zeros(x.numel(), knots.numel(), dtype=torch.float64)  # [S, K]
    if knots.numel() == 1:
        return basis.fill_(1.0)
    left, frac = _segments(x, knots)
    rows = torch.arange(x.numel())
    basis[rows, left] = 1.0 - frac
    basis[rows, left + 1] += frac
    return basis


def _interp(x: torch.Tensor, knots: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Clamped linear interpolation of ``values`` over ``knots`` at ``x`` (any shape)."""
    if knots.numel() == 1:
        return values[0].expand(x.shape).clone()
    left, frac = _segments(x.reshape(-1), knots)
    out = values[left] + frac * (values[left + 1] - values[left])
    return out.reshape(x.shape)


def _knots(name: str, knots: Sequence[int]) -> tuple[int, ...]:
    """``knots`` as a strictly increasing tuple of positive ints, or a ValueError."""
    knots = tuple(positive_int(f"{name}[{i}]", k) for i, k in enumerate(knots))
    if not knots or any(b <= a for a, b in zip(knots, knots[1:])):
        raise ValueError(f"{name}={knots!r} is not a non-empty strictly increasing sequence; "
                         "pass sorted distinct knots")
    return knots


@dataclass(frozen=True)
class AdditiveStepModel:
    """Step seconds ``bias + a(R) + t(B)`` with clamped linear ``a`` and ``t``."""

    bias: float
    """Seconds of a step that no request or token adds to (launches, sampling setup)."""
    request_knots: tuple[int, ...]
    """Request counts R at which ``a`` is given, strictly increasing."""
    request_seconds: tuple[float, ...]
    """a(R) at each request knot, seconds; the first is 0 by convention."""
    token_knots: tuple[int, ...]
    """Packed token counts B at which ``t`` is given, strictly increasing."""
    token_seconds: tuple[float, ...]
    """t(B) at each token knot, seconds; the first is 0 by convention."""

    def __post_init__(self) -> None:
        for knots, values in (("request_knots", "request_seconds"),
                              ("token_knots", "token_seconds")):
            k = _knots(f"AdditiveStepModel.{knots}", getattr(self, knots))
            v = tuple(float(x) for x in getattr(self, values))
            if len(v) != len(k) or not all(math.isfinite(x) for x in v):
                raise ValueError(f"AdditiveStepModel.{values}={v!r} must hold {len(k)} finite "
                                 f"values, one per entry of {knots}")
            object.__setattr__(self, knots, k)
            object.__setattr__(self, values, v)
        floor = self.bias + min(self.request_seconds) + min(self.token_seconds)
        if not math.isfinite(self.bias) or floor <= 0:
            raise ValueError(f"AdditiveStepModel: bias={self.bias!r} gives a least step time of "
                             f"{floor!r} s; every step time must be > 0 (refit with more runs)")
        tensors = {name: torch.tensor(getattr(self, name), dtype=torch.float64)
                   for name in ("request_knots", "request_seconds",
                                "token_knots", "token_seconds")}
        object.__setattr__(self, "_tensors", tensors)

    def seconds(self, tokens: torch.Tensor, requests: int) -> torch.Tensor:
        """float64 step seconds at each entry of ``tokens`` with ``requests`` requests."""
        t = self._tensors
        per_request = _interp(torch.tensor([float(requests)], dtype=torch.float64),
                              t["request_knots"], t["request_seconds"])  # [1]
        per_token = _interp(tokens, t["token_knots"], t["token_seconds"])  # tokens.shape
        return self.bias + per_request + per_token

    def steps_per_second(self, tokens: torch.Tensor, requests: int) -> torch.Tensor:
        """float64 steps per second, ``1 / seconds``."""
        return 1.0 / self.seconds(tokens, requests)

    def rate_span(self, first_tokens: int, count: int, requests: int) -> torch.Tensor:
        """float64 [count] steps per second at ``B = first_tokens, ..., first_tokens+count-1``."""
        return self.steps_per_second(torch.arange(first_tokens, first_tokens + count), requests)


def fit_additive_model(
    samples: Iterable[tuple[int, int, float]],
    request_knots: Sequence[int] | None = None,
    token_knots: Sequence[int] | None = None,
) -> AdditiveStepModel:
    """Least-squares fit of ``(requests, tokens, seconds)`` samples from pinned-budget runs.

    Knots default to the distinct measured values. A fit whose samples cannot separate ``a`` from
    ``t`` (for instance a single pinned budget, where ``B - R`` never changes) is refused.
    """
    rows = [tuple(s) for s in samples]
    for i, (r, b, sec) in enumerate(rows):
        positive_int(f"samples[{i}].requests", r)
        positive_int(f"samples[{i}].tokens", b)
        if not (isinstance(sec, (int, float)) and math.isfinite(sec) and sec > 0):
            raise ValueError(f"samples[{i}].seconds={sec!r} is not a finite number > 0; "
                             "drop the failed measurement")
    if not rows:
        raise ValueError("samples=[] is empty; time pinned-budget runs first")
    rk = _knots("request_knots", request_knots or sorted({r for r, _, _ in rows}))
    tk = _knots("token_knots", token_knots or sorted({b for _, b, _ in rows}))
    data = torch.tensor(rows, dtype=torch.float64)  # [S, 3]
    design = torch.cat([
        torch.ones(len(rows), 1, dtype=torch.float64),
        _hat_basis(data[:, 0], torch.tensor(rk, dtype=torch.float64))[:, 1:],
        _hat_basis(data[:, 1], torch.tensor(tk, dtype=torch.float64))[:, 1:],
    ], dim=1)  # [S, 1 + (len(rk) - 1) + (len(tk) - 1)]
    solution = torch.linalg.lstsq(design, data[:, 2:], driver="gelsd")
    if int(solution.rank) < design.shape[1]:
        raise ValueError(
            f"fit_additive_model: {len(rows)} samples determine only {int(solution.rank)} of "
            f"{design.shape[1]} unknowns; the runs do not separate a(R) from t(R + k). Time at "
            "least two pinned budgets per request count, or pass fewer knots")
    coef = solution.solution[:, 0].tolist()
    n_r = len(rk) - 1
    return AdditiveStepModel(
        bias=coef[0],
        request_knots=rk,
        request_seconds=(0.0, *coef[1:1 + n_r]),
        token_knots=tk,
        token_seconds=(0.0, *coef[1 + n_r:]),
    )
