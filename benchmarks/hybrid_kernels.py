"""Benchmark: ragged causal conv1d and gated-delta-rule verify kernels (Qwen3-Next GDN layers).

Conv: dim 10240 (the issue's), width 4, bf16, verify width T = 8, bs 1 / 64 / 128, packed with
a fixed-seed mix of lengths 1..8, packed with every request at 8, and the dense call a
``[bs, T]`` verify makes (``F.conv1d`` over ``[bs, dim, T+3]`` and SiLU, HF's fallback). The
bandwidth figure counts the bytes each must move (packed: x read, out and replay-ring write,
window read; dense: input read, output write) against 4.8 TB/s.
GDN: 16 key heads, 32 value heads, K = V = 128, bf16 q/k/v, fp32 state, T = 8, bs 1 / 8 / 128,
full rows and the length mix. Floor = the fp32 state read once (``bs * Hv * K * V * 4`` bytes;
the forward writes no state), reported as a share of 4.8 TB/s. The commits are timed too.

Every case is first checked against the pure-torch reference (float32 copies of the inputs),
then timed as back-to-back launches between two CUDA events (no sync in between: a sync per
launch lets the clocks drop) and as CUDA-graph replays. Calls cycle over enough copies
("layers") of the inputs that the reads come from HBM, not the 50 MB L2.

Usage: ``python benchmarks/hybrid_kernels.py [--sweep] [--smoke]``. Writes
``hybrid_kernels.json`` to ``$OUT`` if set, else to ``benchmarks/results/``. ``--smoke`` runs
tiny shapes on the CPU under ``TRITON_INTERPRET=1`` (checks the script, times nothing real).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
from pathlib import Path

if "--smoke" in sys.argv:  # read when @triton.jit decorates: before any kernel import
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from common import time_calls  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dspark_compile.ops import linear_attention as linear_ops  # noqa: E402
from dspark_compile.ops import linear_attention_reference as ref  # noqa: E402
from dspark_compile.kernels import conv as triton_conv  # noqa: E402
from dspark_compile.kernels import gdn as triton_gdn  # noqa: E402

SETTINGS = dict(conv_dim=10240, width=4, conv_batch_sizes=[1, 64, 128], gdn_batch_sizes=[1, 8,
                128], num_k_heads=16, num_v_heads=32, k_dim=128, v_dim=128, verify_len=8,
                dtype="bfloat16", mix_seed=0, hbm_bytes_per_s=4.8e12, rotate_bytes=256e6,
                eager_iters=200, graph_calls=32, graph_replays=20,
                sweep_conv_tiles=[[4, 256], [8, 128], [8, 256], [16, 128]],
                sweep_gdn_block_v=[16, 32, 64])
SMOKE = dict(SETTINGS, conv_dim=40, conv_batch_sizes=[1, 3], gdn_batch_sizes=[2],
             num_k_heads=2, num_v_heads=4, k_dim=16, v_dim=16, dtype="float32", rotate_bytes=0,
             eager_iters=2, graph_calls=1, graph_replays=1, sweep_conv_tiles=[[4, 16]],
             sweep_gdn_block_v=[16])


def lengths(bs: int, mix: bool, s: dict) -> list[int]:
    """All ``verify_len``, or a fixed-seed uniform mix of 1..verify_len."""
    if not mix:
        return [s["verify_len"]] * bs
    g = torch.Generator().manual_seed(s["mix_seed"] + bs)
    return torch.randint(1, s["verify_len"] + 1, (bs,), generator=g).tolist()


def layout(lens: list[int], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``query_start_loc`` and slots (a fixed permutation of a pool twice the batch)."""
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    slots = torch.randperm(2 * len(lens), generator=torch.Generator().manual_seed(1))
    return qsl.to(device), slots[: len(lens)].to(torch.int32).to(device)


