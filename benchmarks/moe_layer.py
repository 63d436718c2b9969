"""Benchmark: one mixture-of-experts layer's verify against its floor and HF's experts paths.

The layer is Qwen3-30B-A3B's experts (128 experts, top 8, hidden 2048, expert intermediate 768,
SwiGLU), bf16, random weights; ``bs`` requests of a fixed-seed ragged length mix with mean
exactly 3 (``common.mix_lens``, lengths 1..8), so ``N = 3 * bs`` token rows and ``8 N``
(token, expert) pairs. Routing is each token's top 8 of a random router over random rows, the
same for every path. Timed paths, each checked first against a float32 reference on the bf16
values (``reference``: expert by expert, held to ``ops/experts_reference.py`` by a CPU test):

- ``ours_triton``: ``dspark::experts_route / experts_up / experts_down`` lowered to Triton
  (``kernels/experts.py``; the target entry's ``experts_kernel="triton"``);
- ``ours_grouped_mm``: the same ops with their GEMMs on ``torch._grouped_mm``
  (``experts_kernel="grouped_mm"``): the vendor option of the target table;
- ``hf_grouped_mm``: transformers' ``grouped_mm`` experts forward on the same module;
- ``hf_eager``: transformers' own loop over the hit experts (a host sync: eager only).

Each is timed as back-to-back launches between CUDA events and, where it captures, as CUDA-graph
replays (``common.time_calls``), after ``rest_s`` of an idle GPU: a long run of any path reaches
the board's power cap and lowers the SM clock (``--sustained`` shows it), and without the rest
a path would inherit that from the one before it (HF's eager loop runs for seconds). The floor of a layer is the larger of the active experts'
weight bytes at 4.8 TB/s and the GEMM flops (``2 * pairs * 3 * D * I``) at 790 TFLOP/s; a
path's ``floor_share`` is floor / its best time (1.0: at the floor). ``experts_kernel_pick``
names the faster of our two GEMM choices per ``bs``: what ``TargetConfig.experts_kernel``
should hold on this GPU.

Usage: ``python benchmarks/moe_layer.py [--smoke] [--out DIR] [--batch-sizes 1 8 64 256]
[--target experts_block_n=128 ...] [--rest S] [--smi] [--tiles | --profile | --sustained | --gap]``.

- ``--rest S``: seconds of an idle GPU before each path is timed (default 1);
- ``--smi``: ``nvidia-smi`` samples the clocks and power through the run, as under
  ``--sustained`` (the samples go into the JSON);

- ``--tiles`` times each projection's GEMM alone under a list of tiles;
- ``--profile`` records each kernel's GPU time per call and the gaps between kernels, eager and
  in graph replays (torch.profiler);
- ``--sustained`` times each graph replay of a long run alone, with the SM clock, power and
  throttle reasons ``nvidia-smi`` reports meanwhile;
- ``--gap`` times the layer as the default mode does, with each replay between its own
  events, and after the caching allocator's history changed, in interleaved rounds.

Writes ``moe_layer.json`` (``moe_layer_smoke.json``; ``moe_layer_<mode>.json``; a ``--target``
override adds a suffix) to ``--out``, else ``$OUT``, else ``benchmarks/results/``. ``--smoke``
runs tiny float32 shapes on the CPU under ``TRITON_INTERPRET=1`` (checks the script; the times
mean nothing, and ``ours_grouped_mm`` falls back to Triton there: the vendor GEMM is taken on
CUDA devices only).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time

if "--smoke" in sys.argv:  # read when @triton.jit decorates: before any kernel import
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from common import (BF16_FLOPS, BLOCK, HBM_BYTES_PER_S, mix_lens, out_dir,  # noqa: E402
                    replay_us, target_overrides, time_calls, versions, write_json)

from dspark_compile.ops import experts_reference as ref  # noqa: E402

SETTINGS = dict(name="full", experts=128, top_k=8, hidden=2048, intermediate=768,
                batch_sizes=[1, 8, 64, 256], mean_len=3, block=BLOCK, dtype="bfloat16",
                seed=0, eager_iters=100, graph_calls=20, graph_replays=10, atol=5e-2,
                rest_s=1.0)
SMOKE = dict(SETTINGS, name="smoke", experts=8, top_k=2, hidden=64, intermediate=32,
             batch_sizes=[3], dtype="float32", eager_iters=1, graph_calls=1,
             graph_replays=1, atol=1e-4, rest_s=0.0)
PATHS = ("ours_triton", "ours_grouped_mm", "hf_grouped_mm", "hf_eager")


def build(s: dict, device: str):
    """transformers' Qwen3-MoE experts module of the settings' shapes (random weights)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=s["hidden"], moe_intermediate_size=s["intermediate"],
                         num_experts=s["experts"], num_experts_per_tok=s["top_k"])
    torch.manual_seed(s["seed"])
    with torch.device(device):
        experts = Qwen3MoeExperts(cfg)
        for p in experts.parameters():
            torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
    return experts.to(getattr(torch, s["dtype"])).requires_grad_(False).eval()


