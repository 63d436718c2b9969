"""Time the host planner per step at R = 1, 8, 64, 256 requests, gamma = 7.

Usage: ``python benchmarks/planner_host.py [--iters N] [--out PATH]``. Writes JSON with the
machine, the versions, every setting and the per-step latency (median, p10, p90, mean) to
``benchmarks/results/planner_host.json``. Target: <= 100 us per step at R = 256. On a shared
machine run it under ``nice -n -10`` so that other jobs do not preempt the timed calls; the JSON
records the niceness and the load average.

One step is ``Planner.__call__`` on a CPU float32 confidence: validation, ranking, budget,
lengths. Each call is timed alone with ``perf_counter_ns``. The batch sizes are interleaved in
rounds: on the shared 2-core VM this was written on, the same code runs 2x slower for tens of
seconds at a time, and rounds show those phases instead of letting them land on one batch
size. Reported per batch size: the median over all calls, p10 / p90, and the median of the
quietest round; ``reference_us`` times a fixed NumPy sort per round as a machine-speed gauge.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from dspark_compile.runtime import Planner, PlannerConfig, SpsEntry, SpsMetadata, SpsTable

GAMMA = 7
REQUESTS = (1, 8, 64, 256)
SEED = 0
# Step times from DESIGN.md "Measured facts": a 1.14B Llama-like model on an H200, dense verify
# at T = 8 (B = 8 * bs): 1.73 / 1.81 / 5.83 / 21.4 ms at bs 1 / 8 / 64 / 256.
H200_STEP_MS = {8: 1.73, 64: 1.81, 512: 5.83, 2048: 21.4}


def _table() -> SpsTable:
    meta = SpsMetadata(gpu="NVIDIA H200 (DESIGN.md figures)", model="1.14B Llama-like bf16",
                       versions=(("torch", "2.11"),), tiers=())
    entries = (SpsEntry(1, 1000.0 / H200_STEP_MS[8]),) + tuple(
        SpsEntry(b, 1000.0 / ms) for b, ms in sorted(H200_STEP_MS.items()))
    return SpsTable(meta, entries)


def _confidence(requests: int, gen: torch.Generator) -> torch.Tensor:
    """Draft confidence [R, gamma] shaped like a trained head: high early, falling with depth."""
    base = torch.linspace(0.95, 0.6, GAMMA)[None, :]  # [1, gamma]
    noise = 0.3 * torch.rand(requests, GAMMA, generator=gen) - 0.15  # [R, gamma]
    return (base + noise).clamp(0.0, 1.0)


def _time_calls(planner: Planner, confidences: list[torch.Tensor], calls: int) -> list[float]:
    """Microseconds of each of ``calls`` planner steps."""
    times = []
    for i in range(calls):
        conf = confidences[i % len(confidences)]
        start = time.perf_counter_ns()
        planner(conf)
        times.append((time.perf_counter_ns() - start) / 1e3)
    return times


def _reference_us() -> float:
    """Median time of a fixed NumPy sort of 1792 int64: how fast the machine is right now."""
    keys = np.random.default_rng(0).integers(-(2**62), 2**62, 1792)
    times = []
    for _ in range(200):
        start = time.perf_counter_ns()
        np.sort(keys)
        times.append((time.perf_counter_ns() - start) / 1e3)
    return statistics.median(times)


def _machine() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "logical_cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "torch_threads": torch.get_num_threads(),
        "niceness": os.nice(0),
        "load_average_1min_at_start": os.getloadavg()[0],
    }


def _summary(r: int, rounds: list[list[float]], plan_tokens: int) -> dict:
    every = sorted(t for times in rounds for t in times)
    return {
        "requests": r,
        "median_us": round(statistics.median(every), 2),
        "p10_us": round(every[len(every) // 10], 2),
        "p90_us": round(every[(9 * len(every)) // 10], 2),
        "mean_us": round(statistics.fmean(every), 2),
        "quietest_round_median_us": round(min(statistics.median(t) for t in rounds), 2),
        "round_medians_us": [round(statistics.median(t), 1) for t in rounds],
        "example_draft_tokens": plan_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds")
    parser.add_argument("--calls", type=int, default=500, help="timed steps per size per round")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "planner_host.json")
    args = parser.parse_args()
    machine = _machine()
    table = _table()
    gen = torch.Generator().manual_seed(SEED)
    planners = {r: Planner(table, PlannerConfig()) for r in REQUESTS}
    inputs = {r: [_confidence(r, gen) for _ in range(64)] for r in REQUESTS}
    for r in REQUESTS:
        _time_calls(planners[r], inputs[r], 200)  # warm-up
    times: dict[int, list[list[float]]] = {r: [] for r in REQUESTS}
    reference = []
    for _ in range(args.rounds):
        reference.append(round(_reference_us(), 2))
        for r in REQUESTS:
            times[r].append(_time_calls(planners[r], inputs[r], args.calls))
    results = [_summary(r, times[r], planners[r](inputs[r][0]).num_draft_tokens)
               for r in REQUESTS]
    for row in results:
        print(f"R={row['requests']:4d}  median {row['median_us']:7.1f} us  p90 "
              f"{row['p90_us']:7.1f} us  quietest round {row['quietest_round_median_us']:7.1f} us")
    machine["load_average_1min_at_end"] = os.getloadavg()[0]
    machine["reference_us_per_round"] = reference
    report = {
        "benchmark": "planner_host",
        "what": "Planner.__call__ per step (validate, rank, budget, lengths) on CPU float32",
        "command": "nice -n -10 python benchmarks/planner_host.py",
        "machine": machine,
        "settings": {"gamma": GAMMA, "requests": list(REQUESTS), "rounds": args.rounds,
                     "calls_per_round": args.calls, "seed": SEED,
                     "planner_config": "PlannerConfig() defaults",
                     "sps_table_ms_by_tokens": H200_STEP_MS,
                     "confidence": "linspace(0.95, 0.6) per position + U(-0.15, 0.15)"},
        "target_us_at_256": 100.0,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
