"""The skinny matmul kernel (``kernels/skinny.py``) against ``torch.mm`` (cuBLAS).

Every shape is a weight of the 1.1B benchmark model (q+k+v and gate+up stacked, as the
verifier runs them). Each figure is us per call in a CUDA-graph replay of back-to-back calls
that cycle through copies of the weight totalling >= 256 MB, so no call finds its weight in
L2 (a verify step reads every weight once). ``--sweep`` also times tile choices at M = 3 and
24 (the mean-3 mix at bs 1 and 8). ``--pdl`` times a fused layer's four matmuls back to back
with programmatic dependent launch off and on (skinny_pdl.json).

    python benchmarks/skinny_kernel.py [--sweep]   # writes skinny_kernel.json to $OUT or results/
"""

from __future__ import annotations

import argparse
import dataclasses
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
ROWS = (1, 3, 8, 16, 24, 32, 48, 64)
"""Rows timed on the kernel itself (its largest row tile is 64, past today's skinny_max_m)."""
SWEEP_ROWS = (3, 24)
SWEEP_SHAPES = ("qkv", "o", "gate_up", "down")
SWEEP = [dict(block_n=bn, block_k=bk, num_stages=st, num_warps=4, tma=tma)
         for tma, bn, bk, st in itertools.product((False, True), (16, 32, 64), (128, 256),
                                                  (3, 5, 8))]
REPLAYS = 10


@triton.jit
def _read_kernel(w_ptr, out_ptr, rows_per_program, k, BLOCK_K: tl.constexpr):
    """Sum of a program's weight rows: the bandwidth a plain streaming read reaches."""
    row0 = tl.program_id(0) * rows_per_program
    offs = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_K], tl.float32)
    for r in range(row0, row0 + rows_per_program):
        for k0 in range(0, k, BLOCK_K):
            acc += tl.load(w_ptr + r.to(tl.int64) * k + k0 + offs).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


@triton.jit
def _empty_kernel(out_ptr):
    if tl.program_id(0) < 0:
        tl.store(out_ptr, 0.0)


