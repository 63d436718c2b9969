"""Where a tier-graph verify step's time goes, per batch size.

Same model and settings as verify_step.py (1.1B Llama-like, bf16, context 1024, page 16,
block 8, the mean-3 mix). For each bs it captures the one tier the mix takes, then reports:

- a full ``verifier(ids, layout, state)`` call and ``graph.replay()`` alone (ms, back-to-back
  between CUDA events), and the host-side ``check_layout`` and ``fill`` per call (ms);
- the kernels of 10 replays under torch.profiler, summed per step by kind (attention, its
  split reduce, cuBLAS GEMMs, the skinny Triton matmuls, Inductor's fused kernels, other),
  and the top kernels;
- the same kernels' exposed time per step by kind (:func:`exposed_ms`): with programmatic
  dependent launch a kernel starts while the one before it runs and waits inside, so its
  duration counts that wait and the plain sums above add up to more than the replay. Exposed
  time credits each kernel only with how far it moves the timeline's end, so the kinds plus
  ``idle`` add up to the profiled span: these are the step's shares.

    python benchmarks/profile_step.py [--bs 1 8 64 256] [--out DIR] [--group-linears MODE]
        [--fuse-linears MODE]

Writes ``profile_step.json`` and ``profile_step_bs{bs}.txt`` (kernel tables) to DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from dspark_compile import VerifyLayout, dspark_compile
from dspark_compile.session.tiers import select_tier, tier_set
from common import (BLOCK, CONTEXT, PAGE, add_variant_args, apply_variant, build_model,
                    fill_context, time_ms, write_json)
from verify_step import environment, mix_lens

KINDS = (("attention", ("_ragged_attention_kernel",)),
         ("split_reduce", ("_split_reduce_kernel",)),
         ("gemm", ("nvjet", "gemm", "gemv", "cutlass", "sm90_xmma", "cublas", "splitk")),
         ("skinny_matmul", ("_skinny_kernel", "_prologue_kernel")),
         ("inductor_fused", ("triton_",)))


def kind_of(name: str) -> str:
    for kind, keys in KINDS:
        if any(k in name for k in keys):
            return kind
    return "other"


def exposed_ms(kernels: list[tuple[str, float, float]], steps: int) -> dict[str, float]:
    """Each kernel's share of the timeline, by kind, in ms per step: ``kernels`` are ``(name,
    start_us, end_us)`` on one stream. Taken in order of start, a kernel is credited with the
    time from where the timeline's end stood (the latest end so far, or its own start after a
    gap) to its own end, and nothing when it ends before that. ``idle`` is the gaps between
    kernels; the kinds and ``idle`` sum to the span from the first start to the last end."""
    out: dict[str, float] = defaultdict(float)
    frontier = None
    for name, start, end in sorted(kernels, key=lambda k: (k[1], k[2])):
        if frontier is None:
            frontier = start
        if start > frontier:
            out["idle"] += start - frontier
            frontier = start
        if end > frontier:
            out[kind_of(name)] += end - frontier
            frontier = end
    return {k: v / steps / 1e3 for k, v in out.items()}


def host_ms(fn, iters: int = 200) -> float:
    """Host time per call (the device work these launch is not waited on per call)."""
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / iters * 1e3


def profile_bs(verifier, state, bs: int, out: str, suffix: str = "") -> dict:
    graphs = verifier.session(state).graphs
    layout = VerifyLayout.pack(mix_lens(bs), [CONTEXT] * bs, list(range(bs)))
    tier = select_tier(graphs.tiers, layout.num_tokens, layout.num_requests)
    ids = torch.randint(0, 32000, (layout.num_tokens,), device="cuda")
    graph = graphs.graphs[tier]
    row = {"tier": [tier.tokens, tier.request_slots], "tokens": layout.num_tokens,
           "full_call_ms": time_ms(lambda: verifier(ids, layout, state), 100),
           "replay_ms": time_ms(graph.replay, 100),
           "check_layout_host_ms": host_ms(lambda: state.check_layout(layout,
                                                                      layout.num_tokens)),
           "fill_host_ms": host_ms(lambda: graphs.fill(tier, ids, layout))}
    torch.cuda.synchronize()
    steps = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
    per_kind, kernels = defaultdict(float), []
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None)
        if us is None:
            us = evt.self_cuda_time_total
        if us <= 0:
            continue
        per_kind[kind_of(evt.key)] += us / steps / 1e3
        kernels.append((evt.key, us / steps, evt.count // steps))
    row["kernel_ms_per_step"] = {k: round(v, 4) for k, v in sorted(per_kind.items())}
    row["kernel_sum_ms"] = round(sum(per_kind.values()), 4)
    timeline = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start]
    exposed = exposed_ms(timeline, steps)
    row["exposed_ms_per_step"] = {k: round(v, 4) for k, v in sorted(exposed.items())}
    row["exposed_span_ms"] = round(sum(exposed.values()), 4)
    row["kernels_per_step"] = sum(c for _, _, c in kernels)
    kernels.sort(key=lambda k: -k[1])
    row["top_kernels_us_per_step"] = [(k[:90], round(us, 1), c) for k, us, c in kernels[:25]]
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
    with open(os.path.join(out, f"profile_step_bs{bs}{suffix}.txt"), "w") as f:
        f.write(f"{environment()}\nbs={bs} tokens={layout.num_tokens} tier={tier} "
                f"({steps} graph replays)\n{table}\n")
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bs", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    add_variant_args(parser, rotary=False)
    args = parser.parse_args()
    suffix, flags, options = apply_variant(args)
    os.makedirs(args.out, exist_ok=True)
    model = build_model()
    verifier = dspark_compile(model, lowering="triton", inductor=True, page_size=PAGE,
                              block=BLOCK, group_linears=args.group_linears,
                              fuse_linears=args.fuse_linears,
                              rotary_epilogue=args.rotary_epilogue)
    max_bs = max(args.bs)
    state = verifier.new_state(max_requests=max_bs, max_context=CONTEXT + BLOCK)
    fill_context(state, CONTEXT)
    all_tiers = tier_set(max_bs, BLOCK)
    tiers = tuple(sorted({select_tier(all_tiers, 3 * bs, bs) for bs in args.bs}))
    verifier.capture(state, tiers=tiers, progress=False)
    rows = {}
    for bs in args.bs:
        rows[str(bs)] = profile_bs(verifier, state, bs, args.out, suffix)
        print(bs, json.dumps({k: v for k, v in rows[str(bs)].items()
                              if k != "top_kernels_us_per_step"}), flush=True)
    env = dict(environment(), **options,
               command="python benchmarks/profile_step.py --bs " + " ".join(map(str, args.bs))
               + flags)
    write_json(args.out, f"profile_step{suffix}.json", {"environment": env, "results": rows})


if __name__ == "__main__":
    main()
