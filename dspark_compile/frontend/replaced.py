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
import sys
from typing import Callable, Collection, Iterator

import torch
from torch import nn

__all__ = ["PLAIN_FLOATS", "bind_call", "helper_keys", "known_forward", "modeling_instances",
           "source_key", "swapped_forward"]

PLAIN_FLOATS = frozenset({torch.float32, torch.float16, torch.bfloat16})
"""Weight dtypes a replaced forward reads as they are (no quantized or packed storage)."""


def modeling_instances(model: nn.Module, module: str, names: tuple[str, ...],
                       held: int = 1) -> tuple[tuple[type, ...], list[nn.Module]]:
    """The classes ``names`` of transformers' modeling module ``module`` and the modules of
    ``model`` that are instances of the first ``held`` of them; ``((), [])`` where that module
    is not loaded (a model holds none of its classes then, so it is not imported for nothing)
    or has no such class (a hook then leaves the model untouched)."""
    modeling = sys.modules.get(module)
    classes = tuple(getattr(modeling, name, None) for name in names)
    if modeling is None or None in classes:
        return (), []
    return classes, [m for m in model.modules() if isinstance(m, classes[:held])]


def source_key(cls, method: str = "forward") -> str:
    """sha256 prefix of ``cls.<method>``'s source: which forward a capture was derived from."""
    return hashlib.sha256(inspect.getsource(getattr(cls, method)).encode()).hexdigest()[:16]


def helper_keys(cls, method: str = "forward") -> dict[str, str]:
    """:func:`source_key`-style prefixes of the functions of ``cls``'s own module that
    ``cls.<method>`` names (decorators unwrapped): what it computes beyond its own source, which
    two models can differ in under the very same forward source (HY-V4-VL's indexer forward is
    HY-V4's, its module's ``apply_rotary_pos_emb`` interleaved and float32)."""
    module = sys.modules.get(cls.__module__)
    code = inspect.unwrap(getattr(cls, method)).__code__
    found = {}
    for name in sorted(set(code.co_names)):
        fn = getattr(module, name, None)
        if inspect.isfunction(fn):
            found[name] = hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]
    return found


def known_forward(module: nn.Module, cls: type, known: Collection[str],
                  method: str = "forward") -> bool:
    """``module`` is exactly ``cls``, its ``method`` is the class's (none set on the
    instance), and that method's :func:`source_key` is one of ``known``."""
    return type(module) is cls and method not in module.__dict__ and \
        source_key(cls, method) in known


@contextlib.contextmanager
def swapped_forward(cls, forward: Callable, method: str = "forward") -> Iterator[None]:
    """``cls.<method>`` (its forward unless named) is ``forward`` inside the block, the
    original again after it."""
    own = method in cls.__dict__
    original = cls.__dict__.get(method)
    setattr(cls, method, forward)
    try:
        yield
    finally:
        if own:
            setattr(cls, method, original)
        else:  # inherited: the base class's again
            delattr(cls, method)


def bind_call(names: tuple[str, ...], required: int, args: tuple, kwargs: dict,
              refuse: Callable[[str], Exception], state: str) -> dict:
    """A replaced forward's call bound to its parameter ``names`` (``past_key_values`` read as
    ``cache``, its deprecated name): refused through ``refuse(what)`` for extra positional
    arguments, an unknown or repeated keyword, a missing one of the first ``required`` names, or
    a cache (the capture runs ``use_cache=False`` and owns ``state``)."""
    if len(args) > len(names):
        raise refuse(f"it is called with {len(args)} positional arguments")
    given = dict(zip(names, args))
    for k, v in kwargs.items():
        if k == "past_key_values":
            k = "cache"
        if k not in names or k in given:
            raise refuse(f"it is called with the keyword {k!r}")
        given[k] = v
    missing = [n for n in names[:required] if n not in given]
    if missing:
        raise refuse(f"it is called without {missing}")
    if given.get("cache") is not None:
        raise refuse(f"it is called with a cache (the capture runs use_cache=False and owns "
                     f"{state})")
    return given
