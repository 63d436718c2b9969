"""What the benchmark scripts share: kernel timing, the verify-length mix, the 1.1B Llama-like
target, the prefilled-context state fill, environment rows and result files.

Timing: eager back-to-back launches and CUDA-graph replays between CUDA events; a sync after
each launch lets the clocks drop and doubles small figures, so none is taken inside a timed
loop.

Scripts run as ``python benchmarks/<name>.py`` from the checkout (their folder is then first on
``sys.path``) and ``import common``; the tests import them through pytest's ``pythonpath``
(``pyproject.toml``). ``dspark_compile`` comes from the environment: ``pip install -e .`` or
``PYTHONPATH=.`` (``gpu_session.sh`` sets the latter).
"""

from __future__ import annotations

import json
import os
import platform
import random
import time

import torch

__all__ = ["time_calls", "graph_of", "graph_us", "replay_us", "time_ms", "capture_graph",
           "mix_lens", "plot_step_ms", "max_err_vs_hf", "errors_vs_models", "variant_suffix", "variant_flags", "target_overrides",
           "add_variant_args", "apply_variant", "LLAMA_1B", "CONTEXT", "PAGE", "BLOCK",
           "HBM_BYTES_PER_S", "BF16_FLOPS", "llama_config", "build_model", "fill_context",
           "versions", "cpu_name", "out_dir", "write_json"]

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=32000,
                max_position_embeddings=4096)
"""The Llama-like 1.1B target of the step benchmarks (random weights, seed 0)."""
CONTEXT, PAGE, BLOCK = 1024, 16, 8
"""Committed context per request, KV page size and verify block of the step benchmarks."""
HBM_BYTES_PER_S = 4.8e12
"""H200 datasheet HBM bandwidth."""
BF16_FLOPS = 790e12
"""H200 dense bf16 peak (no sparsity)."""


def llama_config(**overrides):
    """``LlamaConfig`` of :data:`LLAMA_1B` with ``overrides``."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**LLAMA_1B, **overrides})


def build_model(config: dict | None = None, device: str = "cuda", dtype=torch.bfloat16,
                seed: int = 0):
    """``LlamaForCausalLM`` of ``config`` (LlamaConfig arguments, default :data:`LLAMA_1B`),
    random weights at ``seed``, in ``dtype`` on ``device``, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**(config or LLAMA_1B))).to(dtype).eval()
    return model


def fill_context(state, context: int) -> None:
    """Random KV (N(0, 0.5)) in every slot and ``context`` tokens committed per slot: a state
    that looks prefilled without running a prefill."""
    for k, v in state.kv_caches:
        k.normal_(0, 0.5)
        v.normal_(0, 0.5)
    state.committed_lens[:] = context


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def versions(gpu: bool = True) -> dict:
    """The device (GPU name, or ``cpu (<model>)``) and the versions every result file records
    (Triton and transformers: None where not installed)."""
    import importlib.util

    def version(name: str):
        if importlib.util.find_spec(name) is None:
            return None
        return __import__(name).__version__

    device = torch.cuda.get_device_name() if gpu and torch.cuda.is_available() else \
        f"cpu ({cpu_name()})"
    return {"gpu": device, "torch": torch.__version__, "triton": version("triton"),
            "transformers": version("transformers"), "python": platform.python_version()}


def out_dir(arg: str | None = None) -> str:
    """Where results go: ``arg``, else ``$OUT``, else ``benchmarks/results``; created."""
    path = arg or os.environ.get("OUT") or "benchmarks/results"
    os.makedirs(path, exist_ok=True)
    return path


