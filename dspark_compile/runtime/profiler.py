"""SPS profiler: time a Verifier's step per token tier and turn it into an SPS table.

    python -m dspark_compile profile-sps [--config hf_config.json] [--context 1024] --out t.json

For every tier (tokens, request slots) it runs a uniform verify of that geometry over the
state's tier graphs (replayed on a GPU; the same static, padded path on the CPU), times each
step (CUDA events on a GPU, the host clock on the CPU), keeps the median after warm-up and
writes the table (JSON, with GPU, model, versions and tier set) and a PNG of the curve.
"""

from __future__ import annotations

import platform
import sys
import time
from typing import Callable

import numpy as np
import torch

from ..session.tiers import Tier, tier_set
from ..layout import VerifyLayout
from .sps import SpsMetadata, SpsSample, SpsTable, table_from_samples

__all__ = ["profile_sps", "plot_sps"]


def _timer(device: torch.device) -> Callable[[Callable], float]:
    """Seconds one call of ``fn`` takes on ``device``."""
    if device.type == "cuda":
        def timed(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return timed

    def timed_host(fn):
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    return timed_host


def _metadata(verifier, tiers: tuple[Tier, ...], model: str) -> SpsMetadata:
    device = verifier.device
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"cpu ({platform.processor() or platform.machine()})"
    import triton

    versions = (("python", platform.python_version()), ("torch", torch.__version__),
                ("triton", triton.__version__))
    return SpsMetadata(gpu=gpu, model=model, versions=versions,
                       tiers=tuple((t.tokens, t.request_slots) for t in tiers))


def profile_sps(verifier, state, context: int, tiers: tuple[Tier, ...] | None = None,
                block: int | None = None, warmup: int = 2, iters: int = 5, model: str = "",
                progress: bool = True) -> SpsTable:
    """Measure steps per second of a uniform verify at every tier of ``state``.

    ``context`` committed tokens per request are assumed (the pool contents are not read for
    timing). Captures the tier graphs first if ``state`` has none.

    The steps write KV rows into the state's slots, so ``state`` must hold no live request: a
    slot with committed tokens or uncommitted rows is refused (``ValueError`` naming the slots;
    profile a fresh ``verifier.new_state(...)``). Every slot is released afterwards.
    """
    for name, value in (("context", context), ("warmup", warmup), ("iters", iters)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (name == "iters"):
            raise ValueError(f"profile_sps: {name}={value!r}; it must be an int >= "
                             f"{int(name == 'iters')}")
    block = verifier.config.block if block is None else block
    if context + block > state.max_context:
        raise ValueError(f"profile_sps: context={context} plus the block must fit the state's "
                         f"max_context={state.max_context}")
    live = sorted(set(np.flatnonzero(state.committed_lens.numpy()).tolist()) |
                  set(state.steps.has_provisional().tolist()))
    if live:
        raise ValueError(f"profile_sps: slots {live} of the state are live (committed tokens or "
                         "a verify not yet committed); profiling writes KV into the slots it "
                         "times. Profile a fresh verifier.new_state(...), or release them first")
    tiers = tier_set(state.max_requests, block) if tiers is None else tiers
    if verifier.session(state) is None:
        verifier.capture(state, tiers=tiers, progress=progress)
    timed, samples = _timer(verifier.device), []
    try:
        for i, tier in enumerate(tiers):
            width = tier.tokens // tier.request_slots
            slots = list(range(tier.request_slots))
            state.committed_lens[slots] = context  # a timing context: the pool is not read
            layout = VerifyLayout.pack([width] * len(slots), [context] * len(slots), slots)
            ids = torch.zeros(layout.num_tokens, dtype=torch.int64, device=verifier.device)
            step = lambda: verifier(ids, layout, state)  # noqa: E731
            for _ in range(warmup):
                step()
            samples += [SpsSample(tier.tokens, timed(step), tier.request_slots)
                        for _ in range(iters)]
            if progress:
                sys.stderr.write(f"\rprofiling tiers {i + 1}/{len(tiers)}")
        if progress:
            sys.stderr.write("\n")
    finally:
        state.release(range(state.max_requests))  # nothing the profile wrote stays live
        session = verifier.session(state)
        if session is not None:
            session.done()  # the profile's verifies are never committed
    return table_from_samples(samples, _metadata(verifier, tiers, model))


def plot_sps(table: SpsTable, path: str) -> None:
    """PNG of steps per second (and tokens per second) against verify tokens, per request tier."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in sorted({e.requests for e in table.entries}, key=lambda x: x or 0):
        rows = [e for e in table.entries if e.requests == r]
        ax.plot([e.tokens for e in rows], [e.steps_per_second for e in rows], marker="o",
                label=f"{r} requests" if r else "all")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("verify tokens per step (B)")
    ax.set_ylabel("steps per second")
    ax.set_title(f"SPS, {table.metadata.gpu}, {table.metadata.model}")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
