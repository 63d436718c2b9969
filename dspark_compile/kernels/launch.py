"""Launch of the lowering's Triton kernels, and a compile-only pass that builds them ahead.

Every kernel of the packed forward goes through :func:`launch`. A tier set needs each kernel in
a few specialisations (tile shapes and variants that depend on the row and request counts, and
Triton's own specialisation of integer arguments), and Triton compiles one the first time it is
launched: during a capture, one compile after another, 21.3 s of a 40.3 s cold capture of the
67-tier set on the H200 (26 compiles; ``compile_time_cold_noahead.json``).

:func:`compile_ahead` runs the forward of every tier once with launches turned into
``JITFunction.warmup`` calls (same arguments, so the same specialisation key; compiled, never
launched) under Triton's ``AsyncCompileMode`` on a thread pool, and waits for every compile
before it returns. Triton's code generation and ``ptxas`` release the GIL for most of a compile:
16 variants of a matmul kernel compiled 6x faster on 16 threads than one after another
(``benchmarks/jit_parallel.py``). The captures that follow find every kernel compiled.

While the pass runs no kernel of ours is launched, so nothing is written to the KV pool or the
linear-attention state; each op's outputs come back as zeros (:func:`zeros_when_warming`), so
the compiled graph's own kernels, which run, only ever see in-range values (index 0). The
step's metadata comes back as that of the all-padding batch the pass runs on (position 0, slot
mapping -1, no context: ``triton_metadata.device_metadata_triton``), so even a KV write that
did run would write nothing.
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import torch

from .ir_check import check_compiled, triton_drops_bound_only_carries

__all__ = ["launch", "warming", "zeros_when_warming", "compile_ahead", "tensor_descriptor",
           "dense"]

_CHECK_IR = triton_drops_bound_only_carries()
"""Check each kernel Triton compiles for a construct this Triton compiles wrong
(:mod:`.ir_check`): Triton older than 3.8."""
_warming = False
_warmed: set = set()
"""Inside :func:`compile_ahead`: the :func:`_launch_key` of every launch warmed up so far."""


def dense(*tensors):
    """A kernel's activation inputs (rows, picks, per-head vectors; never a pool it writes nor
    the layout's metadata) made dense where a model hands over a view (Bloom's ALiBi slopes are
    a column of its ALiBi tensor, DeepSeek-V3.2's values a slice of its key-value projection):
    the kernels index them densely. One copy a view, graph-capturable; a dense tensor (or None)
    is passed as it is."""
    return tuple(t if t is None or t.is_contiguous() else t.contiguous() for t in tensors)


def warming() -> bool:
    """True inside :func:`compile_ahead`: launches compile but do not run."""
    return _warming


def launch(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``; inside :func:`compile_ahead` only its compile, once
    per :func:`_launch_key` (a forward makes the same launch once per layer). Under a Triton
    older than 3.8, each compiled kernel's IR is checked once (:func:`.ir_check.check_compiled`)
    and one that Triton compiles wrong raises: inside a CUDA-graph capture before it ever runs,
    eagerly after its first launch, before the forward returns."""
    if not _warming:
        compiled = kernel[grid](*args, **kwargs)
        if _CHECK_IR and compiled is not None:
            check_compiled(compiled)
        return
    key = _launch_key(kernel, args, kwargs)
    if key is not None and key in _warmed:
        return
    kernel.warmup(*args, grid=grid, **kwargs)
    if key is not None:
        _warmed.add(key)


def tensor_descriptor(t: torch.Tensor, block: list[int]):
    """A host tensor descriptor (TMA on sm_90) of the whole of ``t``, loading ``block`` tiles
    (the skinny and experts kernels' weights)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), block)


def descriptor_ok(t: torch.Tensor) -> bool:
    """Whether a tensor descriptor may cover ``t`` (the TMA rule): a 16-byte aligned base, a
    unit last stride and every other stride a multiple of 16 bytes."""
    return (t.data_ptr() % 16 == 0 and t.stride(-1) == 1
            and all(t.stride(i) * t.element_size() % 16 == 0 for i in range(t.dim() - 1)))


def _arg_key(v):
    """What of ``v`` a Triton specialisation can depend on, or at least as much: a tensor's
    dtype and 16-byte alignment (its address is an argument, not part of the kernel), every
    other value itself; ``...`` for a value of a kind not known here."""
    if isinstance(v, torch.Tensor):
        return ("tensor", v.dtype, v.device, v.data_ptr() % 16 == 0)
    if v is None or isinstance(v, (bool, int, float, str, torch.dtype)):
        return (type(v), v)
    if isinstance(v, (list, tuple)):
        return (type(v), tuple(_arg_key(x) for x in v))
    fields = getattr(v, "__dict__", None)
    if type(v).__name__ == "TensorDescriptor" and fields and "base" in fields:
        return (type(v), tuple((k, _arg_key(x)) for k, x in sorted(fields.items())))
    return ...


def _launch_key(kernel, args, kwargs):
    """A key at least as fine as Triton's own specialisation key of this launch (so two
    launches with one key compile one kernel), or None when an argument is of a kind not
    known here (that launch is always warmed up)."""
    key = (id(kernel), _arg_key(args), _arg_key(tuple(sorted(kwargs.items()))))
    return None if _unknown(key) else key


def _unknown(key) -> bool:
    return key is ... or isinstance(key, tuple) and any(_unknown(k) for k in key)


def zeros_when_warming(out):
    """``out`` (a tensor, or a list, tuple or dict of them), zero-filled inside
    :func:`compile_ahead`, where the launch that would have written it did not run."""
    if _warming:
        values = out.values() if isinstance(out, dict) else \
            out if isinstance(out, (list, tuple)) else (out,)
        for t in values:
            if isinstance(t, torch.Tensor):
                t.zero_()
    return out


def _async_mode():
    """Triton's ``AsyncCompileMode`` class, or None where this Triton has none."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return None
    return AsyncCompileMode


def can_compile_ahead() -> bool:
    """This Triton can compile on a thread pool (``AsyncCompileMode``, Triton 3.4 and newer)."""
    return _async_mode() is not None


@contextlib.contextmanager
def compile_ahead(workers: int | None = None) -> Iterator[None]:
    """Inside: every :func:`launch` compiles its kernel on a pool of ``workers`` threads (default
    one per CPU) instead of running it. On leaving, every compile has finished (a failed one
    raises here). Not re-entrant."""
    global _warming
    mode_cls = _async_mode()
    if mode_cls is None:
        raise RuntimeError("compile_ahead: this Triton has no AsyncCompileMode "
                           "(triton.runtime._async_compile, Triton 3.4 and newer)")
    if _warming:
        raise RuntimeError("compile_ahead: already inside compile_ahead")
    workers = workers or os.cpu_count() or 1
    if workers < 1:
        raise ValueError(f"compile_ahead: workers is {workers}; it must be at least 1")
    with ThreadPoolExecutor(workers, thread_name_prefix="dspark-compile") as pool:
        with mode_cls(pool):
            _warming = True
            try:
                yield
            finally:
                _warming = False
                _warmed.clear()
