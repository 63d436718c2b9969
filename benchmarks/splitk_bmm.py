"""Experiment: split-K of a skinny matmul as one batched cuBLAS GEMM, partials summed after.

At small M (3 to 64 packed tokens) cuBLAS tiles ``x @ W.T`` of the 1.1B model's o projection
(2048 x 2048) into 32 programs of 64 columns, so 100 of the H200's 132 multiprocessors idle
while the weight streams (6.2 us, 28% of HBM bandwidth, in ``linear_kernel.json``). Viewing
K as ``S`` chunks turns the matmul into ``torch.bmm`` over ``S`` strided batches (no copy: the
views share the weight's memory) with ``S`` times the programs; the fp32 partials ``[S, M, N]``
are then summed, which an Inductor graph can fuse into the consumer (residual add + RMSNorm for
o and down, SiLU-and-mul for gate/up).

Measured per weight and M, as CUDA-graph replays over weight copies that do not fit in L2:
``torch.mm``; ``bmm`` alone for S = 2, 4, 8; ``bmm`` + sum + cast; and, for o and down, the
compiled block ``rmsnorm(residual + x @ W.T)`` written both ways (``torch.compile``).

    python benchmarks/splitk_bmm.py [--no-compile]   # writes splitk_bmm.json to $OUT or results/
    python benchmarks/splitk_bmm.py --op    # the op with mid_split_k: splitk_bmm_op.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from common import time_calls

SHAPES = {"o": (2048, 2048), "qkv": (4096, 2048), "down": (2048, 8192),
          "gate_up": (16384, 2048)}
ROWS = (3, 8, 24, 64)
SPLITS = (2, 4, 8)
COMPILED = (("o", 3), ("o", 24), ("down", 3), ("down", 24))
TIMING = dict(eager_iters=50, graph_calls=8, graph_replays=20)


def split_views(x: torch.Tensor, w: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]``, ``w [N, K]`` as ``[S, M, K/S]`` and ``[S, K/S, N]`` views (no copy)."""
    m, k = x.shape
    n = w.shape[0]
    return x.view(m, s, k // s).transpose(0, 1), w.view(n, s, k // s).permute(1, 2, 0)


def split_mm(x: torch.Tensor, w: torch.Tensor, s: int) -> torch.Tensor:
    """fp32 partials ``[S, M, N]`` of ``x @ w.T``."""
    xs, ws = split_views(x, w, s)
    return torch.bmm(xs, ws, out_dtype=torch.float32)


def rmsnorm(h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6) * g).to(h.dtype)


def block_mm(x, w, res, g):
    h = res + torch.mm(x, w.t())
    return h, rmsnorm(h, g)


def block_split(x, w, res, g, s: int = 4):
    h = res + split_mm(x, w, s).sum(0).to(x.dtype)
    return h, rmsnorm(h, g)


