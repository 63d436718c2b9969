"""Forwards replaced for a capture: which source a replacement was derived from, and the swap.

A module whose forward a capture cannot trace as written (a loop over the experts the routing
hit, a kernel call) is taken only by exact class and forward source: :func:`source_key` names
the source, each hook keeps the keys it was derived from, and :func:`known_forward` says whether
a module is one of them (a forward set on the instance would shadow any class-level swap).
:func:`swapped_forward` puts the replacement on the class for the capture and the original back
after, whatever happens.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
from typing import Callable, Collection, Iterator

import torch
from torch import nn

__all__ = ["PLAIN_FLOATS", "known_forward", "source_key", "swapped_forward"]

PLAIN_FLOATS = frozenset({torch.float32, torch.float16, torch.bfloat16})
"""Weight dtypes a replaced forward reads as they are (no quantized or packed storage)."""


def source_key(cls) -> str:
    """sha256 prefix of ``cls.forward``'s source: which forward a capture was derived from."""
    return hashlib.sha256(inspect.getsource(cls.forward).encode()).hexdigest()[:16]


def known_forward(module: nn.Module, cls: type, known: Collection[str]) -> bool:
    """``module`` is exactly ``cls``, its forward is the class's (none set on the instance),
    and ``cls.forward``'s :func:`source_key` is one of ``known``."""
    return type(module) is cls and "forward" not in module.__dict__ and \
        source_key(cls) in known


@contextlib.contextmanager
def swapped_forward(cls, forward: Callable) -> Iterator[None]:
    """``cls.forward`` is ``forward`` inside the block, the original again after it."""
    original = cls.forward
    cls.forward = forward
    try:
        yield
    finally:
        cls.forward = original
