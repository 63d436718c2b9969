"""Matmuls at the row counts of the bs 64 / 256 verify steps (192 / 768 packed rows at mean
length 3): ``torch.mm`` (cuBLAS) against a plain tiled Triton kernel over a small tile sweep.

Each weight is one of the 1.1B benchmark model's (q+k+v and gate+up stacked, as the verifier
runs them past ``skinny_max_m``). Each figure is us per call in a CUDA-graph replay of
back-to-back calls cycling through copies of the weight totalling >= 256 MB, so no call finds
its weight in L2 (a verify step reads every weight once). The floor is the larger of the
weight read at 4.8 TB/s and the multiply at 790 TFLOPS.

    python benchmarks/mid_gemm.py [--rows 192 768] [--budget-s 300]   # mid_gemm.json
    python benchmarks/mid_gemm.py --tunable   # torch.mm after TunableOp: mid_gemm_tunable.json
    python benchmarks/mid_gemm.py --rows 192 --rows-resident   # every row in one program
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from common import graph_us

SHAPES = {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (16384, 2048),
          "down": (2048, 8192), "lm_head": (32000, 2048)}
REPLAYS = 10
HBM, FLOPS = 4.8e12, 790e12


@triton.jit
def _mm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, SPLIT_K: tl.constexpr, M_FAST: tl.constexpr):
    """``out = x @ w.T`` tile by tile; split K adds fp32 partials atomically."""
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    if M_FAST:  # the row tiles of one weight tile run side by side: one HBM read of it
        pid_m, pid_n = pid % num_m, pid // num_m
    else:
        pid_m, pid_n = pid // num_n, pid % num_n
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    k_len = K // SPLIT_K
    k_begin = pid_k * k_len
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * K + k_begin + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * K + k_begin + offs_k[:, None]
    acc = tl.zeros([BM, BN], tl.float32)
    for _ in range(0, k_len, BK):
        a = tl.load(x_ptrs, mask=offs_m[:, None] < M, other=0.0)
        b = tl.load(w_ptrs, mask=offs_n[None, :] < N, other=0.0)
        acc = tl.dot(a, b, acc)
        x_ptrs += BK
        w_ptrs += BK
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=mask, sem="relaxed")


@triton.jit
def _mm_tma_kernel(x_desc, w_desc, out_desc, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, M_FAST: tl.constexpr):
    """The same through tensor descriptors (TMA on sm_90), no split."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    if M_FAST:
        pid_m, pid_n = pid % num_m, pid // num_m
    else:
        pid_m, pid_n = pid // num_n, pid % num_n
    acc = tl.zeros([BM, BN], tl.float32)
    for k in range(0, K, BK):
        a = x_desc.load([pid_m * BM, k])
        b = w_desc.load([pid_n * BN, k])
        acc = tl.dot(a, b.T, acc)
    out_desc.store([pid_m * BM, pid_n * BN], acc.to(out_desc.dtype))


@triton.jit
def _mm_rows_kernel(x_desc, w_desc, out_desc, K, MT: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr):
    """Every row in one program (``MT`` tiles of 64, up to 256 rows), a column slice of ``BN``
    per program: each weight tile is loaded once, by one program, and serves all the rows
    (tensor descriptors; rows past M read as zeros and are not stored)."""
    col = tl.program_id(0) * BN
    acc0 = tl.zeros([64, BN], tl.float32)
    acc1 = tl.zeros([64, BN], tl.float32)
    acc2 = tl.zeros([64, BN], tl.float32)
    acc3 = tl.zeros([64, BN], tl.float32)
    for k in range(0, K, BK):
        b = w_desc.load([col, k]).T
        acc0 = tl.dot(x_desc.load([0, k]), b, acc0)
        if MT > 1:
            acc1 = tl.dot(x_desc.load([64, k]), b, acc1)
        if MT > 2:
            acc2 = tl.dot(x_desc.load([128, k]), b, acc2)
        if MT > 3:
            acc3 = tl.dot(x_desc.load([192, k]), b, acc3)
    out_desc.store([0, col], acc0.to(out_desc.dtype))
    if MT > 1:
        out_desc.store([64, col], acc1.to(out_desc.dtype))
    if MT > 2:
        out_desc.store([128, col], acc2.to(out_desc.dtype))
    if MT > 3:
        out_desc.store([192, col], acc3.to(out_desc.dtype))


