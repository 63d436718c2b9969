"""Grouped skinny matmul (``dspark::linear_group``) against ``torch.mm`` per weight, at the
1.1B Llama-like model's weight groups (bf16): q+k+v and o (K 2048), gate+up (K 2048), down
(K 8192), the LM head (vocab 32000); M = 3, 24, 64 rows (bs 1 and 8 at mean length 3, bs 8
at width 8) and 192 (bs 64, which takes ``torch.mm`` by the table's ``linear_max_m``).

Each case is checked against ``torch.mm`` first, then timed as CUDA-graph replays cycling
over enough weight copies that reads come from HBM (not the 50 MB L2). Reported: us per call,
weight bytes / time as a share of 4.8 TB/s, and the ratio to ``torch.mm``. ``--sweep`` also
times tile, pipeline-depth and split alternatives at M = 3 and 24.

    python benchmarks/linear_kernel.py [--sweep] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform

import torch

from common import time_calls

HBM = 4.8e12
GROUPS = {"qkv": ((2048, 1024, 1024), 2048), "o": ((2048,), 2048),
          "gate_up": ((8192, 8192), 2048), "down": ((2048,), 8192), "lm_head": ((32000,), 2048)}
ROWS = (3, 24, 64, 192)
SWEEP = [dict(block_n=bn, block_k=bk, num_stages=st) for bn, bk, st in (
    (32, 128, 4), (128, 128, 4), (64, 256, 3), (64, 64, 5), (32, 256, 3), (64, 128, 3),
    (128, 64, 4))]
TIMING = dict(eager_iters=50, graph_calls=8, graph_replays=20)


def copies_for(nbytes: int) -> int:
    return max(2, -(-200 * 2**20 // nbytes))  # >= 200 MB of weights per cycle


def bench_case(name: str, ns, k: int, m: int, sweep: bool) -> dict:
    from dspark_compile.kernels.linear import linear_group_triton, plan_linear
    from dspark_compile.kernels.device import device_target

    cfg, sms = device_target(torch.device("cuda"))
    wbytes = sum(ns) * k * 2
    reps = min(copies_for(wbytes), 16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    sets = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for n in ns]
            for _ in range(reps)]
    got = linear_group_triton(x, sets[0])
    for g, w in zip(got, sets[0]):
        torch.testing.assert_close(g.float(), (x.float() @ w.float().t()), atol=3e-2, rtol=3e-2)

    def fns(call):
        return [lambda ws=ws: call(ws) for ws in sets]

    mm = time_calls(fns(lambda ws: [torch.mm(x, w.t()) for w in ws]), TIMING, "cuda")
    ours = time_calls(fns(lambda ws: linear_group_triton(x, ws)), TIMING, "cuda")
    plan = plan_linear(m, k, tuple(ns), cfg, sms) if m <= cfg.linear_max_m else None
    row = {"group": name, "n": list(ns), "k": k, "m": m, "weight_bytes": wbytes,
           "torch_mm_us": mm["graph_us"], "ours_us": ours["graph_us"],
           "torch_mm_eager_us": mm["eager_us"], "ours_eager_us": ours["eager_us"],
           "ours_hbm_share": wbytes / (ours["graph_us"] * 1e-6) / HBM,
           "torch_mm_hbm_share": wbytes / (mm["graph_us"] * 1e-6) / HBM,
           "speedup_vs_mm": mm["graph_us"] / ours["graph_us"],
           "plan": None if plan is None else {"block_m": plan.block_m, "block_n": plan.block_n,
                                               "block_k": plan.block_k, "split_k": plan.split_k,
                                               "stages": plan.num_stages}}
    if sweep and plan is not None and m <= 32:
        alts = []
        for over in SWEEP + [dict(split_k=max(1, plan.split_k // 2)),
                             dict(split_k=plan.split_k * 2)]:
            t = time_calls(fns(lambda ws, o=over: linear_group_triton(x, ws, **o)), TIMING,
                           "cuda")
            alts.append({**over, "us": t["graph_us"]})
        row["sweep"] = alts
    print(json.dumps({k: v for k, v in row.items() if k != "sweep"}), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    args = ap.parse_args()
    import triton

    rows = [bench_case(name, ns, k, m, args.sweep) for m in ROWS
            for name, (ns, k) in GROUPS.items()]
    layer = ("qkv", "o", "gate_up", "down")
    per_layer = {m: {side: sum(r[f"{side}_us"] for r in rows if r["m"] == m
                               and r["group"] in layer) for side in ("torch_mm", "ours")}
                 for m in ROWS}
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "python": platform.python_version(),
           "hbm_bytes_per_s": HBM, "timing": TIMING,
           "command": "python benchmarks/linear_kernel.py" + (" --sweep" if args.sweep else "")}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "linear_kernel.json"), "w") as f:
        json.dump({"environment": env, "per_layer_us": per_layer, "results": rows}, f, indent=1)
    print(json.dumps(per_layer))


if __name__ == "__main__":
    main()
