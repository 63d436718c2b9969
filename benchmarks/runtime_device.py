"""Benchmark: the DSpark runtime's device path per planning step, against a bs-256 verify step.

Times, at R = 1, 8, 64, 256 requests and gamma 7, the calls an engine makes on the device each
step, exactly as it makes them (device tensors in, device tensors out, no host sync):

- ``planner``: ``plan_verify_device(conf [R, 7], sps, PlannerConfig(tiers=...), tiers=...)``
  -> ``(lens [R], K)``, with the SPS tensor and the tier tensor built once beforehand (as for
  graph capture) over the tier set of a 256-request, block-8 engine (``tier_set(256, 8)``);
  same SPS table and confidence as ``benchmarks/planner_host.py``, so the two compare.
- ``feature_predict``: ``feature_predict_triton`` over draft logits ``[R, 7, V]`` (bf16,
  V = 32000, spiked so that q_max follows the same confidence) -> ``(x, p)``.
- ``observe``: ``observe_triton(x, accepted, verified)``: IRLS statistics and the guarded refit.
- ``step``: the three in a row (feature_predict -> planner on ``p`` -> observe): the whole
  device path of a drafter without a confidence head; ``planner`` alone is that of one with.

Each is timed with ``benchmarks/common.py``'s ``time_calls``: back-to-back eager launches (host
launch cost included: a host-bound loop measures the host) and CUDA-graph replays (the device
time, how a captured engine pays it). Before timing, the device plan is checked bit for bit
against the host ``plan_verify`` and the estimator's ``p`` against the torch path.

The share is of one bs-256 verify step: ``--verify-ms`` if given, else ``ours_graph_mix3_ms`` at
bs 256 from ``benchmarks/results/verify_step.json``; the JSON says which. Target (issue 7): the
device path <= 2% of it.

Usage: ``python benchmarks/runtime_device.py [--verify-ms MS] [--smoke]``. Writes
``runtime_device.json`` (``runtime_device_smoke.json`` with ``--smoke``) to ``$OUT`` if set, else
to ``benchmarks/results/``. ``--smoke`` runs R = 1, 8 with a tiny vocabulary on the CPU under
``TRITON_INTERPRET=1`` (checks the script, times nothing real).
"""

from __future__ import annotations

import argparse
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

from planner_host import GAMMA, H200_STEP_MS, _confidence, _table  # noqa: E402
from dspark_compile.session.tiers import tier_set  # noqa: E402
from dspark_compile.runtime import (AcceptanceEstimator, EstimatorConfig,  # noqa: E402
                                    PlannerConfig, draft_logit_qmax, plan_verify)
from dspark_compile.runtime.estimator_triton import (feature_predict_triton,  # noqa: E402
                                                     observe_triton)
from dspark_compile.runtime.planner_device import (device_tiers, plan_verify_device,  # noqa: E402
                                                   sps_tensor)

RESULTS = Path(__file__).parent / "results"
SETTINGS = dict(gamma=GAMMA, requests=[1, 8, 64, 256], max_requests=256, block=GAMMA + 1,
                vocab=32000, logits_dtype="bfloat16", copies=4, seed=0, eager_iters=400,
                graph_calls=32, graph_replays=20, target_share_pct=2.0)
SMOKE = dict(SETTINGS, requests=[1, 8], max_requests=8, vocab=64, logits_dtype="float32",
             copies=2, eager_iters=2, graph_calls=1, graph_replays=1)
CALLS = ("planner", "feature_predict", "observe", "step")


def verify_step_ms(arg: float | None) -> tuple[float | None, str]:
    """The bs-256 verify step in ms and where it came from."""
    if arg is not None:
        return arg, "--verify-ms"
    path = RESULTS / "verify_step_quick_bs64_256.json"
    if not path.exists():
        return None, f"none: {path} is missing and --verify-ms was not given"
    data = json.loads(path.read_text())
    env = data.get("environment", {})
    return (float(data["results"]["256"]["ours_graph_mix3_ms"]),
            f"benchmarks/results/verify_step_quick_bs64_256.json results['256']['ours_graph_mix3_ms'] "
            f"({env.get('gpu')}, torch {env.get('torch')}, triton {env.get('triton')})")


def spiked_logits(conf: torch.Tensor, s: dict, gen: torch.Generator) -> torch.Tensor:
    """Draft logits [R, gamma, V]: N(0, 1) plus a spike at token 0 whose q_max ~ ``conf``
    (sum of exp over V normals ~ V e^0.5, so logit(q_max) ~ spike - log V - 0.5)."""
    r, g = conf.shape
    logits = torch.randn(r, g, s["vocab"], generator=gen, device=conf.device)
    c = conf.clamp(1e-3, 1 - 1e-3)
    logits[:, :, 0] += torch.log(c / (1 - c)) + math.log(s["vocab"]) + 0.5
    return logits.to(getattr(torch, s["logits_dtype"]))


