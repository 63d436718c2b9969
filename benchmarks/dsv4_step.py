"""DeepSeek-V4-shaped verify step on one GPU: ours in tier graphs against HF's own forward
padded to the block, side by side in one run.

Model (random weights, seed 0, bf16): DeepSeek-V4's attention at its real dims (hidden 4096, 64
query heads of 512 with a 64-dim rotary slice, one shared K=V head, q and output low rank 1024 in
8 output groups, window 128 with per-head sinks, hyper-connections of 4 streams) in the layer
pattern sliding, HCA (compress rate 128), CSA (rate 4, indexer of 64 heads x 128 keeping 512)
twice: 6 layers. Experts: 64 routed of width 2048, top 6, one shared (the real model routes over
256; 64 keeps the weights on one GPU next to HF's copy of nothing: both paths run the same
module). Vocab 129280. HCA and CSA positions and position biases as HF initialises them, except
``position_bias`` and ``sinks``, drawn N(0, 0.5) so the pooling is not uniform.

Context ``--context`` (default 1024) committed tokens per request, block 8, bs 1 / 8 / 32; verify
lengths: the fixed-seed mix of 1..8 with mean exactly 3, and all 8. Columns:

- ours: ``dspark_compile(model, lowering="triton")`` (no Inductor: untested with the compressed
  ops), replayed from the tier graphs of the needed tiers; the state (KV, raw compressor rows,
  entries) random, every slot at ``context`` tokens.
- HF dense padded to 8: HF's forward of ``[bs, 8]`` tokens over a ``DynamicCache`` prefilled
  with ``context`` tokens by HF itself, eagerly (its compressor caches grow by concatenation:
  no static cache, no CUDA graph); the prefilled cache is restored before every timed call,
  outside the timing, so every call verifies the same step.

Correctness once before timing: prefill + one ragged verify of 3 requests against HF's forward of
each request alone (bf16; the largest |difference| of the logits is recorded).

    python benchmarks/dsv4_step.py [--out DIR] [--bs 1 8] [--context 1024] [--smoke] [--attribute]

Writes ``dsv4_step.json`` (GPU, versions, every setting, all timings; rewritten after each batch
size) to DIR (default: $OUT if set, else benchmarks/results). ``--smoke``: a tiny float32 model
on the CPU (reference ops, no graphs, 1 iteration), ``dsv4_step_smoke.json``: checks the script,
times nothing real.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch

from common import errors_vs_float32, max_err_vs_hf, mix_lens, step_tiers, versions
from dspark_compile import VerifyLayout, dspark_compile

SLIDING, HCA, CSA = "sliding_attention", "heavily_compressed_attention", \
    "compressed_sparse_attention"
REAL = dict(vocab_size=129280, hidden_size=4096, num_attention_heads=64, head_dim=512,
            qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
            sliding_window=128, hc_mult=4, index_n_heads=64, index_head_dim=128,
            index_topk=512, compress_rates={CSA: 4, HCA: 128}, num_local_experts=64,
            num_experts_per_tok=6, moe_intermediate_size=2048, intermediate_size=2048,
            layer_types=[SLIDING, HCA, CSA] * 2,
            mlp_layer_types=["hash_moe", "moe", "moe", "moe", "moe", "moe"],
            num_hidden_layers=6, max_position_embeddings=65536)
TINY = dict(vocab_size=96, hidden_size=64, num_attention_heads=4, head_dim=32,
            qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=5,
            hc_mult=2, index_n_heads=4, index_head_dim=16, index_topk=3,
            compress_rates={CSA: 2, HCA: 4}, num_local_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, intermediate_size=64, layer_types=[SLIDING, HCA, CSA],
            mlp_layer_types=["hash_moe", "moe", "moe"], num_hidden_layers=3,
            max_position_embeddings=512)


@dataclass(frozen=True)
class Settings:
    """Everything a run depends on; all of it is written to the JSON."""

    name: str
    """"full" or "smoke" (the JSON file's suffix)."""
    device: str
    """"cuda" (Triton lowering, tier graphs) or "cpu" (reference ops, no graphs)."""
    model: dict
    """DeepseekV4Config arguments (random weights, seed 0)."""
    dtype: str
    batches: tuple[int, ...] = (1, 8, 32)
    context: int = 1024
    page_size: int = 16
    block: int = 8
    mean_len: int = 3
    iters: int = 20
    """Timed calls per measurement (graph replays: twice as many; HF: one event pair each)."""
    warmup: int = 3

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"


FULL = Settings("full", "cuda", REAL, "bfloat16")
SMOKE = Settings("smoke", "cpu", TINY, "float32", batches=(1, 2), context=12, iters=1,
                 warmup=1)


def build_model(s: Settings):
    import transformers

    torch.manual_seed(0)
    with torch.device(s.device):
        model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**s.model))
    with torch.no_grad():  # HF initialises them to zero: make the pooling non-uniform
        for name, p in model.named_parameters():
            if name.endswith("position_bias") or name.endswith("sinks"):
                p.normal_(0.0, 0.5)
    return model.to(getattr(torch, s.dtype)).eval()


