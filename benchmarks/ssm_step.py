"""State-space hybrid verify-step benchmark on one GPU: a ~1.2B Nemotron-H-like model (Mamba-2
mixers, attention and ReLU^2 MLP layers, bf16, random weights), ours ragged against HF's own
dense forward padded to the block, side by side in one run.

Model: 24 layers, the pattern (Mamba-2, MLP, Mamba-2, MLP, attention, MLP) four times: 8 Mamba-2
mixers (64 heads of P = 64, 8 groups of N = 128, conv 4: Nemotron-H's mixer at hidden 2048), 4
attention layers (16 q / 8 kv heads, head 128), 12 MLPs (intermediate 8192), vocab 131072
(Nemotron-H's), untied head. Context 1024 (page 16), block 8, bs 1 / 8 / 64 / 128; verify
lengths all 8, uniform 3 and a fixed-seed mix of 1..8 with mean exactly 3. HF is timed over 5
calls from bs 64 (its torch fallback scan takes about a second a call there).

Columns and method are ``hybrid_step.py``'s (this script reuses its functions): ours in the tier
graphs of the tiers the batches need (``dspark_compile(model, lowering="triton",
inductor=True)``), the mix once more eagerly, the commit of every token timed on its own; HF
dense padded to 8 over its own ``StaticCache`` (``LinearAttentionLayer`` conv/SSM state for the
mixers), in a CUDA graph when it captures. Without ``mamba_ssm`` / ``causal_conv1d`` HF runs its
torch fallbacks (``mamba2_chunk_scan``, ``F.conv1d``); the JSON says which. Floor: max(weight
bytes / BW, 2 * params * N / peak) + (attention KV + fp32 SSM state + conv windows) / BW, the
layer shapes read off the verifier.

    python benchmarks/ssm_step.py [--out DIR] [--quick | --smoke]

Writes ``ssm_step.json`` (and ``ssm_step.png``) to DIR (default: $OUT if set, else
benchmarks/results). ``--quick``: bs 1 and 8. ``--smoke``: a tiny float32 config on the CPU
(reference ops, static tier buffers without graphs), ``ssm_step_smoke.json``; it checks the
script, times nothing real.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from dataclasses import asdict, replace

import torch

from dspark_compile import VerifyLayout
from hybrid_step import (Settings, capture, compile_and_check, fill_state, hf_row, ours_row,
                         shapes_for, time_ms)
from common import plot_step_ms, versions

PATTERN = ["mamba", "mlp", "mamba", "mlp", "attention", "mlp"]
NEMOTRON_H_1B = dict(
    vocab_size=131072, hidden_size=2048, layers_block_type=PATTERN * 4,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=8192,
    mamba_num_heads=64, mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4,
    chunk_size=128, max_position_embeddings=4096, tie_word_embeddings=False)
TINY = dict(
    vocab_size=101, hidden_size=32, layers_block_type=PATTERN, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=4,
    mamba_head_dim=16, ssm_state_size=8, n_groups=2, conv_kernel=4, chunk_size=4,
    max_position_embeddings=512, tie_word_embeddings=False)

FULL = Settings("full", "cuda", NEMOTRON_H_1B, "bfloat16", (1, 8, 64, 128))
QUICK = replace(FULL, name="quick", batches=(1, 8), iters=20)
SMOKE = Settings("smoke", "cpu", TINY, "float32", (1, 3), context=32, iters=1, warmup=1)


def build_model(s: Settings):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(0)
    with torch.device(s.device):
        model = NemotronHForCausalLM(NemotronHConfig(**s.model))
    model = model.to(getattr(torch, s.dtype)).eval()
    model.set_attn_implementation("sdpa")
    return model


def floor_ms(s: Settings, verifier, linear_params: int, bs: int, mean_len: float) -> float:
    """The step's serial floor in ms (module docstring), layer shapes from ``verifier``."""
    elem = torch.finfo(getattr(torch, s.dtype)).bits // 8
    linear = max(linear_params * elem / s.hbm_bytes_per_s,
                 2 * linear_params * bs * mean_len / s.peak_flops)
    kv = bs * (s.context + mean_len) * sum(a.num_kv_heads * (a.head_dim + a.value_dim)
                                           for a in verifier.adapter.specs) * elem
    state = bs * sum(m.num_v_heads * m.head_k_dim * m.head_v_dim * 4 +
                     m.conv_dim * (m.conv_width - 1) * elem
                     for m in verifier.adapter.linear_specs)
    return 1e3 * (linear + (kv + state) / s.hbm_bytes_per_s)


