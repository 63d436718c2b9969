"""Spike: can one half batch's attention run while the other half's matmuls run, each on its
own share of the multiprocessors?

The 1.1B Llama-like model's shapes (``common.LLAMA_1B``: 16 layers, hidden 2048, 16 query / 8
KV heads of 128, MLP 8192), bf16, context 1024, ``bs`` requests of a ragged mix of mean 3,
split into two halves of ``bs / 2`` requests:

- ``attention``: every layer's ragged paged attention over half A (our Triton kernel,
  ``ragged_attention_triton``; each layer its own pools, so the KV comes from HBM);
- ``linears``: every layer's matmuls over half B's rows (q/k/v 2048 -> 4096, o 2048 -> 2048,
  gate/up 2048 -> 16384, down 8192 -> 2048; cuBLAS through ``torch.mm``), with the gate.

Each part is captured in a CUDA graph on the stream it runs on (one launch: the host never
bounds a timing) and timed between CUDA events (median of ``repeats`` after a warm-up): each
part alone on the whole GPU, both one after the other on one stream, both on two plain streams at once, and
both at once with one of them confined to a CUDA green context of ``n`` multiprocessors (the
other on a plain stream: it may use any multiprocessor the confined one leaves). The overlap
gain of a row is ``serial / concurrent``: above 1 the two parts shared the GPU; the serial sum
is what a step pays when they run one after the other.

Usage: ``python benchmarks/overlap_spike.py [--bs 256 64] [--smoke] [--out DIR]``; writes
``overlap_spike.json``. ``--tiles TILE_N,WARPS,STAGES,REGS ... [--tile-sms 64]`` instead times
only the attention part under each tile config of the kernel (REGS ``none``: no register cap),
on the whole GPU and confined to green contexts of ``--tile-sms`` multiprocessors: does a deeper
K/V pipeline reach the streaming rate on a share of the SMs (``overlap_tiles.json``). ``--smoke`` runs tiny shapes on the CPU under the Triton interpreter
(no streams, no green contexts: it checks the script).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if "--smoke" in sys.argv:  # read when @triton.jit decorates: before any kernel import
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from attention_kernel import build_layer, call_args, tile_config  # noqa: E402
from common import LLAMA_1B, BLOCK, CONTEXT, PAGE, graph_of, mix_lens, out_dir, \
    versions, write_json  # noqa: E402
from dspark_compile.kernels.attention import ragged_attention_triton  # noqa: E402

SETTINGS = dict(name="full", layers=LLAMA_1B["num_hidden_layers"],
                hidden=LLAMA_1B["hidden_size"], mlp=LLAMA_1B["intermediate_size"],
                num_heads=LLAMA_1B["num_attention_heads"],
                num_kv_heads=LLAMA_1B["num_key_value_heads"], head_dim=LLAMA_1B["head_dim"],
                page_size=PAGE, context=CONTEXT, block=BLOCK, mean_len=3, dtype="bfloat16",
                batch_sizes=[256, 64], green_sms=[32, 48, 64, 80, 96], repeats=7, seed=0)
SMOKE = dict(SETTINGS, name="smoke", layers=2, hidden=64, mlp=128, num_heads=4, num_kv_heads=2,
             head_dim=16, context=40, dtype="float32", batch_sizes=[4], green_sms=[],
             repeats=1)


def build(bs: int, s: dict, device: str) -> dict:
    """Half A's attention inputs per layer, half B's rows and every layer's weights."""
    lens = mix_lens(bs, s["block"], s["mean_len"], s["seed"])
    half_a, half_b = lens[:bs // 2], lens[bs // 2:]
    attn = dict(s, max_len=s["block"])
    layers = [build_layer(half_a, attn, device, seed=s["seed"] + i, fill_device=device)
              for i in range(s["layers"])]
    dtype = getattr(torch, s["dtype"])
    g = torch.Generator(device=device).manual_seed(s["seed"])
    d, f, hd = s["hidden"], s["mlp"], s["head_dim"]
    qkv = (s["num_heads"] + 2 * s["num_kv_heads"]) * hd

    def w(rows, cols):
        return (torch.randn(rows, cols, generator=g, device=device) * rows ** -0.5).to(dtype)
    weights = [dict(qkv=w(d, qkv), o=w(s["num_heads"] * hd, d), gate_up=w(d, 2 * f),
                    down=w(f, d)) for _ in range(s["layers"])]
    x = torch.randn(sum(half_b), d, generator=g, device=device).to(dtype)
    return dict(lens=lens, tokens_a=sum(half_a), tokens_b=sum(half_b), layers=layers,
                weights=weights, x=x)


def attention_part(case: dict, s: dict, config=None):
    """Every layer's attention over half A (``config``: the kernel's target entry, default the
    device's)."""
    scale = s["head_dim"] ** -0.5

    def run():
        for layer in case["layers"]:
            ragged_attention_triton(*call_args(layer, scale), max_query_len=s["block"],
                                    config=config)
    return run


def linears_part(case: dict, s: dict):
    x, f = case["x"], s["mlp"]
    attn_out = torch.zeros(x.shape[0], s["num_heads"] * s["head_dim"], dtype=x.dtype,
                           device=x.device)

    def run():
        for w in case["weights"]:
            torch.mm(x, w["qkv"])
            torch.mm(attn_out, w["o"])
            gu = torch.mm(x, w["gate_up"])
            torch.mm(torch.nn.functional.silu(gu[:, :f]) * gu[:, f:], w["down"])
    return run


def _ms(launch, repeats: int) -> float:
    """Median ms of ``launch()`` (which enqueues on any streams and makes the current stream
    wait for them) between two events on the current stream."""
    launch()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        time.sleep(0.05)
    return statistics.median(times)


def _together(pairs):
    """Every ``(stream, fn)`` enqueued at once after the current stream's work."""
    def launch():
        here = torch.cuda.current_stream()
        for stream, _ in pairs:
            stream.wait_stream(here)
        for stream, fn in pairs:
            with torch.cuda.stream(stream):
                fn()
        for stream, _ in pairs:
            here.wait_stream(stream)
    return launch


def green_stream(num_sms: int):
    """A stream of a green context of ``num_sms`` multiprocessors, or why there is none."""
    try:
        from torch.cuda.green_contexts import GreenContext
        try:
            ctx = GreenContext.create(num_sms=num_sms, device_id=torch.cuda.current_device())
        except TypeError:
            ctx = GreenContext.create(num_sms, torch.cuda.current_device())
        if not hasattr(ctx, "Stream"):
            return None, ctx, "this torch's GreenContext has no Stream()"
        return ctx.Stream(), ctx, None
    except Exception as err:  # noqa: BLE001 - the spike records why
        return None, None, f"{type(err).__name__}: {err}"[:300]


def _on(stream, fn):
    """Run ``fn`` on ``stream`` after the current stream's work; the current stream waits."""
    return _together([(stream, fn)])


def _graph(fn, stream):
    """A CUDA graph of ``fn`` captured on ``stream``, after one warm-up call there."""
    return graph_of([fn], 1, stream)


def run_bs(bs: int, s: dict, device: str) -> dict:
    case = build(bs, s, device)
    attn, lin = attention_part(case, s), linears_part(case, s)
    row = dict(bs=bs, tokens_a=case["tokens_a"], tokens_b=case["tokens_b"])
    if device != "cuda":
        attn()
        lin()
        return row
    reps = s["repeats"]
    side_a, side_b = torch.cuda.Stream(), torch.cuda.Stream()
    # every part replayed from a CUDA graph (one launch): the host never bounds a timing
    ga, gb = _graph(attn, side_a), _graph(lin, side_b)
    row["attention_ms"] = _ms(_on(side_a, ga.replay), reps)
    row["linears_ms"] = _ms(_on(side_b, gb.replay), reps)
    row["serial_ms"] = _ms(lambda: (_on(side_a, ga.replay)(), _on(side_b, gb.replay)()), reps)
    row["two_streams_ms"] = _ms(_together([(side_a, ga.replay), (side_b, gb.replay)]), reps)
    row["two_streams_gain"] = row["serial_ms"] / row["two_streams_ms"]
    print(f"bs {bs}: attention {row['attention_ms']:.3f} ms, linears {row['linears_ms']:.3f}, "
          f"serial {row['serial_ms']:.3f}, two streams {row['two_streams_ms']:.3f} "
          f"(x{row['two_streams_gain']:.3f})", flush=True)
    row["green"] = []
    for n in s["green_sms"]:
        stream, ctx, error = green_stream(n)
        if stream is None:
            row["green"].append(dict(sms=n, error=error))
            print(f"bs {bs} green {n}: {error}", flush=True)
            break
        entry = dict(sms=n)
        try:
            for confined, other, name in ((attn, gb, "attention"), (lin, ga, "linears")):
                other_stream = side_b if other is gb else side_a
                g = _graph(confined, stream)
                alone = _ms(_on(stream, g.replay), reps)
                both = _ms(_together([(stream, g.replay), (other_stream, other.replay)]), reps)
                entry[f"{name}_confined_alone_ms"] = alone
                entry[f"{name}_confined_both_ms"] = both
                entry[f"{name}_confined_gain"] = row["serial_ms"] / both
                del g
            print(f"bs {bs} green {n} SMs: attention confined alone "
                  f"{entry['attention_confined_alone_ms']:.3f}, with linears beside "
                  f"{entry['attention_confined_both_ms']:.3f} (x"
                  f"{entry['attention_confined_gain']:.3f}); linears confined alone "
                  f"{entry['linears_confined_alone_ms']:.3f}, with attention beside "
                  f"{entry['linears_confined_both_ms']:.3f} (x"
                  f"{entry['linears_confined_gain']:.3f})", flush=True)
        except Exception as err:  # noqa: BLE001 - the spike records why
            torch.cuda.synchronize()
            entry["error"] = f"{type(err).__name__}: {err}"[:300]
            print(f"bs {bs} green {n}: {entry['error']}", flush=True)
        row["green"].append(entry)
        del stream, ctx
    return row


def tile_rows(bs: int, s: dict, device: str, tiles: list[str], sms: list[int]) -> list[dict]:
    """Half A's attention, every layer, under each tile config: its first layer's output against
    the default config's (max abs difference), and on CUDA its ms on the whole GPU and confined to
    a green context of each of ``sms`` multiprocessors (median of ``repeats`` graph replays)."""
    case = build(bs, s, device)
    scale = s["head_dim"] ** -0.5
    first = call_args(case["layers"][0], scale)
    want = ragged_attention_triton(*first, max_query_len=s["block"]).float()
    greens = {n: green_stream(n) for n in sms} if device == "cuda" else {}
    rows = []
    for spec in tiles:
        cfg = tile_config(spec, device)
        got = ragged_attention_triton(*first, max_query_len=s["block"], config=cfg).float()
        row = dict(bs=bs, tiles=spec, max_abs_diff=float((got - want).abs().max()))
        if device == "cuda":
            fn = attention_part(case, s, cfg)
            side = torch.cuda.Stream()
            g = _graph(fn, side)
            row["all_sms_ms"] = _ms(_on(side, g.replay), s["repeats"])
            del g
            for n, (stream, _, error) in greens.items():
                if stream is None:
                    row[f"sms_{n}"] = error
                    continue
                g = _graph(fn, stream)
                row[f"sms_{n}_ms"] = _ms(_on(stream, g.replay), s["repeats"])
                del g
        print(row, flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run under the interpreter")
    ap.add_argument("--bs", type=int, nargs="+", default=None)
    ap.add_argument("--out", default=None, help="result folder (default $OUT or "
                    "benchmarks/results)")
    ap.add_argument("--tiles", nargs="+", metavar="TILE_N,WARPS,STAGES,REGS",
                    help="only the attention part under these tile configs (overlap_tiles.json)")
    ap.add_argument("--tile-sms", type=int, nargs="+", default=[64],
                    help="green-context sizes the --tiles runs are confined to")
    opts = ap.parse_args(argv)
    s, device = (SMOKE, "cpu") if opts.smoke else (SETTINGS, "cuda")
    if opts.bs:
        s = dict(s, batch_sizes=opts.bs)
    torch.set_grad_enabled(False)
    report = dict(settings=s, environment=versions(gpu=device == "cuda"),
                  command="python benchmarks/overlap_spike.py " + " ".join(argv or sys.argv[1:]))
    if opts.tiles:
        report["tile_sms"] = opts.tile_sms
        report["results"] = {str(bs): tile_rows(bs, s, device, opts.tiles, opts.tile_sms)
                             for bs in s["batch_sizes"]}
    else:
        report["results"] = {str(bs): run_bs(bs, s, device) for bs in s["batch_sizes"]}
    name = (f"overlap_{'tiles' if opts.tiles else 'spike'}{'_smoke' if opts.smoke else ''}"
            ".json")
    report["path"] = write_json(out_dir(opts.out), name, report)
    return report


if __name__ == "__main__":
    main()
