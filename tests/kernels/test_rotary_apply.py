"""``dspark::rotary_apply``: the ``fuse_rotary`` rewrite (``DSparkConfig(rotary="triton")``),
the rotary kernel in its given-cos/sin form against the reference math, and its ahead-of-time
compiles.

Kernel cases run under the Triton interpreter on the CPU (``TRITON_INTERPRET=1``, set by
conftest.py without a GPU; fp32 and fp16, since the interpreter mis-reads bf16 in some ops);
the AOT cases run this file as a script without it (tests/aot.py).
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from aot import TARGET_NAMES, aot_tests, compile_kernel

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def _reference(t, cos, sin):
    half = t.shape[-1] // 2
    return (t.float() * cos.float()[:, None]
            + torch.cat([-t[..., half:], t[..., :half]], -1).float() * sin.float()[:, None])


@pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                    reason="needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("n, hx, hy, d", [(1, 4, 2, 16), (13, 16, 8, 128), (5, 3, 1, 64),
                                          (40, 8, 8, 80)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_the_reference_math(n, hx, hy, d, dtype) -> None:
    from dspark_compile.kernels.rotary import rotary_apply_triton

    g = torch.Generator().manual_seed(n + d)
    x, y = (torch.randn(n, h, d, generator=g).to(dtype).to(DEVICE) for h in (hx, hy))
    cos, sin = (torch.randn(n, d, generator=g).to(dtype).to(DEVICE) for _ in range(2))
    x_strided = torch.randn(n, hx, 2 * d, generator=g).to(dtype).to(DEVICE)[..., :d]
    x_strided.copy_(x)  # a head view of a wider row (q and k sliced from one projection)
    for xin in (x, x_strided):
        outs = rotary_apply_triton(xin, y, cos, sin)
        tol = 0 if dtype == torch.float32 else 4e-3
        for got, src in zip(outs, (x, y)):
            assert got.shape == src.shape and got.dtype == dtype and got.is_contiguous()
            torch.testing.assert_close(got.float(), _reference(src, cos, sin), atol=tol,
                                       rtol=tol)


@pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                    reason="needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("mutate, match", [
    (lambda a: (a[0][None], *a[1:]), "x is"),
    (lambda a: (a[0], a[1][:-1], *a[2:]), "needs x's N"),
    (lambda a: (*a[:2], a[2][:, :-2], a[3]), r"both must be \[N, D\]"),
    (lambda a: (a[0][..., :-1], a[1][..., :-1], a[2][:, :-1], a[3][:, :-1]), "15, even"),
])
def test_bad_inputs_raise_value_error(mutate, match) -> None:
    from dspark_compile.kernels.rotary import rotary_apply_triton

    args = (torch.zeros(3, 4, 16), torch.zeros(3, 2, 16), torch.zeros(3, 16), torch.zeros(3, 16))
    with pytest.raises(ValueError, match=match):
        rotary_apply_triton(*mutate(tuple(t.to(DEVICE) for t in args)))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fuse_rotary_rewrites_each_layer_and_keeps_the_values(family) -> None:
    """One ``rotary_apply`` per layer (q and k together, q_norm or not), no rotate_half left,
    and the packed forward's logits and KV bit for bit equal to the unfused graph's over a
    prefill and verify/commit rounds (reference ops: the same math)."""
    from dspark_compile import DSparkConfig, VerifyLayout, dspark_compile
    from helpers import tiny_llama, tiny_qwen3

    model = (tiny_llama if family == "llama" else tiny_qwen3)(layers=2)
    plain, fused = dspark_compile(model), dspark_compile(model, rotary="triton")
    graph = fused.graph_module.graph
    assert len(graph.find_nodes(op="call_function",
                                target=torch.ops.dspark.rotary_apply.default)) == 2
    assert not graph.find_nodes(op="call_function", target=torch.ops.aten.neg.default)
    assert "fuse_rotary: 2 rewritten" in fused.explain()
    states = [v.new_state(max_requests=6, max_context=64) for v in (plain, fused)]
    gen, rng = torch.Generator().manual_seed(0), random.Random(0)
    slots, ctx = [4, 0, 2], [0, 0, 0]
    lens = [7, 3, 12]
    for _ in range(4):
        layout = VerifyLayout.pack(lens, ctx, slots)
        ids = torch.randint(0, 90, (sum(lens),), generator=gen)
        outs = [v(ids, layout, s) for v, s in zip((plain, fused), states)]
        assert torch.equal(outs[0], outs[1])
        accept = [rng.randint(1, n) for n in lens]
        for v, s in zip((plain, fused), states):
            v.commit(layout, accept, s)
        ctx = [c + a for c, a in zip(ctx, accept)]
        lens = [rng.randint(1, 8) for _ in slots]
    for (k0, v0), (k1, v1) in zip(states[0].kv_caches, states[1].kv_caches):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    with pytest.raises(ValueError, match="rotary='fast'"):
        DSparkConfig(rotary="fast")


def test_partial_rotary_is_left_to_the_graph() -> None:
    """Qwen3.5 rotates a slice of each head: not the pattern, so nothing is rewritten."""
    from dspark_compile import dspark_compile
    from helpers import tiny_qwen35

    fused = dspark_compile(tiny_qwen35(vocab=101), rotary="triton")
    assert "fuse_rotary: 0 rewritten" in fused.explain()


# --------------------------------------------------------------------------- ahead of time
def _compile_all() -> dict:
    """The rotary kernel in its given-cos/sin form (``GIVEN=True``), as rotary_apply runs it."""
    from dspark_compile.kernels import rotary as triton_rotary

    kernel = triton_rotary._rotary_kernel
    out: dict = {}
    for dtype in ("bf16", "fp16"):
        pointers = {a: dtype for a in kernel.arg_names if a.endswith("_ptr")}
        consts = dict(HALF=64, HALF_PAD=64, BLOCK_N=2, BLOCK_H=8, MROPE=0, S0=0, S1=0, S2=0,
                      GIVEN=True)
        for target in TARGET_NAMES:
            out.setdefault(dtype, {})[target] = compile_kernel(
                kernel, pointers, consts, target, {"num_warps": 4, "enable_fp_fusion": False},
                scalars={"scaling": "fp32"})
    return out


compiled, test_kernel_compiles_ahead_of_time = aot_tests(__file__, ["bf16", "fp16"])


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") != "1", "AOT compile needs TRITON_INTERPRET unset"
    print(json.dumps(_compile_all()))


def test_a_layer_with_one_matched_rotation_is_not_paired_with_the_next_layers() -> None:
    """Falcon-H1 rotates q in the matched form and k otherwise, over the cos/sin every layer
    shares: layer 0's q once paired with layer 1's, defining layer 0's rotated q after the
    attention that reads it (the graph failed on the GPU). Unpaired rotations stay graph code
    and the packed forward equals the unfused one."""
    transformers = pytest.importorskip("transformers")
    from dspark_compile import VerifyLayout, dspark_compile
    from dspark_compile.zoo.tiny import tiny_config

    config = tiny_config("falcon_h1", transformers.FalconH1ForCausalLM).config
    torch.manual_seed(0)
    model = transformers.FalconH1ForCausalLM._from_config(
        config, attn_implementation="eager", dtype=torch.float32).eval()
    plain, fused = dspark_compile(model), dspark_compile(model, rotary="triton")
    assert "fuse_rotary: 0 rewritten" in fused.explain()
    layout = VerifyLayout.pack([10, 7], [0, 0], [0, 1])
    ids = torch.randint(3, 100, (17,), generator=torch.Generator().manual_seed(1))
    outs = [v(ids, layout, v.new_state(max_requests=2, max_context=32))
            for v in (plain, fused)]
    assert torch.equal(outs[0], outs[1])