def write_json(out: str, name: str, data: dict, **dump) -> str:
    """``data`` as indented JSON in ``out/name`` (the folder is created); the path."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, **dump)
    return path


def add_variant_args(parser, rotary: bool = True) -> None:
    """The verifier options a step benchmark takes (``--group-linears``, ``--rotary`` unless
    ``rotary`` is False, ``--fuse-linears``, ``--rotary-epilogue``) and ``--target``."""
    from dspark_compile.config import FUSE_LINEARS, GROUP_LINEARS, ROTARY, ROTARY_EPILOGUE

    parser.add_argument("--group-linears", choices=GROUP_LINEARS, default="auto",
                        help="DSparkConfig(group_linears=...); not auto: files get a suffix")
    if rotary:
        parser.add_argument("--rotary", choices=ROTARY, default="auto",
                            help="DSparkConfig(rotary=...); not auto: files get a suffix")
    parser.add_argument("--fuse-linears", choices=FUSE_LINEARS, default="auto",
                        help="DSparkConfig(fuse_linears=...); not auto: files get a suffix")
    parser.add_argument("--rotary-epilogue", choices=ROTARY_EPILOGUE, default="auto",
                        help="DSparkConfig(rotary_epilogue=...); not auto: files get a suffix")
    parser.add_argument("--target", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a TargetConfig field (e.g. pdl=false); files get a suffix")


def apply_variant(args) -> tuple[str, str, dict]:
    """Apply ``args.target`` (:func:`target_overrides`); ``(file-name suffix, command-line
    flags, environment fields)`` of the options :func:`add_variant_args` added."""
    overrides, target_suffix, target_flags = target_overrides(args.target)
    rotary = getattr(args, "rotary", "auto")
    options = (args.group_linears, rotary, args.fuse_linears, args.rotary_epilogue)
    env = dict(group_linears=args.group_linears, rotary=rotary, fuse_linears=args.fuse_linears,
               rotary_epilogue=args.rotary_epilogue, target_overrides=overrides)
    return variant_suffix(*options) + target_suffix, variant_flags(*options) + target_flags, env


def target_overrides(items: list[str]) -> tuple[dict, str, str]:
    """Apply ``KEY=VALUE`` overrides (``TargetConfig`` fields, e.g. ``pdl=false``) to every
    target entry; call it before any kernel runs (the device's entry is cached at first use).
    Returns ``(overrides, file-name suffix, command-line flags)``."""
    import dataclasses

    from dspark_compile.kernels import targets

    applied: dict = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in {f.name for f in dataclasses.fields(targets.TargetConfig)} or not value:
            raise SystemExit(f"--target {item!r}: expected FIELD=VALUE with a TargetConfig field")
        current = getattr(targets.TARGETS["sm_90"], key)
        if isinstance(current, bool):
            if value.lower() not in ("true", "false", "1", "0", "on", "off"):
                raise SystemExit(f"--target {item!r}: {key} takes true or false")
            applied[key] = value.lower() in ("true", "1", "on")
        else:
            applied[key] = type(current)(value) if current is not None else int(value)
    for name, entry in targets.TARGETS.items():
        targets.TARGETS[name] = dataclasses.replace(entry, **applied)
    suffix = "".join(f"_{k}_{str(v).lower()}" for k, v in applied.items())
    flags = "".join(f" --target {k}={str(v).lower()}" for k, v in applied.items())
    return applied, suffix, flags


def variant_suffix(group_linears: str, rotary: str, fuse_linears: str = "auto",
                   rotary_epilogue: str = "auto") -> str:
    """File-name suffix of a run with non-default ``group_linears`` / ``rotary`` /
    ``fuse_linears`` / ``rotary_epilogue`` options."""
    return (f"_group_{group_linears}" if group_linears != "auto" else "") + \
        (f"_rotary_{rotary}" if rotary != "auto" else "") + \
        (f"_fuse_{fuse_linears}" if fuse_linears != "auto" else "") + \
        (f"_rotary_epilogue_{rotary_epilogue}" if rotary_epilogue != "auto" else "")


def variant_flags(group_linears: str, rotary: str, fuse_linears: str = "auto",
                  rotary_epilogue: str = "auto") -> str:
    """The command-line flags of those options (empty for the defaults)."""
    return (f" --group-linears {group_linears}" if group_linears != "auto" else "") + \
        (f" --rotary {rotary}" if rotary != "auto" else "") + \
        (f" --fuse-linears {fuse_linears}" if fuse_linears != "auto" else "") + \
        (f" --rotary-epilogue {rotary_epilogue}" if rotary_epilogue != "auto" else "")


def max_err_vs_hf(model, verifier, vocab: int, device, **state_kwargs) -> float:
    """Largest |ours - HF| on real rows: a prefill of 3 requests (17, 5, 30 tokens in slots
    3, 0, 1), then one verify of 4, 1, 7 tokens, each request against HF's forward over its own
    tokens alone. ``state_kwargs`` go to ``new_state`` (e.g. ``max_step_tokens``)."""
    return errors_vs_models(verifier, {"hf": model}, vocab, device, **state_kwargs)["hf"]


def errors_vs_models(verifier, models: dict, vocab: int, device, **state_kwargs) -> dict:
    """``max_err_vs_hf`` against each of ``models`` (name -> HF model; e.g. the model itself
    and a float32 copy), plus ``"<a>_vs_<b>"``: the largest |a - b| between every later model
    and the first on the same rows (how far the model's own dtype is from the reference)."""
    from dspark_compile import VerifyLayout

    gen = torch.Generator().manual_seed(0)
    state = verifier.new_state(max_requests=4, max_context=128, **state_kwargs)
    prompt_lens, new_lens, slots = [17, 5, 30], [4, 1, 7], [3, 0, 1]
    prompts = [torch.randint(0, vocab, (n,), generator=gen).to(device) for n in prompt_lens]
    layout = VerifyLayout.pack(prompt_lens, [0, 0, 0], slots)
    verifier(torch.cat(prompts), layout, state)
    verifier.commit(layout, prompt_lens, state)
    new = [torch.randint(0, vocab, (n,), generator=gen).to(device) for n in new_lens]
    layout = VerifyLayout.pack(new_lens, prompt_lens, slots)
    logits = verifier(torch.cat(new), layout, state).float()
    qsl = layout.query_start_loc.tolist()
    names = list(models)
    out = dict.fromkeys(names, 0.0)
    out.update({f"{b}_vs_{names[0]}": 0.0 for b in names[1:]})
    with torch.no_grad():
        for i, (p, t) in enumerate(zip(prompts, new)):
            rows = {name: m(torch.cat([p, t])[None]).logits[0, -t.numel():].float()
                    for name, m in models.items()}
            for name, want in rows.items():
                out[name] = max(out[name], (logits[qsl[i]:qsl[i + 1]] - want).abs().max().item())
            for b in names[1:]:
                key = f"{b}_vs_{names[0]}"
                out[key] = max(out[key], (rows[b] - rows[names[0]]).abs().max().item())
    return out


def errors_vs_float32(model, verifier, vocab: int, device) -> dict:
    """:func:`errors_vs_models` against the model itself and a float32 copy of it (made here,
    freed after): whether a bf16 difference from HF is ours or the dtype's. Prints the result."""
    import copy

    reference = copy.deepcopy(model).float()
    errors = errors_vs_models(verifier, {"hf_float32": reference, "hf": model}, vocab, device,
                              max_step_tokens=64)
    del reference
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    print("max |x - y| of the logits:", errors, flush=True)
    return errors


def capture_graph(step) -> tuple:
    """``(graph, None)``: ``step`` captured in a CUDA graph after a warm-up call on a side
    stream (:func:`graph_of`); ``(None, error)`` if it cannot be captured (the error goes into
    the JSON, never hidden)."""
    try:
        return graph_of([step], 1), None
    except Exception as err:  # noqa: BLE001 - reported by the caller
        torch.cuda.synchronize()
        return None, f"{type(err).__name__}: {err}"[:300]


def time_ms(fn, iters: int, warmup: int = 3, gpu: bool = True) -> float:
    """Mean ms per call over back-to-back calls between two CUDA events (no sync in between);
    wall clock with ``gpu=False`` (CPU smoke runs)."""
    for _ in range(warmup):
        fn()
    if not gpu:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def plot_step_ms(results: dict, series, title: str, path: str) -> None:
    """PNG of ms per step against bs (log-log), one line per ``(key, label)`` of ``series``,
    through the bs of ``results`` (``{bs: {key: ms}}``) that have it (two at least)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bss = sorted(int(b) for b in results)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label in series:
        points = [(b, results[str(b)].get(key)) for b in bss]
        points = [(b, y) for b, y in points if y is not None]
        if len(points) >= 2:
            ax.plot(*zip(*points), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("requests (bs)")
    ax.set_ylabel("ms per verify step")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def mix_lens(bs: int, block: int, mean: int = 3, seed: int = 0) -> list[int]:
    """Lengths in 1..block with mean exactly ``mean`` (binomial draw, then evened out)."""
    if bs == 1:
        return [mean]
    rng = random.Random(seed + bs)
    lens = [1 + sum(rng.random() < (mean - 1) / (block - 1) for _ in range(block - 1))
            for _ in range(bs)]
    i = 0
    while sum(lens) != mean * bs:  # deterministic nudge to the exact total
        j = i % bs
        if sum(lens) > mean * bs and lens[j] > 1:
            lens[j] -= 1
        elif sum(lens) < mean * bs and lens[j] < block:
            lens[j] += 1
        i += 1
    return lens


def step_tiers(batches, widths) -> tuple:
    """Only the tiers a run replays: ``(w * bs, bs)`` for every batch size and verify width
    (at least 2 tokens); a full tier set would capture ~30 graphs for nothing."""
    from dspark_compile.session.tiers import Tier

    return tuple(sorted({Tier(max(2, w * bs), bs) for bs in batches for w in widths}))


def graph_of(fns: list, calls: int, stream=None):
    """A CUDA graph of ``calls`` calls cycling ``fns``, captured after one warm-up call of each
    on a side stream (``stream``, or a new one), on that same stream: a split launch's counters
    are made per stream by its first call outside a capture
    (``triton_attention.split_counters``), so a capture on another stream would run every
    split kernel unsplit (and log it)."""
    side = stream or torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        for i in range(calls):
            fns[i % len(fns)]()
    return graph


def graph_us(fns: list, reps: int, replays: int = 10) -> float:
    """us per call of ``fns`` cycled ``reps`` times in one CUDA graph (:func:`graph_of`, after
    one eager call of each), mean over ``replays`` replays."""
    for f in fns:
        f()
    graph = graph_of(fns, reps * len(fns))
    graph.replay()
    torch.cuda.synchronize()
    return replay_us(graph, replays) / (reps * len(fns))


def replay_us(graph, replays: int) -> float:
    """us per replay of ``replays`` back-to-back replays of ``graph`` between two events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def time_calls(fns: list, s: dict, device: str) -> dict:
    """us per call: back-to-back eager launches and CUDA-graph replays, cycling ``fns``."""
    if device == "cpu":  # smoke mode: wall clock, nothing to report
        t0 = time.perf_counter()
        for i in range(s["eager_iters"]):
            fns[i % len(fns)]()
        return dict(eager_us=(time.perf_counter() - t0) * 1e6 / s["eager_iters"], graph_us=None)
    for f in fns:  # compile, warm the clocks
        f()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    ev[0].record()
    for i in range(s["eager_iters"]):
        fns[i % len(fns)]()
    ev[1].record()
    graph = graph_of(fns, s["graph_calls"])
    graph.replay()
    ev[2].record()
    for _ in range(s["graph_replays"]):
        graph.replay()
    ev[3].record()
    ev[3].synchronize()
    calls = s["graph_calls"] * s["graph_replays"]
    return dict(eager_us=ev[0].elapsed_time(ev[1]) * 1e3 / s["eager_iters"],
                graph_us=ev[2].elapsed_time(ev[3]) * 1e3 / calls)
