"""Where the cold start of a verifier goes: dspark_compile, the first call (torch.compile of the
packed graph), and the capture of every tier, with torch's own per-phase compile times.

Run it in a fresh process with an empty Inductor cache to see what a new machine pays:

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) \
        python benchmarks/compile_time.py [--label NAME]

The model is verify_step.py's Llama-like 1.1B (bf16, random weights), block 8, 256 request
slots (67 tiers). Writes ``compile_time[_NAME].json`` to ``$OUT`` (or benchmarks/results/).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import torch

from dspark_compile import dspark_compile
from dspark_compile.session.tiers import tier_set
from common import build_model


def cpu_only() -> None:
    """Seconds of ``dspark_compile`` on the CPU, whole and per phase (the dense capture, each
    pass, the lowering), best of two runs in this process."""
    import platform

    import dspark_compile.passes as passes
    import dspark_compile.verifier as verifier_mod

    model = build_model(device="cpu")
    phases: dict = {}

    def timed(name, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0
        return call

    passes.PIPELINE = tuple(dataclasses.replace(p, run=timed(p.name, p.run))
                            for p in passes.PIPELINE)
    verifier_mod.capture_dense = timed("capture_dense", verifier_mod.capture_dense)
    runs = []
    for _ in range(2):
        phases.clear()
        t0 = time.perf_counter()
        verifier_mod.dspark_compile(model, page_size=16, block=8, lowering="reference")
        runs.append((time.perf_counter() - t0, dict(phases)))
    total, best = min(runs, key=lambda r: r[0])
    row = {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "torch": torch.__version__, "command": "python benchmarks/compile_time.py --cpu",
           "model": "verify_step.py's Llama-like 1.1B (16 layers), bf16, on the CPU",
           "dspark_compile_s": total, "phase_s": best,
           "runs_s": [r[0] for r in runs]}
    print(json.dumps(row, indent=1))
    out = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile_time_cpu.json").write_text(json.dumps(row, indent=1))


def _trace_jit(events: list) -> None:
    """Record (kernel, start, seconds) of every Triton JIT compile from now on."""
    from triton.runtime.jit import JITFunction

    inner = getattr(JITFunction, "_do_compile", None)
    if inner is None:
        raise SystemExit("--trace-jit: this Triton has no JITFunction._do_compile")

    def timed(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            events.append((self.fn.__name__, t, time.perf_counter() - t))

    JITFunction._do_compile = timed


def _jit_summary(events: list, capture_start: float, ahead: float, reports) -> dict:
    """JIT seconds per kernel, and per captured tier (tiers in capture order). Inside the
    compile-ahead pass (its first ``ahead`` seconds) a compile is submitted to a thread pool:
    its seconds there are only the submission's."""
    per_kernel: dict = {}
    for name, _, sec in events:
        n, s = per_kernel.get(name, (0, 0.0))
        per_kernel[name] = (n + 1, s + sec)
    bounds, t = [(capture_start, capture_start + ahead, "compile_ahead")], capture_start + ahead
    for r in reports:
        bounds.append((t, t + r.seconds, f"{r.tier.tokens}x{r.tier.request_slots}"))
        t += r.seconds
    per_tier: dict = {}
    for _, start, sec in events:
        label = next((lab for lo, hi, lab in bounds if lo <= start < hi),
                     "before capture" if start < capture_start else "after capture")
        n, s = per_tier.get(label, (0, 0.0))
        per_tier[label] = (n + 1, round(s + sec, 3))
    return {"compiles": len(events), "seconds": round(sum(e[2] for e in events), 3),
            "per_kernel": {k: [n, round(s, 3)] for k, (n, s) in
                           sorted(per_kernel.items(), key=lambda kv: -kv[1][1])},
            "per_tier": per_tier}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="", help="suffix of the JSON file name")
    ap.add_argument("--no-ahead", action="store_true",
                    help="capture with compile_ahead=False: each Triton kernel compiles when a "
                         "capture first launches it")
    ap.add_argument("--trace-jit", action="store_true",
                    help="time every Triton JIT compile of our kernels (JITFunction._do_compile) "
                         "and group them by kernel and by tier")
    ap.add_argument("--cpu", action="store_true",
                    help="only dspark_compile, of the model on the CPU (reference lowering): "
                         "the passes' own cost, no GPU needed (compile_time_cpu.json)")
    opts = ap.parse_args()
    if opts.cpu:
        return cpu_only()
    import torch._dynamo.utils as dyn_utils
    import torch._inductor.config as ind_config
    import triton

    jit_events: list = []
    if opts.trace_jit:
        _trace_jit(jit_events)
    model = build_model()
    row: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "triton": triton.__version__, "cpus": os.cpu_count(),
                 "compile_threads": ind_config.compile_threads,
                 "inductor_cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
                 "command": "python benchmarks/compile_time.py"
                            + (f" --label {opts.label}" if opts.label else "")
                            + (" --no-ahead" if opts.no_ahead else "")
                            + (" --trace-jit" if opts.trace_jit else "")}
    t0 = time.perf_counter()
    verifier = dspark_compile(model, page_size=16, block=8, lowering="triton", inductor=True)
    row["dspark_compile_s"] = time.perf_counter() - t0
    state = verifier.new_state(max_requests=256, max_context=1024 + 64)
    tiers = tier_set(256, 8)
    t0 = time.perf_counter()
    session = verifier.capture(state, tiers=tiers, progress=False,
                               compile_ahead=not opts.no_ahead)
    reports = session.reports
    row["capture_s"] = time.perf_counter() - t0
    row["compile_ahead"] = not opts.no_ahead
    row["compile_ahead_s"] = session.ahead_seconds
    row["tiers"] = len(tiers)
    row["slowest_tiers"] = sorted(([r.tier.tokens, r.tier.request_slots, round(r.seconds, 3)]
                                   for r in reports), key=lambda t: -t[2])[:8]
    row["tier_seconds_sum"] = sum(r.seconds for r in reports)
    if opts.trace_jit:
        row["jit"] = _jit_summary(jit_events, t0, session.ahead_seconds, reports)
    row["dynamo_compile_times"] = dyn_utils.compile_times(repr="str", aggregate=True)
    print(json.dumps({k: v for k, v in row.items() if k != "dynamo_compile_times"}, indent=1))
    print(row["dynamo_compile_times"])
    out = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    name = f"compile_time_{opts.label}.json" if opts.label else "compile_time.json"
    (out / name).write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
