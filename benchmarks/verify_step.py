"""Verify-step benchmark on one GPU: ours (Triton + Inductor, eager and tier graphs) against
PyTorch dense padded to the block, and against the roofline floor, side by side in one run.

Model: Llama-like 1.1B, bf16, random weights (hidden 2048, 16 layers, 16 heads, 8 KV heads,
head 128, FFN 8192, vocab 32000); context 1024, page 16, block 8; bs 1, 8, 64, 256.
Verify lengths: all 8, and a fixed-seed mix with mean exactly 3 (same token count as uniform 3).

    python benchmarks/verify_step.py [--out DIR] [--quick] [--group-linears MODE] [--rotary MODE]
        [--fuse-linears MODE]

Writes ``verify_step.json`` (GPU, versions, every setting, all timings) and
``verify_step.png`` to DIR (default: $OUT if set, else benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from dspark_compile import VerifyLayout, dspark_compile
from common import (BF16_FLOPS, BLOCK, CONTEXT, HBM_BYTES_PER_S, PAGE, add_variant_args,
                    apply_variant, build_model, capture_graph, fill_context, max_err_vs_hf,
                    plot_step_ms, time_ms, versions, write_json)
from common import mix_lens as _mix_lens
from dspark_compile.session.tiers import tier_set

BATCHES = (1, 8, 64, 256)


def mix_lens(bs: int, mean: int = 3, seed: int = 0) -> list[int]:
    """The fixed-seed mix of lengths 1..BLOCK with mean exactly ``mean``."""
    return _mix_lens(bs, BLOCK, mean, seed)


def floor_ms(params: int, layers: int, kv_heads: int, head_dim: int, bs: int,
             mean_len: float) -> float:
    """max(weight bytes / BW, 2 * params * N / peak) + KV bytes / BW, in ms."""
    n = bs * mean_len
    linear = max(params * 2 / HBM_BYTES_PER_S, 2 * params * n / BF16_FLOPS)
    kv_bytes = bs * (CONTEXT + mean_len) * layers * 2 * kv_heads * head_dim * 2
    return 1e3 * (linear + kv_bytes / HBM_BYTES_PER_S)


def hf_dense(model, bs: int):
    """PyTorch dense verify padded to the block: HF sdpa with a boolean mask over a static
    KV cache of the same context; returns (step fn, captured graph or error)."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=CONTEXT + BLOCK)
    ids = torch.randint(0, 32000, (bs, BLOCK), device="cuda")
    pos = torch.arange(CONTEXT, CONTEXT + BLOCK, device="cuda").expand(bs, -1)
    mask = torch.ones(bs, CONTEXT + BLOCK, dtype=torch.long, device="cuda")
    cache_pos = torch.arange(CONTEXT, CONTEXT + BLOCK, device="cuda")

    def step():
        with torch.no_grad():
            return model(input_ids=ids, position_ids=pos, attention_mask=mask,
                         past_key_values=cache, cache_position=cache_pos, use_cache=True).logits

    step()
    return (step, *capture_graph(step))


