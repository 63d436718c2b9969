"""Run many checks in parallel, each in its own process with a time limit.

Processes come from a fork server that imported torch, transformers and the package once, so
a check starts in milliseconds instead of seconds; a check that hangs is killed at its limit
and one that crashes the interpreter (a segfault) becomes an ``error`` row naming the step it
was in. Each process uses ``cpu_count // jobs`` torch threads.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import warnings
from collections import deque
from multiprocessing.connection import wait
from typing import Callable, Iterable

from .check import Entry, Result, check

__all__ = ["run_checks"]

_PRELOAD = ["torch", "torch._dynamo", "torch.export", "sympy", "transformers",
            "transformers.modeling_utils", "transformers.masking_utils",
            "transformers.generation", "dspark_compile.verifier", "dspark_compile.zoo.check"]
"""Imported once by the fork server (imports only: no torch op runs before a fork)."""


def _child(entry: Entry, conn, threads: int, device: str, dtype: str, static: bool,
           check_fn: Callable[..., Result]) -> None:
    import torch
    import transformers

    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    result = check_fn(entry, phase=lambda step: conn.send(("phase", step)), device=device,
                      dtype=dtype, static=static)
    conn.send(("result", result.to_json()))
    conn.close()


def run_checks(selected: Iterable[Entry], jobs: int = 1, timeout: float = 300.0,
               on_result: Callable[[Result], None] = lambda _: None,
               preload: list[str] | None = None, device: str = "cpu",
               dtype: str = "float32", static: bool = False,
               check_fn: Callable[..., Result] = check) -> list[Result]:
    """Check every entry, ``jobs`` at a time; results in the order of ``selected``.
    ``preload``: the modules the fork server imports (default :data:`_PRELOAD`; it takes
    effect only when this process starts its fork server, i.e. on the first call). ``device``,
    ``dtype``, ``static``: where, in what and how each check runs its model and verifier.
    ``check_fn``: the check (default the zoo's :func:`~.check.check`; another takes the same
    arguments, returns a :class:`~.check.Result` and is importable by name in a fresh
    process)."""
    selected = list(selected)
    ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods()
                         else "spawn")
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD if preload is None else preload)
    threads = max(1, (os.cpu_count() or 1) // max(1, jobs))
    pending = deque(enumerate(selected))
    running: dict = {}  # conn -> [process, index, entry, start, phase]
    done: dict[int, Result] = {}

    def finish(conn, result: Result) -> None:
        proc, index = running.pop(conn)[:2]
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join()
        conn.close()
        done[index] = result
        on_result(result)

    while pending or running:
        while pending and len(running) < max(1, jobs):
            index, entry = pending.popleft()
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(entry, child, threads, device, dtype,
                                                    static, check_fn), daemon=True)
            proc.start()
            child.close()
            running[parent] = [proc, index, entry, time.monotonic(), "start"]
        for conn in wait(list(running), timeout=1.0):
            proc, index, entry, start, step = running[conn]
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError):
                proc.join(timeout=10)
                code = proc.exitcode
                how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                result = _failed(entry, step, f"worker died ({how}) during {step}",
                                 time.monotonic() - start)
            else:
                if kind == "phase":
                    running[conn][4] = payload
                    continue
                result = Result(**payload)
            finish(conn, result)
        now = time.monotonic()
        for conn, (proc, index, entry, start, step) in list(running.items()):
            if now - start > timeout:
                proc.kill()
                result = _failed(entry, step, f"timed out after {timeout:.0f} s during {step}",
                                 now - start)
                finish(conn, result)
    return [done[i] for i in range(len(selected))]


def _failed(entry: Entry, step: str, why: str, seconds: float) -> Result:
    status = "skipped" if step in ("start", "config", "model", "reference") else "error"
    return Result(entry.name, entry.model_type, entry.architecture, status,
                  reason=why if status == "error" else f"HF {step}: {why}", phase=step,
                  seconds=round(seconds, 2))
