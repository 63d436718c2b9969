"""Hybrid verify-step benchmark on one GPU: a small Qwen3-Next-like model (Gated DeltaNet +
gated full attention, bf16, random weights), ours ragged against HF's own dense forward padded
to the block, side by side in one run.

Model: Qwen3-Next's layer pattern (3 GDN layers, then 1 full attention) twice: 8 layers, hidden
2048; GDN heads of the real model (16 key heads, 32 value heads, K = V = 128, conv kernel 4);
full attention 16 q heads / 2 kv heads, head 256, partial rotary 0.25 (HF's defaults); vocab
151936. MLP: dense, intermediate 5632 = the real model's active expert width per token (10
routed x 512 + 1 shared x 512). ``--variant moe``: the same model with its real experts (512
routed of width 512, top 10, one shared); ``--variant a3b``: Qwen3-30B-A3B's layer (128 experts
of width 768, top 8, attention 32 q / 4 kv heads of 128), 12 layers, bs up to 256. HF's dense
baseline runs its experts as ``grouped_mm`` where torch has it on the GPU (JSON:
``hf_experts``); the floor counts the experts a step's picks reach under uniform routing.

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

    python benchmarks/hybrid_step.py [--out DIR] [--quick | --smoke] [--variant moe|a3b]
        [--bs 1 8] [--attribute] [--check-only]

Writes ``hybrid_step.json`` (``hybrid_step_<variant>.json`` for a variant; GPU, versions, every
setting, all timings) and the same-named ``.png``
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
from common import (capture_graph, errors_vs_float32, max_err_vs_hf, mix_lens,
                    plot_step_ms, step_tiers, time_ms as _time_ms)

PATTERN = ["linear_attention"] * 3 + ["full_attention"]
QWEN3_NEXT_SMALL = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
    layer_types=PATTERN * 2, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=0,
    max_position_embeddings=4096)
QWEN3_NEXT_MOE = dict(  # the real model's experts: 512 of width 512, top 10, one shared
    QWEN3_NEXT_SMALL, intermediate_size=5120, num_experts=512, num_experts_per_tok=10,
    moe_intermediate_size=512, shared_expert_intermediate_size=512, norm_topk_prob=True)
A3B_SMALL = dict(  # Qwen3-30B-A3B's layer with 12 of its 48 layers: ~1B parameters per token
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=12,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
    max_position_embeddings=4096)
TINY = dict(
    vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    layer_types=PATTERN, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=0,
    max_position_embeddings=512)
TINY_MOE = dict(TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=32)
TINY_A3B = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=512)
FAMILIES = {"qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
            "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}


@dataclass(frozen=True)
class Settings:
    """Everything a run depends on; all of it is written to the JSON."""

    name: str
    """"full", "quick" or "smoke" (the JSON file's suffix)."""
    device: str
    """"cuda" (Triton lowering, Inductor, tier graphs) or "cpu" (reference ops, no graphs)."""
    model: dict
    """Config arguments of ``family`` (random weights, seed 0)."""
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
    family: str = "qwen3_next"
    """Key of :data:`FAMILIES`: the transformers model class."""
    variant: str = "dense_mlp"
    """``dense_mlp`` (Qwen3-Next's layers, a dense MLP of the active expert width), ``moe``
    (Qwen3-Next with its real experts) or ``a3b`` (Qwen3-30B-A3B's layer, 12 layers)."""

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"


FULL = Settings("full", "cuda", QWEN3_NEXT_SMALL, "bfloat16", (1, 8, 64, 128))
QUICK = replace(FULL, name="quick", batches=(1, 8), iters=20)
SMOKE = Settings("smoke", "cpu", TINY, "float32", (1, 3), context=32, iters=1, warmup=1)
VARIANTS = {  # --variant: (full model, tiny model for --smoke, family, batches)
    "dense_mlp": (QWEN3_NEXT_SMALL, TINY, "qwen3_next", (1, 8, 64, 128)),
    "moe": (QWEN3_NEXT_MOE, TINY_MOE, "qwen3_next", (1, 8, 64, 128)),
    "a3b": (A3B_SMALL, TINY_A3B, "qwen3_moe", (1, 8, 64, 256))}


def settings_for(base: Settings, variant: str) -> Settings:
    full, tiny, family, batches = VARIANTS[variant]
    if base.name == "smoke":
        return replace(base, model=tiny, family=family, variant=variant)
    return replace(base, model=full, family=family, variant=variant,
                   batches=batches if base.name == "full" else base.batches)


# ---------------------------------------------------------------------- model and shapes
def build_model(s: Settings):
    import transformers

    config_cls, model_cls = (getattr(transformers, n) for n in FAMILIES[s.family])
    torch.manual_seed(0)
    with torch.device(s.device):
        model = model_cls(config_cls(**s.model))
    model = model.to(getattr(torch, s.dtype)).eval()
    model.set_attn_implementation("sdpa")
    return model


def hf_experts_path(model, s: Settings) -> str | None:
    """HF's experts for the dense baseline: ``grouped_mm`` (one grouped GEMM) where this torch
    has it on the GPU, else HF's own loop; None without experts."""
    if not s.model.get("num_experts"):
        return None
    impl = "grouped_mm" if s.gpu and hasattr(torch, "_grouped_mm") else "eager"
    model.set_experts_implementation(impl)
    return impl


def shapes_for(s: Settings, bs: int) -> dict[str, list[int]]:
    return {"mix3": mix_lens(bs, s.block, s.mean_len), "uniform3": [s.mean_len] * bs,
            "all8": [s.block] * bs}


def tiers_for(s: Settings) -> tuple[Tier, ...]:
    """``(mean * bs, bs)`` (mix and uniform) and ``(block * bs, bs)``."""
    return step_tiers(s.batches, (s.mean_len, s.block))


def time_ms(fn, s: Settings, iters: int) -> float:
    """ms per call (CUDA events on the GPU, wall clock in the CPU smoke run)."""
    return _time_ms(fn, iters, warmup=s.warmup, gpu=s.gpu)


def fill_state(state, s: Settings) -> None:
    """Random KV and linear state, every slot ``context`` tokens committed."""
    for k, v in state.kv_caches:
        k.normal_(0, 0.5)
        v.normal_(0, 0.5)
    linear = getattr(state, "linear", None)
    for conv, rec in zip(getattr(linear, "conv_states", ()),
                         getattr(linear, "recurrent_states", ())):
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
def expert_params(s: Settings) -> int:
    """Parameters of one routed expert (gate, up and down)."""
    return 3 * s.model["hidden_size"] * s.model["moe_intermediate_size"] \
        if s.model.get("num_experts") else 0


def floor_ms(s: Settings, linear_params: int, bs: int, mean_len: float) -> float:
    """max(weight bytes / BW, 2 * params per token * N / peak) + (KV + linear state) bytes /
    BW, in ms: the full-attention KV of ``context + mean_len`` tokens, the fp32 recurrent
    state and the conv window of every GDN layer, read once. With experts, the weight bytes are
    those of the experts the step's ``N * top_k`` picks reach, in expectation under uniform
    routing (``E (1 - (1 - k / E)^N)`` per layer), and the flops count ``k`` experts per token."""
    m, elem = s.model, torch.finfo(getattr(torch, s.dtype)).bits // 8
    kinds = m.get("layer_types") or ["full_attention"] * m["num_hidden_layers"]
    full, lin = kinds.count("full_attention"), kinds.count("linear_attention")
    n = bs * mean_len
    read, per_token = linear_params, linear_params
    if m.get("num_experts"):
        e, k, layers = m["num_experts"], m["num_experts_per_tok"], m["num_hidden_layers"]
        routed = layers * e * expert_params(s)
        read = linear_params - routed + layers * e * (1 - (1 - k / e) ** n) * expert_params(s)
        per_token = linear_params - routed + layers * k * expert_params(s)
    linear = max(read * elem / s.hbm_bytes_per_s, 2 * per_token * n / s.peak_flops)
    kv = bs * (s.context + mean_len) * full * 2 * m["num_key_value_heads"] * m["head_dim"] * elem
    state = 0
    if lin:
        conv_dim = 2 * m["linear_num_key_heads"] * m["linear_key_head_dim"] + \
            m["linear_num_value_heads"] * m["linear_value_head_dim"]
        state = bs * lin * (m["linear_num_value_heads"] * m["linear_key_head_dim"] *
                            m["linear_value_head_dim"] * 4 +
                            conv_dim * (m["linear_conv_kernel_dim"] - 1) * elem)
    return 1e3 * (linear + (kv + state) / s.hbm_bytes_per_s)


# ---------------------------------------------------------------------- run
def compile_and_check(model, s: Settings, check: bool = True) -> tuple:
    """The verifier and its check against HF (``check_against_hf``), or with ``check=False``
    the compile alone (the check comes later)."""
    t0 = time.perf_counter()
    verifier = dspark_compile(model, lowering="triton" if s.gpu else "reference",
                              inductor=s.gpu, page_size=s.page_size, block=s.block)
    compile_s = time.perf_counter() - t0
    print(f"compiled in {compile_s:.1f} s", flush=True)
    out = {"compile_seconds": compile_s}
    if check:
        out.update(check_against_hf(model, verifier, s))
    return verifier, out


def check_against_hf(model, verifier, s: Settings) -> dict:
    t0 = time.perf_counter()
    max_err = max_err_vs_hf(model, verifier, s.model["vocab_size"], s.device,
                            max_step_tokens=64)
    check_s = time.perf_counter() - t0
    print(f"check {check_s:.1f} s; max |ours - HF| ({s.dtype}) = {max_err:.3g}", flush=True)
    return {"check_seconds": check_s, "max_abs_err_vs_hf": max_err}


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
    """HF's dense step at ``bs``; on a CUDA out-of-memory error the row says so, with no times
    (the cache classes then come back empty)."""
    try:
        step, graph, error, classes = hf_dense(model, s, bs)
    except torch.OutOfMemoryError as err:
        torch.cuda.empty_cache()
        return {"hf_dense8_eager_ms": None, "hf_dense8_graph_ms": None,
                "hf_dense8_graph_error": None,
                "hf_dense8_error": "torch.OutOfMemoryError: " + str(err).split(". GPU")[0]}, []
    row = {"hf_dense8_eager_ms": time_ms(step, s, s.iters),
           "hf_dense8_graph_ms": time_ms(graph.replay, s, 2 * s.iters) if graph else None,
           "hf_dense8_graph_error": error}
    del step, graph
    if s.gpu:
        torch.cuda.empty_cache()
    return row, classes


def run(s: Settings, save, attribute: bool = False, check_only: bool = False,
        check_last: bool = False) -> dict:
    model = build_model(s)
    params = sum(p.numel() for p in model.parameters())
    linear_params = params - model.model.embed_tokens.weight.numel()  # the LM head is read
    check_last = check_last and not (attribute or check_only)
    verifier, check = compile_and_check(model, s, check=not check_last)
    if attribute:
        check["errors_vs_float32"] = errors_vs_float32(model, verifier, s.model["vocab_size"],
                                                       s.device)
    if check_only:
        return {"params": params, **check, "results": {}}
    experts = hf_experts_path(model, s)  # after the check: HF's oracle ran its default
    max_bs = max(s.batches)
    state = verifier.new_state(max_requests=max_bs, max_context=s.context + s.block,
                               max_step_tokens=max_bs * s.block)  # rings hold the largest tier
    fill_state(state, s)
    shapes = {bs: shapes_for(s, bs) for bs in s.batches}
    data = {"params": params, "linear_params": linear_params, "hf_experts": experts,
            "params_per_token": linear_params - (
                s.model["num_hidden_layers"] * (s.model.get("num_experts", 0) -
                                                s.model.get("num_experts_per_tok", 0))
                * expert_params(s)), **check,
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
        hf, classes = hf_row(model, s, bs)
        data["hf_cache_layers"] = classes or data.get("hf_cache_layers", [])
        results[bs].update(hf)
        for mean, name in ((s.mean_len, "floor_mean3_ms"), (s.block, "floor_all8_ms")):
            results[bs][name] = floor_ms(s, linear_params, bs, mean)
        print(bs, {k: (round(v, 3) if isinstance(v, float) else v)
                   for k, v in results[bs].items()}, flush=True)
        data["results"] = {str(k): v for k, v in results.items()}
        save(data)
    if check_last:  # HF's experts are on ``experts`` by now: the check runs against that path
        data.update(check_against_hf(model, verifier, s), check_last=True)
    del data["partial"]
    return data


MODEL_WORDS = {
    "dense_mlp": "Qwen3-Next-like, random weights (seed 0): hidden 2048, 8 layers (3 GDN + 1 "
                 "full attention, twice), GDN 16 key / 32 value heads K = V = 128 conv 4, "
                 "attention 16 q / 2 kv heads head 256 (output gate, partial rotary 0.25), "
                 "dense MLP 5632 (the real model's active expert width), vocab 151936",
    "moe": "Qwen3-Next-like as dense_mlp, with the real model's experts: 512 routed experts of "
           "width 512, top 10, one shared expert of width 512, random router",
    "a3b": "Qwen3-30B-A3B-like, random weights (seed 0): hidden 2048, 12 of its 48 layers, "
           "attention 32 q / 4 kv heads head 128 (q/k norm), 128 experts of width 768, top 8, "
           "vocab 151936"}


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
            "model": MODEL_WORDS[s.variant] if s.name != "smoke" else
                     f"tiny {s.family} ({s.variant})",
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
                 f"{data['settings']['family']} ({data['settings']['variant']}) verify step, "
                 f"{data['environment']['gpu']}", path)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="bs 1 and 8, fewer iterations")
    group.add_argument("--smoke", action="store_true", help="tiny config on the CPU")
    parser.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="dense_mlp",
                        help="dense_mlp (default), moe (Qwen3-Next's real experts) or a3b "
                             "(Qwen3-30B-A3B's layer, 12 layers)")
    parser.add_argument("--bs", type=int, nargs="+", help="batch sizes (default: the variant's)")
    parser.add_argument("--attribute", action="store_true",
                        help="also compare ours and HF's own forward against a float32 copy of "
                             "the model (errors_vs_float32 in the JSON; needs the copy's memory)")
    parser.add_argument("--check-only", action="store_true",
                        help="compile and check against HF (and --attribute), time nothing")
    parser.add_argument("--check-last", action="store_true",
                        help="check against HF after the timings, not before the capture "
                             "(HF's forward then allocates nothing before it); files get a "
                             "_check_last suffix")
    args = parser.parse_args(argv)
    s = settings_for(SMOKE if args.smoke else QUICK if args.quick else FULL, args.variant)
    if args.bs:
        s = replace(s, batches=tuple(args.bs))
    if s.gpu and not torch.cuda.is_available():
        sys.exit("hybrid_step.py needs a GPU; use --smoke on the CPU")
    os.makedirs(args.out, exist_ok=True)
    base = "hybrid_step" if s.variant == "dense_mlp" else f"hybrid_step_{s.variant}"
    stem = os.path.join(args.out, base if s.name == "full" else f"{base}_{s.name}")
    if args.check_last:
        stem += "_check_last"
    head = {"environment": environment(s), "settings": asdict(s)}

    def save(part: dict) -> None:
        with open(stem + ".json", "w") as f:
            json.dump({**head, **part}, f, indent=1)

    data = {**head, **run(s, save, args.attribute, args.check_only, args.check_last)}
    if args.check_only:
        save(data)
        print(json.dumps({k: v for k, v in data.items() if k not in head}, indent=1))
        return data
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
