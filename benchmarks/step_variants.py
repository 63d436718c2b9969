"""The verify step under each compile option, side by side in one run: which matmul grouping
(``DSparkConfig.group_linears``) and which rotary (``DSparkConfig.rotary``) is faster.

Same model and settings as verify_step.py (1.1B Llama-like, bf16, context 1024, page 16,
block 8, the mean-3 mix at bs 1, 8, 64, 256). Per variant: compile (torch.compile included in
the first calls), the correctness check against HF, capture of the tiers the mixes take, then
graph-replayed verify calls (ms, back-to-back between CUDA events) and, with ``--profile``, the
kernel time per step by kind (as profile_step.py reports it).

    python benchmarks/step_variants.py [--variants off/inductor concat/inductor ...]
                                       [--bs 1 8 64 256] [--profile] [--out DIR]

Writes ``step_variants.json`` to DIR (default: $OUT if set, else benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from dspark_compile import VerifyLayout, dspark_compile
from dspark_compile.session.tiers import select_tier, tier_set
from profile_step import profile_bs
from common import (BLOCK, CONTEXT, PAGE, build_model, fill_context, max_err_vs_hf, time_ms,
                    variant_suffix)
from verify_step import environment, floor_ms, mix_lens

DEFAULT_VARIANTS = ("off/inductor", "concat/inductor", "concat/triton")


def run_variant(model, group: str, rotary: str, batches, profile: bool, out: str) -> dict:
    torch._dynamo.reset()
    t0 = time.perf_counter()
    verifier = dspark_compile(model, lowering="triton", inductor=True, page_size=PAGE,
                              block=BLOCK, group_linears=group, rotary=rotary)
    row = {"compile_s": time.perf_counter() - t0}
    t0 = time.perf_counter()
    row["max_abs_err_vs_hf_bf16"] = max_err_vs_hf(model, verifier, 32000, "cuda")
    row["first_calls_s"] = time.perf_counter() - t0
    state = verifier.new_state(max_requests=max(batches), max_context=CONTEXT + BLOCK)
    fill_context(state, CONTEXT)
    every = tier_set(max(batches), BLOCK)
    tiers = tuple(sorted({select_tier(every, 3 * bs, bs) for bs in batches}))
    t0 = time.perf_counter()
    verifier.capture(state, tiers=tiers, progress=False)
    row["capture_s"], row["tiers"] = time.perf_counter() - t0, len(tiers)
    row["graph_mix3_ms"], row["profile"] = {}, {}
    for bs in batches:
        layout = VerifyLayout.pack(mix_lens(bs), [CONTEXT] * bs, list(range(bs)))
        ids = torch.randint(0, 32000, (layout.num_tokens,), device="cuda")
        row["graph_mix3_ms"][str(bs)] = time_ms(lambda: verifier(ids, layout, state), 100)
        if profile:
            prof = profile_bs(verifier, state, bs, out, variant_suffix(group, rotary) or
                              "_group_auto")
            row["profile"][str(bs)] = {k: prof[k] for k in ("kernel_ms_per_step",
                                                            "kernel_sum_ms", "kernels_per_step")}
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS),
                        help="GROUP/ROTARY pairs, e.g. concat/triton")
    parser.add_argument("--bs", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("step_variants.py needs a GPU")
    os.makedirs(args.out, exist_ok=True)
    model = build_model()
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    env = dict(environment(), command="python benchmarks/step_variants.py --variants "
               + " ".join(args.variants) + " --bs " + " ".join(map(str, args.bs))
               + (" --profile" if args.profile else ""))
    floors = {str(bs): floor_ms(params, cfg.num_hidden_layers, cfg.num_key_value_heads,
                                cfg.head_dim, bs, 3) for bs in args.bs}
    results = {}
    for variant in args.variants:
        group, rotary = variant.split("/")
        results[variant] = run_variant(model, group, rotary, args.bs, args.profile, args.out)
        torch.cuda.empty_cache()  # the variant's state and graph pool, freed on its return
        row = results[variant]
        row["over_floor"] = {bs: row["graph_mix3_ms"][bs] / floors[bs] for bs in floors}
        print(variant, json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        with open(os.path.join(args.out, "step_variants.json"), "w") as f:
            json.dump({"environment": env, "floor_mean3_ms": floors, "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