def run(args, save) -> dict:
    model = build_model()
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    model.set_attn_implementation("sdpa")
    t0 = time.perf_counter()
    verifier = dspark_compile(model, lowering="triton", inductor=True, page_size=PAGE,
                              block=BLOCK, group_linears=args.group_linears,
                              rotary=args.rotary, fuse_linears=args.fuse_linears,
                              rotary_epilogue=args.rotary_epilogue)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    max_err = max_err_vs_hf(model, verifier, 32000, "cuda")
    first_calls_s = time.perf_counter() - t0
    print(f"compiled in {compile_s:.1f} s; max |ours - HF| (bf16) = {max_err:.3g}", flush=True)

    batches = tuple(args.bs) if args.bs else (1, 8) if args.quick else BATCHES
    max_bs = max(batches)
    state = verifier.new_state(max_requests=max_bs, max_context=CONTEXT + BLOCK)
    if args.page_order == "in_order":  # each slot's pages one run (the model has no rings)
        table = state.block_table
        table.copy_(torch.arange(table.numel(), dtype=table.dtype).view_as(table))
    fill_context(state, CONTEXT)
    shapes = {bs: {"mix3": mix_lens(bs), "uniform3": [3] * bs, "all8": [BLOCK] * bs}
              for bs in batches}
    iters = 20 if args.quick else 50

    def step_fn(bs, lens):
        layout = VerifyLayout.pack(lens, [CONTEXT] * bs, list(range(bs)))
        ids = torch.randint(0, 32000, (layout.num_tokens,), device="cuda")
        return lambda: verifier(ids, layout, state)

    results = {bs: {} for bs in batches}
    for bs in batches:  # eager: no graphs (launch-bound at small bs)
        for name, lens in shapes[bs].items():
            results[bs][f"ours_eager_{name}_ms"] = time_ms(step_fn(bs, lens), iters)
        print(bs, results[bs], flush=True)
        save({"results": {str(k): v for k, v in results.items()}, "partial": True})

    tiers = tier_set(max_bs, BLOCK)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    reports = verifier.capture(state, tiers=tiers, progress=True).reports
    capture = {"tiers": len(tiers), "seconds": time.perf_counter() - t0,
               "note": "after the first calls compiled the packed graph with torch.compile "
                       "(first_calls_seconds: the correctness check's two calls, compile "
                       "included)",
               "pool_bytes": sum(r.pool_bytes for r in reports),
               "per_tier": [(r.tier.tokens, r.tier.request_slots, round(r.seconds, 4),
                             r.pool_bytes) for r in reports]}
    print(f"captured {len(tiers)} tiers in {capture['seconds']:.1f} s, pool "
          f"{capture['pool_bytes'] / 2**30:.3f} GiB", flush=True)

    for bs in batches:
        for name, lens in shapes[bs].items():
            results[bs][f"ours_graph_{name}_ms"] = time_ms(step_fn(bs, lens), iters * 2)
        step, graph, error = hf_dense(model, bs)
        results[bs]["pytorch_dense8_eager_ms"] = time_ms(step, iters)
        results[bs]["pytorch_dense8_graph_ms"] = time_ms(graph.replay, iters) if graph else None
        results[bs]["pytorch_dense8_graph_error"] = error
        save({"results": {str(k): v for k, v in results.items()}, "capture": capture,
              "partial": True})
        del step, graph
        torch.cuda.empty_cache()
        for mean, name in ((3, "floor_mean3_ms"), (BLOCK, "floor_all8_ms")):
            results[bs][name] = floor_ms(params, cfg.num_hidden_layers,
                                         cfg.num_key_value_heads, cfg.head_dim, bs, mean)
        print(bs, results[bs], flush=True)
    return {"results": {str(k): v for k, v in results.items()}, "capture": capture,
            "max_abs_err_vs_hf_bf16": max_err, "compile_seconds": compile_s,
            "first_calls_seconds": first_calls_s,
            "shapes": {str(k): v["mix3"] for k, v in shapes.items()}, "params": params}


def environment() -> dict:
    return {**versions(), "hbm_bytes_per_s": HBM_BYTES_PER_S,
            "bf16_flops": BF16_FLOPS, "context": CONTEXT, "page_size": PAGE, "block": BLOCK,
            "model": "Llama-like 1.1B bf16 random weights: hidden 2048, 16 layers, 16 heads, "
                     "8 kv heads, head 128, ffn 8192, vocab 32000",
            "timing": "mean of back-to-back calls between two CUDA events, after 3 warm-ups",
            "command": "python benchmarks/verify_step.py"}


def plot(data: dict, path: str) -> None:
    plot_step_ms(data["results"], (
        ("ours_graph_mix3_ms", "ours ragged, mean 3 (graph)"),
        ("ours_graph_uniform3_ms", "ours uniform 3 (graph)"),
        ("ours_eager_mix3_ms", "ours ragged, mean 3 (eager)"),
        ("pytorch_dense8_graph_ms", "PyTorch dense padded to 8 (graph)"),
        ("floor_mean3_ms", "floor, mean 3")), f"verify step, {data['environment']['gpu']}", path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    parser.add_argument("--quick", action="store_true", help="bs 1 and 8 only, fewer iters")
    parser.add_argument("--bs", type=int, nargs="+",
                        help="these batch sizes instead (files get a suffix)")
    parser.add_argument("--page-order", choices=("shuffled", "in_order"), default="shuffled",
                        help="the state's block table as new_state lays it out (a fixed "
                             "permutation) or each slot's pages one run (files get a suffix)")
    add_variant_args(parser)
    args = parser.parse_args()
    suffix, flags, options = apply_variant(args)
    if args.page_order != "shuffled":
        suffix += "_pages_" + args.page_order
        flags += " --page-order " + args.page_order
    options["page_order"] = args.page_order
    if not torch.cuda.is_available():
        sys.exit("verify_step.py needs a GPU")
    os.makedirs(args.out, exist_ok=True)
    env = {**environment(), **options}
    if args.bs:
        suffix += "_bs" + "_".join(map(str, args.bs))
        flags += " --bs " + " ".join(map(str, args.bs))
    env["command"] += (" --quick" if args.quick else "") + flags

    def save(part: dict) -> None:
        write_json(args.out, f"verify_step{suffix}.json", {"environment": env, **part})

    data = {"environment": env, **run(args, save)}
    save(data)
    try:
        plot(data, os.path.join(args.out, f"verify_step{suffix}.png"))
    except ImportError as err:
        print(f"no plot: {err}")
    print(json.dumps(data["results"], indent=1))


if __name__ == "__main__":
    main()
