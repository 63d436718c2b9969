"""``fuse_linears``: each matmul with its RMSNorm (and residual add) or SiLU-and-mul becomes one
``dspark::skinny_linear``. The reference op runs the graph's own ops in order, so on the CPU the
fused verifier equals the unfused one bit for bit; the GPU kernel is in test_triton_skinny.py."""

from __future__ import annotations

import re

import pytest
import torch

from dspark_compile import DSparkConfig, dspark_compile
from helpers import prefill_verify_rounds, tiny_llama, tiny_qwen3, tiny_vl, with_forward

SKINNY = torch.ops.dspark.skinny_linear.default


def _details(verifier) -> dict:
    return next(r.details for r in verifier.results if r.name == "fuse_linears")


@pytest.mark.parametrize("make, group", [
    (lambda: tiny_llama(layers=2), "concat"),
    (lambda: tiny_llama(layers=2), "off"),
    (lambda: tiny_qwen3(layers=2), "concat"),    # q/k norms between the matmul and attention
    (lambda: tiny_vl("qwen2_vl"), "concat"),     # q/k/v biases (addmm)
], ids=["llama_concat", "llama_off", "qwen3", "qwen2_vl_bias"])
def test_fused_verifier_equals_the_unfused_one_bit_for_bit(make, group) -> None:
    model = make().half()
    vocab = model.config.get_text_config().vocab_size
    off = prefill_verify_rounds(dspark_compile(model, group_linears=group, fuse_linears="off"),
                                vocab)
    fused = dspark_compile(model, group_linears=group, fuse_linears="on")
    assert sum(n.target is SKINNY for n in fused.graph_module.graph.nodes) > 0
    for a, b in zip(off, prefill_verify_rounds(fused, vocab)):
        assert torch.equal(a, b)


def test_llama_layer_is_six_launches() -> None:
    """Stacked q/k/v and gate/up: per layer the residual add, both norms and the SiLU-and-mul
    are inside the four matmuls; nothing of them is left for Inductor."""
    layers = 3
    verifier = dspark_compile(tiny_llama(layers=layers).half(), group_linears="concat",
                              fuse_linears="on")
    assert _details(verifier) == {"plain": layers, "glu epilogue": layers,
                                  "rmsnorm": 2 * layers + 1, "residual add": 2 * layers}
    nodes = list(verifier.graph_module.graph.nodes)
    ops = [n for n in nodes if n.target is SKINNY]
    assert len(ops) == 4 * layers + 1  # q/k/v, o, gate/up, down per layer; the LM head
    aten = torch.ops.aten
    left = {n.target for n in nodes} & {aten.rsqrt.default, aten.silu.default, aten.mm.default,
                                         aten.pow.Tensor_Scalar}
    assert not left, f"unfused ops left: {left}"
    glu = [n for n in ops if n.args[7]]
    assert len(glu) == layers and all(n.meta["val"][0].shape[1] == 96 for n in glu)


def test_explain_names_each_fusion_and_its_model_line() -> None:
    verifier = dspark_compile(tiny_llama(layers=1).half(), group_linears="concat",
                              fuse_linears="on")
    text = verifier.explain()
    for want in ("gate_proj_weight_stacked + rmsnorm + residual add -> skinny_linear",
                 "silu*mul -> the epilogue of model_layers_0_mlp_gate_proj_weight_stacked's",
                 "o_proj_weight -> skinny_linear  <- ", "self.o_proj(attn_output)"):
        assert want in text, f"{want!r} not in explain():\n{text}"


def test_float32_graphs_are_left_alone() -> None:
    verifier = dspark_compile(tiny_llama(layers=1), fuse_linears="on")
    assert _details(verifier) == {}
    assert not any(n.target is SKINNY for n in verifier.graph_module.graph.nodes)


def test_auto_is_on_with_triton_and_off_with_the_reference() -> None:
    from helpers import packed_graph

    verifier = dspark_compile(tiny_llama(layers=1).half())
    assert not any(r.name == "fuse_linears" for r in verifier.results)
    for device_type, want in (("cuda", 5), ("cpu", 0)):
        gm, _ = packed_graph(tiny_llama(layers=1).half(), torch.float16, device_type,
                             ("ragged", "lowering"), rotary="inductor")
        made = [n for n in gm.graph.nodes if "skinny_linear" in str(n.target)]
        assert len(made) == want


@pytest.mark.parametrize("bad", [True, "triton", None])
def test_fuse_linears_value_is_checked(bad) -> None:
    with pytest.raises(ValueError, match=r"fuse_linears=.*must be one of 'auto', 'on', 'off'"):
        DSparkConfig(fuse_linears=bad)


ROTARY_APPLY = torch.ops.dspark.rotary_apply.default