def events_ms(fn, s: Settings, iters: int, before=None) -> float:
    """Median ms of ``iters`` calls, each between its own CUDA events (wall clock on the CPU);
    ``before`` runs untimed ahead of every call."""
    for _ in range(s.warmup):
        if before:
            before()
        fn()
    times = []
    for _ in range(iters):
        if before:
            before()
        if s.gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def fill_state(state, s: Settings) -> None:
    """Random KV and compressor pools (raw rows, entries), every slot at ``context`` tokens."""
    for k, v in state.kv_caches:
        k.normal_(0, 0.5)
        v.normal_(0, 0.5)
    for pool in state.compress_pools:
        pool.normal_(0, 0.5)
    state.committed_lens[:] = s.context


def ours_row(verifier, state, s: Settings, bs: int) -> dict:
    row = {}
    for name, lens in (("mix3", mix_lens(bs, s.block, s.mean_len)), ("all8", [s.block] * bs)):
        state.committed_lens[:bs] = s.context
        layout = VerifyLayout.pack(lens, [s.context] * bs, list(range(bs)))
        ids = torch.randint(0, s.model["vocab_size"], (layout.num_tokens,), device=s.device)
        row[f"ours_graph_{name}_ms"] = events_ms(lambda: verifier(ids, layout, state), s,
                                                 2 * s.iters)
    return row


def hf_row(model, s: Settings, bs: int) -> dict:
    """HF's forward of [bs, block] over its own cache prefilled with ``context`` tokens."""
    from transformers import DynamicCache

    gen = torch.Generator(device="cpu").manual_seed(bs)
    prompt = torch.randint(0, s.model["vocab_size"], (bs, s.context), generator=gen)
    step_ids = torch.randint(0, s.model["vocab_size"], (bs, s.block), generator=gen)
    prompt, step_ids = prompt.to(s.device), step_ids.to(s.device)
    kw = _cache_kw(model)
    prefilled = DynamicCache(config=model.config)
    with torch.no_grad():
        for c0 in range(0, s.context, 256):  # chunks bound the prefill's attention memory
            model(input_ids=prompt[:, c0:c0 + 256], use_cache=True, **{kw: prefilled})
    cache = [None]
    pos = torch.arange(s.context, s.context + s.block, device=s.device).expand(bs, -1)

    def restore():
        cache[0] = copy.deepcopy(prefilled)

    def step():
        with torch.no_grad():
            return model(input_ids=step_ids, position_ids=pos, use_cache=True,
                         **{kw: cache[0]}).logits

    return {"hf_dense8_eager_ms": events_ms(step, s, s.iters, before=restore)}