HF_ITERS_LARGE = 5
"""Timed HF calls from bs 64 (its fallback scan takes about a second a call there)."""


def hf_settings(s: Settings, bs: int) -> Settings:
    """``s`` with at most ``HF_ITERS_LARGE`` timed calls from bs 64 on."""
    return replace(s, iters=min(s.iters, HF_ITERS_LARGE)) if bs >= 64 else s


def run(s: Settings, save) -> dict:
    model = build_model(s)
    params = sum(p.numel() for p in model.parameters())
    linear_params = params - model.get_input_embeddings().weight.numel()  # the head is read
    verifier, check = compile_and_check(model, s)
    max_bs = max(s.batches)
    state = verifier.new_state(max_requests=max_bs, max_context=s.context + s.block,
                               max_step_tokens=max_bs * s.block)
    fill_state(state, s)
    shapes = {bs: shapes_for(s, bs) for bs in s.batches}
    data = {"params": params, "linear_params": linear_params, **check,
            "mixers": len(verifier.adapter.linear_specs),
            "attention_layers": len(verifier.adapter.specs),
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
        # HF's torch fallback scan takes about a second a call from bs 64: fewer calls there
        hf_s = hf_settings(s, bs)
        hf, classes = hf_row(model, hf_s, bs)
        data["hf_cache_layers"] = classes or data.get("hf_cache_layers", [])
        results[bs]["hf_iters"] = hf_s.iters
        results[bs].update(hf)
        for mean, name in ((s.mean_len, "floor_mean3_ms"), (s.block, "floor_all8_ms")):
            results[bs][name] = floor_ms(s, verifier, linear_params, bs, mean)
        print(bs, {k: (round(v, 3) if isinstance(v, float) else v)
                   for k, v in results[bs].items()}, flush=True)
        data["results"] = {str(k): v for k, v in results.items()}
        save(data)
    del data["partial"]
    return data


def environment(s: Settings) -> dict:
    have = {p: importlib.util.find_spec(p) is not None for p in ("mamba_ssm", "causal_conv1d")}
    return {**versions(s.gpu),
            "command": " ".join(sys.argv),
            "model": "Nemotron-H-like, random weights (seed 0): hidden 2048, 24 layers "
                     "(M, MLP, M, MLP, A, MLP) x 4; Mamba-2 64 heads P 64, 8 groups N 128, conv "
                     "4; attention 16 q / 8 kv heads head 128; MLP 8192 relu2; vocab 131072"
                     if s.name != "smoke" else "tiny Nemotron-H (M, MLP, M, MLP, A, MLP)",
            "hf_dense": {"packages_installed": have,
                         "scan": "mamba_ssm" if have["mamba_ssm"] else
                         "HF torch fallback mamba2_chunk_scan (mamba_ssm absent)"}}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="bs 1 and 8, fewer iterations")
    group.add_argument("--smoke", action="store_true", help="tiny config on the CPU")
    parser.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    args = parser.parse_args(argv)
    s = SMOKE if args.smoke else QUICK if args.quick else FULL
    if s.gpu and not torch.cuda.is_available():
        sys.exit("ssm_step.py needs a GPU; use --smoke on the CPU")
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "ssm_step" if s.name == "full" else f"ssm_step_{s.name}")
    head = {"environment": environment(s), "settings": asdict(s)}

    def save(part: dict) -> None:
        with open(stem + ".json", "w") as f:
            json.dump({**head, **part}, f, indent=1)

    data = {**head, **run(s, save)}
    try:
        res = data["results"]
        hf = "hf_dense8_graph_ms" if all(r["hf_dense8_graph_ms"] for r in res.values()
                                         if r["hf_dense8_eager_ms"]) else "hf_dense8_eager_ms"
        plot_step_ms(res, (("ours_graph_mix3_ms", "ours ragged, mean 3 (tier graph)"),
                           ("ours_graph_all8_ms", "ours all 8 (tier graph)"),
                           (hf, f"HF dense padded to 8 ({hf.split('_')[2]})"),
                           ("floor_mean3_ms", "floor, mean 3")),
                     f"Nemotron-H-like verify step, {data['environment']['gpu']}",
                     stem + ".png")
        data["png"] = stem + ".png"
    except ImportError as err:  # matplotlib is not a dependency of the package
        data["png"] = None
        print(f"no plot ({err}); the JSON has every number")
    save(data)
    print(json.dumps(data["results"], indent=1))
    return data


if __name__ == "__main__":
    main()
