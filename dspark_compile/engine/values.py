"""Host values of the engine's per-request controls: Python or NumPy numbers, checked without
rounding or casting (``SamplingParams.build``)."""

from __future__ import annotations

import numbers

import numpy as np
import torch

__all__ = ["is_scalar", "number", "check_scalar", "positive_int_arg"]


def is_scalar(value) -> bool:
    return isinstance(value, (numbers.Number, np.generic)) or (
        isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 0)


def number(x):
    return x.item() if isinstance(x, (torch.Tensor, np.ndarray, np.generic)) else x


def check_scalar(name: str, i: int, x) -> None:
    """One sampling value: a real number (``top_k``: integral), never a bool."""
    v = number(x) if is_scalar(x) else x
    integral = isinstance(v, numbers.Integral) and not isinstance(v, bool)
    real = isinstance(v, numbers.Real) and not isinstance(v, bool)
    if not (integral if name == "top_k" else real):
        rule = "an int (0: off)" if name == "top_k" else "a real number"
        raise ValueError(f"SamplingParams.build: {name}[{i}]={x!r}; it must be {rule}, not a "
                         f"{type(x).__name__} (nothing is rounded or cast)")


def positive_int_arg(owner: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{owner}: {name}={value!r}; it must be an int >= 1")
    return int(value)
