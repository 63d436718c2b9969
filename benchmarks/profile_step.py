"""Where a verify step's time goes: kernel table of one packed step under torch.profiler.

Same model and settings as verify_step.py (1.1B Llama-like, bf16, context 1024, page 16);
one batch size and the mean-3 mix, Triton lowering + Inductor, eager (kernels are the same
as in the tier graph, launches are not).

    python benchmarks/profile_step.py [--bs 256] [--out DIR]
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.profiler import ProfilerActivity, profile

from dspark_compile import VerifyLayout, dspark_compile
from verify_step import BLOCK, CONTEXT, PAGE, build_model, environment, mix_lens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bs", type=int, default=256)
    parser.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    args = parser.parse_args()
    model = build_model()
    verifier = dspark_compile(model, lowering="triton", inductor=True, page_size=PAGE,
                              block=BLOCK)
    state = verifier.new_state(max_requests=args.bs, max_context=CONTEXT + BLOCK)
    state.committed_lens[:] = CONTEXT
    layout = VerifyLayout.pack(mix_lens(args.bs), [CONTEXT] * args.bs, list(range(args.bs)))
    ids = torch.randint(0, 32000, (layout.num_tokens,), device="cuda")
    for _ in range(5):
        verifier(ids, layout, state)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            verifier(ids, layout, state)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"profile_step_bs{args.bs}.txt")
    with open(path, "w") as f:
        f.write(f"{environment()}\nbs={args.bs} tokens={layout.num_tokens} (10 steps)\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
