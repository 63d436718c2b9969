"""``concat_linears`` (``DSparkConfig(group_linears="concat")``): the rewrite, the stacked
weights (no weight stored twice), and equality with one matmul per weight."""

import pytest
import torch
from expecttest import assert_expected_inline

from dspark_compile import DSparkConfig, VerifyLayout, dspark_compile
from dspark_compile.passes.printing import graph_text
from helpers import packed_graph, prefill_verify_rounds, tiny_llama, tiny_qwen35, tiny_vl


def _stacked(verifier) -> list:
    return [s for s in verifier.inputs if s.kind == "param_concat"]


def _mms(verifier) -> int:
    return sum(n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
               for n in verifier.graph_module.graph.nodes)


def _storage_bytes(model) -> int:
    seen = {}
    for p in model.parameters():
        seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    return sum(seen.values())


def test_concat_stacks_qkv_and_gate_up_into_views_of_one_buffer() -> None:
    model = tiny_llama(layers=2)
    before = _storage_bytes(model)
    eager = model(torch.arange(9)[None]).logits
    verifier = dspark_compile(model, group_linears="concat")
    layer = model.model.layers[1]
    assert [s.parts for s in _stacked(verifier)][2:] == [
        ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
         "model.layers.1.self_attn.v_proj.weight"),
        ("model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight")]
    assert _mms(verifier) == 2 * 2 + 2 * 2 + 1, "o, down and the LM head stay single matmuls"
    text = verifier.explain()
    assert "concat_linears: 4 rewritten" in text
    # each rewrite names the model's line (flatten_tokens keeps the source meta; nn.Linear's
    # own forward is skipped for the line that calls it)
    assert "<no source line recorded>" not in text
    assert "self.q_proj(hidden_states)" in text and "self.gate_proj(x)" in text
    q, k, v = (layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight,
               layer.self_attn.v_proj.weight)
    assert q.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    assert k.storage_offset() == q.storage_offset() + q.numel()
    assert _storage_bytes(model) == before, "no weight is stored twice"
    stacked = verifier._weights["+".join(_stacked(verifier)[2].parts)]
    assert torch.equal(stacked[q.shape[0]:q.shape[0] + k.shape[0]], k)
    assert torch.equal(model(torch.arange(9)[None]).logits, eager), "the model is unchanged"
    again = dspark_compile(model, group_linears="concat")
    assert again._weights[_stacked(again)[2].name].data_ptr() == stacked.data_ptr(), \
        "a second verifier reuses the stacked buffer"


@pytest.mark.parametrize("make", [lambda: tiny_llama(layers=2), lambda: tiny_vl("qwen2_vl"),
                                  tiny_qwen35],
                         ids=["llama", "qwen2_vl_bias", "qwen35_hybrid"])
def test_concat_verifier_equals_one_matmul_per_weight(make) -> None:
    """Prefill + verify + commit rounds: the stacked GEMM's logits and KV equal the separate
    matmuls' to float32 rounding (bias groups stack their biases too)."""
    model = make()
    vocab = model.config.get_text_config().vocab_size
    off = prefill_verify_rounds(dspark_compile(model, group_linears="off"), vocab)
    concat = dspark_compile(model, group_linears="concat")
    assert _stacked(concat)
    if make is tiny_qwen35:  # its GDN views merge the token axis into the q/k/v columns
        assert "contiguous=2" in concat.explain(), "those slices must be made contiguous"
    for a, b in zip(off, prefill_verify_rounds(concat, vocab)):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_qwen2_biases_are_stacked_with_their_weights() -> None:
    verifier = dspark_compile(tiny_vl("qwen2_vl"), group_linears="concat")
    names = [s.name for s in _stacked(verifier)]
    assert "model.language_model.layers.0.self_attn.q_proj.bias+model.language_model.layers.0" \
        ".self_attn.k_proj.bias+model.language_model.layers.0.self_attn.v_proj.bias" in names
    addmms = [n for n in verifier.graph_module.graph.nodes
              if n.target is torch.ops.aten.addmm.default]
    assert addmms and all(a.args[0].meta["dspark_input"].kind == "param_concat" for a in addmms)


