"""A measured lower bound on the verify step at a given batch: the step's matmuls, each at the
best of the cuBLAS forms measured here, plus every layer's KV read at the best rate of a plain
streaming-read kernel, in one process on one GPU.

The floor of ``verify_step.py`` assumes the datasheet's 4.8 TB/s and 790 TFLOP/s; this bound
asks what the kernels this machine actually gives would add up to if nothing else ran (no
norm, SiLU-and-mul, rotary, embedding or metadata launch, no attention arithmetic, no ramp).
Matmuls per layer: q+k+v, o, gate+up, down (each as ``torch.mm`` and as ``torch.bmm`` over 2 or
4 K chunks into fp32 partials, the partials' sum not counted), then the LM head once. Weights
cycle through copies totalling >= 256 MB so none is read from L2.

    python benchmarks/step_bound.py [--bs 64 256]   # writes step_bound.json to $OUT or results/
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import triton

from hbm_read import _read_kernel
from splitk_bmm import split_mm
from common import CONTEXT, llama_config, time_calls
from verify_step import floor_ms

CFG = llama_config()
HIDDEN, FFN, LAYERS, VOCAB = (CFG.hidden_size, CFG.intermediate_size, CFG.num_hidden_layers,
                              CFG.vocab_size)
HEADS, KV_HEADS, HEAD_DIM = CFG.num_attention_heads, CFG.num_key_value_heads, CFG.head_dim
MEAN_LEN = 3
PER_LAYER = {"qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), "o": (HIDDEN, HIDDEN),
             "gate_up": (2 * FFN, HIDDEN), "down": (HIDDEN, FFN)}
PARAMS = (LAYERS * (sum(n * k for n, k in PER_LAYER.values()) + 2 * HIDDEN)
          + 2 * VOCAB * HIDDEN + HIDDEN)  # + norms, embedding, untied LM head, final norm
TIMING = dict(eager_iters=20, graph_calls=8, graph_replays=10)


def best_matmul(n: int, k: int, m: int) -> dict:
    """us of ``x @ w.T`` at ``m`` rows: ``torch.mm`` and the K-chunk ``bmm`` forms."""
    copies = max(2, -(-256 * 2**20 // (n * k * 2)))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
          for _ in range(copies)]
    forms = {"mm": lambda w: torch.mm(x, w.t())}
    for s in (2, 4):
        if k % (8 * s) == 0:
            forms[f"bmm{s}"] = lambda w, s=s: split_mm(x, w, s)
    us = {name: time_calls([lambda w=w, f=f: f(w) for w in ws], TIMING, "cuda")["graph_us"]
          for name, f in forms.items()}
    best = min(us, key=us.get)
    return {"n": n, "k": k, "m": m, "us": us, "best": best, "best_us": us[best]}


def best_read_us(layer_bytes: int) -> dict:
    """us to stream one layer's KV bytes, best over a few grids of the plain read kernel."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = layer_bytes // 2
    bufs = [torch.randn(n, device="cuda", dtype=torch.bfloat16)
            for _ in range(max(2, -(-2 * 2**30 // layer_bytes)))]
    rows = []
    for per_sm in (2, 4):
        for warps in (8, 16):
            grid = sms * per_sm
            out = torch.empty(grid, device="cuda", dtype=torch.float32)
            us = time_calls([lambda x=x: _read_kernel[(grid,)](x, out, n, BLOCK=16384,
                                                                num_warps=warps)
                             for x in bufs], TIMING, "cuda")["graph_us"]
            rows.append({"programs": grid, "warps": warps, "us": us})
    best = min(rows, key=lambda r: r["us"])
    return {"layer_bytes": layer_bytes, "grids": rows, "best_us": best["us"],
            "bytes_per_s": layer_bytes / (best["us"] * 1e-6)}


def bound(bs: int) -> dict:
    m = bs * MEAN_LEN
    mats = {name: best_matmul(n, k, m) for name, (n, k) in PER_LAYER.items()}
    mats["lm_head"] = best_matmul(VOCAB, HIDDEN, m)
    read = best_read_us(bs * CONTEXT * KV_HEADS * HEAD_DIM * 2 * 2)
    matmul_ms = (LAYERS * sum(mats[n]["best_us"] for n in PER_LAYER)
                 + mats["lm_head"]["best_us"]) / 1e3
    read_ms = LAYERS * read["best_us"] / 1e3
    floor = floor_ms(PARAMS, LAYERS, KV_HEADS, HEAD_DIM, bs, MEAN_LEN)  # verify_step's
    row = {"bs": bs, "rows": m, "matmuls": mats, "read": read, "matmul_ms": matmul_ms,
           "kv_read_ms": read_ms, "bound_ms": matmul_ms + read_ms, "floor_ms": floor,
           "bound_over_floor": (matmul_ms + read_ms) / floor, "target_1_3x_ms": 1.3 * floor}
    print({k: v for k, v in row.items() if k not in ("matmuls", "read")}, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bs", type=int, nargs="+", default=[64, 256])
    opts = ap.parse_args()
    report = {"environment": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "triton": triton.__version__, "timing": TIMING,
                              "command": "python benchmarks/step_bound.py --bs "
                                         + " ".join(map(str, opts.bs))},
              "model": {"hidden": HIDDEN, "ffn": FFN, "layers": LAYERS, "vocab": VOCAB,
                        "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                        "params": PARAMS, "context": CONTEXT, "mean_len": MEAN_LEN},
              "results": [bound(bs) for bs in opts.bs]}
    out = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_bound.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