class Case:
    def __init__(self, name: str):
        self.name = name
        self.n, self.k = SHAPES[name]
        copies = max(2, -(-256 * 2**20 // (self.n * self.k * 2)))
        self.ws = [torch.randn(self.n, self.k, device="cuda", dtype=torch.bfloat16)
                   / self.k ** 0.5 for _ in range(copies)]
        self.reps = max(1, 64 // copies)

    def x(self, m: int) -> torch.Tensor:
        return torch.randn(m, self.k, device="cuda", dtype=torch.bfloat16)

    def calls(self, m: int, mode: str, **cfg) -> list:
        """One call per weight copy with the fusion ``mode``: ``plain``, ``glu`` (SiLU-and-mul
        prologue), ``rms`` (RMSNorm prologue), ``rms_res`` (residual add + RMSNorm),
        ``rms_res_glu`` (that, and a SiLU-and-mul epilogue over the gate and up halves),
        ``rms_res_rope`` (``rms_res`` and the q/k rotation, heads of 128, in the epilogue: the
        first 3072 of q/k/v's 4096 columns)."""
        from dspark_compile.kernels.skinny import skinny_linear_triton

        x = torch.randn(m, 2 * self.k if mode == "glu" else self.k, device="cuda",
                        dtype=torch.bfloat16)
        kw = dict(glu=mode == "glu", eps=1e-6, glu_out=mode.endswith("_glu"), **cfg)
        if mode.startswith("rms"):
            kw["gamma"] = torch.rand(self.k, device="cuda", dtype=torch.bfloat16) + 0.5
        if mode.startswith("rms_res"):
            kw["residual"] = torch.randn_like(x)
        if mode.endswith("_rope"):
            angle = torch.rand(m, 64, device="cuda") * 6.0
            kw.update(cos=torch.cat([angle.cos()] * 2, 1).to(torch.bfloat16),
                      sin=torch.cat([angle.sin()] * 2, 1).to(torch.bfloat16), rot_cols=3072)
        return [lambda w=w: skinny_linear_triton(x, w, **kw) for w in self.ws]

    def fused_us(self, m: int, mode: str, **cfg) -> float:
        """us per call with the fusion ``mode`` (:meth:`calls`)."""
        return graph_us(self.calls(m, mode, **cfg), self.reps)

    def read_us(self, programs: int) -> float:
        out = torch.empty(programs, device="cuda")
        rows = self.n // programs
        return graph_us([lambda w=w: _read_kernel[(programs,)](w, out, rows, self.k,
                                                               BLOCK_K=1024, num_warps=4)
                         for w in self.ws], self.reps)

    def mm_us(self, m: int) -> float:
        x = self.x(m)
        return graph_us([lambda w=w: torch.mm(x, w.t()) for w in self.ws], self.reps)

    def ours(self, m: int, **cfg) -> tuple[float, float]:
        from dspark_compile.kernels.skinny import skinny_linear_triton

        x = self.x(m)
        want = x.float() @ self.ws[0].float().t()
        err = (skinny_linear_triton(x, self.ws[0], **cfg)[0].float() - want).abs().max().item()
        us = graph_us([lambda w=w: skinny_linear_triton(x, w, **cfg) for w in self.ws], self.reps)
        return us, err


LAYER = (("qkv", "rms_res"), ("o", "plain"), ("gate_up", "rms_res_glu"), ("down", "plain"))
"""A fused layer's four matmuls, in order."""


def layer_us(cases: dict, m: int, **cfg) -> float:
    """us per layer of :data:`LAYER`'s four calls back to back, each on its own next weight
    copy, in one CUDA graph (the boundaries between different kernels, as in a step)."""
    calls = [cases[name].calls(m, mode, **cfg) for name, mode in LAYER]
    rounds = max(len(c) for c in calls) * 2
    fns = [calls[j][i % len(calls[j])] for i in range(rounds) for j in range(len(LAYER))]
    return graph_us(fns, 4) * len(LAYER)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="also time tile choices")
    ap.add_argument("--fused-only", action="store_true",
                    help="only the fused modes, each with the dot's operands both ways")
    ap.add_argument("--pdl", action="store_true",
                    help="only the layer chain with programmatic dependent launch on and off")
    ap.add_argument("--split-sweep", action="store_true",
                    help="only a fused layer's four launches over column tile and split count "
                         "(skinny_split_sweep.json)")
    ap.add_argument("--rope-sweep", action="store_true",
                    help="only q/k/v with and without the rotary epilogue over column tile, "
                         "split count and warps (skinny_rope_sweep.json)")
    ap.add_argument("--budget-s", type=float, default=400.0,
                    help="stop the sweep after this many seconds (the rows so far are kept)")
    opts = ap.parse_args()
    from dspark_compile.kernels.device import device_target
    from dspark_compile.kernels.skinny import plan_skinny

    t0 = time.perf_counter()
    cfg, sms = device_target(torch.device("cuda"))
    out = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    report = {"environment": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "triton": triton.__version__, "hbm_bytes_per_s": 4.8e12,
                              "replays": REPLAYS, "command": "python benchmarks/skinny_kernel.py"
                              + (" --sweep" if opts.sweep else "")},
              "rows": [], "sweep": []}
    cases = {name: Case(name) for name in SHAPES}

    def save():
        name = ("skinny_pdl.json" if opts.pdl else "skinny_split_sweep.json"
                if opts.split_sweep else "skinny_rope_sweep.json" if opts.rope_sweep
                else "skinny_kernel.json")
        (out / name).write_text(json.dumps(report, indent=1))

    kcfg = dataclasses.replace(cfg, skinny_max_m=max(ROWS))  # the kernel, not the fallback

    def record(key: str, row: dict) -> None:
        """A measured row into ``report[key]``, on stdout and (the rows so far) into the file."""
        report.setdefault(key, []).append(row)
        print(json.dumps(row), flush=True)
        save()

    def fused(pairs, ms, variants) -> None:
        """Each (weight, mode) at each M and tile variant; past 64 rows the fallback path."""
        for name, mode in pairs:
            for m in ms:
                for c in variants if m <= kcfg.skinny_max_m else ({},):
                    us = (cases[name].ours(m, config=kcfg, **c)[0] if mode == "plain"
                          else cases[name].fused_us(m, mode, config=kcfg, **c))
                    record("fused", dict(name=name, mode=mode, m=m, **c, us=us))

    report["fused"] = []
    if opts.pdl:
        report["environment"]["command"] += " --pdl"
        for m in (3, 24):
            for pdl in (False, True, False, True):
                us = layer_us(cases, m, config=dataclasses.replace(kcfg, pdl=pdl))
                record("layer", dict(m=m, pdl=pdl, layer_us=us))
        report["seconds"] = time.perf_counter() - t0
        save()
        return
    if opts.rope_sweep:
        report["environment"]["command"] += " --rope-sweep"
        qkv = cases["qkv"]
        for m in (3, 24):
            for mode in ("rms_res", "rms_res_rope"):
                default = plan_skinny(m, qkv.n, qkv.k, kcfg, sms, rms=True,
                                      rot_d=128 if mode.endswith("_rope") else 0)
                record("rope_sweep", dict(mode=mode, m=m, default=True,
                                          block_n=default.block_n, split_k=default.split_k,
                                          us=qkv.fused_us(m, mode, config=kcfg)))
            for block_n, split_k, warps in itertools.product((128, 256), (2, 4, 8), (4, 8)):
                if time.perf_counter() - t0 > opts.budget_s:
                    report["sweep_stopped"] = "budget"
                    save()
                    return
                c = dict(block_n=block_n, split_k=split_k, num_warps=warps)
                record("rope_sweep", dict(mode="rms_res_rope", m=m, default=False, **c,
                                          us=qkv.fused_us(m, "rms_res_rope", config=kcfg, **c)))
        report["seconds"] = time.perf_counter() - t0
        save()
        return
    if opts.split_sweep:
        report["environment"]["command"] += " --split-sweep"
        for m in (3, 24):
            for name, mode in LAYER:
                for block_n, split_k in itertools.product((32, 64, 128), (1, 2, 4, 8)):
                    if time.perf_counter() - t0 > opts.budget_s:
                        report["sweep_stopped"] = "budget"
                        save()
                        return
                    c = dict(block_n=block_n, split_k=split_k)
                    glu_out = mode.endswith("_glu")
                    n_out = cases[name].n // (2 if glu_out else 1)
                    kw = dict(glu_out=glu_out, rms=mode.startswith("rms"))
                    plan = plan_skinny(m, n_out, cases[name].k, kcfg, sms, **kw, **c)
                    us = (cases[name].ours(m, config=kcfg, **c)[0] if mode == "plain"
                          else cases[name].fused_us(m, mode, config=kcfg, **c))
                    default = plan_skinny(m, n_out, cases[name].k, kcfg, sms, **kw)
                    record("split_sweep", dict(name=name, mode=mode, m=m, **c,
                                               stages=plan.num_stages,
                                               default=plan == default, us=us))
        report["seconds"] = time.perf_counter() - t0
        save()
        return
    if opts.fused_only:
        report["environment"]["command"] += " --fused-only"
        fused((("qkv", "rms_res"), ("gate_up", "rms_res_glu"), ("lm_head", "rms_res"),
               ("down", "plain"), ("o", "plain")), (3, 24, 64),
              ({}, dict(swap=True), dict(swap=True, block_n=128), dict(block_n=128)))
        report["seconds"] = time.perf_counter() - t0
        save()
        return
    out_f = torch.empty(1, device="cuda")
    report["empty_kernel_us"] = graph_us([lambda: _empty_kernel[(128,)](out_f)], 64)
    report["read_us"] = {name: {p: case.read_us(p) for p in (128, 256, 512)}
                         for name, case in cases.items()}
    print("empty", report["empty_kernel_us"], "read", report["read_us"], flush=True)
    for name, case in cases.items():
        for m in ROWS:
            plan = plan_skinny(m, case.n, case.k, cfg, sms)
            us, err = case.ours(m, config=kcfg)
            mm = case.mm_us(m)
            row = dict(name=name, n=case.n, k=case.k, m=m, mm_us=mm, ours_us=us, max_err=err,
                       ratio=us / mm, ours_hbm_share=case.n * case.k * 2 / (us * 1e-6) / 4.8e12,
                       mm_hbm_share=case.n * case.k * 2 / (mm * 1e-6) / 4.8e12,
                       plan=dict(block_n=plan.block_n, block_k=plan.block_k,
                                 split_k=plan.split_k, stages=plan.num_stages,
                                 warps=plan.num_warps))
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
        save()
    fused((("qkv", "rms_res"), ("gate_up", "rms_res_glu"), ("gate_up", "rms_res"),
           ("lm_head", "rms_res"), ("down", "glu")), (3, 24, 64, 192),
          ({}, dict(block_n=128, block_k=128, num_stages=4),
           dict(block_n=64, block_k=256, num_stages=3)))
    if opts.sweep:
        for m in SWEEP_ROWS:
            seen = set()
            for c in SWEEP:
                for name in SWEEP_SHAPES:
                    case = cases[name]
                    plan = plan_skinny(m, case.n, case.k, cfg, sms, **c)
                    if (name, plan) in seen:  # stages cut to fit: a launch already timed
                        continue
                    seen.add((name, plan))
                    if time.perf_counter() - t0 > opts.budget_s:
                        report["sweep_stopped"] = "budget"
                        save()
                        return
                    try:
                        us, err = case.ours(m, config=kcfg, **c)
                    except Exception as e:  # noqa: BLE001 - recorded
                        us, err = None, f"{type(e).__name__}: {e}"[:200]
                    row = dict(name=name, m=m, **c, stages_used=plan.num_stages,
                               split_k=plan.split_k, us=us, err=err)
                    report["sweep"].append(row)
                    print(json.dumps(row), flush=True)
            save()
    report["seconds"] = time.perf_counter() - t0
    save()


if __name__ == "__main__":
    main()
