"""Benchmark: Triton ragged paged attention per layer vs PyTorch SDPA on dense padded shapes.

The verify step of the design's 1.14B Llama-like model on an H200: bf16, 16 query heads, 8 KV
heads, head 128, page 16, context 1024, bs 1/8/64/256, verify lengths all 8 or a fixed-seed mix
of 1..8 with mean 3. Each case is checked against ``reference.ragged_attention`` first, then
timed as back-to-back launches between two CUDA events (no sync between launches) and as CUDA
graph replays (how the engine runs it). Every call uses the next of several layers' pools so
the KV read comes from HBM, not L2, as in a real forward. Bandwidth = KV bytes read / time,
against 4.8 TB/s. SDPA gets ``[bs, H, T, D]`` queries, contiguous ``[bs, Hkv, ctx + T, D]`` K/V
(``enable_gqa``) and a boolean mask, T = the widest request.

``--semantics`` times the attention switches instead (issue 22's targets): (a) a windowed layer
(window 1024 at context 8192) against a full layer at context 1024, same batch, bs 1/8/64/256;
(b) softcap 50, sinks, and both against plain, bs 64, context 1024; all-8 verify lengths; each
case checked against the reference first. Writes ``attention_semantics.json``.

Usage: ``python benchmarks/attention_kernel.py [--sweep] [--semantics] [--smoke] [--out DIR]``.
Writes ``attention_kernel.json`` to ``--out``, else ``$OUT`` if set, else
``benchmarks/results/``. ``--smoke`` runs tiny shapes on the CPU under ``TRITON_INTERPRET=1``
(checks the script, times nothing real).
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
from common import out_dir, time_calls, versions, write_json  # noqa: E402
from dspark_compile.ops import attention_reference as reference  # noqa: E402
from dspark_compile.kernels.targets import target_for_device  # noqa: E402
from dspark_compile.kernels.attention import (  # noqa: E402
    plan_attention, ragged_attention_triton)

SETTINGS = dict(num_heads=16, num_kv_heads=8, head_dim=128, page_size=16, context=1024,
                dtype="bfloat16", batch_sizes=[1, 8, 64, 256], max_len=8, mix_mean=3,
                mix_seed=0, hbm_bytes_per_s=4.8e12, rotate_bytes=256e6, eager_iters=200,
                graph_calls=32, graph_replays=20, sweep_tile_bs=[64, 256],
                sweep_tiles=[[64, 4, 2, 128], [64, 4, 2, None], [32, 4, 3, 128]],
                sweep_splits=[[1, [4, 8, 16]], [8, [2, 4, 8]], [64, [1, 2]]],
                small_bs=[1, 8], small_tiles=[[64, 4, 2, 128], [32, 4, 2, 128], [32, 4, 3, 128],
                                              [64, 4, 3, 128]],
                small_splits=[None, 8, 16], window=1024, window_context=8192,
                window_bs=[1, 8, 64, 256], switch_bs=[64], softcap=50.0)
SMOKE = dict(SETTINGS, num_heads=4, num_kv_heads=2, head_dim=64, context=40, dtype="float32",
             batch_sizes=[1, 3], rotate_bytes=0, eager_iters=2, graph_calls=1, graph_replays=1,
             sweep_tile_bs=[2], sweep_tiles=[[32, 4, 3, None]], sweep_splits=[[1, [1, 2]]],
             small_bs=[1], small_tiles=[[32, 4, 3, None]], small_splits=[None, 2], window=16,
             window_context=80, window_bs=[2], switch_bs=[2])


def verify_lengths(bs: int, mix: bool, s: dict) -> list[int]:
    """All ``max_len``, or a fixed-seed 1..max_len mix whose mean is exactly ``mix_mean``."""
    if not mix:
        return [s["max_len"]] * bs
    g = torch.Generator().manual_seed(s["mix_seed"] + bs)
    lens = (1 + (torch.rand(bs, s["max_len"] - 1, generator=g)
                 < (s["mix_mean"] - 1) / (s["max_len"] - 1)).sum(1)).tolist()
    i = 0
    while sum(lens) != s["mix_mean"] * bs:  # nudge to the exact mean, deterministically
        step = 1 if sum(lens) < s["mix_mean"] * bs else -1
        if 1 <= lens[i % bs] + step <= s["max_len"]:
            lens[i % bs] += step
        i += 1
    return lens


def build_layer(lens: list[int], s: dict, device: str, seed: int,
                fill_device: str = "cpu") -> dict:
    """Inputs of one layer's call: packed q/k/v, a randomly paged pool, block table, slots.
    ``fill_device``: where the random values are drawn (``device`` for the 8k-context pools,
    gigabytes that the CPU would take a minute to fill)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    fill = torch.Generator(device=fill_device).manual_seed(seed)
    dtype = getattr(torch, s["dtype"])
    bs, ctx, page = len(lens), s["context"], s["page_size"]
    hkv, d = s["num_kv_heads"], s["head_dim"]
    per_req = -(-(ctx + max(lens)) // page)
    table = page_table(bs, per_req, s.get("page_order", "shuffled"), g)
    lens_t = torch.tensor(lens)
    qsl = torch.zeros(bs + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(lens_t, 0)
    req = torch.repeat_interleave(torch.arange(bs), lens_t)
    pos = ctx + torch.arange(int(qsl[-1])) - qsl[:-1].long()[req]
    slots = table[req, pos // page] * page + pos % page

    def rnd(*shape):
        return torch.randn(*shape, generator=fill, device=fill_device).to(dtype).to(device)

    n = int(qsl[-1])
    return dict(q=rnd(n, s["num_heads"], d), k=rnd(n, hkv, d), v=rnd(n, hkv, d),
                k_cache=rnd(bs * per_req, page, hkv, d), v_cache=rnd(bs * per_req, page, hkv, d),
                query_start_loc=qsl.to(device), seq_lens=(lens_t + ctx).int().to(device),
                block_table=table.int().to(device), slot_mapping=slots.to(device))


def page_table(bs: int, per_req: int, order: str, g: torch.Generator) -> torch.Tensor:
    """``[bs, per_req]`` page ids of a pool of ``bs * per_req`` pages: ``shuffled`` (every page
    anywhere, the default), ``in_order`` (each request's pages one run, requests in order), or
    ``runs:N`` (runs of N consecutive pages in a random order, as an allocator that hands out N
    pages at a time would leave them)."""
    pages = bs * per_req
    if order == "shuffled":
        return torch.randperm(pages, generator=g).view(bs, per_req)
    if order == "in_order":
        return torch.arange(pages).view(bs, per_req)
    run = int(order.split(":", 1)[1]) if order.startswith("runs:") else 0
    if run < 1 or pages % run:
        raise ValueError(f"page order {order!r}: 'shuffled', 'in_order' or 'runs:N' with N "
                         f"dividing the {pages} pages")
    starts = torch.randperm(pages // run, generator=g) * run
    return (starts[:, None] + torch.arange(run)[None]).reshape(bs, per_req)


def call_args(layer: dict, scale: float) -> list:
    """Positional arguments of the op for one layer."""
    keys = ("q", "k", "v", "k_cache", "v_cache", "query_start_loc", "seq_lens", "block_table",
            "slot_mapping")
    return [layer[k] for k in keys] + [scale]


def check_correct(layer: dict, s: dict, sem: dict | None = None, **kw) -> float:
    """Max |triton - reference| on copies of the pools; raises if the pools differ. ``sem``:
    the switches (window, softcap, sinks) both take."""
    scale, sem = s["head_dim"] ** -0.5, sem or {}
    mine = {**layer, "k_cache": layer["k_cache"].clone(), "v_cache": layer["v_cache"].clone()}
    ref = {**layer, "k_cache": layer["k_cache"].clone(), "v_cache": layer["v_cache"].clone()}
    got = ragged_attention_triton(*call_args(mine, scale), max_query_len=s["max_len"], **sem,
                                  **kw)
    want = reference.ragged_attention(*call_args(ref, scale), **sem)
    if not (torch.equal(mine["k_cache"], ref["k_cache"])
            and torch.equal(mine["v_cache"], ref["v_cache"])):
        raise AssertionError("KV pool after the write differs from the reference's")
    err = (got.float() - want.float()).abs().max().item()
    if not err < (3e-2 if s["dtype"] == "bfloat16" else 1e-4):
        raise AssertionError(f"triton vs reference: max abs error {err}")
    return err


def sdpa_layers(lens: list[int], s: dict, device: str, count: int) -> list:
    """SDPA calls on the equivalent dense padded shapes, one per rotated layer."""
    bs, t, ctx = len(lens), max(lens), s["context"]
    dtype = getattr(torch, s["dtype"])
    key_pos = torch.arange(ctx + t, device=device)
    q_pos = ctx + torch.arange(t, device=device)
    valid = torch.arange(t, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
    mask = (key_pos[None, None, :] <= q_pos[None, :, None]) & valid[:, :, None]  # [bs, T, S]
    mask[:, :, 0] = True  # padded query rows see key 0: finite, as a dense verify pads
    mask = mask[:, None]  # [bs, 1, T, S]
    fns = []
    for _ in range(count):
        q = torch.randn(bs, s["num_heads"], t, s["head_dim"], device=device, dtype=dtype)
        kv = torch.randn(2, bs, s["num_kv_heads"], ctx + t, s["head_dim"], device=device,
                         dtype=dtype)
        fns.append(lambda q=q, kv=kv: torch.nn.functional.scaled_dot_product_attention(
            q, kv[0], kv[1], attn_mask=mask, enable_gqa=True))
    return fns


def keys_read(context: int, n: int, window: int) -> int:
    """Keys a request of ``n`` new tokens after ``context`` reads (with a window: its first
    query's window and the new keys)."""
    return min(context + n, window + n - 1) if window else context + n


def run_case(bs: int, mix: bool, s: dict, device: str, with_sdpa: bool = True,
             sem: dict | None = None, fill_device: str = "cpu", **kw) -> dict:
    """Check, then time the Triton op (and SDPA) for one (batch, length mix). ``sem``: the
    switches (window, softcap; ``sinks: True`` draws ``[H]`` sink logits per layer)."""
    lens = verify_lengths(bs, mix, s)
    sem = dict(sem or {})
    elem = torch.finfo(getattr(torch, s["dtype"])).bits // 8
    kv_bytes = 2 * sum(keys_read(s["context"], n, sem.get("window", 0)) for n in lens) \
        * s["num_kv_heads"] * s["head_dim"] * elem
    layers = max(1, min(64, math.ceil(s["rotate_bytes"] / kv_bytes)))
    built = [build_layer(lens, s, device, seed=bs * 100 + i, fill_device=fill_device)
             for i in range(layers)]
    sinks = [None] * layers
    if sem.pop("sinks", False):
        g = torch.Generator().manual_seed(bs)
        sinks = [torch.randn(s["num_heads"], generator=g).to(getattr(torch, s["dtype"]))
                 .to(device) for _ in range(layers)]
    err = check_correct(built[0], s, {**sem, "sinks": sinks[0]}, **kw)
    scale = s["head_dim"] ** -0.5
    fns = [lambda a=call_args(x, scale), sk=sk: ragged_attention_triton(
        *a, max_query_len=s["max_len"], sinks=sk, **sem, **kw) for x, sk in zip(built, sinks)]
    times = time_calls(fns, s, device)
    sdpa = (time_calls(sdpa_layers(lens, s, device, layers), s, device) if with_sdpa
            else dict(eager_us=None, graph_us=None))
    cfg = kw.get("config") or target_for_device(device)
    plan = plan_attention(sum(lens), bs, s["num_heads"], s["num_kv_heads"],
                          built[0]["block_table"].shape[1] * s["page_size"], s["max_len"], cfg,
                          torch.cuda.get_device_properties(device).multi_processor_count
                          if device == "cuda" else cfg.default_sm_count, kw.get("num_splits"),
                          window=sem.get("window", 0))
    best = min(v for v in (times["eager_us"], times["graph_us"]) if v is not None)
    return dict(bs=bs, lengths="mix_mean3" if mix else "all8", num_tokens=sum(lens),
                mean_len=sum(lens) / bs, layers_rotated=layers, kv_bytes=kv_bytes,
                max_abs_err=err, **times, hbm_pct_eager=_pct(kv_bytes, times["eager_us"], s),
                hbm_pct_graph=_pct(kv_bytes, times["graph_us"], s),
                floor_us=kv_bytes / s["hbm_bytes_per_s"] * 1e6, best_us=best,
                sdpa_eager_us=sdpa["eager_us"], sdpa_graph_us=sdpa["graph_us"],
                plan=dataclasses.asdict(plan), tile_config=_tiles(cfg))


def semantics(s: dict, device: str) -> dict:
    """Issue 22's timings: (a) window ``s["window"]`` at ``s["window_context"]`` against a full
    layer at ``s["context"]``, same batch; (b) softcap, sinks and both against plain at
    ``s["switch_bs"]``. Ratios of the best of eager and graph us; all-8 lengths."""
    fill = device  # the 8k pools are gigabytes: draw them where they live
    long = dict(s, context=s["window_context"])
    rows = []
    for bs in s["window_bs"]:
        full = run_case(bs, False, s, device, with_sdpa=False, fill_device=fill)
        win = run_case(bs, False, long, device, with_sdpa=False, fill_device=fill,
                       sem=dict(window=s["window"]))
        rows.append(dict(case="window", bs=bs, window=s["window"], context=long["context"],
                         full_context=s["context"], ratio=win["best_us"] / full["best_us"],
                         full=full, windowed=win))
        print(f"bs {bs:>3}: window {s['window']} at {long['context']}: {win['best_us']:.1f} us, "
              f"full at {s['context']}: {full['best_us']:.1f} us -> {rows[-1]['ratio']:.3f}x",
              flush=True)
    for bs in s["switch_bs"]:
        plain = run_case(bs, False, s, device, with_sdpa=False, fill_device=fill)
        for name, sem in (("softcap", dict(softcap=s["softcap"])), ("sinks", dict(sinks=True)),
                          ("softcap_sinks", dict(softcap=s["softcap"], sinks=True))):
            r = run_case(bs, False, s, device, with_sdpa=False, fill_device=fill, sem=sem)
            rows.append(dict(case=name, bs=bs, context=s["context"],
                             ratio=r["best_us"] / plain["best_us"], plain=plain, switched=r))
            print(f"bs {bs:>3}: {name}: {r['best_us']:.1f} us, plain {plain['best_us']:.1f} us "
                  f"-> {rows[-1]['ratio']:.3f}x", flush=True)
    return dict(rows=rows)


def _pct(kv_bytes: int, us: float | None, s: dict) -> float | None:
    return None if us is None else round(100 * kv_bytes / (us * 1e-6) / s["hbm_bytes_per_s"], 1)


def _tiles(cfg) -> dict:
    return dict(tile_n=cfg.attn_tile_n, num_warps=cfg.attn_num_warps,
                num_stages=cfg.attn_num_stages, max_registers=cfg.attn_max_registers)


def sweep(s: dict, device: str) -> list[dict]:
    """Tile configs (tile_n, warps, stages, register cap) and split counts, all-8 lengths."""
    base = target_for_device(device)
    rows = []
    for tile_n, warps, stages, regs in s["sweep_tiles"]:
        cfg = dataclasses.replace(base, attn_tile_n=tile_n, attn_num_warps=warps,
                                  attn_num_stages=stages, attn_max_registers=regs)
        for bs in s["sweep_tile_bs"]:
            r = run_case(bs, False, s, device, with_sdpa=False, config=cfg)
            rows.append(dict(bs=bs, **_tiles(cfg), eager_us=r["eager_us"],
                             graph_us=r["graph_us"], hbm_pct_graph=r["hbm_pct_graph"]))
    for bs, counts in s["sweep_splits"]:
        for splits in counts:
            r = run_case(bs, False, s, device, with_sdpa=False, num_splits=splits)
            rows.append(dict(bs=bs, num_splits=splits, eager_us=r["eager_us"],
                             graph_us=r["graph_us"], hbm_pct_graph=r["hbm_pct_graph"]))
    return rows


def small_sweep(s: dict, device: str) -> list[dict]:
    """Small batches (mean-3 mix, where the launch is latency-bound): merge in the attention
    launch (fold) or in a reduce launch, x tiles (tile_n, warps, stages, register cap) x split
    counts (None: the split rule's)."""
    base = target_for_device(device)
    rows = []
    for bs in s["small_bs"]:
        for tile_n, warps, stages, regs in s["small_tiles"]:
            cfg = dataclasses.replace(base, attn_tile_n=tile_n, attn_num_warps=warps,
                                      attn_num_stages=stages, attn_max_registers=regs)
            for splits in s["small_splits"]:
                for fold in (False, True):
                    r = run_case(bs, True, s, device, with_sdpa=False, num_splits=splits,
                                 config=cfg, fold_reduce=fold)
                    rows.append(dict(bs=bs, **_tiles(cfg), fold=fold,
                                     num_splits=r["plan"]["num_splits"],
                                     eager_us=r["eager_us"], graph_us=r["graph_us"],
                                     max_abs_err=r["max_abs_err"]))
                    print(rows[-1], flush=True)
    return rows


def tile_config(spec: str, device: str):
    """The device's target entry with the attention tiles of ``TILE_N,WARPS,STAGES,REGS``
    (REGS ``none``: no register cap)."""
    tile_n, warps, stages, regs = spec.split(",")
    return dataclasses.replace(target_for_device(device), attn_tile_n=int(tile_n),
                               attn_num_warps=int(warps), attn_num_stages=int(stages),
                               attn_max_registers=None if regs == "none" else int(regs))


def tile_sweep(tiles: list[str], batch_sizes: list[int], s: dict, device: str) -> list[dict]:
    """Tile configs ``TILE_N,WARPS,STAGES,REGS`` (REGS ``none``: no register cap) at the given
    batch sizes, mean-3 mix, the split rule's count; each checked against the reference."""
    rows = []
    for spec in tiles:
        cfg = tile_config(spec, device)
        for bs in batch_sizes:
            r = run_case(bs, True, s, device, with_sdpa=False, config=cfg)
            rows.append(dict(bs=bs, **_tiles(cfg), graph_us=r["graph_us"],
                             hbm_pct_graph=r["hbm_pct_graph"], max_abs_err=r["max_abs_err"],
                             num_splits=r["plan"]["num_splits"]))
            print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", nargs="+", metavar="TILE_N,WARPS,STAGES,REGS",
                    help="only time these tile configs at --tile-bs (attention_tiles.json)")
    ap.add_argument("--tile-bs", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--sweep", action="store_true", help="also sweep tiles and split counts")
    ap.add_argument("--small-sweep", action="store_true",
                    help="also sweep fold/tiles/splits at the small batch sizes")
    ap.add_argument("--semantics", action="store_true",
                    help="only time window / softcap / sinks against plain "
                         "(attention_semantics.json)")
    ap.add_argument("--page-order", default="shuffled",
                    help="the pools' page order with --tiles: shuffled (default), in_order or "
                         "runs:N (page_table); other than shuffled the file is "
                         "attention_tiles_<order>.json")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run under the interpreter")
    ap.add_argument("--out", help="results folder (default: $OUT, else benchmarks/results)")
    opts = ap.parse_args(argv)
    s, device = (SMOKE, "cpu") if opts.smoke else (SETTINGS, "cuda")
    s = dict(s, page_order=opts.page_order)
    import triton
    if opts.semantics:
        report = dict(environment=versions(device == "cuda"), settings=s,
                      target=dataclasses.asdict(target_for_device(device)),
                      command=" ".join(["benchmarks/attention_kernel.py"] + (argv or sys.argv[1:])),
                      **semantics(s, device))
        print(write_json(out_dir(opts.out), "attention_semantics.json", report))
        return
    if opts.tiles:
        report = dict(gpu=torch.cuda.get_device_name() if device == "cuda" else
                      platform.processor(), torch=torch.__version__, triton=triton.__version__,
                      settings=s, command=" ".join(["benchmarks/attention_kernel.py"]
                                                   + sys.argv[1:]),
                      tiles=tile_sweep(opts.tiles, opts.tile_bs, s, device))
        folder = Path(opts.out or os.environ.get("OUT") or Path(__file__).parent / "results")
        folder.mkdir(parents=True, exist_ok=True)
        name = "attention_tiles" + ("" if opts.page_order == "shuffled" else
                                    "_" + opts.page_order.replace(":", ""))
        (folder / f"{name}.json").write_text(json.dumps(report, indent=1))
        return
    report = dict(gpu=torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
                  torch=torch.__version__, triton=triton.__version__, settings=s,
                  target=dataclasses.asdict(target_for_device(device)),
                  command=" ".join(sys.argv), results=[])
    for bs in s["batch_sizes"]:
        for mix in (False, True):
            report["results"].append(run_case(bs, mix, s, device))
    if opts.sweep:
        report["sweep"] = sweep(s, device)
    if opts.small_sweep:
        report["small_sweep"] = small_sweep(s, device)
    folder = Path(opts.out or os.environ.get("OUT") or Path(__file__).parent / "results")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "attention_kernel.json").write_text(json.dumps(report, indent=1))
    for row in report.get("sweep", []):
        print(row)
    print(f"{'bs':>4} {'lens':>9} {'eager us':>9} {'graph us':>9} {'HBM% eager':>10} "
          f"{'HBM% graph':>10} {'floor us':>8} {'SDPA us':>8} {'splits':>6} {'err':>8}")
    for r in report["results"]:
        print(f"{r['bs']:>4} {r['lengths']:>9} {r['eager_us']:>9.1f} {r['graph_us'] or 0:>9.1f} "
              f"{r['hbm_pct_eager']:>10} {r['hbm_pct_graph']!s:>10} {r['floor_us']:>8.1f} "
              f"{r['sdpa_eager_us']:>8.1f} {r['plan']['num_splits']:>6} {r['max_abs_err']:>8.1e}")


if __name__ == "__main__":
    main()