def bench(name: str, m: int) -> dict:
    n, k = SHAPES[name]
    copies = max(2, -(-256 * 2**20 // (n * k * 2)))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
          for _ in range(copies)]
    want = x.float() @ ws[0].float().t()
    row = {"name": name, "n": n, "k": k, "m": m, "weight_bytes": n * k * 2}
    row["mm_us"] = time_calls([lambda w=w: torch.mm(x, w.t()) for w in ws], TIMING,
                              "cuda")["graph_us"]
    for s in SPLITS:
        got = split_mm(x, ws[0], s).sum(0)
        row[f"max_err_s{s}"] = (got - want).abs().max().item()
        row[f"bmm_s{s}_us"] = time_calls([lambda w=w: split_mm(x, w, s) for w in ws], TIMING,
                                         "cuda")["graph_us"]
        row[f"bmm_sum_s{s}_us"] = time_calls(
            [lambda w=w: split_mm(x, w, s).sum(0).to(x.dtype) for w in ws], TIMING,
            "cuda")["graph_us"]
    best = min(SPLITS, key=lambda s: row[f"bmm_sum_s{s}_us"])
    row["best_split"] = best
    row["hbm_share_mm"] = n * k * 2 / (row["mm_us"] * 1e-6) / 4.8e12
    row["hbm_share_bmm_sum_best"] = n * k * 2 / (row[f"bmm_sum_s{best}_us"] * 1e-6) / 4.8e12
    print(row, flush=True)
    return row


def bench_compiled(name: str, m: int) -> dict:
    n, k = SHAPES[name]
    copies = max(2, -(-256 * 2**20 // (n * k * 2)))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    g = torch.rand(n, device="cuda")
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
          for _ in range(copies)]
    row = {"name": name, "m": m}
    ref = block_mm(x, ws[0], res, g)[1].float()
    fa = torch.compile(block_mm, dynamic=False)
    row["compiled_mm_us"] = time_calls([lambda w=w: fa(x, w, res, g) for w in ws], TIMING,
                                       "cuda")["graph_us"]
    for s in (4, 8):
        fb = torch.compile(lambda x, w, r, g, s=s: block_split(x, w, r, g, s), dynamic=False)
        row[f"max_err_s{s}"] = (fb(x, ws[0], res, g)[1].float() - ref).abs().max().item()
        row[f"compiled_split_s{s}_us"] = time_calls(
            [lambda w=w: fb(x, w, res, g) for w in ws], TIMING, "cuda")["graph_us"]
    print(row, flush=True)
    return row


OP_ROWS = (64, 96, 192, 384, 768)
OP_CHUNKS = (1, 2, 4, 8)


def bench_op(m: int) -> dict:
    """``dspark::skinny_linear``'s path past the skinny kernel for the down projection (the
    SiLU-and-mul input launch, then the matmul), ``mid_split_k`` = 1 (``torch.mm``) against
    the K-chunk partials and their sum launch."""
    import dataclasses

    from dspark_compile.kernels.targets import target_for_device
    from dspark_compile.kernels.skinny import skinny_linear_triton

    n, k = SHAPES["down"]
    copies = max(2, -(-256 * 2**20 // (n * k * 2)))
    x = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
          for _ in range(copies)]
    a = torch.nn.functional.silu(x[:, :k].float()) * x[:, k:].float()
    want = a @ ws[0].float().t()
    base = target_for_device(x.device)
    row = {"name": "down", "n": n, "k": k, "m": m, "weight_bytes": n * k * 2}
    for s in OP_CHUNKS:
        cfg = dataclasses.replace(base, mid_split_k=s, mid_split_full_m=m, mid_split_max_m=m)
        got = skinny_linear_triton(x, ws[0], glu=True, config=cfg)[0]
        row[f"max_err_chunks{s}"] = (got.float() - want).abs().max().item()
        row[f"op_chunks{s}_us"] = time_calls(
            [lambda w=w: skinny_linear_triton(x, w, glu=True, config=cfg) for w in ws],
            TIMING, "cuda")["graph_us"]
    print(row, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled blocks")
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS),
                    help="row counts M (default %(default)s); the compiled o and down blocks "
                         "then run at these rows too")
    ap.add_argument("--op", action="store_true",
                    help=f"time the op's down-projection path at {OP_ROWS} rows for "
                         f"mid_split_k in {OP_CHUNKS} instead (splitk_bmm_op.json)")
    opts = ap.parse_args()
    rows = tuple(opts.rows)
    if opts.op:
        import triton
        report = {"environment": {"gpu": torch.cuda.get_device_name(),
                                  "torch": torch.__version__, "triton": triton.__version__,
                                  "timing": TIMING,
                                  "command": "python benchmarks/splitk_bmm.py --op"},
                  "rows": [bench_op(m) for m in OP_ROWS]}
        out = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
        out.mkdir(parents=True, exist_ok=True)
        (out / "splitk_bmm_op.json").write_text(json.dumps(report, indent=1))
        return
    compiled = COMPILED if rows == ROWS else tuple((n, m) for n in ("o", "down") for m in rows)
    import triton
    report = {"environment": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "triton": triton.__version__, "timing": TIMING,
                              "command": "python benchmarks/splitk_bmm.py"
                                         + ("" if rows == ROWS else
                                            " --rows " + " ".join(map(str, rows)))},
              "raw": [bench(name, m) for name in SHAPES for m in rows]}
    if not opts.no_compile:
        report["compiled"] = [bench_compiled(name, m) for name, m in compiled]
    out = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    name = "splitk_bmm.json" if rows == ROWS else \
        f"splitk_bmm_rows_{'_'.join(map(str, rows))}.json"
    (out / name).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