def triton_calls(x, ws, cfg):
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x.shape
    n = ws[0].shape[0]
    if cfg.get("rows_resident"):
        bn, bk = cfg["bn"], cfg["bk"]
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
        xd = TensorDescriptor.from_tensor(x, [64, bk])
        od = TensorDescriptor.from_tensor(out, [64, bn])
        wds = [TensorDescriptor.from_tensor(w, [bn, bk]) for w in ws]
        opts = dict(num_warps=cfg["warps"], num_stages=cfg["stages"])
        return out, [lambda wd=wd: _mm_rows_kernel[(triton.cdiv(n, bn),)](
            xd, wd, od, k, MT=triton.cdiv(m, 64), BN=bn, BK=bk, **opts) for wd in wds]
    bm, bn, bk, split = cfg["bm"], cfg["bn"], cfg["bk"], cfg["split_k"]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), split)
    opts = dict(num_warps=cfg["warps"], num_stages=cfg["stages"])
    if cfg["tma"]:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
        xd = TensorDescriptor.from_tensor(x, [bm, bk])
        od = TensorDescriptor.from_tensor(out, [bm, bn])
        wds = [TensorDescriptor.from_tensor(w, [bn, bk]) for w in ws]
        return out, [lambda wd=wd: _mm_tma_kernel[grid[:1]](xd, wd, od, m, n, k, BM=bm, BN=bn,
                                                            BK=bk, M_FAST=cfg["m_fast"], **opts)
                     for wd in wds]
    if split == 1:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
        return out, [lambda w=w: _mm_kernel[grid](x, w, out, m, n, k, BM=bm, BN=bn, BK=bk,
                                                  SPLIT_K=1, M_FAST=cfg["m_fast"], **opts)
                     for w in ws]
    out = torch.zeros(m, n, device=x.device, dtype=torch.float32)

    def call(w):  # zero the fp32 sum, add the partials, cast: what a split costs in a step
        out.zero_()
        _mm_kernel[grid](x, w, out, m, n, k, BM=bm, BN=bn, BK=bk, SPLIT_K=split,
                         M_FAST=cfg["m_fast"], **opts)
        return out.to(torch.bfloat16)
    return out, [lambda w=w: call(w) for w in ws]


