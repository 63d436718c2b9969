"""Launch of the lowering's Triton kernels, and a compile-only pass that builds them ahead.

Every kernel of the packed forward goes through :func:`launch`. A tier set needs each kernel in
a few specialisations (tile shapes and variants that depend on the row and request counts, and
Triton's own specialisation of integer arguments), and Triton compiles one the first time it is
launched: during a capture, one compile after another, about 18 s of a 34 s cold capture of the
67-tier set on the H200 (``compile_time_cold.json``).

:func:`compile_ahead` runs the forward of every tier once with launches turned into
``JITFunction.warmup`` calls (same arguments, so the same specialisation key; compiled, never
launched) under Triton's ``AsyncCompileMode`` on a thread pool, and waits for every compile
before it returns. Triton's code generation and ``ptxas`` release the GIL for most of a compile:
16 variants of a matmul kernel compiled 6x faster on 16 threads than one after another
(``benchmarks/jit_parallel.py``). The captures that follow find every kernel compiled.

While the pass runs no kernel of ours is launched, so nothing is written to the KV pool or the
linear-attention state; each op's outputs come back as zeros (:func:`zeros_when_warming`), so
the compiled graph's own kernels, which run, only ever see in-range values (index 0).
"""

from __future__ import annotations

import contextlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import torch

__all__ = ["launch", "warming", "zeros_when_warming", "compile_ahead"]

log = logging.getLogger("dspark_compile")

_warming = False


def warming() -> bool:
    """True inside :func:`compile_ahead`: launches compile but do not run."""
    return _warming


def launch(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``; inside :func:`compile_ahead` only its compile."""
    if _warming:
        kernel.warmup(*args, grid=grid, **kwargs)
    else:
        kernel[grid](*args, **kwargs)


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