def _cache_kw(model) -> str:
    """transformers 5.24 names the cache argument ``cache``, 5.17 ``past_key_values`` (a wrong
    name is silently ignored, so it is looked up)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else \
        "past_key_values"


def environment(s: Settings) -> dict:
    return {**versions(s.gpu),
            "command": " ".join(sys.argv),
            "timing": "median of per-call CUDA event pairs after warm-ups (graph replays: 2x "
                      "iters); HF's cache restored from a deep copy before every call, untimed",
            "ours": "dspark_compile(lowering='triton'), tier graphs of the needed tiers"
                    if s.gpu else "dspark_compile(lowering='reference'), no graphs",
            "hf_dense": "model(input_ids [bs, block], position_ids, DynamicCache prefilled by HF "
                        "with context tokens, use_cache=True), eager"}


def run(s: Settings, save, attribute: bool = False) -> dict:
    model = build_model(s)
    t0 = time.perf_counter()
    verifier = dspark_compile(model, lowering="triton" if s.gpu else "reference",
                              page_size=s.page_size, block=s.block)
    compile_s = time.perf_counter() - t0
    err = max_err_vs_hf(model, verifier, s.model["vocab_size"], s.device, max_step_tokens=64)
    print(f"compiled in {compile_s:.1f} s; max |ours - HF| ({s.dtype}) = {err:.3g}", flush=True)
    attribution = errors_vs_float32(model, verifier, s.model["vocab_size"], s.device) \
        if attribute else None  # ours and HF's own forward, in the model's dtype, vs float32
    max_bs = max(s.batches)
    state = verifier.new_state(max_requests=max_bs, max_context=s.context + s.block,
                               max_step_tokens=max_bs * s.block)
    fill_state(state, s)
    t0 = time.perf_counter()
    tiers = step_tiers(s.batches, (s.mean_len, s.block))
    verifier.capture(state, tiers=tiers, progress=s.gpu, use_graphs=s.gpu)
    data = {"params": sum(p.numel() for p in model.parameters()), "compile_seconds": compile_s,
            "capture_seconds": time.perf_counter() - t0,
            "tiers": [(t.tokens, t.request_slots) for t in tiers], "max_abs_err_vs_hf": err,
            "errors_vs_float32": attribution,
            "partial": True, "results": {}}
    fill_state(state, s)  # again after the capture's warm-up runs
    for bs in s.batches:
        row = ours_row(verifier, state, s, bs)
        row.update(hf_row(model, s, bs))
        if s.gpu:
            torch.cuda.empty_cache()  # HF's caches of this batch size are gone
        row["hf_over_ours_mix3"] = row["hf_dense8_eager_ms"] / row["ours_graph_mix3_ms"]
        data["results"][str(bs)] = row
        print(bs, {k: round(v, 3) for k, v in row.items()}, flush=True)
        save(data)
    del data["partial"]
    return data


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny config on the CPU")
    parser.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    parser.add_argument("--bs", type=int, nargs="+", help="batch sizes (default 1 8 32)")
    parser.add_argument("--context", type=int, help="committed tokens per request")
    parser.add_argument("--attribute", action="store_true",
                        help="also compare ours and HF's own forward against a float32 copy of "
                             "the model (errors_vs_float32 in the JSON; needs the copy's memory)")
    args = parser.parse_args(argv)
    s = SMOKE if args.smoke else FULL
    if args.bs:
        s = replace(s, batches=tuple(args.bs))
    if args.context:
        s = replace(s, context=args.context)
    if s.gpu and not torch.cuda.is_available():
        sys.exit("dsv4_step.py needs a GPU; use --smoke on the CPU")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "dsv4_step.json" if s.name == "full" else
                        f"dsv4_step_{s.name}.json")
    head = {"environment": environment(s), "settings": asdict(s)}

    def save(part: dict) -> None:
        with open(path, "w") as f:
            json.dump({**head, **part}, f, indent=1)

    data = {**head, **run(s, save, args.attribute)}
    save(data)
    print(json.dumps(data["results"], indent=1))
    return data


if __name__ == "__main__":
    main()