def _rates(nbytes: float, times: dict, s: dict) -> dict:
    best = min(v for v in (times["eager_us"], times["graph_us"]) if v is not None)
    return dict(**times, best_us=best, bytes=int(nbytes),
                floor_us=nbytes / s["hbm_bytes_per_s"] * 1e6,
                hbm_pct=round(100 * nbytes / (best * 1e-6) / s["hbm_bytes_per_s"], 1))


def _copies(one_bytes: float, s: dict) -> int:
    return max(1, min(64, math.ceil(s["rotate_bytes"] / max(one_bytes, 1))))


def conv_inputs(lens: list[int], s: dict, device: str, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    dtype, dim, n = getattr(torch, s["dtype"]), s["conv_dim"], sum(lens)
    qsl, slots = layout(lens, device)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    return dict(x=rnd(n, dim), weight=rnd(dim, s["width"]), bias=rnd(dim),
                conv_state=rnd(2 * len(lens), dim, s["width"] - 1), qsl=qsl, slots=slots,
                ring=torch.zeros(n, dim, dtype=dtype, device=device))


def check_conv(c: dict, lens: list[int], plan=None) -> float:
    """Max |triton - reference| (reference on float32 copies); exact ring and commit."""
    f32 = {k: (v.float().clone() if v.is_floating_point() else v) for k, v in c.items()}
    want = ref.causal_conv1d(f32["x"], f32["weight"], f32["bias"], f32["conv_state"],
                             c["qsl"], c["slots"], f32["ring"], "silu")
    got = triton_conv.causal_conv1d_triton(c["x"], c["weight"], c["bias"], c["conv_state"],
                                           c["qsl"], c["slots"], c["ring"], "silu", plan=plan)
    acc = torch.tensor([max(1, n // 2) for n in lens], dtype=torch.int32, device=c["x"].device)
    state = c["conv_state"].clone()
    triton_conv.causal_conv1d_commit_triton(state, c["ring"], c["qsl"], c["slots"], acc)
    ref.causal_conv1d_commit(f32["conv_state"], f32["ring"], c["qsl"], c["slots"], acc)
    if not (torch.equal(c["ring"].float(), f32["ring"]) and
            torch.equal(state.float(), f32["conv_state"])):
        raise AssertionError("conv: ring or committed window differs from the reference")
    err = (got.float() - want).abs().max().item()
    scale = max(1.0, want.abs().max().item())  # bf16 rounds the output: 2^-8 of its size
    if not err < (1e-2 * scale if c["x"].dtype == torch.bfloat16 else 1e-4):
        raise AssertionError(f"conv: triton vs reference max abs error {err} at output scale "
                             f"{scale}")
    return err


def conv_case(bs: int, mix: bool, s: dict, device: str, plan=None) -> dict:
    lens = lengths(bs, mix, s)
    elem = torch.finfo(getattr(torch, s["dtype"])).bits // 8
    n, dim, keep = sum(lens), s["conv_dim"], s["width"] - 1
    nbytes = (3 * n * dim + bs * dim * keep + dim * (s["width"] + 1)) * elem  # x, out, ring
    sets = [conv_inputs(lens, s, device, seed=bs + i) for i in range(_copies(nbytes, s))]
    err = check_conv(sets[0], lens, plan)
    fns = [lambda c=c: triton_conv.causal_conv1d_triton(
        c["x"], c["weight"], c["bias"], c["conv_state"], c["qsl"], c["slots"], c["ring"],
        "silu", plan=plan) for c in sets]
    acc = torch.tensor(lens, dtype=torch.int32, device=device)
    commit = [lambda c=c: triton_conv.causal_conv1d_commit_triton(
        c["conv_state"], c["ring"], c["qsl"], c["slots"], acc) for c in sets]
    commit_bytes = (2 * bs * dim * keep + n * dim) * elem
    used = plan or triton_conv.plan_conv(n, dim, bs, s["width"], triton_conv.device_sm_count(
        torch.device(device)))
    return dict(kernel="conv", bs=bs, lengths="mix1-8" if mix else "all8", num_tokens=n,
                copies=len(sets), max_abs_err=err, plan=dataclasses.asdict(used),
                **_rates(nbytes, time_calls(fns, s, device), s),
                commit=_rates(commit_bytes, time_calls(commit, s, device), s))


def conv_dense_case(bs: int, s: dict, device: str) -> dict:
    """What a dense verify runs: depthwise F.conv1d over cat(window, x) and SiLU."""
    dtype, dim, t = getattr(torch, s["dtype"]), s["conv_dim"], s["verify_len"]
    elem = torch.finfo(dtype).bits // 8
    nbytes = (bs * dim * (t + s["width"] - 1) + bs * dim * t) * elem
    weight = torch.randn(dim, 1, s["width"], dtype=dtype, device=device)
    bias = torch.randn(dim, dtype=dtype, device=device)
    xs = [torch.randn(bs, dim, t + s["width"] - 1, dtype=dtype, device=device)
          for _ in range(_copies(nbytes, s))]
    fns = [lambda x=x: F.silu(F.conv1d(x, weight, bias, groups=dim)) for x in xs]
    return dict(kernel="conv_dense_F.conv1d", bs=bs, lengths="all8", num_tokens=bs * t,
                copies=len(xs), **_rates(nbytes, time_calls(fns, s, device), s))


def gdn_inputs(lens: list[int], s: dict, device: str, seed: int) -> dict:
    g = torch.Generator(device).manual_seed(seed)  # on the device: a CPU randn of the state
    dtype, n = getattr(torch, s["dtype"]), sum(lens)  # at bs 128 takes seconds a case
    hk, hv, kd, vd = s["num_k_heads"], s["num_v_heads"], s["k_dim"], s["v_dim"]
    qsl, slots = layout(lens, device)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device)

    return dict(q=rnd(n, hk, kd).to(dtype), k=rnd(n, hk, kd).to(dtype), v=rnd(n, hv, vd).to(dtype),
                g=-F.softplus(rnd(n, hv)), beta=torch.sigmoid(rnd(n, hv)).to(dtype),
                state=0.3 * rnd(2 * len(lens), hv, kd, vd), qsl=qsl, slots=slots,
                rings=linear_ops.gdn_ring(n, hk, hv, kd, vd, device))


def _gdn_args(c: dict, s: dict) -> tuple:
    return (c["q"], c["k"], c["v"], c["g"], c["beta"], c["state"], c["qsl"], c["slots"],
            *c["rings"], s["k_dim"] ** -0.5, True)


def check_gdn(c: dict, lens: list[int], s: dict, plan=None) -> float:
    f32 = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
           for k, v in c.items()}
    f32["rings"] = tuple(torch.zeros_like(r) for r in c["rings"])
    want = ref.gated_delta_rule(*_gdn_args(f32, s))
    got = triton_gdn.gated_delta_rule_triton(*_gdn_args(c, s), plan=plan)
    acc = torch.tensor([max(1, n // 2) for n in lens], dtype=torch.int32, device=c["q"].device)
    state, want_state = c["state"].clone(), c["state"].clone()
    triton_gdn.gated_delta_rule_commit_triton(state, *c["rings"], c["qsl"], c["slots"], acc)
    ref.gated_delta_rule_commit(want_state, *f32["rings"], c["qsl"], c["slots"], acc)
    state_err = (state - want_state).abs().max().item()
    err = (got.float() - want).abs().max().item()
    if not (err < 3e-2 and state_err < 1e-3):
        raise AssertionError(f"gdn: triton vs reference max abs error {err}, state {state_err}")
    return err


def gdn_case(bs: int, mix: bool, s: dict, device: str, plan=None) -> dict:
    lens = lengths(bs, mix, s)
    hv, kd, vd = s["num_v_heads"], s["k_dim"], s["v_dim"]
    floor = bs * hv * kd * vd * 4  # fp32 state, read once, never written by the forward
    sets = [gdn_inputs(lens, s, device, seed=bs + i) for i in range(_copies(floor, s))]
    err = check_gdn(sets[0], lens, s, plan)
    fns = [lambda c=c: triton_gdn.gated_delta_rule_triton(*_gdn_args(c, s), plan=plan)
           for c in sets]
    acc = torch.tensor(lens, dtype=torch.int32, device=device)
    commit = [lambda c=c: triton_gdn.gated_delta_rule_commit_triton(
        c["state"], *c["rings"], c["qsl"], c["slots"], acc) for c in sets]
    used = plan or triton_gdn.plan_gdn(bs, hv, kd, vd, triton_conv.device_sm_count(
        torch.device(device)), num_tokens=sum(lens))
    return dict(kernel="gdn", bs=bs, lengths="mix1-8" if mix else "all8", num_tokens=sum(lens),
                copies=len(sets), max_abs_err=err, plan=dataclasses.asdict(used),
                **_rates(floor, time_calls(fns, s, device), s),
                commit=_rates(2 * floor, time_calls(commit, s, device), s))


def sweep(s: dict, device: str) -> list[dict]:
    """Conv tiles (rows x channels) and GDN value blocks at the largest batch, full rows."""
    rows, bs = [], s["conv_batch_sizes"][-1]
    for block_t, block_d in s["sweep_conv_tiles"]:
        base = triton_conv.plan_conv(bs * s["verify_len"], s["conv_dim"], bs, s["width"],
                                     triton_conv.device_sm_count(torch.device(device)))
        plan = dataclasses.replace(base, block_t=block_t, block_d=block_d)
        r = conv_case(bs, False, s, device, plan)
        rows.append(dict(kernel="conv", bs=bs, block_t=block_t, block_d=block_d,
                         best_us=r["best_us"], hbm_pct=r["hbm_pct"]))
    for bs in s["gdn_batch_sizes"]:
        for block_v in s["sweep_gdn_block_v"]:
            kpad = 1 << (s["k_dim"] - 1).bit_length()
            plan = triton_gdn.GdnPlan(kpad, block_v, -(-s["v_dim"] // block_v))
            r = gdn_case(bs, False, s, device, plan)
            rows.append(dict(kernel="gdn", bs=bs, block_v=block_v, best_us=r["best_us"],
                             hbm_pct=r["hbm_pct"]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="also sweep conv tiles and BLOCK_V")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run under the interpreter")
    opts = ap.parse_args()
    s, device = (SMOKE, "cpu") if opts.smoke else (SETTINGS, "cuda")
    import triton
    report = dict(gpu=torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
                  torch=torch.__version__, triton=triton.__version__, settings=s,
                  command=" ".join(sys.argv), results=[])
    for bs in s["conv_batch_sizes"]:
        report["results"] += [conv_case(bs, True, s, device), conv_case(bs, False, s, device),
                              conv_dense_case(bs, s, device)]
    for bs in s["gdn_batch_sizes"]:
        report["results"] += [gdn_case(bs, False, s, device), gdn_case(bs, True, s, device)]
    if opts.sweep:
        report["sweep"] = sweep(s, device)
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "hybrid_kernels.json").write_text(json.dumps(report, indent=1))
    print(f"{'kernel':>20} {'bs':>4} {'lens':>7} {'eager us':>9} {'graph us':>9} "
          f"{'floor us':>8} {'HBM%':>6} {'commit us':>9}")
    for r in report["results"]:
        commit = r.get("commit", {}).get("best_us")
        print(f"{r['kernel']:>20} {r['bs']:>4} {r['lengths']:>7} {r['eager_us']:>9.1f} "
              f"{r['graph_us'] or 0:>9.1f} {r['floor_us']:>8.2f} {r['hbm_pct']:>6} "
              f"{commit if commit is None else round(commit, 1)!s:>9}")
    for row in report.get("sweep", []):
        print(row)


if __name__ == "__main__":
    main()
