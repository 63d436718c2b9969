"""Host time of a verify step's bookkeeping, per call, at R = 1, 8, 64, 256 requests.

The reference engine loop is host-synchronous (the accept result comes back every step), so
these add directly to a step. Timed on the CPU, no device work: ``VerifyLayout.pack``,
``VerifierState.check_layout``, ``TierGraphs.fill`` (the static-buffer staging a tier-graph
replay does) and ``VerifierState.commit`` (host bookkeeping only), for the mean-3 mix of
verify lengths over a context of 1024.

    python benchmarks/host_step.py [--calls N] [--out DIR]

Writes ``host_step.json`` (machine, versions, median us per call).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from dspark_compile import VerifyLayout, dspark_compile
from dspark_compile.session.graphs import TierGraphs
from dspark_compile.session.tiers import select_tier, tier_set

REQUESTS = (1, 8, 64, 256)


def mix(r: int) -> list[int]:
    """Fixed lengths in 1..8 with mean 3 (a cycle summing to 3 per request)."""
    cycle = [1, 2, 3, 6, 5, 1, 2, 4]  # mean 3
    lens = [cycle[i % len(cycle)] for i in range(r)]
    return lens if r % len(cycle) == 0 else [3] * r


def median_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=16, vocab_size=64))
    verifier = dspark_compile(model, lowering="reference")
    state = verifier.new_state(max_requests=max(REQUESTS), max_context=1040)
    state.committed_lens[:] = 1024
    tiers = tier_set(max(REQUESTS), 8)
    graphs = TierGraphs(lambda *a: None, tiers, 64, torch.float32, torch.device("cpu"),
                        use_graphs=False)
    rows = {}
    for r in REQUESTS:
        lens, ctx, slots = mix(r), [1024] * r, list(range(r))
        layout = VerifyLayout.pack(lens, ctx, slots)
        lens_t = torch.tensor(lens, dtype=torch.int32)
        ctx_t = torch.tensor(ctx, dtype=torch.int32)
        slots_t = torch.tensor(slots, dtype=torch.int32)
        ids = torch.zeros(layout.num_tokens, dtype=torch.int64)
        tier = select_tier(tiers, layout.num_tokens, r)
        acc = torch.ones(r, dtype=torch.int64)

        def commit():
            state.advance(layout, acc)
            state.committed_lens[:r] = 1024

        rows[str(r)] = {
            "pack_lists_us": median_us(lambda: VerifyLayout.pack(lens, ctx, slots), args.calls),
            "pack_tensors_us": median_us(lambda: VerifyLayout.pack(lens_t, ctx_t, slots_t),
                                         args.calls),
            "check_layout_us": median_us(lambda: state.check_layout(layout, layout.num_tokens),
                                         args.calls),
            "fill_us": median_us(lambda: graphs.fill(tier, ids, layout), args.calls),
            "commit_us": median_us(commit, args.calls),
        }
        print(r, {k: round(v, 1) for k, v in rows[str(r)].items()}, flush=True)
    env = {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
           "torch": torch.__version__, "threads": torch.get_num_threads(),
           "command": "python benchmarks/host_step.py", "calls": args.calls}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "host_step.json"), "w") as f:
        json.dump({"environment": env, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
