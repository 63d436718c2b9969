"""Benchmark: rotary embedding on flat positions, Inductor vs the Triton kernel (issue 6).

What a verify step runs per attention layer: rotate packed ``q [N, H, D]`` and ``k [N, Hkv, D]``
by their positions. Two cases at N = 3 / 24 / 192 / 768 packed tokens, bf16:

- text: the 1.1B Llama-like shapes (16 q heads, 8 KV heads, D 128, rope_theta 10000);
- mRoPE: Qwen2-VL-like (28 q heads, 4 KV heads, D 128, rope_theta 1e6, chunked sections
  16 / 24 / 24, positions ``[3, N]``).

(a) Inductor: ``torch.compile(fn, dynamic=False)`` of HF's math, from positions to rotated q
and k: ``LlamaRotaryEmbedding.forward`` (``float(pos) * inv_freq``, ``cat(freqs, freqs)``, cos
and sin times ``attention_scaling``, cast to bf16; Qwen2-VL's ``recomposition_frequencies`` for
mRoPE) then ``apply_rotary_pos_emb`` (``q * cos + rotate_half(q) * sin``). (b)
``rotary_triton``: the same in one launch for q and k. Each case is checked first: Triton vs
Inductor within bf16 tolerance, and the share of elements bitwise equal to HF's eager math.
Then both are timed with ``common.time_calls`` (back-to-back launches between two events, and
CUDA-graph replays), cycling over ``copies`` input sets so the reads come from HBM rather than
L2 at the larger N. Bytes = q and k read and written, positions and inv_freq read; the floor
is bytes / 4.8 TB/s.

Usage: ``python benchmarks/rotary.py [--smoke] [--sweep] [--out DIR]``. Writes ``rotary.json`` to
``--out``, else ``$OUT``, else ``benchmarks/results/``. ``--smoke`` runs tiny shapes on the CPU
under ``TRITON_INTERPRET=1`` with dynamo's eager backend (checks the script, times nothing
real) and writes ``rotary_smoke.json`` only where ``--out`` or ``$OUT`` says. ``--sweep``
also times the Triton kernel alone at the tiles of ``sweep_plans`` (one JIT compile each).
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
from dspark_compile.kernels import rotary as triton_rotary  # noqa: E402
from dspark_compile.kernels.device import device_sm_count  # noqa: E402

CASES = {
    "text": dict(num_heads=16, num_kv_heads=8, head_dim=128, rope_theta=10000.0,
                 mrope_section=None),
    "mrope": dict(num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1e6,
                  mrope_section=[16, 24, 24]),
}
SETTINGS = dict(cases=CASES, num_tokens=[3, 24, 192, 768], dtype="bfloat16",
                position_dtype="int64", max_position=4096, attention_scaling=1.0, copies=8,
                compile_backend="inductor", hbm_bytes_per_s=4.8e12, eager_iters=200,
                graph_calls=32, graph_replays=20, seed=0,
                sweep_plans=[[1, 4, 1], [1, 8, 2], [1, 16, 4], [2, 16, 8], [4, 8, 4], [1, 32, 8]])
SMOKE = dict(SETTINGS, num_tokens=[1, 3], copies=1, compile_backend="eager", eager_iters=1,
             graph_calls=1, graph_replays=1, sweep_plans=[[1, 2, 1]],
             cases={"text": dict(CASES["text"], num_heads=2, num_kv_heads=1, head_dim=32),
                    "mrope": dict(CASES["mrope"], num_heads=2, num_kv_heads=1, head_dim=32,
                                  mrope_section=[4, 6, 6])})


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF's ``rotate_half``."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def hf_rotary(q, k, positions, inv_freq, mrope_section, attention_scaling: float):
    """HF's rotary module then ``apply_rotary_pos_emb`` on packed ``[N, heads, D]`` rows.

    ``positions [N]`` (Llama) or ``[3, N]`` with chunked ``mrope_section`` (Qwen2-VL).
    """
    freqs = positions[..., None].float() * inv_freq.float()  # [(3,) N, D/2]
    cos = freqs.cos() * attention_scaling
    sin = freqs.sin() * attention_scaling
    if mrope_section is not None:  # Qwen2-VL's recomposition_frequencies
        cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(mrope_section, -1))], -1)
        sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(mrope_section, -1))], -1)
    cos = torch.cat((cos, cos), -1).to(q.dtype)[:, None, :]  # [N, 1, D]
    sin = torch.cat((sin, sin), -1).to(q.dtype)[:, None, :]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def make_inputs(case: dict, n: int, s: dict, device: str, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    dtype, d = getattr(torch, s["dtype"]), case["head_dim"]
    rows = () if case["mrope_section"] is None else (3,)
    pos = torch.randint(0, s["max_position"], (*rows, n), generator=g)
    return dict(q=torch.randn(n, case["num_heads"], d, generator=g).to(dtype).to(device),
                k=torch.randn(n, case["num_kv_heads"], d, generator=g).to(dtype).to(device),
                positions=pos.to(getattr(torch, s["position_dtype"])).to(device))


def check(c: dict, inductor, triton_fn, case: dict, s: dict) -> dict:
    """Triton vs Inductor within bf16 tolerance; shares bitwise equal to each and HF eager."""
    got = triton_fn(c)
    comp = inductor(c)
    sec = case["mrope_section"]
    eager = hf_rotary(c["q"], c["k"], c["positions"], c["inv_freq"], sec,
                      s["attention_scaling"])
    for g, w in zip(got, comp):
        torch.testing.assert_close(g.float(), w.float(), rtol=2 ** -6, atol=2 ** -6)

    def equal_share(a, b):
        return sum(int((x == y).sum()) for x, y in zip(a, b)) / sum(x.numel() for x in a)

    return dict(max_abs_diff_vs_inductor=max((g.float() - w.float()).abs().max().item()
                                             for g, w in zip(got, comp)),
                bitwise_share_vs_inductor=equal_share(got, comp),
                bitwise_share_vs_hf_eager=equal_share(got, eager))


def _timed(fns: list, nbytes: int, s: dict, device: str) -> dict:
    t = time_calls(fns, s, device)
    best = min(v for v in (t["eager_us"], t["graph_us"]) if v is not None)
    return dict(**t, best_us=best, hbm_pct=round(100 * nbytes / (best * 1e-6) /
                                                 s["hbm_bytes_per_s"], 1))


def case_setup(name: str, n: int, s: dict, device: str) -> tuple:
    """``(case, input sets, bytes moved per call, compiled HF fn, Triton fn)`` of one case."""
    case = s["cases"][name]
    d = case["head_dim"]
    sec = None if case["mrope_section"] is None else tuple(case["mrope_section"])
    inv_freq = (1.0 / case["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float) / d)
                ).to(device)  # HF's default rope init
    sets = [dict(make_inputs(case, n, s, device, s["seed"] + i), inv_freq=inv_freq)
            for i in range(s["copies"])]
    scaling = s["attention_scaling"]

    def hf_fn(q, k, positions, inv_freq):  # sections and scaling are constants, as in HF
        return hf_rotary(q, k, positions, inv_freq, sec, scaling)

    compiled = torch.compile(hf_fn, dynamic=False, backend=s["compile_backend"])

    def inductor(c, plan=None):
        return compiled(c["q"], c["k"], c["positions"], c["inv_freq"])

    def triton_fn(c, plan=None):
        return triton_rotary.rotary_triton(c["q"], c["k"], c["positions"], c["inv_freq"], sec,
                                           attention_scaling=scaling, plan=plan)

    elem = sets[0]["q"].element_size()
    pos_bytes = sets[0]["positions"].numel() * sets[0]["positions"].element_size()
    nbytes = 2 * n * (case["num_heads"] + case["num_kv_heads"]) * d * elem + pos_bytes + d * 2
    return case, sets, nbytes, inductor, triton_fn


def run_case(name: str, n: int, s: dict, device: str) -> dict:
    case, sets, nbytes, inductor, triton_fn = case_setup(name, n, s, device)
    checked = check(sets[0], inductor, triton_fn, case, s)
    t_ind = _timed([lambda c=c: inductor(c) for c in sets], nbytes, s, device)
    t_tri = _timed([lambda c=c: triton_fn(c) for c in sets], nbytes, s, device)
    plan = triton_rotary.plan_rotary(n, case["num_heads"], case["num_kv_heads"],
                                     case["head_dim"], device_sm_count(torch.device(device)))

    def ratio(key):
        a, b = t_ind[key], t_tri[key]
        return None if a is None or b is None else round(a / b, 3)

    return dict(case=name, num_tokens=n, bytes=nbytes,
                floor_us=nbytes / s["hbm_bytes_per_s"] * 1e6, inductor=t_ind, triton=t_tri,
                inductor_over_triton_graph=ratio("graph_us"),
                inductor_over_triton_eager=ratio("eager_us"),
                plan=dataclasses.asdict(plan), **checked)


def sweep(s: dict, device: str) -> list[dict]:
    """Triton alone at other tiles (``sweep_plans``: tokens, heads, warps per program)."""
    rows = []
    for name in s["cases"]:
        for n in s["num_tokens"]:
            _, sets, nbytes, _, triton_fn = case_setup(name, n, s, device)
            for bn, bh, warps in s["sweep_plans"]:
                plan = triton_rotary.RotaryPlan(bn, bh, warps)
                t = _timed([lambda c=c: triton_fn(c, plan) for c in sets], nbytes, s, device)
                rows.append(dict(case=name, num_tokens=n, block_n=bn, block_h=bh,
                                 num_warps=warps, graph_us=t["graph_us"], best_us=t["best_us"]))
    return rows


def _summary(results: list[dict]) -> dict:
    ratios = [r["inductor_over_triton_graph"] for r in results
              if r["inductor_over_triton_graph"] is not None]
    if not ratios:
        return {}
    geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
    return dict(geomean_inductor_over_triton_graph=round(geo, 3),
                faster=("triton" if geo > 1 else "inductor"), min_ratio=min(ratios),
                max_ratio=max(ratios))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run under the interpreter")
    ap.add_argument("--out", help="directory of the JSON (default: $OUT, else results/)")
    ap.add_argument("--sweep", action="store_true", help="also time Triton at other tiles")
    opts = ap.parse_args(argv)
    s, device = (SMOKE, "cpu") if opts.smoke else (SETTINGS, "cuda")
    import triton
    # one code object compiled at 8 shapes: past dynamo's default recompile limit of 8
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 64
    else:
        torch._dynamo.config.cache_size_limit = 64
    report = dict(gpu=torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
                  torch=torch.__version__, triton=triton.__version__, settings=s,
                  command=" ".join(["python", "benchmarks/rotary.py",
                                    *(sys.argv[1:] if argv is None else argv)]),
                  results=[])
    for name in s["cases"]:
        for n in s["num_tokens"]:
            report["results"].append(run_case(name, n, s, device))
    report["summary"] = _summary(report["results"])
    if opts.sweep:
        report["sweep"] = sweep(s, device)
    out_dir = opts.out or os.environ.get("OUT") or (
        None if opts.smoke else Path(__file__).resolve().parent / "results")
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        path = Path(out_dir) / ("rotary_smoke.json" if opts.smoke else "rotary.json")
        path.write_text(json.dumps(report, indent=1))
        print(f"wrote {path}")
    _print(report)
    return report


def _print(report: dict) -> None:
    print(f"{'case':>6} {'N':>4} {'ind eager':>9} {'ind graph':>9} {'tri eager':>9} "
          f"{'tri graph':>9} {'ratio':>6} {'floor us':>8} {'tri HBM%':>8} {'=HF':>6}")
    for r in report["results"]:
        ind, tri = r["inductor"], r["triton"]
        print(f"{r['case']:>6} {r['num_tokens']:>4} {ind['eager_us']:>9.1f} "
              f"{ind['graph_us'] or 0:>9.1f} {tri['eager_us']:>9.1f} {tri['graph_us'] or 0:>9.1f}"
              f" {r['inductor_over_triton_graph'] or 0:>6.2f} {r['floor_us']:>8.2f} "
              f"{tri['hbm_pct']:>8} {r['bitwise_share_vs_hf_eager']:>6.4f}")
    print(report["summary"])
    for row in report.get("sweep", []):
        print(row)


if __name__ == "__main__":
    main()