def configs(m: int, n: int, k: int, sms: int):
    for bm, bn, bk, warps, stages, tma, m_fast in itertools.product(
            (64, 128), (64, 128, 256), (64, 128), (4, 8), (3, 4), (False, True), (True,)):
        if bm * bn > 128 * 128 or (bn == 256 and warps == 4) or (bm == 128 and warps == 4):
            continue
        smem = stages * (bm + bn) * bk * 2
        if smem > 200 * 1024:
            continue
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        for split in (1, 2, 4):
            if split > 1 and (tma or tiles * split > 4 * sms or k // split < 4 * bk):
                continue
            yield dict(bm=bm, bn=bn, bk=bk, warps=warps, stages=stages, tma=tma,
                       m_fast=m_fast, split_k=split)


def rows_configs(m: int):
    """Tiles of the row-resident kernel (``m`` <= 256): column slice, K step, warps, stages,
    within 220 KB of shared memory."""
    mt = triton.cdiv(m, 64)
    for bn, bk, warps, stages in itertools.product((64, 128, 256), (64, 128), (4, 8),
                                                   (2, 3, 4)):
        if stages * (mt * 64 + bn) * bk * 2 > 220 * 1024 or (bn == 256 and warps == 4):
            continue
        yield dict(rows_resident=True, bn=bn, bk=bk, warps=warps, stages=stages, split_k=1)


def tunable_mm(x, ws, reps: int, want, out_dir: Path) -> dict:
    """us per ``torch.mm`` once TunableOp has tuned this shape (then tuning off, TunableOp on
    while timing) and its max error."""
    from torch.cuda import tunable

    tunable.set_filename(str(out_dir / "tunableop_results.csv"))
    tunable.set_rotating_buffer_size(256)
    tunable.enable(True)
    tunable.tuning_enable(True)
    try:
        y = torch.mm(x, ws[0].t())  # tunes this shape
        torch.cuda.synchronize()
        tunable.tuning_enable(False)
        err = (y.float() - want).abs().max().item()
        us = graph_us([lambda w=w: torch.mm(x, w.t()) for w in ws], reps)
    finally:
        tunable.tuning_enable(False)
        tunable.enable(False)
    return dict(mm_tuned_us=us, mm_tuned_err=err)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[192, 768])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--rows-resident", action="store_true",
                    help="sweep the row-resident kernel (every row in one program) instead, "
                         "rows <= 256: mid_gemm_rows_resident.json")
    ap.add_argument("--tunable", action="store_true",
                    help="instead of the Triton sweep, torch.mm again after PyTorch's TunableOp "
                         "picked its GEMM (cuBLAS / cuBLASLt algorithms, timed over a 256 MB "
                         "rotating buffer): mid_gemm_tunable.json")
    opts = ap.parse_args()
    t0 = time.perf_counter()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"environment": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "triton": triton.__version__, "hbm_bytes_per_s": HBM,
                              "bf16_flops": FLOPS, "replays": REPLAYS,
                              "command": "python benchmarks/mid_gemm.py --rows "
                              + " ".join(map(str, opts.rows))},
              "rows": []}

    if opts.tunable:
        report["environment"]["command"] += " --tunable"
    if opts.rows_resident:
        report["environment"]["command"] += " --rows-resident"
        if max(opts.rows) > 256:
            raise SystemExit(f"--rows-resident takes rows <= 256, not {max(opts.rows)}")

    def save():
        name = ("mid_gemm_tunable.json" if opts.tunable else
                "mid_gemm_rows_resident.json" if opts.rows_resident else "mid_gemm.json")
        (out_dir / name).write_text(json.dumps(report, indent=1))

    for m in opts.rows:
        for name in opts.shapes:
            n, k = SHAPES[name]
            copies = max(2, -(-256 * 2**20 // (n * k * 2)))
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
                  for _ in range(copies)]
            reps = max(1, 64 // copies)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = (x.float() @ ws[0].float().t())
            floor = max(n * k * 2 / HBM, 2 * m * n * k / FLOPS) * 1e6
            mm = graph_us([lambda w=w: torch.mm(x, w.t()) for w in ws], reps)
            row = dict(name=name, m=m, n=n, k=k, floor_us=floor, mm_us=mm, best=None)
            print(json.dumps(row), flush=True)
            best = None
            if opts.tunable:
                row.update(tunable_mm(x, ws, reps, want, out_dir))
                report["rows"].append(row)
                print(json.dumps(row), flush=True)
                save()
                continue
            for cfg in (rows_configs(m) if opts.rows_resident else configs(m, n, k, sms)):
                if time.perf_counter() - t0 > opts.budget_s:
                    report["stopped"] = "budget"
                    break
                try:
                    res, fns = triton_calls(x, ws, cfg)
                    got = fns[0]()
                    got = got if cfg["split_k"] > 1 else res
                    err = (got.float() - want).abs().max().item()
                    us = graph_us(fns, reps)
                except Exception as e:  # noqa: BLE001 - a config that does not compile
                    print("skip", cfg, type(e).__name__, str(e)[:120], flush=True)
                    continue
                if best is None or us < best["us"]:
                    best = dict(cfg, us=us, err=err)
            row["best"] = best
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
            save()
            del ws
    if opts.tunable:  # (op, shapes, chosen solution, its time in ms) of every tuned GEMM
        from torch.cuda import tunable

        report["tunable_results"] = [list(r) for r in tunable.get_results()]
    report["seconds"] = time.perf_counter() - t0
    save()


if __name__ == "__main__":
    main()