def routing(n: int, s: dict, device: str):
    """``(x [N, D], ids [N, K], weights [N, K], query_start_loc)``: rows, their top-k of a
    random router (softmax, renormalised over the top k, as Qwen3-MoE does)."""
    g = torch.Generator().manual_seed(s["seed"] + n)
    dtype = getattr(torch, s["dtype"])
    x = torch.randn(n, s["hidden"], generator=g)
    router = torch.randn(s["experts"], s["hidden"], generator=g) * s["hidden"] ** -0.5
    probs = (x @ router.T).softmax(-1)
    weights, ids = probs.topk(s["top_k"], dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    qsl = torch.tensor([0, n], dtype=torch.int32)
    return (x.to(dtype).to(device), ids.to(device), weights.to(dtype).to(device),
            qsl.to(device))


def floor_us(ids: torch.Tensor, s: dict) -> dict:
    """The layer's floor: active experts' weight bytes at HBM speed, or the GEMM compute."""
    active = int(torch.unique(ids).numel())
    per_expert = 3 * s["hidden"] * s["intermediate"]  # gate, up and down
    elem = torch.finfo(getattr(torch, s["dtype"])).bits // 8
    bytes_us = active * per_expert * elem / HBM_BYTES_PER_S * 1e6
    flops_us = 2 * ids.numel() * per_expert / BF16_FLOPS * 1e6
    return dict(active_experts=active, weight_bytes=active * per_expert * elem,
                floor_us=max(bytes_us, flops_us),
                floor_kind="bytes" if bytes_us >= flops_us else "compute")


@contextlib.contextmanager
def use_kernel(kind: str):
    """Every target entry's ``experts_kernel`` set to ``kind`` (``triton`` | ``grouped_mm``)
    inside; the entries are restored after."""
    from dspark_compile.kernels import device, targets

    saved = dict(targets.TARGETS)
    for name, entry in saved.items():
        targets.TARGETS[name] = dataclasses.replace(entry, experts_kernel=kind)
    device.device_target.cache_clear()
    try:
        yield
    finally:
        targets.TARGETS.update(saved)
        device.device_target.cache_clear()


def path_fn(path: str, experts, x, ids, weights, qsl):
    """A call of ``path`` on the layer's rows (returns ``[N, D]``)."""
    from dspark_compile.kernels import experts as kx
    from transformers.integrations.moe import grouped_mm_experts_forward

    if path.startswith("ours"):
        def ours():
            order, offsets = kx.experts_route_triton(ids, qsl, experts.num_experts)
            h = kx.experts_up_triton(x, order, offsets, experts.gate_up_proj, None, False,
                                     "silu_glu")
            return kx.experts_down_triton(h, order, offsets, weights, experts.down_proj, None,
                                          False)
        return ours
    if path == "hf_grouped_mm":
        return lambda: grouped_mm_experts_forward(experts, x, ids, weights)
    eager = type(experts).forward.__wrapped__  # the class's own loop (use_experts_impl wraps it)
    return lambda: eager(experts, x, ids, weights)


def reference(experts, x, ids, weights, qsl) -> torch.Tensor:
    """The layer's rows in float32, expert by expert over the rows routed to it (HF's eager
    loop, in float32): one expert's weights are converted at a time. ``ops/experts_reference``
    gathers a float32 copy of each pair's weights instead (76.5 GiB reserved at bs 256), and a
    graph captured after that replays 8% slower (``--gap``)."""
    out = torch.zeros(x.shape[0], experts.down_proj.shape[1], dtype=torch.float32,
                      device=x.device)
    real = torch.arange(x.shape[0], device=x.device) < qsl[-1].to(torch.int64)
    for e in torch.unique(ids).tolist():
        token, slot = torch.nonzero((ids == e) & real[:, None], as_tuple=True)
        if not token.numel():
            continue
        gate, up = (x[token].float() @ experts.gate_up_proj[e].float().T).chunk(2, dim=-1)
        h = torch.nn.functional.silu(gate) * up
        y = (h @ experts.down_proj[e].float().T) * weights[token, slot, None].float()
        out.index_add_(0, token, y)
    return out


def gathered_reference(experts, x, ids, weights, qsl) -> torch.Tensor:
    """The same rows through the library's oracle (``ops/experts_reference``): a float32 copy of
    each pair's expert weights, gathered at once (what ``--gap`` runs before a capture)."""
    order, offsets = ref.route(ids, qsl, experts.num_experts)
    h = ref.up(x.float(), order, offsets, experts.gate_up_proj.float(), None, False,
               "silu_glu")
    return ref.down(h, order, offsets, weights.float(), experts.down_proj.float(), None, False)


def time_path(fn, s: dict, device: str, graph: bool = True) -> dict:
    """Eager and graph times of one path; a path that cannot capture gets its eager time and
    why (HF's eager loop is not even tried: it syncs on the host for the experts it hits)."""
    if device == "cuda" and not graph:
        return dict(eager_us=_eager_us(fn, s), graph_us=None,
                    graph_error="not captured: the loop over hit experts syncs on the host")
    try:
        return time_calls([fn], s, device)
    except Exception as err:  # noqa: BLE001 - recorded in the JSON
        if device == "cpu":
            raise
        torch.cuda.synchronize()
        return dict(eager_us=_eager_us(fn, s), graph_us=None,
                    graph_error=f"{type(err).__name__}: {err}"[:300])


def _eager_us(fn, s: dict) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(s["eager_iters"]):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / s["eager_iters"]


def run_bs(bs: int, experts, s: dict, device: str) -> dict:
    lens = mix_lens(bs, s["block"], s["mean_len"], s["seed"])
    x, ids, weights, qsl = routing(sum(lens), s, device)
    row = dict(bs=bs, tokens=sum(lens), pairs=ids.numel(), **floor_us(ids, s))
    want = reference(experts, x, ids, weights, qsl)
    for path in PATHS:
        kernel = path.split("_", 1)[1] if path.startswith("ours") else "triton"
        with use_kernel(kernel):
            fn = path_fn(path, experts, x, ids, weights, qsl)
            err = (fn().float() - want).abs().max().item()
            if device == "cuda":
                torch.cuda.synchronize()
            time.sleep(s["rest_s"])  # each path from a rested GPU: none inherits a power cap
            times = time_path(fn, s, device, graph=path != "hf_eager")
        best = min(t for t in (times["eager_us"], times["graph_us"]) if t is not None)
        row[path] = dict(**times, best_us=best, max_err=err,
                         floor_share=round(row["floor_us"] / best, 3))
    row["experts_kernel_pick"] = min(("triton", "grouped_mm"),
                                     key=lambda k: row[f"ours_{k}"]["best_us"])
    return row


# (BLOCK_M or None for the plan's, BLOCK_N, BLOCK_K, warps, stages) of each projection's sweep
TILES_UP = [(None, 64, 64, 4, 3), (None, 64, 64, 4, 4), (None, 64, 64, 4, 5),
            (None, 64, 128, 4, 3), (None, 64, 64, 8, 3), (None, 128, 64, 8, 3),
            (None, 32, 64, 4, 4), (32, 64, 64, 4, 3), (32, 64, 64, 4, 4), (128, 64, 64, 8, 3),
            (None, 128, 64, 8, 4), (None, 128, 64, 4, 3), (None, 64, 128, 8, 3),
            (None, 128, 128, 8, 3)]
TILES_DOWN = [(None, 64, 64, 4, 3), (None, 64, 64, 4, 4), (None, 64, 64, 4, 5),
              (None, 64, 128, 4, 3), (None, 128, 64, 4, 3), (None, 128, 64, 8, 3),
              (None, 128, 128, 8, 3), (None, 256, 64, 8, 3), (32, 64, 64, 4, 3),
              (32, 128, 64, 4, 3), (128, 128, 64, 8, 3), (None, 128, 64, 4, 4),
              (None, 128, 32, 4, 4), (None, 256, 64, 4, 3), (None, 128, 64, 8, 4),
              (None, 256, 64, 8, 4), (None, 128, 128, 4, 3), (None, 256, 128, 8, 3)]


@contextlib.contextmanager
def block_m(value: int | None):
    """The experts plan's ``BLOCK_M`` forced to ``value`` inside (None: the plan's own)."""
    from dspark_compile.kernels import experts as kx

    plan = kx.plan_experts
    if value is not None:
        kx.plan_experts = lambda pairs, e: dataclasses.replace(
            plan(pairs, e), block_m=value, max_tiles=-(-pairs // value) + min(e + 1, pairs))
    try:
        yield
    finally:
        kx.plan_experts = plan


def tile_sweep(bs: int, experts, s: dict, device: str) -> dict:
    """Each projection's grouped GEMM alone under every tile of ``TILES_UP`` / ``TILES_DOWN``
    (the down projection without its combine), against its own weight bytes at HBM speed."""
    from dspark_compile.kernels import experts as kx
    from dspark_compile.kernels.device import device_target

    lens = mix_lens(bs, s["block"], s["mean_len"], s["seed"])
    x, ids, weights, qsl = routing(sum(lens), s, device)
    floor = floor_us(ids, s)
    e = experts.num_experts
    order, offsets = kx.experts_route_triton(ids, qsl, e)
    cfg, _ = device_target(x.device)
    h = kx.experts_up_triton(x, order, offsets, experts.gate_up_proj, None, False, "silu_glu")
    scale = weights.reshape(-1).contiguous()
    want_down = torch.empty(order.shape[0], s["hidden"], dtype=h.dtype, device=device)
    kx._gemm(h, order, offsets, experts.down_proj, None, scale, want_down, 1, False, "none",
             cfg, cfg.experts_down_block_n, cfg.experts_down_block_n_wide)
    share = dict(up=2 / 3, down=1 / 3)  # of the layer's weight bytes
    rows = []
    for proj, tiles in (("up", TILES_UP), ("down", TILES_DOWN)):
        for bm, bn, bk, warps, stages in tiles:
            c = dataclasses.replace(cfg, experts_block_k=bk, experts_num_warps=warps,
                                    experts_num_stages=stages)
            if proj == "up":
                out, want = torch.empty_like(h), h
                def fn(out=out, c=c):
                    kx._gemm(x, order, offsets, experts.gate_up_proj, None, None, out,
                             order.shape[0] // x.shape[0], False, "silu_glu", c, bn)
            else:
                out, want = torch.empty_like(want_down), want_down
                def fn(out=out, c=c):
                    kx._gemm(h, order, offsets, experts.down_proj, None, scale, out, 1, False,
                             "none", c, bn)
            row = dict(proj=proj, block_m=bm, block_n=bn, block_k=bk, warps=warps,
                       stages=stages)
            try:
                with block_m(bm):
                    fn()
                    err = (out.float() - want.float()).abs().max().item()
                    times = time_calls([fn], s, device)
            except Exception as exc:  # noqa: BLE001 - a tile that does not fit is recorded
                torch.cuda.synchronize()
                rows.append(dict(row, error=f"{type(exc).__name__}: {exc}"[:200]))
                print(rows[-1])
                continue
            best = min(t for t in (times["eager_us"], times["graph_us"]) if t is not None)
            rows.append(dict(row, **times, best_us=best, max_err=err, floor_share=round(
                floor["floor_us"] * share[proj] / best, 3)))
            print(f"bs {bs} {proj:>4} BM {bm or 'plan'} BN {bn} BK {bk} w {warps} st {stages}:"
                  f" {best:8.1f} us  share {rows[-1]['floor_share']:.3f}  err {err:.2e}")
    return dict(bs=bs, tokens=sum(lens), pairs=ids.numel(), **floor,
                plan_block_m=kx.plan_experts(ids.numel(), e).block_m, tiles=rows)


def _kernel_spans(prof) -> list[tuple[str, float, float]]:
    """``(name, start us, end us)`` of every GPU kernel a profile recorded, by start."""
    spans = []
    for evt in prof.events():
        if "cuda" in str(getattr(evt, "device_type", "")).lower() and evt.time_range.end > 0:
            spans.append((evt.name, evt.time_range.start, evt.time_range.end))
    return sorted(spans, key=lambda s: s[1])


def _timeline(spans: list, calls: int) -> dict:
    """Per call: each kernel's GPU time, their sum (busy), first start to last end (span), and
    the time between one kernel's end and the next one's start summed (gaps; an overlap counts
    negative)."""
    kernels: dict = {}
    for name, start, end in spans:
        k = kernels.setdefault(name, dict(us_per_call=0.0, launches_per_call=0.0))
        k["us_per_call"] += (end - start) / calls
        k["launches_per_call"] += 1 / calls
    gaps = sum(b[1] - a[2] for a, b in zip(spans, spans[1:]))
    return dict(kernels=kernels, busy_us_per_call=sum(e - s for _, s, e in spans) / calls,
                span_us_per_call=(spans[-1][2] - spans[0][1]) / calls if spans else None,
                gap_us_per_call=gaps / calls, kernels_seen=len(spans))


def profile_bs(bs: int, experts, s: dict, device: str) -> dict:
    """Our layer's kernels on a GPU timeline (torch.profiler): each kernel's time per call, and
    the gaps between kernels, over back-to-back eager calls and over CUDA-graph replays of the
    same calls (a graph of ``graph_calls`` calls, replayed twice)."""
    from common import graph_of
    from torch.profiler import ProfilerActivity, profile

    lens = mix_lens(bs, s["block"], s["mean_len"], s["seed"])
    x, ids, weights, qsl = routing(sum(lens), s, device)
    fn = path_fn("ours_triton", experts, x, ids, weights, qsl)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    calls = s["graph_calls"]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    eager = _timeline(_kernel_spans(prof), calls)
    graph = graph_of([fn], calls)
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            graph.replay()
        torch.cuda.synchronize()
    replays = _timeline(_kernel_spans(prof), 2 * calls)
    row = dict(bs=bs, tokens=sum(lens), **floor_us(ids, s), eager=eager, graph=replays)
    for kind, t in (("eager", eager), ("graph", replays)):
        print(f"bs {bs} {kind}: busy {t['busy_us_per_call']:.1f} span "
              f"{t['span_us_per_call'] or 0:.1f} gaps {t['gap_us_per_call']:.1f} us/call; " +
              ", ".join(f"{name[:28]} {k['us_per_call']:.1f}"
                        for name, k in t["kernels"].items()))
    return row


SMI_FIELDS = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"


@contextlib.contextmanager
def _smi_sampling(enabled: bool = True):
    """``nvidia-smi`` samples the clocks, power and throttle reasons every 20 ms while the
    block runs; the list it yields holds them (``_smi_rows``) once the block ends (empty where
    ``nvidia-smi`` is not there, or not ``enabled``)."""
    import shutil
    import subprocess
    import tempfile

    rows: list[dict] = []
    if not enabled or shutil.which("nvidia-smi") is None:
        yield rows
        return
    with tempfile.NamedTemporaryFile("w", suffix=".csv") as out:
        proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={SMI_FIELDS}",
                                 "--format=csv,noheader", "-lms", "20"], stdout=out,
                                stderr=subprocess.DEVNULL)
        try:
            yield rows
        finally:
            proc.terminate()
            proc.wait()
            rows.extend(_smi_rows(out.name))


def _smi_rows(path: str) -> list[dict]:
    rows = []
    for line in open(path).read().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 6:
            continue
        def num(text):
            try:
                return float(text.split()[0])
            except (ValueError, IndexError):
                return None
        rows.append(dict(t=parts[0], sm_mhz=num(parts[1]), mem_mhz=num(parts[2]),
                         power_w=num(parts[3]), temp_c=num(parts[4]), throttle=parts[5]))
    return rows


def _replay_series(graph, calls: int, replays: int, pause_s: float) -> list[float]:
    """us per call of each of ``replays`` replays of ``graph`` (``calls`` calls), each between
    its own two events; with ``pause_s``, the host waits for a replay and sleeps that long
    before the next."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for i in range(replays):
        starts[i].record()
        graph.replay()
        ends[i].record()
        if pause_s:
            ends[i].synchronize()
            time.sleep(pause_s)
    torch.cuda.synchronize()
    return [a.elapsed_time(b) * 1e3 / calls for a, b in zip(starts, ends)]


def _stream_fn(experts):
    """One plain streaming read of every expert's weights (``hbm_read``'s kernel, 8 programs
    a multiprocessor): what HBM gives the layer's bytes under the same conditions."""
    from hbm_read import _read_kernel

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bufs = [experts.gate_up_proj.reshape(-1), experts.down_proj.reshape(-1)]
    out = torch.empty(8 * sms, dtype=torch.float32, device=bufs[0].device)

    def fn():
        for buf in bufs:
            _read_kernel[(8 * sms,)](buf, out, buf.numel(), BLOCK=8192, num_warps=8)
    return fn


def sustained_bs(bs: int, experts, s: dict, device: str, replays: int = 600,
                 pause_s: float = 0.005) -> dict:
    """Each replay of a graph of ``graph_calls`` layer calls timed alone over a long run (from a
    GPU rested 2 s), then ``replays // 4`` with the host idle ``pause_s`` between replays, then
    the same long run of a plain streaming read of every expert's weights (``_stream_fn``);
    ``nvidia-smi`` samples the SM clock, power and throttle reasons meanwhile; then, as
    ``common.time_calls`` runs it, ``eager_iters`` eager calls before ``graph_replays`` replays
    of the same graph, and of one captured after them. Does the layer slow down as a run goes
    on, does HBM's own rate, and does an eager run before the replays slow them?"""
    from common import graph_of

    lens = mix_lens(bs, s["block"], s["mean_len"], s["seed"])
    x, ids, weights, qsl = routing(sum(lens), s, device)
    floor = floor_us(ids, s)
    calls = s["graph_calls"]
    fn = path_fn("ours_triton", experts, x, ids, weights, qsl)
    graphs = dict(layer=graph_of([fn], calls), stream=graph_of([_stream_fn(experts)], calls))
    for g in graphs.values():
        g.replay()
    torch.cuda.synchronize()
    series = {}
    with _smi_sampling() as smi_rows:
        for name, pause, n in (("layer", 0.0, replays), ("layer_paused", pause_s, replays // 4),
                               ("stream", 0.0, replays)):
            time.sleep(2.0)  # every run from a rested GPU
            series[name] = _replay_series(graphs[name.split("_")[0]], calls, n, pause)
        # as common.time_calls runs it: eager calls first, then the graph (the same one, or one
        # captured after them), ``graph_replays`` replays
        for name, fresh in (("layer_after_eager", False), ("layer_after_eager_new_graph", True)):
            time.sleep(2.0)
            for _ in range(s["eager_iters"]):
                fn()
            graph = graph_of([fn], calls) if fresh else graphs["layer"]
            graph.replay()
            series[name] = _replay_series(graph, calls, s["graph_replays"], 0.0)

    def med(v):
        return sorted(v)[len(v) // 2]
    row = dict(bs=bs, tokens=sum(lens), **floor, replays=replays, pause_s=pause_s,
               series_us_per_call=series, smi=smi_rows)
    for name, us in series.items():
        row[name] = dict(first10_us=med(us[:10]), last50_us=med(us[-50:]), median_us=med(us))
        print(f"bs {bs} {name}: first 10 {row[name]['first10_us']:.1f} us/call, last 50 "
              f"{row[name]['last50_us']:.1f}, median {row[name]['median_us']:.1f}")
    # the layer's share of what HBM streamed its weight bytes at, replay for replay position
    row["layer_over_stream_last50"] = row["stream"]["last50_us"] / row["layer"]["last50_us"]
    row["stream_tb_per_s_last50"] = floor["weight_bytes"] / row["stream"]["last50_us"] / 1e6
    clocks = [r["sm_mhz"] for r in smi_rows if r["sm_mhz"]]
    power = [r["power_w"] for r in smi_rows if r["power_w"]]
    if clocks and power:
        print(f"bs {bs} SM clock {min(clocks):.0f}-{max(clocks):.0f} MHz, power "
              f"{min(power):.0f}-{max(power):.0f} W, throttle reasons "
              f"{sorted(set(r['throttle'] for r in smi_rows))}")
    print(f"bs {bs}: stream of the weights at {row['stream_tb_per_s_last50']:.2f} TB/s over the "
          f"last 50 replays; layer / stream {row['layer_over_stream_last50']:.3f}")
    return row


GAP_BLOCK_BYTES = 72 * 2**30
"""The block ``--gap`` allocates and frees: about what bs 256's whole float32 reference keeps
reserved (76.5 GiB)."""


def gap_bs(bs: int, experts, s: dict, device: str, rounds: int = 2) -> dict:
    """Why ``time_calls``' graph figure sat above ``--sustained``'s replays. In one process,
    ``rounds`` times over, each after ``rest_s`` idle, the same layer call timed:

    - as ``common.time_calls`` does (``window``: eager calls, a fresh capture, one window over
      ``graph_replays`` replays) and with each replay between its own events (``one_by_one``);
    - the graph captured before any variant ran, replayed alone (``first_graph``);
    - each after ``gathered_reference`` ran (as ``run_bs`` ran it before timing until it took
      ``reference``: its per-pair weight gathers reserve 76.5 GiB at bs 256), freed, with and
      without ``torch.cuda.empty_cache()``;
    - each after a ``GAP_BLOCK_BYTES`` block was allocated and freed to the caching allocator
      (its next allocations land in it), held instead, or freed and taken back whole (nothing
      lands in it), with the layer's eager calls in between or not.

    Each row records the device's free bytes and the allocator's reserved bytes before its
    timing. Last, each kernel's time (torch.profiler) in replays of the first graph and of one
    captured after ``gathered_reference``."""
    from common import graph_of

    if device != "cuda":
        raise SystemExit("--gap times CUDA graph replays: it needs a GPU")
    lens = mix_lens(bs, s["block"], s["mean_len"], s["seed"])
    x, ids, weights, qsl = routing(sum(lens), s, device)
    fn = path_fn("ours_triton", experts, x, ids, weights, qsl)
    calls, replays = s["graph_calls"], s["graph_replays"]
    state: dict = {}

    def measure(timer):
        free, _ = torch.cuda.mem_get_info()
        state.update(free_gb=free / 2**30, reserved_gb=torch.cuda.memory_reserved() / 2**30)
        return timer()

    def window():
        return [time_calls([fn], s, device)["graph_us"]]

    def one_by_one() -> list[float]:  # time_calls' steps, each replay timed alone
        fn()
        for _ in range(s["eager_iters"]):
            fn()
        graph = graph_of([fn], calls)
        graph.replay()
        return _replay_series(graph, calls, replays, 0.0)

    def first_graph():  # back-to-back replays between two events
        return [replay_us(first, replays) / calls]

    def after_reference(then, empty: bool = False):
        def run():
            gathered_reference(experts, x, ids, weights, qsl)  # its result freed at once
            if empty:
                torch.cuda.empty_cache()
            return measure(then)
        return run

    def after_block(then, keep: str = "freed", eager: bool = False):
        def run():
            block = torch.empty(GAP_BLOCK_BYTES, dtype=torch.uint8, device=device)
            if keep != "held":
                block = None  # freed, cached by the allocator: its next allocations land in it
            if keep == "filled":  # taken back whole: nothing else lands in it
                block = torch.empty(GAP_BLOCK_BYTES, dtype=torch.uint8, device=device)
            if eager:
                for _ in range(s["eager_iters"]):
                    fn()
            out = measure(then)
            del block
            torch.cuda.empty_cache()  # the next variant starts without the block
            return out
        return run

    def after_empty_cache(then):
        def run():
            torch.cuda.empty_cache()
            return measure(then)
        return run

    first = graph_of([fn], calls)
    first.replay()
    torch.cuda.synchronize()
    variants = [("window", lambda: measure(window)), ("one_by_one", lambda: measure(one_by_one)),
                ("first_graph", lambda: measure(first_graph)),
                ("window_after_reference", after_reference(window)),
                ("window_after_reference_empty_cache", after_reference(window, empty=True)),
                ("window_after_empty_cache", after_empty_cache(window)),
                ("first_graph_after_reference", after_reference(first_graph)),
                ("window_after_block_freed", after_block(window)),
                ("window_after_block_held", after_block(window, keep="held")),
                ("window_after_block_filled", after_block(window, keep="filled")),
                ("first_graph_after_block_freed", after_block(first_graph)),
                ("first_graph_after_block_freed_and_eager", after_block(first_graph, eager=True)),
                ("first_graph_after_empty_cache", after_empty_cache(first_graph))]
    rows = []
    for r in range(rounds):
        for name, run in variants:
            torch.cuda.synchronize()
            time.sleep(s["rest_s"])
            us = run()
            rows.append(dict(round=r, variant=name, us_per_call=us, mean_us=sum(us) / len(us),
                             **state))
            print(f"bs {bs} round {r} {name:>40}: {rows[-1]['mean_us']:.1f} us/call (free "
                  f"{state['free_gb']:.1f} GiB, reserved {state['reserved_gb']:.1f} GiB) " +
                  " ".join(f"{u:.1f}" for u in us))
    # each kernel's time in replays of the first graph and of one captured after the gathers
    from torch.profiler import ProfilerActivity, profile

    gathered_reference(experts, x, ids, weights, qsl)
    after = graph_of([fn], calls)
    timelines = {}
    for name, graph in (("first_graph", first), ("graph_after_reference", after)):
        graph.replay()
        torch.cuda.synchronize()
        time.sleep(s["rest_s"])
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                graph.replay()
            torch.cuda.synchronize()
        timelines[name] = t = _timeline(_kernel_spans(prof), 2 * calls)
        print(f"bs {bs} {name}: span {t['span_us_per_call'] or 0:.1f} us/call; " + ", ".join(
            f"{k[:28]} {v['us_per_call']:.1f}" for k, v in t["kernels"].items()))
    return dict(bs=bs, tokens=sum(lens), **floor_us(ids, s), rows=rows, profile=timelines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run under the interpreter")
    ap.add_argument("--out", default=None, help="result folder (default $OUT or "
                    "benchmarks/results)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    ap.add_argument("--target", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a TargetConfig field (e.g. experts_block_n=128); files get "
                    "a suffix")
    ap.add_argument("--tiles", action="store_true",
                    help="sweep each projection's tiles alone (moe_layer_tiles.json)")
    ap.add_argument("--graph-calls", type=int, default=None,
                    help="layer calls captured in one CUDA graph (default 20); files get a suffix")
    ap.add_argument("--rest", type=float, default=None,
                    help="seconds of an idle GPU before each path is timed (default 1); files "
                    "get a suffix")
    ap.add_argument("--smi", action="store_true",
                    help="sample nvidia-smi every 20 ms through the run, as --sustained does "
                    "(moe_layer_smi.json): does the sampler change the graph figures?")
    ap.add_argument("--sustained", action="store_true",
                    help="each graph replay timed alone over a long run, with the SM clock, "
                    "power and throttle reasons (moe_layer_sustained.json)")
    ap.add_argument("--gap", action="store_true",
                    help="the graph figure as time_calls takes it, against each replay timed alone "
                    "and after the allocator's history changed (moe_layer_gap.json)")
    ap.add_argument("--profile", action="store_true",
                    help="GPU time of each of our kernels per call and the gaps between them, eager "
                    "and in graph replays (moe_layer_profile.json)")
    opts = ap.parse_args(argv)
    s, device = (SMOKE, "cpu") if opts.smoke else (SETTINGS, "cuda")
    overrides, suffix, _ = target_overrides(opts.target)
    if opts.batch_sizes:
        s = dict(s, batch_sizes=opts.batch_sizes)
    if opts.rest is not None:
        s = dict(s, rest_s=opts.rest)
        suffix += f"_rest_{opts.rest:g}"
    if opts.graph_calls:
        s = dict(s, graph_calls=opts.graph_calls,
                 graph_replays=s["graph_replays"] * s["graph_calls"] // opts.graph_calls)
        suffix += f"_graph_calls_{opts.graph_calls}"
    torch.set_grad_enabled(False)
    experts = build(s, device)
    report = dict(settings=s, target_overrides=overrides,
                  environment=versions(gpu=device == "cuda"),
                  command="python benchmarks/moe_layer.py " + " ".join(argv or sys.argv[1:]),
                  results={})
    modes = dict(tiles=tile_sweep, profile=profile_bs, sustained=sustained_bs, gap=gap_bs)
    chosen = [kind for kind in modes if getattr(opts, kind)]
    if len(chosen) > 1:
        raise SystemExit(f"--{' and --'.join(chosen)}: choose one mode")
    if chosen:
        kind = chosen[0]
        run = modes[kind]
        report["results"] = {str(bs): run(bs, experts, s, device) for bs in s["batch_sizes"]}
        name = f"moe_layer_{kind}{'_smoke' if opts.smoke else ''}{suffix}.json"
        report["path"] = write_json(out_dir(opts.out), name, report)
        return report
    # --smi: does the sampler --sustained runs change the figures?
    with _smi_sampling(opts.smi and device == "cuda") as smi:
        for bs in s["batch_sizes"]:
            report["results"][str(bs)] = row = run_bs(bs, experts, s, device)
            bad = [p for p in PATHS if row[p]["max_err"] > s["atol"]]
            if bad:
                report["errors"] = f"bs {bs}: {bad} differ from the reference by more than " \
                    f"{s['atol']}"
            print(f"bs {bs:>4} N {row['tokens']:>4} active {row['active_experts']:>3} floor "
                  f"{row['floor_us']:8.1f} us ({row['floor_kind']})  " + "  ".join(
                      f"{p} {row[p]['best_us']:8.1f} us ({row[p]['floor_share']:.2f})"
                      for p in PATHS))
    if opts.smi:
        report["smi"] = smi
    name = f"moe_layer{'_smoke' if opts.smoke else ''}{suffix}{'_smi' if opts.smi else ''}.json"
    report["path"] = write_json(out_dir(opts.out), name, report)
    return report


if __name__ == "__main__":
    main()
