"""Triton rotary on flat positions against HF's math, under the interpreter on the CPU.

Oracles: a pure-torch mirror of HF's rotary modules and ``apply_rotary_pos_emb`` (written
here), and, where transformers imports, HF's own Llama, Qwen2-VL and Qwen3-VL rotary classes.
bf16 is compared bit for bit (the kernel rounds as HF's eager ops do; see the kernel's
docstring), float32 within a few ulp (the interpreter's cosine is numpy's, not torch's).
The ahead-of-time compile for cuda:90, hip:gfx942 and hip:gfx950 runs this file as a script
without the interpreter (``tests/aot.py``); ``benchmarks/rotary.py --smoke`` runs in-process.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from aot import TARGET_NAMES, compile_kernel, missing_artifacts, run_script
from dspark_compile.kernels import rotary as triton_rotary
from dspark_compile.kernels.rotary import RotaryPlan, plan_rotary, rotary_triton
from helpers import load_benchmark

# (rtol, atol) of the comparison, and the largest share of elements allowed to differ at all
TOL = {torch.float32: ((2e-6, 2e-6), 1.0), torch.bfloat16: ((2 ** -6, 2 ** -6), 1e-3),
       torch.float16: ((2e-3, 2e-3), 1e-3)}
ONE_PROGRAM = RotaryPlan(block_n=16, block_h=16, num_warps=4)  # N, heads <= 16: one per tensor
MODES = {"text": (None, False), "chunked": ((16, 24, 24), False),
         "interleaved": ((24, 20, 20), True)}


def inv_freq_of(d: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float) / d)


def recompose(freq: torch.Tensor, sections, interleaved: bool) -> torch.Tensor:
    """``[3, N, D/2] -> [N, D/2]``: HF's ``recomposition_frequencies`` of Qwen2-VL (chunks)
    and Qwen3-VL (interleaved T H W, H and W ending at ``3 * section``)."""
    if not interleaved:
        return torch.cat([m[i % 3] for i, m in enumerate(freq.split(list(sections), -1))], -1)
    out = freq[0].clone()
    for row in (1, 2):
        idx = slice(row, 3 * sections[row], 3)
        out[..., idx] = freq[row, ..., idx]
    return out


def reference(q, k, positions, inv_freq, sections=None, interleaved=False, scaling=1.0):
    """HF: fp32 ``float(pos) * inv_freq``, cos/sin times scaling, cast to the activation dtype,
    then ``x * cos + rotate_half(x) * sin`` in that dtype."""
    freqs = positions[..., None].float() * inv_freq
    cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
    if sections is not None:
        cos, sin = recompose(cos, sections, interleaved), recompose(sin, sections, interleaved)
    cos = torch.cat((cos, cos), -1).to(q.dtype)[:, None, :]
    sin = torch.cat((sin, sin), -1).to(q.dtype)[:, None, :]

    def rotate_half(x):
        return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), -1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def assert_matches(got, want) -> None:
    for g, w in zip(got, want):
        (rtol, atol), share = TOL[w.dtype]
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g.float(), w.float(), rtol=rtol, atol=atol)
        differ = (g != w).float().mean().item() if w.numel() else 0.0
        assert differ <= share, f"{differ:.2%} of {w.dtype} elements differ from the oracle"


def inputs(n, h, hkv, d, dtype, pos_dtype, sections, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = () if sections is None else (3,)
    pos = torch.randint(0, 5000, (*rows, n), generator=g).to(pos_dtype)
    return (torch.randn(n, h, d, generator=g).to(dtype),
            torch.randn(n, hkv, d, generator=g).to(dtype), pos)


# (q heads, kv heads, D, position dtype, token counts): each interpreter launch costs ~0.1 s,
# so the odd token counts are split between the two shapes rather than crossed with them
SHAPES = {"16x8xD128_i64": (16, 8, 128, torch.int64, (13,)),
          "4x1xD64_i32": (4, 1, 64, torch.int32, (1, 3))}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_matches_hf_math(mode, dtype, shape) -> None:
    h, hkv, d, pos_dtype, token_counts = SHAPES[shape]
    sections, interleaved = MODES[mode]
    if sections is not None and d == 64:  # sections of D/2 = 32, in the same proportions
        sections = (8, 12, 12) if not interleaved else (12, 10, 10)
    inv = inv_freq_of(d)
    for n in token_counts:
        q, k, pos = inputs(n, h, hkv, d, dtype, pos_dtype, sections, seed=n)
        got = rotary_triton(q, k, pos, inv, sections, mrope_interleaved=interleaved,
                            plan=ONE_PROGRAM)
        assert_matches(got, reference(q, k, pos, inv, sections, interleaved))


def test_many_programs_both_axes() -> None:
    """Token blocks with a ragged tail, head blocks of q then k with masked heads."""
    q, k, pos = inputs(5, 3, 2, 64, torch.bfloat16, torch.int64, None)
    got = rotary_triton(q, k, pos, inv_freq_of(64), plan=RotaryPlan(4, 2, 1))
    assert_matches(got, reference(q, k, pos, inv_freq_of(64)))


def test_default_plan_and_scaling() -> None:
    q, k, pos = inputs(3, 4, 1, 64, torch.bfloat16, torch.int32, (8, 12, 12))
    got = rotary_triton(q, k, pos, inv_freq_of(64), (8, 12, 12), attention_scaling=0.75)
    assert_matches(got, reference(q, k, pos, inv_freq_of(64), (8, 12, 12), scaling=0.75))


@pytest.mark.parametrize("interleaved", [False, True])
def test_half_not_a_power_of_two_fp16(interleaved) -> None:
    """D = 80: 40 frequencies padded to 64 lanes and masked."""
    q, k, pos = inputs(3, 2, 1, 80, torch.float16, torch.int64, (8, 16, 16))
    got = rotary_triton(q, k, pos, inv_freq_of(80), [8, 16, 16],
                        mrope_interleaved=interleaved, plan=ONE_PROGRAM)
    assert_matches(got, reference(q, k, pos, inv_freq_of(80), (8, 16, 16), interleaved))


def test_strided_views_and_in_place() -> None:
    """q and k as views of one fused qkv row, positions a strided slice, rotated in place."""
    n, h, hkv, d = 6, 4, 2, 64
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(n, (h + 2 * hkv) * d, generator=g).to(torch.bfloat16)
    q, k = qkv[:, : h * d].view(n, h, d), qkv[:, h * d: (h + hkv) * d].view(n, hkv, d)
    pos = torch.randint(0, 9000, (3, 2 * n), generator=g)[:, ::2]
    want = reference(q.clone(), k.clone(), pos, inv_freq_of(d), (8, 12, 12), True)
    v = qkv[:, (h + hkv) * d:].clone()
    got = rotary_triton(q, k, pos, inv_freq_of(d), (8, 12, 12), q, k, mrope_interleaved=True,
                        plan=RotaryPlan(2, 2, 1))
    assert got[0] is q and got[1] is k
    assert_matches((q, k), want)
    assert torch.equal(qkv[:, (h + hkv) * d:], v), "v was written"


def test_empty_batch() -> None:
    q, k, pos = inputs(0, 4, 2, 64, torch.bfloat16, torch.int64, None)
    oq, ok = rotary_triton(q, k, pos, inv_freq_of(64))
    assert oq.shape == (0, 4, 64) and ok.shape == (0, 2, 64)


def test_plan_spreads_small_batches_and_tiles_large_ones() -> None:
    small, large = plan_rotary(3, 16, 8, 128, 132), plan_rotary(768, 16, 8, 128, 132)
    assert (small.block_n, small.block_h) == (1, 4)
    assert (large.block_n, large.block_h, large.num_warps) == (1, 16, 4)
    assert plan_rotary(8192, 4, 1, 64, 132).block_n == 8  # 8 x 4 x 32 = 1024 elements


# ---- HF's own rotary classes (where transformers imports) ----------------------------------

def _hf(kind: str, d: int):
    """HF rotary module and apply_rotary_pos_emb of ``kind`` at head dim ``d``."""
    try:
        if kind == "llama":
            from transformers import LlamaConfig as Config
            from transformers.models.llama import modeling_llama as m
            rot, extra = m.LlamaRotaryEmbedding, {}
        elif kind == "qwen2_vl":
            from transformers.models.qwen2_vl.configuration_qwen2_vl import \
                Qwen2VLTextConfig as Config
            from transformers.models.qwen2_vl import modeling_qwen2_vl as m
            rot, extra = m.Qwen2VLRotaryEmbedding, {"mrope_section": [16, 24, 24]}
        else:
            from transformers.models.qwen3_vl.configuration_qwen3_vl import \
                Qwen3VLTextConfig as Config
            from transformers.models.qwen3_vl import modeling_qwen3_vl as m
            rot, extra = m.Qwen3VLTextRotaryEmbedding, {"mrope_section": [24, 20, 20],
                                                        "mrope_interleaved": True}
        config = Config(hidden_size=4 * d, num_attention_heads=4, num_key_value_heads=1,
                        head_dim=d, rope_parameters={"rope_type": "default",
                                                     "rope_theta": 1e6, **extra})
        return rot(config), m.apply_rotary_pos_emb, extra
    except (ImportError, AttributeError, TypeError, KeyError) as e:
        pytest.skip(f"transformers' {kind} rotary is not importable here: {e!r}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["llama", "qwen2_vl", "qwen3_vl"])
def test_matches_hf_modules(kind, dtype) -> None:
    rot, apply, extra = _hf(kind, 128)
    rot.attention_scaling = 0.875  # HF multiplies cos and sin by it (YaRN, longrope, ...)
    sections = extra.get("mrope_section")
    q, k, pos = inputs(13, 4, 1, 128, dtype, torch.int64, sections, seed=7)
    cos, sin = rot(q, pos[None] if sections is None else pos[:, None])  # [1, N, D]
    want = apply(q, k, cos[0], sin[0], unsqueeze_dim=1)
    got = rotary_triton(q, k, pos, rot.inv_freq, sections,
                        mrope_interleaved=extra.get("mrope_interleaved", False),
                        attention_scaling=rot.attention_scaling, plan=ONE_PROGRAM)
    assert_matches(got, want)


# ---- bad input: ValueError naming the argument, before any launch -------------------------

def _good() -> dict:
    q, k, pos = inputs(3, 4, 2, 64, torch.bfloat16, torch.int64, None)
    return dict(q=q, k=k, positions=pos, inv_freq=inv_freq_of(64))


BAD = {
    "q 2-D": (dict(q=torch.zeros(3, 64)), "q is"),
    "q int": (dict(q=torch.zeros(3, 4, 64, dtype=torch.int32)), "q is"),
    "q odd D": (dict(q=torch.zeros(3, 4, 63, dtype=torch.bfloat16)), "must be even"),
    "q strided last dim": (dict(q=torch.zeros(3, 4, 128, dtype=torch.bfloat16)[..., ::2]),
                           "dense last dim"),
    "k other D": (dict(k=torch.zeros(3, 2, 32, dtype=torch.bfloat16)), "k is"),
    "k other N": (dict(k=torch.zeros(4, 2, 64, dtype=torch.bfloat16)), "k is"),
    "k other dtype": (dict(k=torch.zeros(3, 2, 64)), "k is"),
    "k no heads": (dict(k=torch.zeros(3, 0, 64, dtype=torch.bfloat16)), "at least one head"),
    "inv_freq size": (dict(inv_freq=inv_freq_of(128)), "inv_freq is"),
    "inv_freq dtype": (dict(inv_freq=inv_freq_of(64).double()), "inv_freq is"),
    "positions float": (dict(positions=torch.zeros(3)), "positions is"),
    "positions rows without sections": (dict(positions=torch.zeros(3, 3, dtype=torch.int64)),
                                        "positions is"),
    "positions flat with sections": (dict(mrope_section=(8, 12, 12)), "positions is"),
    "sections sum": (dict(mrope_section=(8, 12, 13)), "mrope_section is"),
    "sections length": (dict(mrope_section=(16, 16)), "mrope_section is"),
    "sections negative": (dict(mrope_section=(-8, 20, 20)), "mrope_section is"),
    "interleaved without sections": (dict(mrope_interleaved=True), "mrope_interleaved is"),
    "scaling nan": (dict(attention_scaling=float("nan")), "attention_scaling is"),
    "scaling tensor": (dict(attention_scaling=torch.tensor(1.0)), "attention_scaling is"),
    "out_q shape": (dict(out_q=torch.zeros(3, 4, 32, dtype=torch.bfloat16)), "out_q is"),
    "out_k dtype": (dict(out_k=torch.zeros(3, 2, 64)), "out_k is"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_raises_before_launch(case, monkeypatch) -> None:
    change, match = BAD[case]

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("launched before validation")

    monkeypatch.setattr(triton_rotary, "_rotary_kernel", NoLaunch())
    with pytest.raises(ValueError, match=match):
        rotary_triton(**{**_good(), **change})


# ---- benchmarks/rotary.py --smoke, in this process -----------------------------------------

def test_benchmark_smoke(tmp_path) -> None:
    module = load_benchmark("rotary")
    report = module.main(["--smoke", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "rotary_smoke.json").read_text())
    assert saved["results"] and len(saved["results"]) == len(report["results"])
    for r in saved["results"]:
        assert r["bitwise_share_vs_hf_eager"] == 1.0 and r["triton"]["eager_us"] > 0
        assert r["bytes"] > 0 and r["plan"]["block_h"] >= 1


# ---- ahead-of-time compile for cuda:90, hip:gfx942, hip:gfx950 ------------------------------

_PTRS = ("q_ptr", "k_ptr", "out_q_ptr", "out_k_ptr", "cos_ptr", "sin_ptr")
# case -> (activation dtype, position dtype, constexprs, warps); other scalars are i32,
# ``scaling`` fp32. One case per position mode; D = 80 pads 40 frequencies to 64 lanes.
AOT_CASES = {
    "text_bf16": ("bf16", "i64", dict(HALF=64, HALF_PAD=64, BLOCK_N=1, BLOCK_H=16, MROPE=0,
                                      S0=0, S1=0, S2=0, GIVEN=False), 4),
    "mrope_chunked_fp16_d80": ("fp16", "i32", dict(HALF=40, HALF_PAD=64, BLOCK_N=2,
                                                   BLOCK_H=8, MROPE=1, S0=8, S1=16, S2=16,
                                                   GIVEN=False), 4),
    "mrope_interleaved_fp32": ("fp32", "i64", dict(HALF=64, HALF_PAD=64, BLOCK_N=1,
                                                   BLOCK_H=4, MROPE=2, S0=24, S1=20, S2=20,
                                                   GIVEN=False), 1),
}


def _compile_all() -> dict:
    """``{target: {case: [artifact kinds]}}``, fp fusion off as at run time."""
    out: dict = {}
    for target in TARGET_NAMES:
        for case, (dtype, pos_dtype, consts, warps) in AOT_CASES.items():
            pointers = {**{p: dtype for p in _PTRS}, "pos_ptr": pos_dtype,
                        "inv_freq_ptr": "fp32"}
            out.setdefault(target, {})[case] = compile_kernel(
                triton_rotary._rotary_kernel, pointers, consts, target,
                {"num_warps": warps, "enable_fp_fusion": False}, scalars={"scaling": "fp32"})
    return out


@pytest.fixture(scope="module", autouse=True)
def _aot_in_background(request):
    """Start the AOT subprocess when this module starts, so it compiles (one CPU core) while
    the interpreter tests run: the file takes the longer of the two, not their sum."""
    if not any("ahead_of_time" in item.name for item in request.session.items):
        yield None
        return
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield pool.submit(run_script, __file__)


@pytest.mark.parametrize("target", TARGET_NAMES)
def test_rotary_kernel_compiles_ahead_of_time(_aot_in_background, target: str) -> None:
    compiled = _aot_in_background.result()
    for case in AOT_CASES:
        kinds = compiled[target][case]
        assert not missing_artifacts(kinds, target), f"{case} for {target}: only {kinds}"


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") != "1", "AOT compile needs TRITON_INTERPRET unset"
    print(json.dumps(_compile_all()))
