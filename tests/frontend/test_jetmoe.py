"""JetMoE: its mixture of experts (MLP) and mixture of attention heads (query and output
projections per expert) as the experts ops.

``frontend/jetmoe.py`` replaces ``JetMoeMoE.forward``, ``JetMoeMoA.map`` and
``JetMoeMoA.reduce`` for the capture (HF groups the pairs with ``expert_size.tolist()``, a host
sync a capture refuses), and ``JetMoeAttention.forward`` so that K and V are stored once, not
once per routed slot. Every ragged logit row equals HF's forward over that request's whole
sequence alone over a prefill and four ragged rounds (float32, CPU, reference ops), with every
expert of both routers picked; the gates and the slot layout matter (a mutated replacement is
caught); a changed source of any of the five classes is refused naming the module.
"""

import pytest
import torch

from dspark_compile import dspark_compile
from helpers import ragged_rounds_error, triton_rounds_error

jetmoe = pytest.importorskip("transformers.models.jetmoe.modeling_jetmoe")

VOCAB = 89
TOL = 1e-4


def tiny_jetmoe(top_k: int = 2):
    from transformers import JetMoeConfig

    torch.manual_seed(0)
    cfg = JetMoeConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_key_value_heads=2,
        kv_channels=16, intermediate_size=96, num_local_experts=4, num_experts_per_tok=top_k,
        num_attention_heads=2 * top_k, max_position_embeddings=256, bos_token_id=1,
        eos_token_id=2)
    model = jetmoe.JetMoeForCausalLM(cfg).eval()
    with torch.no_grad():  # HF's init is std 0.01 and zero biases: too close to a no-op
        for name, p in model.named_parameters():
            if "layernorm" not in name and "norm.weight" not in name:
                p.normal_(0.0, 0.2)
    return model


@pytest.fixture(scope="module")
def compiled():
    model = tiny_jetmoe()
    return model, dspark_compile(model)


def test_every_expert_of_both_routers_is_picked(compiled):
    model, _ = compiled
    picks = {"mlp": [], "attention": []}
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, jetmoe.JetMoeTopKGating):
            kind = "mlp" if name.endswith("mlp.router") else "attention"
            hooks.append(m.register_forward_hook(
                lambda mod, args, out, kind=kind: picks[kind].append(
                    mod.layer(args[0]).topk(mod.top_k, dim=1).indices.flatten())))
    try:
        with torch.no_grad():
            model(torch.randint(3, VOCAB, (1, 24), generator=torch.Generator().manual_seed(2)))
    finally:
        for h in hooks:
            h.remove()
    for kind, ids in picks.items():
        assert set(torch.cat(ids).tolist()) == {0, 1, 2, 3}, kind


def test_experts_are_the_ops(compiled):
    """Two routes a layer (attention and MLP), two up and two down projections, no loop."""
    model, verifier = compiled
    targets = [str(n.target) for n in verifier.graph_module.graph.nodes
               if n.op == "call_function"]
    layers = model.config.num_hidden_layers
    for op in ("experts_route", "experts_up", "experts_down"):
        assert sum(op in t for t in targets) == 2 * layers, op


def test_kv_heads_are_stored_once(compiled):
    """HF tiles K and V once per routed slot; the capture regroups the query heads instead, so
    each layer's pool holds the model's KV heads, not top_k times as many."""
    model, verifier = compiled
    assert [s.num_kv_heads for s in verifier.adapter.specs] == \
        [model.config.num_key_value_heads] * model.config.num_hidden_layers


@pytest.mark.parametrize("slots,prompts", [([1, 0, 2], [7, 4, 9]), ([0], [6])])
def test_ragged_equals_hf_forward(compiled, slots, prompts):
    model, verifier = compiled
    err = ragged_rounds_error(model, verifier, slots, prompts, VOCAB, seed=5)
    assert err < TOL, f"max |ragged - HF| = {err}"


def test_one_expert_a_token_equals_hf_forward():
    model = tiny_jetmoe(top_k=1)
    err = ragged_rounds_error(model, dspark_compile(model), [1, 0], [5, 8], VOCAB, seed=3)
    assert err < TOL, f"max |ragged - HF| = {err}"


@pytest.mark.parametrize("mutation", ["gates", "slots", "head_groups"])
def test_a_wrong_replacement_is_caught(monkeypatch, mutation):
    """The check above can fail: equal gates, or the slots of each token swapped, make the
    ragged logits differ from HF's."""
    from dspark_compile.frontend import jetmoe as hook

    if mutation == "gates":
        route = hook._route
        monkeypatch.setattr(hook, "_route", lambda router, rows: (
            lambda ids, gates, logits: (ids, torch.full_like(gates, 1 / gates.shape[1]),
                                        logits))(*route(router, rows)))
    elif mutation == "slots":
        reduce = hook._moa_reduce
        monkeypatch.setattr(hook, "_moa_reduce", lambda module, x, topo: reduce(
            module, x.flip(2), topo))
    else:  # the query heads left in slot order: each would read another slot's KV head
        monkeypatch.setattr(hook, "_by_kv_head", lambda q, top_k, kv_heads: q)
    model = tiny_jetmoe()
    err = ragged_rounds_error(model, dspark_compile(model), [1, 0], [5, 8], VOCAB, seed=3)
    assert err > 1e-2, err


@pytest.mark.parametrize("key", [("JetMoeMoE", "forward"), ("JetMoeMoA", "map"),
                                 ("JetMoeMoA", "reduce"), ("JetMoeTopKGating", "forward"),
                                 ("JetMoeParallelExperts", "forward"),
                                 ("JetMoeAttention", "forward")])
def test_changed_source_is_refused(monkeypatch, key):
    from dspark_compile.frontend import jetmoe as hook

    monkeypatch.setitem(hook.KNOWN_SOURCES, key, frozenset())
    with pytest.raises(NotImplementedError,
                       match=r"JetMoe(MoA|MoE|Attention) "
                             r"'model.layers.0.(self_attention.experts|mlp|self_attention)'"
                             r".*refused rather than verified wrong"):
        dspark_compile(tiny_jetmoe())


def test_replaced_methods_are_restored():
    model = tiny_jetmoe()
    before = (jetmoe.JetMoeMoE.forward, jetmoe.JetMoeMoA.map, jetmoe.JetMoeMoA.reduce)
    dspark_compile(model)
    assert (jetmoe.JetMoeMoE.forward, jetmoe.JetMoeMoA.map, jetmoe.JetMoeMoA.reduce) == before


@pytest.mark.gpu
def test_float32_on_gpu_through_triton_matches_hf():
    """Both routers' experts through the Triton routing and grouped GEMMs, on the GPU."""
    err = triton_rounds_error(tiny_jetmoe(), [1, 0, 2], [7, 4, 9], VOCAB, seed=5)
    assert err < 2e-3, err
