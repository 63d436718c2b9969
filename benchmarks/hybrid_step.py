"""Hybrid verify-step benchmark on one GPU: a small Qwen3-Next-like model (Gated DeltaNet +
gated full attention, bf16, random weights), ours ragged against HF's own dense forward padded
to the block, side by side in one run.

Model: Qwen3-Next's layer pattern (3 GDN layers, then 1 full attention) twice: 8 layers, hidden
2048; GDN heads of the real model (16 key heads, 32 value heads, K = V = 128, conv kernel 4);
full attention 16 q heads / 2 kv heads, head 256, partial rotary 0.25 (HF's defaults); vocab
151936. MLP: dense, intermediate 5632 = the real model's active expert width per token (10
routed x 512 + 1 shared x 512). Not the MoE: ``dspark_compile`` runs HF's experts as
``batched_mm``, which gathers a copy of the expert weights per (token, expert) row (k = 10 at
bs 128 x 8 tokens: ~20 GB per layer), so an MoE here would time that gather, not the verify.

Context 1024 (page 16), block 8, bs 1 / 8 / 64 / 128; verify lengths: all 8, uniform 3 and a
fixed-seed mix of 1..8 with mean exactly 3 (same token count as uniform 3). Columns:

- ours ragged (mix) / uniform 3 / all 8: ``dspark_compile(model, lowering="triton",
  inductor=True)`` replayed in the tier graphs (only the tiers the batches need:
  ``(3 bs, bs)`` and ``(8 bs, bs)``), and the mix once more eagerly; the commit that keeps the
  accepted tokens' conv/recurrent state (every token accepted: the most replay work) is timed
  on its own, since HF's dense forward writes its final state inside the forward instead.
- HF dense padded to 8: HF's forward of the model on ``[bs, 8]`` over its own ``StaticCache``
  (``StaticLayer`` KV for full attention, ``LinearAttentionLayer`` conv/recurrent state for
  GDN), in a CUDA graph when it captures, else eagerly with the capture error in the JSON.
  The causal mask is passed as a 4D boolean ``[bs, 1, 8, 1032]``: HF's own mask builder
  compares the cache offset tensor on the host (``q_offset == 0``), which no CUDA graph can
  capture. Without the ``fla`` / ``causal_conv1d`` packages HF runs its torch fallbacks
  (``torch_chunk_gated_delta_rule``, ``F.conv1d``); the JSON says which it ran.

Correctness once before timing: prefill + one ragged verify of 3 requests against HF's forward
of each request alone (bf16: the max abs error is recorded, as verify_step.py does).

    python benchmarks/hybrid_step.py [--out DIR] [--quick | --smoke]

Writes ``hybrid_step.json`` (GPU, versions, every setting, all timings) and ``hybrid_step.png``
to DIR (default: $OUT if set, else benchmarks/results). ``--quick``: bs 1 and 8. ``--smoke``:
a tiny float32 config on the CPU (reference ops, static tier buffers without graphs, 2
iterations), written as ``hybrid_step_smoke.json``; it checks the script, times nothing real.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch

from dspark_compile import VerifyLayout, dspark_compile
from dspark_compile.session.tiers import Tier
from common import (capture_graph, max_err_vs_hf, mix_lens, plot_step_ms,
                    time_ms as _time_ms)

PATTERN = ["linear_attention"] * 3 + ["full_attention"]
QWEN3_NEXT_SMALL = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
    layer_types=PATTERN * 2, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=0,
    max_position_embeddings=4096)
TINY = dict(
    vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    layer_types=PATTERN, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=0,
    max_position_embeddings=512)


@dataclass(frozen=True)
class Settings:
    """Everything a run depends on; all of it is written to the JSON."""

    name: str
    """"full", "quick" or "smoke" (the JSON file's suffix)."""
    device: str
    """"cuda" (Triton lowering, Inductor, tier graphs) or "cpu" (reference ops, no graphs)."""
    model: dict
    """Qwen3NextConfig arguments (random weights, seed 0)."""
    dtype: str
    """Weights, KV and logits dtype: "bfloat16" or "float32"."""
    batches: tuple[int, ...]
    """Requests per verify step, one row of results each."""
    context: int = 1024
    """Committed tokens per request (random KV and linear state stand in for a prefill)."""
    page_size: int = 16
    """KV page size in tokens."""
    block: int = 8
    """Most tokens a request verifies (gamma + 1): the dense baseline pads to it."""
    mean_len: int = 3
    """Mean verify length of the mix and the uniform width."""
    iters: int = 50
    """Timed calls per measurement (graph replays: twice as many)."""
    warmup: int = 3
    """Untimed calls before each measurement."""
    hbm_bytes_per_s: float = 4.8e12
    """H200 HBM bandwidth, for the floor."""
    peak_flops: float = 790e12
    """H200 dense bf16 peak, for the floor."""

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"


FULL = Settings("full", "cuda", QWEN3_NEXT_SMALL, "bfloat16", (1, 8, 64, 128))
QUICK = replace(FULL, name="quick", batches=(1, 8), iters=20)
SMOKE = Settings("smoke", "cpu", TINY, "float32", (1, 3), context=32, iters=1, warmup=1)


# ---------------------------------------------------------------------- model and shapes
def build_model(s: Settings):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    with torch.device(s.device):
        model = Qwen3NextForCausalLM(Qwen3NextConfig(**s.model))
    model = model.to(getattr(torch, s.dtype)).eval()
    model.set_attn_implementation("sdpa")
    return model


def shapes_for(s: Settings, bs: int) -> dict[str, list[int]]:
    return {"mix3": mix_lens(bs, s.block, s.mean_len), "uniform3": [s.mean_len] * bs,
            "all8": [s.block] * bs}


def tiers_for(s: Settings) -> tuple[Tier, ...]:
    """Only the tiers the batches replay: ``(mean * bs, bs)`` (mix and uniform) and
    ``(block * bs, bs)``; a full tier set would capture ~30 graphs for nothing."""
    return tuple(sorted({Tier(max(2, w * bs), bs) for bs in s.batches
                         for w in (s.mean_len, s.block)}))


def time_ms(fn, s: Settings, iters: int) -> float:
    """ms per call (CUDA events on the GPU, wall clock in the CPU smoke run)."""
    return _time_ms(fn, iters, warmup=s.warmup, gpu=s.gpu)


def fill_state(state, s: Settings) -> None:
    """Random KV and linear state, every slot ``context`` tokens committed."""
    for k, v in state.kv_caches:
        k.normal_(0, 0.5)
        v.normal_(0, 0.5)
    for conv, rec in zip(state.linear.conv_states, state.linear.recurrent_states):
        conv.normal_(0, 0.5)
        rec.normal_(0, 0.05)
    state.committed_lens[:] = s.context


def ours_row(verifier, state, s: Settings, bs: int) -> dict:
    """Tier-graph verify of each shape, and the commit of every token (state replay)."""
    row = {}
    for name, lens in shapes_for(s, bs).items():
        state.committed_lens[:bs] = s.context  # the last shape's timed commits moved it on
        layout = VerifyLayout.pack(lens, [s.context] * bs, list(range(bs)))
        ids = torch.randint(0, s.model["vocab_size"], (layout.num_tokens,), device=s.device)
        row[f"ours_graph_{name}_ms"] = time_ms(lambda: verifier(ids, layout, state), s,
                                               2 * s.iters)
        if name == "uniform3":
            continue

        def commit(layout=layout, lens=lens):
            state.committed_lens[:bs] = s.context  # the same step, committed again
            verifier.commit(layout, lens, state)

        row[f"ours_commit_{name}_ms"] = time_ms(commit, s, s.iters)
    state.committed_lens[:] = s.context
    return row


# ---------------------------------------------------------------------- HF dense
def hf_dense(model, s: Settings, bs: int):
    """HF's forward on ``[bs, block]`` over its own StaticCache holding ``context`` tokens;
    returns (step fn, captured graph or None, capture error or None, cache layer classes)."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=s.context + s.block)
    ids = torch.randint(0, s.model["vocab_size"], (bs, s.block), device=s.device)
    pos = torch.arange(s.context, s.context + s.block, device=s.device).expand(bs, -1)
    keys = torch.arange(s.context + s.block, device=s.device)
    mask = (keys[None, :] <= pos[0][:, None]).expand(bs, 1, s.block, -1)  # [bs, 1, T, C+T]
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else \
        "past_key_values"  # transformers 5.24 / 5.17; a wrong name is silently ignored

    def step():
        for layer in cache.layers:  # every step writes positions context.. again
            if getattr(layer, "is_initialized", False) and hasattr(layer, "cumulative_length"):
                layer.cumulative_length.fill_(s.context)
        with torch.no_grad():
            return model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                         **{cache_kw: cache}).logits

    step()  # allocates the cache; later calls take the cached (verify) path
    for t in _cache_tensors(cache):
        t.normal_(0, 0.05 if t.dtype == torch.float32 else 0.5)
    classes = sorted({type(layer).__name__ for layer in cache.layers})
    if not s.gpu:
        return step, None, "no CUDA device (--smoke): eager only", classes
    return (step, *capture_graph(step), classes)


def _cache_tensors(cache) -> list[torch.Tensor]:
    """KV of the StaticLayers, conv and recurrent state of the LinearAttentionLayers."""
    out = []
    for layer in cache.layers:
        for name in ("keys", "values", "conv_states", "recurrent_states"):
            value = getattr(layer, name, None)
            values = value.values() if isinstance(value, dict) else \
                value if isinstance(value, (list, tuple)) else [value]
            out += [t for t in values if isinstance(t, torch.Tensor)]
    return out


def hf_gdn_path() -> dict:
    """Which GDN kernels HF's modeling module runs: the packages, else its torch fallbacks."""
    have = {p: importlib.util.find_spec(p) is not None for p in ("fla", "causal_conv1d",
                                                                  "kernels")}
    return {"packages_installed": have,
            "gated_delta_rule": "fla chunk_gated_delta_rule" if have["fla"] else
            "HF torch fallback torch_chunk_gated_delta_rule (fla absent)",
            "conv1d": "causal_conv1d package" if have["causal_conv1d"] else
            "HF torch fallback causal_conv1d_fn (F.conv1d over cat(state, x); causal_conv1d "
            "absent)"}


# ---------------------------------------------------------------------- floor
def floor_ms(s: Settings, linear_params: int, bs: int, mean_len: float) -> float:
    """max(weight bytes / BW, 2 * params * N / peak) + (KV + linear state) bytes / BW, in ms:
    the full-attention KV of ``context + mean_len`` tokens, the fp32 recurrent state and the
    conv window of every GDN layer, read once."""
    m, elem = s.model, torch.finfo(getattr(torch, s.dtype)).bits // 8
    full = m["layer_types"].count("full_attention")
    lin = m["layer_types"].count("linear_attention")
    linear = max(linear_params * elem / s.hbm_bytes_per_s,
                 2 * linear_params * bs * mean_len / s.peak_flops)
    kv = bs * (s.context + mean_len) * full * 2 * m["num_key_value_heads"] * m["head_dim"] * elem
    conv_dim = 2 * m["linear_num_key_heads"] * m["linear_key_head_dim"] + \
        m["linear_num_value_heads"] * m["linear_value_head_dim"]
    state = bs * lin * (m["linear_num_value_heads"] * m["linear_key_head_dim"] *
                        m["linear_value_head_dim"] * 4 +
                        conv_dim * (m["linear_conv_kernel_dim"] - 1) * elem)
    return 1e3 * (linear + (kv + state) / s.hbm_bytes_per_s)


# ---------------------------------------------------------------------- run
def compile_and_check(model, s: Settings) -> tuple:
    t0 = time.perf_counter()
    verifier = dspark_compile(model, lowering="triton" if s.gpu else "reference",
                              inductor=s.gpu, page_size=s.page_size, block=s.block)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    max_err = max_err_vs_hf(model, verifier, s.model["vocab_size"], s.device,
                            max_step_tokens=64)
    check_s = time.perf_counter() - t0
    print(f"compiled in {compile_s:.1f} s; check (first calls compile) {check_s:.1f} s; "
          f"max |ours - HF| ({s.dtype}) = {max_err:.3g}", flush=True)
    return verifier, {"compile_seconds": compile_s, "check_seconds": check_s,
                      "max_abs_err_vs_hf": max_err}


def capture(verifier, state, s: Settings) -> dict:
    tiers = tiers_for(s)
    t0 = time.perf_counter()
    reports = verifier.capture(state, tiers=tiers, progress=s.gpu, use_graphs=s.gpu).reports
    out = {"graphs": s.gpu, "tiers": [(t.tokens, t.request_slots) for t in tiers],
           "seconds": time.perf_counter() - t0,
           "pool_bytes": sum(r.pool_bytes for r in reports),  # the graph pool's own segments
           "per_tier": [(r.tier.tokens, r.tier.request_slots, round(r.seconds, 4),
                         r.pool_bytes) for r in reports]}
    print(f"captured {len(reports)} of {len(tiers)} tiers in {out['seconds']:.1f} s, pool "
          f"{out['pool_bytes'] / 2**30:.2f} GiB", flush=True)
    return out


def hf_row(model, s: Settings, bs: int) -> tuple[dict, list[str]]:
    step, graph, error, classes = hf_dense(model, s, bs)
    row = {"hf_dense8_eager_ms": time_ms(step, s, s.iters),
           "hf_dense8_graph_ms": time_ms(graph.replay, s, 2 * s.iters) if graph else None,
           "hf_dense8_graph_error": error}
    del step, graph
    if s.gpu:
        torch.cuda.empty_cache()
    return row, classes


def run(s: Settings, save) -> dict:
    model = build_model(s)
    params = sum(p.numel() for p in model.parameters())
    linear_params = params - model.model.embed_tokens.weight.numel()  # the LM head is read
    verifier, check = compile_and_check(model, s)
    max_bs = max(s.batches)
    state = verifier.new_state(max_requests=max_bs, max_context=s.context + s.block,
                               max_step_tokens=max_bs * s.block)  # rings hold the largest tier
    fill_state(state, s)
    shapes = {bs: shapes_for(s, bs) for bs in s.batches}
    data = {"params": params, "linear_params": linear_params, **check,
            "shapes": {str(bs): v["mix3"] for bs, v in shapes.items()}, "partial": True}
    results = {bs: {} for bs in s.batches}
    for bs in s.batches:  # eager first: every Inductor compile happens before the capture
        layout = VerifyLayout.pack(shapes[bs]["mix3"], [s.context] * bs, list(range(bs)))
        ids = torch.randint(0, s.model["vocab_size"], (layout.num_tokens,), device=s.device)
        results[bs]["ours_eager_mix3_ms"] = time_ms(lambda: verifier(ids, layout, state), s,
                                                    s.iters)
    data["capture"] = capture(verifier, state, s)
    for bs in s.batches:
        results[bs].update(ours_row(verifier, state, s, bs))
        hf, data["hf_cache_layers"] = hf_row(model, s, bs)
        results[bs].update(hf)
        for mean, name in ((s.mean_len, "floor_mean3_ms"), (s.block, "floor_all8_ms")):
            results[bs][name] = floor_ms(s, linear_params, bs, mean)
        print(bs, {k: (round(v, 3) if isinstance(v, float) else v)
                   for k, v in results[bs].items()}, flush=True)
        data["results"] = {str(k): v for k, v in results.items()}
        save(data)
    del data["partial"]
    return data


def environment(s: Settings) -> dict:
    import transformers

    try:
        import triton
    except ImportError:  # the CPU smoke run needs no Triton
        triton = None
    gpu = torch.cuda.get_device_name() if s.gpu else \
        f"cpu ({platform.processor() or platform.machine()})"
    return {"gpu": gpu, "torch": torch.__version__,
            "triton": getattr(triton, "__version__", None),
            "transformers": transformers.__version__, "python": platform.python_version(),
            "command": " ".join(sys.argv),
            "model": "Qwen3-Next-like, random weights (seed 0): hidden 2048, 8 layers (3 GDN + 1 "
                     "full attention, twice), GDN 16 key / 32 value heads K = V = 128 conv 4, "
                     "attention 16 q / 2 kv heads head 256 (output gate, partial rotary 0.25), "
                     "dense MLP 5632 (the real model's active expert width), vocab 151936"
                     if s.name != "smoke" else "tiny Qwen3-Next (3 GDN + 1 full attention)",
            "timing": "mean of back-to-back calls between two CUDA events after warm-ups "
                      "(graph replays: 2x iters); wall clock on the CPU",
            "ours": "dspark_compile(lowering='triton', inductor=True), tier graphs of the "
                    "needed tiers only; commit timed on its own with every token accepted"
                    if s.gpu else "dspark_compile(lowering='reference'), static tier buffers "
                                  "without graphs",
            "hf_dense": {"forward": "model(input_ids [bs, block], position_ids, 4D boolean mask "
                                    "[bs, 1, block, context + block], StaticCache, "
                                    "use_cache=True), sdpa",
                         "why_4d_mask": "HF's create_causal_mask evaluates q_offset == 0 on a "
                                        "cache tensor (a host sync): not capturable",
                         "gdn": hf_gdn_path()}}


def plot(data: dict, path: str) -> None:
    res = data["results"]
    hf = "hf_dense8_graph_ms" if all(r["hf_dense8_graph_ms"] for r in res.values()) else \
        "hf_dense8_eager_ms"
    plot_step_ms(res, (("ours_graph_mix3_ms", "ours ragged, mean 3 (tier graph)"),
                       ("ours_graph_uniform3_ms", "ours uniform 3 (tier graph)"),
                       ("ours_graph_all8_ms", "ours all 8 (tier graph)"),
                       ("ours_eager_mix3_ms", "ours ragged, mean 3 (eager)"),
                       (hf, f"HF dense padded to 8 ({hf.split('_')[2]})"),
                       ("floor_mean3_ms", "floor, mean 3")),
                 f"hybrid (Qwen3-Next-like) verify step, {data['environment']['gpu']}", path)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="bs 1 and 8, fewer iterations")
    group.add_argument("--smoke", action="store_true", help="tiny config on the CPU")
    parser.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    args = parser.parse_args(argv)
    s = SMOKE if args.smoke else QUICK if args.quick else FULL
    if s.gpu and not torch.cuda.is_available():
        sys.exit("hybrid_step.py needs a GPU; use --smoke on the CPU")
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "hybrid_step" if s.name == "full" else f"hybrid_step_{s.name}")
    head = {"environment": environment(s), "settings": asdict(s)}

    def save(part: dict) -> None:
        with open(stem + ".json", "w") as f:
            json.dump({**head, **part}, f, indent=1)

    data = {**head, **run(s, save)}
    try:
        plot(data, stem + ".png")
        data["png"] = stem + ".png"
    except ImportError as err:  # matplotlib is not a dependency of the package
        data["png"] = None
        print(f"no plot ({err}); the JSON has every number")
    save(data)
    print(json.dumps(data["results"], indent=1))
    return data


if __name__ == "__main__":
    main()