def test_shared_weight_is_not_stacked() -> None:
    """A weight another matmul also reads (here v_proj tied to k_proj) keeps its own storage."""
    model = tiny_llama(layers=1)
    attn = model.model.layers[0].self_attn
    attn.v_proj.weight = attn.k_proj.weight
    verifier = dspark_compile(model, group_linears="concat")
    parts = [p for s in _stacked(verifier) for p in s.parts]
    assert parts == ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    assert attn.q_proj.weight.untyped_storage().data_ptr() != \
        attn.k_proj.weight.untyped_storage().data_ptr()


def test_auto_is_concat_with_triton_and_off_with_the_reference() -> None:
    assert not _stacked(dspark_compile(tiny_llama(layers=1))), "reference: auto is off"
    for device_type, want in (("cuda", 2), ("cpu", 0)):
        gm, ctx = packed_graph(tiny_llama(layers=1), device_type=device_type,
                               stages=("ragged", "lowering"), rotary="inductor",
                               fuse_linears="off")
        inputs = ctx.inputs
        assert sum(s.kind == "param_concat" for s in inputs) == want
        placeholders = [n.meta["dspark_input"] for n in gm.graph.find_nodes(op="placeholder")]
        assert placeholders == inputs, "the inputs list stays in step with the placeholders"


@pytest.mark.parametrize("bad", [True, "stack", None])
def test_group_linears_value_is_checked(bad) -> None:
    with pytest.raises(ValueError, match=r"group_linears=.*must be one of 'auto', 'concat'"):
        DSparkConfig(group_linears=bad)


@pytest.mark.skipif(not torch.__version__.startswith("2.13"),
                    reason="snapshot taken on torch 2.13")
def test_concat_snapshot() -> None:
    gm, _ = packed_graph(tiny_llama(layers=1), stages=("ragged", "lowering"),
                         group_linears="concat")
    lines = [ln for ln in graph_text(gm).splitlines()
             if "stacked" in ln or " = aten.slice(mm" in ln or "aten.mm(" in ln]
    assert_expected_inline("\n".join(lines), """\
t_default = aten.t(model_layers_0_self_attn_q_proj_weight_stacked)  # [64, 128]
mm_default = aten.mm(view, t_default)  # [s0, 128]
slice_tensor = aten.slice(mm_default, 1, 0, 64)  # [s0, 64]
slice_tensor_1 = aten.slice(mm_default, 1, 64, 96)  # [s0, 32]
slice_tensor_2 = aten.slice(mm_default, 1, 96, 128)  # [s0, 32]
mm = aten.mm(view_9, t)  # [s0, 64]
t_default_1 = aten.t(model_layers_0_mlp_gate_proj_weight_stacked)  # [64, 192]
mm_default_1 = aten.mm(view_10, t_default_1)  # [s0, 192]
slice_tensor_3 = aten.slice(mm_default_1, 1, 0, 96)  # [s0, 96]
slice_tensor_4 = aten.slice(mm_default_1, 1, 96, 192)  # [s0, 96]
mm_1 = aten.mm(view_11, t_1)  # [s0, 64]
mm_2 = aten.mm(view_12, t_2)  # [s0, 97]""")


def test_moving_the_model_after_the_build_is_refused_not_read_stale() -> None:
    """model.to() after dspark_compile gives every parameter a new storage: the stacked
    buffers (and captured graphs) would read the old one, so the next call says so;
    load_state_dict copies in place and is seen."""
    model = tiny_llama(layers=2)
    verifier = dspark_compile(model, group_linears="concat")
    state = verifier.new_state(max_requests=2, max_context=32)
    ids = torch.arange(5)
    layout = VerifyLayout.pack([5], [0], [0])
    before = verifier(ids, layout, state).clone()
    model.load_state_dict({k: v * 1.0 for k, v in model.state_dict().items()})
    state.release([0])
    torch.testing.assert_close(verifier(ids, layout, state), before, rtol=0, atol=0)
    model.to(torch.float64)
    with pytest.raises(RuntimeError, match="moved since this verifier was built"):
        verifier(ids, layout, state)
    with pytest.raises(RuntimeError, match="dspark_compile\\(model\\) again"):
        verifier.capture(state, progress=False)
