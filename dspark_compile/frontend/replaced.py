"""Forwards replaced for a capture: which source a replacement was derived from, and the swap.

A module whose forward a capture cannot trace as written (a loop over the experts the routing
hit, a kernel call) is taken only by exact class and forward source: :func:`source_key` names
the source, and each hook keeps the keys it was derived from. :func:`swapped_forward` puts the
replacement on the class for the capture and the original back after, whatever happens.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
from typing import Callable, Iterator

__all__ = ["source_key", "swapped_forward"]


def source_key(cls) -> str:
    """sha256 prefix of ``cls.forward``'s source: which forward a capture was derived from."""
    return hashlib.sha256(inspect.getsource(cls.forward).encode()).hexdigest()[:16]


@contextlib.contextmanager
def swapped_forward(cls, forward: Callable) -> Iterator[None]:
    """``cls.forward`` is ``forward`` inside the block, the original again after it."""
    original = cls.forward
    cls.forward = forward
    try:
        yield
    finally:
        cls.forward = original
