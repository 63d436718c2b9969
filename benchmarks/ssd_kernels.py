"""Benchmark: the Mamba-2 (SSD) and Gated DeltaNet verify ops against their state-read floor.

SSD: Nemotron-H's mixer shapes (128 heads of P = 64, 8 groups of N = 128), bf16 x / dt / B / C,
fp32 state. GDN: Qwen3-Next's (16 key heads, 32 value heads, K = V = 128), bf16 q / k / v, fp32
state. bs 1 / 8 / 64 / 128, verify lengths all 8 and a fixed-seed mix of 1..8 with mean exactly
3 (``common.mix_lens``). Floor = the fp32 state read once (``bs * heads * K * V * 4`` bytes; the
forward writes no state) at 4.8 TB/s; the share of it is ``floor / best time``. The commits
(state read + write) are timed too, against twice that floor.

Every case is first checked against the pure-torch reference (float32 copies), then timed as
back-to-back launches between two CUDA events and as CUDA-graph replays, cycling over enough
copies of the inputs that the state comes from HBM, not the 50 MB L2 (``common.time_calls``).
``--sweep`` also times every channel block (``BLOCK_P`` / ``BLOCK_V``) and warp count at each
batch size, all 8 rows.

``--ssd-plans rows block block:from1`` times the SSD forward (and commit) under each named
plan on the same inputs (:func:`ssd_plan`): the row walk against the block form.
``--gdn-plans rows default block:v128`` does the same for the GDN forward (:func:`gdn_plan`).

Usage: ``python benchmarks/ssd_kernels.py [--sweep] [--smoke] [--bs 64 128] [--kernels gdn]
[--sweep-warps 1 2 4 8] [--ssd-plans rows block] [--gdn-plans rows block]``. Writes
``ssd_kernels.json`` to ``$OUT`` if set, else to ``benchmarks/results/`` (after every row). The
GDN inputs and their check are ``hybrid_kernels.py``'s. ``--smoke`` runs tiny shapes on the CPU
under ``TRITON_INTERPRET=1`` (checks the script, times nothing real).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
from pathlib import Path

if "--smoke" in sys.argv:  # read when @triton.jit decorates: before any kernel import
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from common import mix_lens, time_calls  # noqa: E402
from hybrid_kernels import (_copies, _gdn_args, check_gdn, gdn_inputs,  # noqa: E402
                            layout)

from dspark_compile.kernels import gdn as triton_gdn  # noqa: E402
from dspark_compile.kernels import ssd as triton_ssd  # noqa: E402
from dspark_compile.kernels.device import device_sm_count  # noqa: E402
from dspark_compile.ops import ssd as ssd_ops  # noqa: E402
from dspark_compile.ops import ssd_reference as ssd_ref  # noqa: E402

SETTINGS = dict(batch_sizes=[1, 8, 64, 128], block=8, mean_len=3, dtype="bfloat16",
                ssd_heads=128, ssd_groups=8, ssd_state=128, ssd_head_dim=64,
                num_k_heads=16, num_v_heads=32, k_dim=128, v_dim=128,
                hbm_bytes_per_s=4.8e12, rotate_bytes=256e6, eager_iters=200, graph_calls=32,
                graph_replays=20, sweep_blocks=[16, 32, 64], sweep_warps=[1, 2, 4, 8])
SMOKE = dict(SETTINGS, batch_sizes=[1, 3], dtype="float32", ssd_heads=4, ssd_groups=2,
             ssd_state=8, ssd_head_dim=24, num_k_heads=2, num_v_heads=4, k_dim=16,
             v_dim=16, rotate_bytes=0, eager_iters=2, graph_calls=1, graph_replays=1,
             sweep_blocks=[16], sweep_warps=[4])


def _label(mix: bool, s: dict) -> str:
    return f"mix_mean{s['mean_len']}" if mix else f"all{s['block']}"


def lengths(bs: int, mix: bool, s: dict) -> list[int]:
    return mix_lens(bs, s["block"], s["mean_len"]) if mix else [s["block"]] * bs


def _rates(nbytes: float, times: dict, s: dict) -> dict:
    best = min(v for v in (times["eager_us"], times["graph_us"]) if v is not None)
    floor = nbytes / s["hbm_bytes_per_s"] * 1e6
    return dict(**times, best_us=best, bytes=int(nbytes), floor_us=floor,
                floor_pct=round(100 * floor / best, 1))


# ---------------------------------------------------------------------- SSD
def ssd_inputs(lens: list[int], s: dict, device: str, seed: int) -> dict:
    g = torch.Generator(device).manual_seed(seed)  # on the device: a CPU randn of a 1 GB
    dtype, n, r = getattr(torch, s["dtype"]), sum(lens), len(lens)  # state takes seconds
    h, grp, ns, p = s["ssd_heads"], s["ssd_groups"], s["ssd_state"], s["ssd_head_dim"]
    qsl, slots = layout(lens, device)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    return dict(x=rnd(n, h, p), dt=rnd(n, h, scale=0.5), B=rnd(n, grp, ns), C=rnd(n, grp, ns),
                A=-torch.rand(h, generator=g, device=device).add(0.5),
                D=torch.randn(h, generator=g, device=device),
                dt_bias=torch.randn(h, generator=g, device=device).mul(0.3),
                state=torch.randn(2 * r, h, ns, p, generator=g, device=device).mul(0.3),
                qsl=qsl, slots=slots, rings=ssd_ops.ssd_ring(n, h, grp, ns, p, device))


def _ssd_args(c: dict) -> tuple:
    return (c["x"], c["dt"], c["A"], c["B"], c["C"], c["D"], c["dt_bias"], c["state"], c["qsl"],
            c["slots"], *c["rings"], True, 0.0, float("inf"))


def check_ssd(c: dict, lens: list[int], plan=None) -> float:
    f32 = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
           for k, v in c.items()}
    f32["rings"] = tuple(torch.zeros_like(r) for r in c["rings"])
    want = ssd_ref.ssd(*_ssd_args(f32))
    got = triton_ssd.ssd_triton(*_ssd_args(c), plan=plan)
    acc = torch.tensor([max(1, n // 2) for n in lens], dtype=torch.int32, device=c["x"].device)
    state, want_state = c["state"].clone(), c["state"].clone()
    triton_ssd.ssd_commit_triton(state, *c["rings"], c["qsl"], c["slots"], acc, plan=plan)
    ssd_ref.ssd_commit(want_state, *f32["rings"], c["qsl"], c["slots"], acc)
    err = (got - want).abs().max().item()
    state_err = (state - want_state).abs().max().item()
    scale = max(1.0, want.abs().max().item())
    state_scale = max(1.0, want_state.abs().max().item())
    # outputs in the inputs' dtype: bf16 rounds at 2^-8 of the value; the fp32 state carries
    # the rounding of its bf16 inputs
    tol = 1e-3 if c["x"].dtype == torch.float32 else 2 ** -6
    if not (err < tol * scale and state_err < tol * state_scale):
        raise AssertionError(f"ssd: triton vs reference max abs error {err} (output scale "
                             f"{scale}), state {state_err} (state scale {state_scale})")
    return err


def ssd_case(bs: int, mix: bool, s: dict, device: str, plan=None) -> dict:
    lens = lengths(bs, mix, s)
    h, ns, p = s["ssd_heads"], s["ssd_state"], s["ssd_head_dim"]
    floor = bs * h * ns * p * 4  # fp32 state, read once, never written by the forward
    sets = [ssd_inputs(lens, s, device, seed=bs + i) for i in range(_copies(floor, s))]
    err = check_ssd(sets[0], lens, plan)
    fns = [lambda c=c: triton_ssd.ssd_triton(*_ssd_args(c), plan=plan) for c in sets]
    acc = torch.tensor(lens, dtype=torch.int32, device=device)
    commit = [lambda c=c: triton_ssd.ssd_commit_triton(
        c["state"], *c["rings"], c["qsl"], c["slots"], acc, plan=plan) for c in sets]
    used = plan or triton_ssd.plan_ssd(bs, h, ns, p, device_sm_count(torch.device(device)),
                                       num_tokens=sum(lens))
    return dict(kernel="ssd", bs=bs, lengths=_label(mix, s),
                num_tokens=sum(lens), copies=len(sets), max_abs_err=err,
                plan=dataclasses.asdict(used), **_rates(floor, time_calls(fns, s, device), s),
                commit=_rates(2 * floor, time_calls(commit, s, device), s))


_PLAN_FIELDS = {"p": "block_p", "w": "num_warps", "n": "block_n", "from": "block_from",
                "bp": "block_form_p", "bw": "block_form_warps", "wp": "block_walk_p",
                "r": "block_form_registers"}
_GDN_FIELDS = {"v": "block_form_v", "w": "block_form_warps", "r": "block_form_registers",
               "wv": "walk_v", "p": "block_wait_polls", "wr": "block_weights_registers",
               "ww": "block_weights_warps", "kc": "block_stream_kc",
               "st": "block_form_stages"}


def _changes(spec: str, option: str, fields: dict, flags: dict) -> dict:
    """The field changes a ``block[:name<number>][:flag]`` spec names (a ValueError naming the
    spec and the grammar otherwise)."""
    name, *changes = spec.split(":")
    grammar = f"block[:{']['.join(k + '..' for k in fields)}][:{']['.join(flags)}]"
    if name != "block":
        raise ValueError(f"{option}: {spec!r} is not rows, default or {grammar}")
    out = {}
    for change in changes:
        if change in flags:
            out.update(flags[change])
            continue
        key = change.rstrip("0123456789")
        if key not in fields or key == change:
            raise ValueError(f"{option}: {change!r} in {spec!r}: a change is one of "
                             f"{sorted(flags)} or one of {sorted(fields)} followed by a number")
        out[fields[key]] = int(change[len(key):])
    return out


def ssd_plan(spec: str, bs: int, s: dict, device: str):
    """A named SSD plan: ``rows`` (every request walks its rows), ``default`` (``plan_ssd``'s), or
    ``block`` (``plan_ssd(..., block_form=True)``) with changes, e.g.
    ``block:p64:w2:n32:from3:bp64:bw2:wp16:r128:one`` (the row walk's channel block and warps,
    state rows a block-form step, the shortest request in block form, the block form's own
    channel block and warps, its launch walking the other requests 16 channels at a time, its
    register cap, both forms in one launch)."""
    if spec == "default":
        return None  # the op's own plan (it sees the launch's rows)
    p = s["ssd_head_dim"]
    base = triton_ssd.plan_ssd(bs, s["ssd_heads"], s["ssd_state"], p,
                               device_sm_count(torch.device(device)), block_form=spec != "rows")
    if spec == "rows":
        return base
    fields = _changes(spec, "--ssd-plans", _PLAN_FIELDS, {"one": {"block_launch": False}})
    if "block_p" in fields:
        fields["num_pb"] = -(-p // fields["block_p"])
    return dataclasses.replace(base, **fields)


def gdn_plan(spec: str, bs: int, s: dict, device: str):
    """A named GDN plan: ``rows``, ``default`` (``plan_gdn``'s) or ``block`` with changes, e.g.
    ``block:v128:w2:r0:wv8:p0:last`` (channels a block-form program streams, its warps, its
    register cap (0: none), the long-request walk's channels, a stream program's further reads
    of its flag, the weight programs last in the grid, so that every stream program makes its
    own weights); ``block:wl:wr80:ww4``: the weight programs in a launch of their own, capped at
    80 registers, four warps each; ``block:ieee:kc32``: the stream programs' products as float32
    FMAs (or ``bf16x3``, ``tf32x2``, ``tf32x3``), 32 state rows a step; ``block:ptr``: the state
    through pointer loads instead of a tensor descriptor (``tma``: through one, the default);
    ``block:gram_ieee``: the weight programs' Gram products as float32 FMAs (``gram_native``: as
    one 16-bit product, the default for 16-bit inputs)."""
    if spec == "default":
        return None  # the op's own plan (it sees the launch's rows)
    base = triton_gdn.plan_gdn(bs, s["num_v_heads"], s["k_dim"], s["v_dim"],
                               device_sm_count(torch.device(device)), block_form=spec != "rows")
    if spec == "rows":
        return base
    return dataclasses.replace(base, **_changes(spec, "--gdn-plans", _GDN_FIELDS,
                                                {"last": {"block_weights_first": False,
                                                          "block_wait_polls": 0},
                                                 "wl": {"block_weights_launch": True},
                                                 "tma": {"block_state_tma": True},
                                                 "ptr": {"block_state_tma": False},
                                                 "gram_ieee": {"block_gram": "ieee"},
                                                 "gram_native": {"block_gram": "native"},
                                                 **{how: {"block_stream_dot": how}
                                                    for how in triton_gdn._STREAM_DOTS}}))


# ---------------------------------------------------------------------- GDN
def gdn_case(bs: int, mix: bool, s: dict, device: str, plan=None) -> dict:
    lens = lengths(bs, mix, s)
    hv, kd, vd = s["num_v_heads"], s["k_dim"], s["v_dim"]
    floor = bs * hv * kd * vd * 4
    sets = [gdn_inputs(lens, s, device, seed=bs + i) for i in range(_copies(floor, s))]
    err = check_gdn(sets[0], lens, s, plan)
    fns = [lambda c=c: triton_gdn.gated_delta_rule_triton(*_gdn_args(c, s), plan=plan)
           for c in sets]
    acc = torch.tensor(lens, dtype=torch.int32, device=device)
    commit = [lambda c=c: triton_gdn.gated_delta_rule_commit_triton(
        c["state"], *c["rings"], c["qsl"], c["slots"], acc, plan=plan) for c in sets]
    used = plan or triton_gdn.plan_gdn(bs, hv, kd, vd, device_sm_count(torch.device(device)),
                                       num_tokens=sum(lens))
    return dict(kernel="gdn", bs=bs, lengths=_label(mix, s),
                num_tokens=sum(lens), copies=len(sets), max_abs_err=err,
                plan=dataclasses.asdict(used), **_rates(floor, time_calls(fns, s, device), s),
                commit=_rates(2 * floor, time_calls(commit, s, device), s))


def sweep(s: dict, device: str, kernels: tuple[str, ...], emit) -> None:
    """Every channel block and warp count of the kernels at each batch size, all 8 rows."""
    ns, kd = s["ssd_state"], s["k_dim"]
    n_pad, k_pad = 1 << (ns - 1).bit_length(), 1 << (kd - 1).bit_length()
    for bs in s["batch_sizes"]:
        for block_v in s["sweep_blocks"] if "gdn" in kernels else ():
            for warps in s["sweep_warps"]:
                plan = triton_gdn.GdnPlan(k_pad, block_v, -(-s["v_dim"] // block_v),
                                          warps)
                r = gdn_case(bs, False, s, device, plan)
                emit(dict(kernel="gdn", bs=bs, block_v=block_v, num_warps=warps,
                          best_us=r["best_us"], floor_pct=r["floor_pct"],
                          commit_us=r["commit"]["best_us"]))
        for block_p in s["sweep_blocks"] if "ssd" in kernels else ():
            for warps in s["sweep_warps"]:
                plan = triton_ssd.SsdPlan(n_pad, block_p, -(-s["ssd_head_dim"] // block_p),
                                          warps)
                r = ssd_case(bs, False, s, device, plan)
                emit(dict(kernel="ssd", bs=bs, block_p=block_p, num_warps=warps,
                          best_us=r["best_us"], floor_pct=r["floor_pct"],
                          commit_us=r["commit"]["best_us"]))


def _row(r: dict) -> str:
    c = r["commit"]
    return (f"{r['kernel']:>6} {r['bs']:>4} {r['lengths']:>9} {r['eager_us']:>9.1f} "
            f"{r['graph_us'] or 0:>9.1f} {r['floor_us']:>8.2f} {r['floor_pct']:>6} "
            f"{c['best_us']:>9.1f} {c['floor_pct']:>7}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="also sweep channel blocks and warps")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run under the interpreter")
    ap.add_argument("--bs", type=int, nargs="+", help="batch sizes (default: 1 8 64 128)")
    ap.add_argument("--kernels", nargs="+", choices=("ssd", "gdn"), default=("ssd", "gdn"))
    ap.add_argument("--sweep-warps", type=int, nargs="+", help="warp counts of the sweep")
    ap.add_argument("--mean-len", type=int,
                    help="mean rows a request of the mixed lengths (default 3; at 6 or more "
                         "plan_ssd and plan_gdn take the block form, shorter requests walking)")
    ap.add_argument("--ssd-plans", nargs="+", metavar="SPEC",
                    help="time the SSD forward under each named plan side by side (rows, "
                         "default, block:p64:w2:n32:from3; see ssd_plan) instead of the default")
    ap.add_argument("--gdn-plans", nargs="+", metavar="SPEC",
                    help="the same for the GDN forward (rows, default, block:v64:w1; "
                         "see gdn_plan)")
    opts = ap.parse_args()
    s, device = (SMOKE, "cpu") if opts.smoke else (SETTINGS, "cuda")
    s = dict(s, **({"batch_sizes": opts.bs} if opts.bs else {}),
             **({"sweep_warps": opts.sweep_warps} if opts.sweep_warps else {}),
             **({"mean_len": opts.mean_len} if opts.mean_len else {}))
    if not 1 <= s["mean_len"] <= s["block"]:
        raise SystemExit(f"--mean-len {s['mean_len']}: must be in 1..{s['block']} (the verify "
                         "width)")
    import transformers
    import triton
    report = dict(gpu=torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
                  torch=torch.__version__, triton=triton.__version__,
                  transformers=transformers.__version__, settings=s,
                  command=" ".join(sys.argv), results=[], partial=True)
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every row: a run stopped by its time limit keeps what it did
        (out_dir / "ssd_kernels.json").write_text(json.dumps(report, indent=1))

    print(f"{'kernel':>6} {'bs':>4} {'lens':>9} {'eager us':>9} {'graph us':>9} "
          f"{'floor us':>8} {'floor%':>6} {'commit us':>9} {'commit%':>7}", flush=True)
    cases = {"ssd": ssd_case, "gdn": gdn_case}
    for bs in s["batch_sizes"]:
        for mix in (True, False):
            for name in opts.kernels:
                specs = {"ssd": opts.ssd_plans, "gdn": opts.gdn_plans}[name]
                for spec in specs or [None]:
                    plan = spec and {"ssd": ssd_plan, "gdn": gdn_plan}[name](spec, bs, s,
                                                                             device)
                    report["results"].append(dict(cases[name](bs, mix, s, device, plan),
                                                  **({"form": spec} if spec else {})))
                    print(_row(report["results"][-1]), spec or "", flush=True)
                    save()
    if opts.sweep:
        report["sweep"] = []

        def emit(row: dict) -> None:
            report["sweep"].append(row)
            print(row, flush=True)
            save()

        sweep(s, device, tuple(opts.kernels), emit)
    del report["partial"]
    save()


if __name__ == "__main__":
    main()
