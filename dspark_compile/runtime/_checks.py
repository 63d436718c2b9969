"""Argument checks shared by the runtime modules: ``ValueError`` with the value, rule and fix."""

from __future__ import annotations

import math

import torch

__all__ = ["positive_int", "fraction", "check_outcomes"]


def positive_int(name: str, value) -> int:
    """``value`` as an int >= 1; bools, floats and non-positive values are refused."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is not an integer >= 1; pass a positive int")
    return value


def fraction(name: str, value, *, low_open: bool = True) -> float:
    """``value`` as a float in (0, 1] (or [0, 1] with ``low_open=False``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value > 1 or value < 0 or (low_open and value == 0):
        interval = "(0, 1]" if low_open else "[0, 1]"
        raise ValueError(f"{name}={value!r} is not in {interval}; pass a fraction in {interval}")
    return float(value)


def check_outcomes(owner: str, scores: torch.Tensor, accepted: torch.Tensor,
                   verified: torch.Tensor, gamma: int) -> None:
    """Shapes of one step's outcomes: ``scores [R, gamma]``, ``accepted [R]``, ``verified [R]``.

    Only shapes and dtypes are checked: the values live on the device and reading them would
    be a host sync on every step.
    """
    if scores.dim() != 2 or scores.shape[1] != gamma:
        raise ValueError(f"{owner}: scores have shape {tuple(scores.shape)}; they must be "
                         f"[R, gamma={gamma}] (one per request and draft position)")
    r = scores.shape[0]
    for name, t in (("accepted", accepted), ("verified", verified)):
        if t.shape != (r,):
            raise ValueError(f"{owner}: {name} has shape {tuple(t.shape)}; it must be [R={r}] "
                             "(one count of draft tokens per request)")
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"{owner}: {name} has dtype {t.dtype}; pass an integer tensor")