@pytest.mark.parametrize("make, inductor", [
    (lambda: tiny_llama(layers=2), True),        # the rotated views through Inductor
    (lambda: tiny_vl("qwen2_vl"), False),        # q/k/v biases, mRoPE cos/sin
], ids=["llama_inductor", "qwen2_vl_bias"])
def test_rotary_epilogue_verifier_equals_the_rotary_launch_bit_for_bit(make, inductor) -> None:
    model = make().half()
    vocab = model.config.get_text_config().vocab_size
    kw = dict(group_linears="concat", rotary="triton", fuse_linears="on", inductor=inductor)
    base = dspark_compile(model, rotary_epilogue="off", **kw)
    moved = dspark_compile(model, rotary_epilogue="on", **kw)
    assert next(r for r in moved.results if r.name == "fuse_rotary_epilogue").changed == 2
    nodes = list(moved.graph_module.graph.nodes)
    assert not [n for n in nodes if n.target is ROTARY_APPLY]
    assert len([n for n in nodes if n.target is SKINNY and len(n.args) > 10 and n.args[10]]) == 2
    for a, b in zip(prefill_verify_rounds(base, vocab), prefill_verify_rounds(moved, vocab)):
        assert torch.equal(a, b)


def _matmul_angles(self, x, position_ids):
    """HF 5.17's rotary angles: ``inv_freq @ positions``, a matmul over one (5.24 multiplies)."""
    inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
    freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return ((emb.cos() * self.attention_scaling).to(x.dtype),
            (emb.sin() * self.attention_scaling).to(x.dtype))


@pytest.mark.parametrize("epilogue", ["on", "off"])
@pytest.mark.parametrize("angles", ["mul", "matmul"])
def test_inductor_writes_the_rotary_tables_once_for_every_layer(epilogue, angles) -> None:
    """cos and sin are read by one op per layer; Inductor's code passes every layer the same
    two buffers (it copied them out per layer before: 2 x layers buffers), whether the model
    multiplies its angles out or takes them from a matmul over one (``outer_products``)."""
    from torch._inductor.utils import run_and_get_code

    layers = 3
    model = tiny_llama(layers=layers).half()
    if angles == "matmul":
        rotary = model.model.rotary_emb
        with_forward(rotary, _matmul_angles)
    verifier = dspark_compile(model, group_linears="concat", rotary="triton",
                              fuse_linears="on", inductor=True, rotary_epilogue=epilogue)
    if angles == "matmul":
        assert next(r for r in verifier.results if r.name == "outer_products").changed == 1
    assert not [n for n in verifier.graph_module.graph.nodes
                if n.target in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)]
    with torch._inductor.config.patch(fx_graph_cache=False):  # compile here, not a cache hit
        _, codes = run_and_get_code(prefill_verify_rounds, verifier, 97)
    # skinny_linear(..., cos, sin, rot_cols) with rot_cols > 0, or rotary_apply(q, k, cos, sin)
    tables = re.compile(r"dspark\.(?:skinny_linear|rotary_apply)\.default\(.*, (\w+), (\w+)"
                        r"(?:, [1-9]\d*)?\)$")
    for code in codes:
        read = [m.groups() for line in code.splitlines() if (m := tables.search(line.strip()))]
        assert len(read) == layers, code
        assert len(set(read)) == 1, read


def test_rotary_epilogue_leaves_a_rotation_behind_q_k_norms() -> None:
    """Qwen3 normalises q and k between the matmul and the rotary: they are not views of the
    matmul's output, so the rotary launch stays."""
    verifier = dspark_compile(tiny_qwen3(layers=2).half(), group_linears="concat",
                              rotary="triton", fuse_linears="on", rotary_epilogue="on")
    assert next(r for r in verifier.results if r.name == "fuse_rotary_epilogue").changed == 0
    assert sum(n.target is ROTARY_APPLY for n in verifier.graph_module.graph.nodes) == 2


def test_rotary_epilogue_makes_a_llama_layer_five_launches() -> None:
    layers = 2
    verifier = dspark_compile(tiny_llama(layers=layers).half(), group_linears="concat",
                              rotary="triton", fuse_linears="on", rotary_epilogue="on")
    nodes = list(verifier.graph_module.graph.nodes)
    assert not [n for n in nodes if n.target is ROTARY_APPLY]
    qkv = [n for n in nodes if n.target is SKINNY and len(n.args) > 10 and n.args[10]]
    assert [n.args[10] for n in qkv] == [96] * layers  # 4 q heads + 2 k heads of 16
    assert "rotary_apply of 6 heads -> the epilogue of" in verifier.explain()
    with pytest.raises(ValueError, match="rotary_epilogue='yes'"):
        DSparkConfig(rotary_epilogue="yes")
