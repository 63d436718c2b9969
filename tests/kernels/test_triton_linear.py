"""``dspark::linear_group``: the grouped skinny matmul against ``torch.mm``, its split rule, the
``group_linears`` rewrite, and ahead-of-time compiles for cuda:90, gfx942 and gfx950.

Kernel cases run under the Triton interpreter on the CPU (``TRITON_INTERPRET=1``, set by
conftest.py without a GPU); the AOT cases run this file as a script without it (tests/aot.py).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from aot import TARGET_NAMES, aot_tests, compile_kernel

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_kernel_device = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                         reason="needs a GPU or TRITON_INTERPRET=1")


def _device() -> str:
    return "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def _case(m: int, k: int, ns: tuple[int, ...], dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(_device())
    ws = [(torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(_device()) for n in ns]
    return x, ws


@needs_kernel_device
@pytest.mark.parametrize("m, k, ns, split_k", [
    (1, 128, (40, 8), None),          # one row, N not a tile multiple
    (3, 256, (64, 32, 32), None),     # q, k, v of a small layer; the split rule's choice
    (3, 200, (72, 24), 2),            # K not a multiple of BLOCK_K, two splits
    (17, 512, (96, 80), 4),           # 32-row tile, four splits
    (64, 384, (130, 2), 3),           # 64-row tile, uneven last split
    (40, 128, (16, 16, 48), 1),       # no split
])
@pytest.mark.parametrize("dtype", [
    torch.float16,
    # the interpreter mis-reads bf16 in tl.dot (garbage on the CPU): bf16 runs on a GPU only
    pytest.param(torch.bfloat16, marks=[pytest.mark.gpu, pytest.mark.skipif(
        INTERPRET or not torch.cuda.is_available(), reason="bf16 tl.dot needs a GPU")])])
def test_linear_group_matches_mm(m, k, ns, split_k, dtype) -> None:
    from dspark_compile.kernels.linear import linear_group_triton

    x, ws = _case(m, k, ns, dtype)
    over = {} if split_k is None else {"split_k": split_k, "block_k": 64}
    got = linear_group_triton(x, ws, **over)
    again = linear_group_triton(x, ws, **over)
    for g, a, w in zip(got, again, ws):
        want = (x.float() @ w.float().t())
        assert g.shape == want.shape and g.dtype == dtype
        torch.testing.assert_close(g.float(), want, atol=2e-2, rtol=2e-2)
        assert torch.equal(g, a), "two runs must agree bit for bit (ordered split sums)"


@needs_kernel_device
def test_wide_and_float32_batches_use_torch_mm() -> None:
    from dspark_compile.kernels.targets import TARGETS
    from dspark_compile.kernels.linear import linear_group_triton

    cfg = TARGETS["sm_90"]
    big = cfg.linear_max_group_elems // 64 + 1
    for m, dtype, ns in ((cfg.linear_max_m + 1, torch.float16, (24, 8)),
                         (5, torch.float32, (24, 8)), (5, torch.float16, (24,)),
                         (2, torch.float16, (big, 1))):
        x, ws = _case(m, 64, ns, dtype, seed=1)
        for g, w in zip(linear_group_triton(x, ws), ws):
            assert torch.equal(g, torch.mm(x, w.t()))


@needs_kernel_device
@pytest.mark.parametrize("mutate, match", [
    (lambda x, ws: (x[None], ws), "2-D tensor"),
    (lambda x, ws: (x, ws * 2), "a group holds 1 to 3"),
    (lambda x, ws: (x, [ws[0][:, :-1]]), r"weights\[0\]"),
    (lambda x, ws: (x, [ws[0].float()]), "x's dtype"),
    (lambda x, ws: (x, [ws[0].t().contiguous().t()]), "contiguous"),
])
def test_bad_inputs_raise_value_error(mutate, match) -> None:
    from dspark_compile.kernels.linear import linear_group_triton

    x, ws = _case(3, 32, (32, 32), torch.float16)
    with pytest.raises(ValueError, match=match):
        linear_group_triton(*mutate(x, ws))


def test_split_rule_fills_the_gpu_and_keeps_k_per_split() -> None:
    from dspark_compile.kernels.targets import TARGETS
    from dspark_compile.kernels.linear import plan_linear

    cfg = TARGETS["sm_90"]
    qkv = plan_linear(3, 2048, (2048, 1024, 1024), cfg, 132)
    assert qkv.tiles == (32, 16, 16) and qkv.split_k == 8 and qkv.block_m == 16
    assert qkv.grid == (64, 8) and qkv.k_per_split == 256
    gate_up = plan_linear(24, 2048, (8192, 8192), cfg, 132)
    assert gate_up.split_k == 2 and gate_up.block_m == 32 and gate_up.grid == (256, 2)
    wide = plan_linear(64, 2048, (32000,), cfg, 132)
    assert wide.split_k == 1 and wide.block_m == 64 and wide.grid == (500, 1)
    odd = plan_linear(3, 200, (40,), cfg, 132, split_k=3, block_k=64)
    assert odd.k_per_split == 128 and odd.split_k == 2, "no empty split"


def test_group_linears_groups_weights_that_share_rows() -> None:
    from dspark_compile import dspark_compile
    from helpers import tiny_llama

    assert not [n for n in dspark_compile(tiny_llama(layers=1)).graph_module.graph.nodes
                if n.target is torch.ops.dspark.linear_group.default], "not by default"
    verifier = dspark_compile(tiny_llama(layers=2), group_linears="triton")
    groups = [[a.name for a in n.args[1]] for n in verifier.graph_module.graph.nodes
              if n.target is torch.ops.dspark.linear_group.default]
    assert ["model_layers_0_self_attn_q_proj_weight", "model_layers_0_self_attn_k_proj_weight",
            "model_layers_0_self_attn_v_proj_weight"] in groups
    assert ["model_layers_1_mlp_gate_proj_weight", "model_layers_1_mlp_up_proj_weight"] in groups
    assert len(groups) == 2 * 2, "lone weights (o, down, the LM head) stay aten.mm"
    mms = [n for n in verifier.graph_module.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert len(mms) == 2 * 2 + 1
    assert "group_linears: 4 rewritten" in verifier.explain()


def test_grouped_verifier_equals_ungrouped() -> None:
    """The rewrite is semantics-preserving: same logits and KV over prefill + verify."""
    from dspark_compile import VerifyLayout, dspark_compile
    from helpers import tiny_llama

    model = tiny_llama(layers=2)
    outs = []
    for group in ("off", "triton"):
        verifier = dspark_compile(model, group_linears=group)
        state = verifier.new_state(max_requests=3, max_context=40)
        g = torch.Generator().manual_seed(0)
        layout = VerifyLayout.pack([5, 9], [0, 0], [2, 0])
        first = verifier(torch.randint(0, 97, (14,), generator=g), layout, state)
        verifier.commit(layout, [5, 9], state)
        layout = VerifyLayout.pack([3, 1], [5, 9], [2, 0])
        outs.append((first, verifier(torch.randint(0, 97, (4,), generator=g), layout, state),
                     state.kv_caches[0][0].clone()))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- ahead of time
AOT_CASES = {  # case -> (kernel, dtype, constexprs)
    "group_bf16_m16_split": ("_linear_group_kernel", "bf16",
                             dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT=True, EVEN_K=True)),
    "group_fp16_m64": ("_linear_group_kernel", "fp16",
                       dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, SPLIT=False, EVEN_K=False)),
    "reduce_bf16": ("linear_reduce_kernel", "bf16", dict(BLOCK_N=64, HAS_BIAS=False,
                                                          PDL=False)),
    "reduce_bf16_bias": ("linear_reduce_kernel", "bf16", dict(BLOCK_N=1024, HAS_BIAS=True)),
}


def _compile_all() -> dict:
    from dspark_compile.kernels import linear as triton_linear
    from dspark_compile.kernels.targets import TARGETS

    out: dict = {}
    for case, (name, dtype, consts) in AOT_CASES.items():
        kernel = getattr(triton_linear, name)
        pointers = {a: dtype for a in kernel.arg_names if a.endswith("_ptr")}
        pointers["part_ptr"] = "fp32"
        for target in TARGET_NAMES:
            cfg = TARGETS[target]
            opts = {"num_warps": cfg.linear_num_warps}
            if name == "_linear_group_kernel":
                opts["num_stages"] = cfg.linear_num_stages
            out.setdefault(case, {})[target] = compile_kernel(kernel, pointers, consts, target,
                                                              opts)
    return out


compiled, test_kernel_compiles_ahead_of_time = aot_tests(__file__, AOT_CASES)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") != "1", "AOT compile needs TRITON_INTERPRET unset"
    print(json.dumps(_compile_all()))
