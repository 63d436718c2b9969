"""``dspark::experts_route / experts_up / experts_down``: routing order, padding that routes
nowhere, and the reference against transformers' own experts forwards (``batched_mm`` and
``grouped_mm``) on real HF experts modules, gated (Mixtral) and with a custom gate, biases and
transposed weights (GPT-OSS)."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from transformers.integrations.moe import batched_mm_experts_forward, grouped_mm_experts_forward

from dspark_compile.ops.experts_reference import pair_experts

ops = torch.ops.dspark


def _experts(family: str):
    torch.manual_seed(0)
    if family == "mixtral":
        cfg = T.MixtralConfig(hidden_size=64, intermediate_size=32, num_local_experts=4,
                              num_experts_per_tok=2, num_hidden_layers=1, vocab_size=32,
                              num_attention_heads=4, num_key_value_heads=2)
        module = T.MixtralForCausalLM(cfg).model.layers[0].mlp.experts
    else:
        cfg = T.GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=4,
                             num_experts_per_tok=2, num_hidden_layers=1, vocab_size=32,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        module = T.GptOssForCausalLM(cfg).model.layers[0].mlp.experts
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return module.eval()


def _ours(module, x, ids, weights, qsl=None, activation="silu_glu"):
    gated = module.has_gate
    w_up = module.gate_up_proj if gated else module.up_proj
    b_up = getattr(module, "gate_up_proj_bias", None) if module.has_bias else None
    b_down = module.down_proj_bias if module.has_bias else None
    order, offsets = ops.experts_route(ids, qsl, w_up.shape[0])
    h = ops.experts_up(x, order, offsets, w_up, b_up, module.is_transposed, activation)
    if activation == "none":
        h = module._apply_gate(h)
    return ops.experts_down(h, order, offsets, weights, module.down_proj, b_down,
                            module.is_transposed)


def test_route_groups_pairs_by_expert_stably_with_padding_last():
    ids = torch.tensor([[2, 0], [0, 3], [1, 2], [0, 0]])
    qsl = torch.tensor([0, 1, 3], dtype=torch.int32)  # row 3 is padding
    order, offsets = ops.experts_route(ids, qsl, 4)
    assert order.tolist() == [1, 2, 4, 0, 5, 3, 6, 7]
    assert offsets.tolist() == [2, 3, 5, 6]
    ids[0, 1] = 7  # an id outside [0, E) routes nowhere too
    order, offsets = ops.experts_route(ids, None, 4)
    assert offsets.tolist() == [3, 4, 6, 7] and order.tolist()[-1] == 1
    assert pair_experts(order, offsets).tolist() == [2, 4, 0, 3, 1, 2, 0, 0]


@pytest.mark.parametrize("family,activation", [("mixtral", "silu_glu"), ("mixtral", "none"),
                                               ("gpt_oss", "none")])
def test_reference_equals_transformers_experts(family, activation):
    module = _experts(family)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 64, generator=gen)
    ids = torch.randint(0, 4, (9, 2), generator=gen)
    weights = torch.rand(9, 2, generator=gen)
    got = _ours(module, x, ids, weights, activation=activation)
    assert torch.equal(got, batched_mm_experts_forward(module, x, ids, weights))
    torch.testing.assert_close(got, grouped_mm_experts_forward(module, x, ids, weights),
                               atol=1e-5, rtol=1e-5)


def test_padding_routes_nowhere_and_cannot_poison_real_rows():
    module = _experts("mixtral")
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, 64, generator=gen)
    ids = torch.randint(0, 4, (7, 2), generator=gen)
    weights = torch.rand(7, 2, generator=gen)
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32)
    clean = _ours(module, x, ids, weights, qsl)
    x[5:], weights[5:], ids[5:] = float("nan"), float("inf"), 3
    got = _ours(module, x, ids, weights, qsl)
    assert torch.equal(got[:5], clean[:5])
    assert torch.equal(got[:5], batched_mm_experts_forward(module, x[:5], ids[:5], weights[:5]))
    assert torch.equal(got[5:], torch.zeros(2, 64)), "padded rows come out as zeros"


def test_empty_batch_and_fake_shapes():
    module = _experts("mixtral")
    ids, weights = torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2)
    assert _ours(module, torch.zeros(0, 64), ids, weights).shape == (0, 64)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, ids, w = torch.empty(5, 64), torch.empty(5, 3, dtype=torch.int64), torch.empty(5, 3)
        order, offsets = ops.experts_route(ids, None, 4)
        h = ops.experts_up(x, order, offsets, torch.empty(4, 32, 64), None, False, "gelu_glu")
        out = ops.experts_down(h, order, offsets, w.double(), torch.empty(4, 64, 16), None,
                               False)
    assert (order.shape, offsets.shape, h.shape) == ((15,), (4,), (15, 16))
    assert out.shape == (5, 64) and out.dtype == torch.float64


@pytest.mark.parametrize("call,match", [
    (lambda x, o, f, w: ops.experts_up(x.double(), o, f, w, None, False, "silu_glu"),
     "cast the rows"),
    (lambda x, o, f, w: ops.experts_up(x, o, f, w, None, False, "swish"), "activation="),
    (lambda x, o, f, w: ops.experts_up(x, o, f, w.transpose(1, 2), None, False, "none"),
     "take 32 input columns"),
    (lambda x, o, f, w: ops.experts_up(x, o, f[:3], w, None, False, "none"), "3 entries"),
])
def test_bad_arguments_say_the_rule(call, match):
    order, offsets = ops.experts_route(torch.zeros(3, 2, dtype=torch.int64), None, 4)
    with pytest.raises(ValueError, match=match):
        call(torch.zeros(3, 64), order, offsets, torch.zeros(4, 32, 64))


@pytest.mark.parametrize("transposed", [False, True])
def test_the_reference_gathers_expert_weights_in_bounded_chunks_bit_for_bit(monkeypatch,
                                                                            transposed):
    """Each pair's product is its own, so gathering the pairs' expert weights a few at a time
    (768 rows of Qwen3-30B-A3B's experts once gathered 72 GiB at once) changes no bit."""
    from dspark_compile.ops import experts_reference as R

    torch.manual_seed(0)
    w = torch.randn(8, 32, 64) if transposed else torch.randn(8, 64, 32)
    rows, experts, bias = torch.randn(50, 32), torch.randint(0, 8, (50,)), torch.randn(8, 64)
    whole = R._expert_rows(rows, w, bias, transposed, experts)
    monkeypatch.setattr(R, "GATHER_BYTES", 3 * w[0].numel() * w.element_size())
    assert torch.equal(R._expert_rows(rows, w, bias, transposed, experts), whole)
    assert R._expert_rows(rows[:0], w, None, transposed, experts[:0]).shape == (0, 64)