def outcomes(conf: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """accepted [R] int32 (leading drafts with u < c) and verified [R] int32 (all gamma)."""
    u = torch.rand(conf.shape, generator=gen, device=conf.device)
    accepted = torch.cumprod((u < conf).to(torch.int32), 1).sum(1).to(torch.int32)
    return accepted, torch.full_like(accepted, conf.shape[1])


def build(r: int, s: dict, device: str) -> dict:
    """Inputs and callables of one request count; the plan is checked against the host's."""
    gen = torch.Generator(device=device).manual_seed(s["seed"] + r)
    cpu_gen = torch.Generator().manual_seed(s["seed"] + r)
    table = _table()
    tiers = tier_set(s["max_requests"], s["block"])
    config = PlannerConfig(tiers=tuple((t.tokens, t.request_slots) for t in tiers))
    sps = sps_tensor(table, r, s["gamma"], device)  # once, before capture
    dev_tiers = device_tiers(config, r, device)
    confs = [_confidence(r, cpu_gen).to(device) for _ in range(s["copies"])]  # [R, gamma] each
    plan_k = []
    for conf in confs:
        lens, k = plan_verify_device(conf, sps, config, tiers=dev_tiers)
        host = plan_verify(conf, table, config)
        if lens.tolist() != host.lens.tolist() or int(k) != host.num_draft_tokens:
            raise AssertionError(f"R={r}: device plan (K={int(k)}) differs from the host's "
                                 f"(K={host.num_draft_tokens})")
        plan_k.append(int(k))
    est = AcceptanceEstimator(EstimatorConfig(gamma=s["gamma"]), device=device)
    logits = [spiked_logits(c, s, gen) for c in confs]  # [R, gamma, V] each
    temp = torch.zeros(r, device=device)  # greedy rows (scored at T = 1)
    x0, p0 = feature_predict_triton(est, logits[0], temp)
    want = est.predict(draft_logit_qmax(logits[0], temp))
    p_err = float((p0 - want).abs().max())
    if not p_err < 1e-4:
        raise AssertionError(f"R={r}: feature_predict_triton p differs from the torch path by "
                             f"{p_err}")
    accepted, verified = outcomes(confs[0], gen)

    def step(lg):
        x, p = feature_predict_triton(est, lg, temp)
        plan_verify_device(p, sps, config, tiers=dev_tiers)
        observe_triton(est, x, accepted, verified)

    fns = {
        "planner": [lambda c=c: plan_verify_device(c, sps, config, tiers=dev_tiers)
                    for c in confs],
        "feature_predict": [lambda lg=lg: feature_predict_triton(est, lg, temp) for lg in logits],
        "observe": [lambda: observe_triton(est, x0, accepted, verified)],
        "step": [lambda lg=lg: step(lg) for lg in logits],
    }
    return dict(fns=fns, check=dict(device_plan_equals_host=True, plan_k=plan_k,
                                    mean_accepted=float(accepted.float().mean()),
                                    p_max_abs_err_vs_torch=p_err))


def share(us: float | None, verify_ms: float | None) -> float | None:
    return None if us is None or verify_ms is None else round(100 * us / (1e3 * verify_ms), 3)


def run_case(r: int, s: dict, device: str, verify_ms: float | None) -> dict:
    case = build(r, s, device)
    row = dict(requests=r, check=case["check"])
    for name in CALLS:
        t = time_calls(case["fns"][name], s, device)
        row[name] = dict(eager_us=round(t["eager_us"], 2),
                         graph_us=None if t["graph_us"] is None else round(t["graph_us"], 2),
                         eager_share_pct=share(t["eager_us"], verify_ms),
                         graph_share_pct=share(t["graph_us"], verify_ms))
    return row


def environment(device: str, smoke: bool) -> dict:
    import triton

    gpu = torch.cuda.get_device_name() if device == "cuda" else \
        f"cpu ({platform.processor() or platform.machine()}), TRITON_INTERPRET=1"
    return dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda, hip=getattr(torch.version, "hip", None),
                python=platform.python_version(), smoke=smoke)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verify-ms", type=float, default=None,
                    help="bs-256 verify step in ms (default: from verify_step.json)")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run under the interpreter")
    opts = ap.parse_args(argv)
    s, device = (SMOKE, "cpu") if opts.smoke else (SETTINGS, "cuda")
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("runtime_device.py needs a GPU; use --smoke on the CPU")
    verify_ms, source = verify_step_ms(opts.verify_ms)
    # CPU times under the interpreter say nothing about a GPU step: no shares in smoke runs.
    rows = [run_case(r, s, device, None if opts.smoke else verify_ms) for r in s["requests"]]
    top = rows[-1]
    report = dict(
        benchmark="runtime_device", environment=environment(device, opts.smoke), settings=s,
        command=" ".join(["python", *sys.argv]),
        planner="plan_verify_device, PlannerConfig(tiers=tier_set(max_requests, block)), SPS "
                "table and confidence of planner_host.py (H200 step ms by tokens: "
                f"{H200_STEP_MS})",
        verify_step_ms_bs256=verify_ms, verify_step_source=source,
        target=dict(share_pct_max=s["target_share_pct"], at_requests=top["requests"],
                    step_graph_share_pct=top["step"]["graph_share_pct"],
                    planner_graph_share_pct=top["planner"]["graph_share_pct"],
                    met=None if top["step"]["graph_share_pct"] is None else
                    top["step"]["graph_share_pct"] <= s["target_share_pct"]),
        results=rows)
    out_dir = Path(os.environ.get("OUT") or RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = "runtime_device_smoke.json" if opts.smoke else "runtime_device.json"
    (out_dir / name).write_text(json.dumps(report, indent=1) + "\n")
    print(f"bs-256 verify step: {verify_ms} ms ({source})")
    print(f"{'R':>4} {'call':>16} {'eager us':>9} {'graph us':>9} {'graph %':>8}")
    for row in rows:
        for c in CALLS:
            t = row[c]
            print(f"{row['requests']:>4} {c:>16} {t['eager_us']:>9.1f} {t['graph_us']!s:>9} "
                  f"{t['graph_share_pct']!s:>8}")
    print(f"wrote {out_dir / name}")
    return report


if __name__ == "__main__":
    main()
