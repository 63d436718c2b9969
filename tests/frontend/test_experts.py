"""Mixture-of-experts families verify exactly through transformers' experts interface.

Every family whose experts class uses ``@use_experts_implementation`` runs its experts as
``dspark::experts_route / experts_up / experts_down`` during the capture, with no per-model
code: SwiGLU experts (Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3) fuse their gate into
``experts_up``; the router before them (DeepSeek-V3's top-k within the best expert groups, with
a score-correction bias and a routed scaling factor) and a shared expert beside them (Qwen2-MoE,
DeepSeek-V3; Qwen3-Next in ``test_moe.py``) stay graph code; GPT-OSS's clamped gate over
interleaved columns, with biases and transposed weights, runs as its own graph code between the
two ops. Every verified row of a prefill and three ragged rounds equals HF's own forward
(``use_cache=False``) over that request's whole sequence.
"""

from __future__ import annotations

import pytest
import torch
import transformers as T
from torch import nn

from dspark_compile import dspark_compile
from dspark_compile.frontend.experts import _arguments, _tables, fused_activation
from helpers import Session, prefill_and_rounds

TOL = 1e-5
VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2)
DEEPSEEK = dict(n_routed_experts=4, n_shared_experts=1, n_group=2, topk_group=1,
                first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                qk_nope_head_dim=8, v_head_dim=16, routed_scaling_factor=2.5, **MOE)

FAMILIES = {  # name: (config, model, extra config, the gate experts_up fuses)
    "mixtral": (T.MixtralConfig, T.MixtralForCausalLM,
                dict(num_local_experts=4, num_experts_per_tok=2), "silu_glu"),
    "qwen2_moe": (T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM,
                  dict(num_experts=4, shared_expert_intermediate_size=32, **MOE), "silu_glu"),
    "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM,
                  dict(num_experts=4, head_dim=16, **MOE), "silu_glu"),
    "olmoe": (T.OlmoeConfig, T.OlmoeForCausalLM,
              dict(num_experts=4, num_experts_per_tok=2), "silu_glu"),
    "gpt_oss": (T.GptOssConfig, T.GptOssForCausalLM,
                dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2), "none"),
    "deepseek_v3": (T.DeepseekV3Config, T.DeepseekV3ForCausalLM, DEEPSEEK, "silu_glu"),
}


def _build(name: str):
    config_cls, model_cls, extra, _ = FAMILIES[name]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**BASE, **extra})).eval()
    _spread_biases(model)
    return model


def _spread_biases(model) -> None:
    """Expert and router biases start at zero; make them count (and DeepSeek's correction)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("_proj_bias", "router.bias", "e_score_correction_bias")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def _run(model, verifier) -> float:
    return prefill_and_rounds(model, verifier, VOCAB)


def _experts_calls(verifier) -> dict[str, list]:
    """The experts ops of the packed graph, by op name: their arguments."""
    found: dict[str, list] = {}
    for node in verifier.graph_module.graph.nodes:
        name = getattr(node.target, "__name__", "")
        if name.startswith("experts_"):
            found.setdefault(name.split(".")[0], []).append(node.args)
    return found


def _check_graph(verifier, layers: int, activation: str) -> None:
    calls = _experts_calls(verifier)
    assert {k: len(v) for k, v in calls.items()} == {
        "experts_route": layers, "experts_up": layers, "experts_down": layers}
    assert all(args[1] is not None for args in calls["experts_route"]), "padding must not route"
    assert {args[-1] for args in calls["experts_up"]} == {activation}
    assert not any(getattr(n.target, "__name__", "").startswith("bmm")
                   for n in verifier.graph_module.graph.nodes), "no per-pair weight gathers"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_ragged_equals_hf_forward(name):
    model = _build(name)
    previous = model.config._experts_implementation
    verifier = dspark_compile(model)
    assert model.config._experts_implementation == previous, "the capture restores it"
    _check_graph(verifier, 1, FAMILIES[name][3])
    err = _run(model, verifier)
    assert err <= TOL, f"{name}: max |ragged - HF| = {err}"


def test_tier_padding_routes_nowhere_and_changes_no_real_row(monkeypatch):
    """On the static-buffer tier path (the CPU twin of the tier graphs) every step pads ``N``
    up to its tier; the padded rows route nowhere and the real rows still equal HF's."""
    from dspark_compile.ops import experts_reference

    seen = []
    route = experts_reference.route
    monkeypatch.setattr(experts_reference, "route", lambda ids, qsl, e: seen.append(
        (ids.shape[0], int(qsl[-1]))) or route(ids, qsl, e))
    model = _build("mixtral")
    verifier = dspark_compile(model)
    session = Session(model, verifier, [2, 0, 1], seed=1)
    verifier.capture(session.state, block=4)
    session.vocab = VOCAB
    session.step([9, 11, 10], accept=[9, 11, 10])  # past the largest tier: eager
    for lens in ([3, 2, 4], [4, 1, 3], [2, 4, 1]):
        session.step(lens)
    assert session.max_err <= TOL
    assert any(rows > real for rows, real in seen), "some step ran with padded rows"


# ---------------------------------------------------------------------- whitelist
def test_fused_activation_is_proven_by_probing_the_gate():
    mixtral = _build("mixtral").model.layers[0].mlp.experts
    assert fused_activation(mixtral, 64) == "silu_glu"
    mixtral.act_fn = nn.GELU(approximate="tanh")
    assert fused_activation(mixtral, 64) == "gelu_tanh_glu"
    mixtral.act_fn = nn.Tanh()  # no fused form: the model's own gate runs in the graph
    assert fused_activation(mixtral, 64) == "none"
    oss = _build("gpt_oss").model.layers[0].mlp.experts  # clamped, interleaved: graph code
    assert fused_activation(oss, 64) == "none"


class _Experts(nn.Module):
    """What ``@use_experts_implementation`` leaves on an experts module."""

    has_gate, has_bias, is_transposed, has_post_expert_norm = True, False, False, False
    _is_expert_parallel = False

    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(4, 8, 6))
        self.down_proj = nn.Parameter(torch.zeros(4, 6, 4))


@pytest.mark.parametrize("attribute,why", [
    ("_is_expert_parallel", "expert-parallel"),
    ("has_post_expert_norm", "has_post_expert_norm"),
])
def test_layouts_outside_the_ops_are_refused_by_name(attribute, why):
    module = _Experts()
    setattr(module, attribute, True)
    with pytest.raises(NotImplementedError, match=why):
        _tables(module, "experts model.layers.0.mlp.experts")


def test_quantized_expert_weights_are_refused():
    module = _Experts()
    module.gate_up_proj = nn.Parameter(torch.zeros(4, 8, 6).to(torch.float8_e4m3fn),
                                       requires_grad=False)
    with pytest.raises(NotImplementedError, match="quantized experts"):
        _tables(module, "experts model.layers.0.mlp.experts")


def test_arguments_outside_the_routing_tensors_are_refused():
    x, ids, w = torch.zeros(3, 6), torch.zeros(3, 2, dtype=torch.int64), torch.zeros(3, 2)
    assert _arguments("e", (x,), {"router_indices": ids, "routing_weights": w})[1] is ids
    with pytest.raises(NotImplementedError, match="'capacity'"):
        _arguments("e", (x, ids, w), {"capacity": 2})
    with pytest.raises(NotImplementedError, match="not \\[M, D\\] rows"):
        _arguments("e", (x[None], ids, w), {})


# ---------------------------------------------------------------------- GPU (-m gpu)
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_gpu_triton_lowering_matches_hf(name):
    """The Triton experts (fused SwiGLU; GPT-OSS: biases, transposed weights, its own gate in
    between) in float32 against HF's forward (IEEE fp32 dots at torch's default precision)."""
    model = _build(name).cuda()
    model.set_experts_implementation("batched_mm")  # HF's oracle in float32 on any GPU
    verifier = dspark_compile(model, lowering="triton")
    assert {n.target.__name__.split(".")[0] for n in verifier.graph_module.graph.nodes
            if getattr(n.target, "__name__", "").startswith("experts_")} == {
        "experts_route_triton", "experts_up_triton", "experts_down_triton"}
    session = Session(model, verifier, [2, 0, 1], seed=1, device="cuda")
    session.vocab = VOCAB
    session.step([9, 11, 10], accept=[9, 11, 10])
    for lens in ([3, 2, 4], [4, 1, 3], [2, 4, 1]):
        session.step(lens)
    assert session.max_err < 2e-2


@pytest.mark.gpu
def test_gpu_tier_graph_replay_equals_eager_bitwise():
    """A bf16 Qwen3-MoE in tier graphs: every replay equals the eager run of the same tier
    bit for bit (padded rows route nowhere in both), and both match the reference lowering."""
    import random

    from dspark_compile import VerifyLayout
    from dspark_compile.session.tiers import tier_set

    model = _build("qwen3_moe").cuda().to(torch.bfloat16)
    tri = dspark_compile(model, lowering="triton")
    ref = dspark_compile(model, lowering="reference")
    block, max_requests = 4, 8
    tiers = tier_set(max_requests, block)
    graph_state, eager_state = (tri.new_state(max_requests=max_requests, max_context=64)
                                for _ in range(2))
    ref_state = ref.new_state(max_requests=max_requests, max_context=64)
    tri.capture(graph_state, tiers=tiers, progress=False)
    tri.capture(eager_state, tiers=tiers, use_graphs=False)
    rng = random.Random(0)
    for _ in range(50):
        r = rng.randint(1, max_requests)
        layout = VerifyLayout.pack([rng.randint(1, block) for _ in range(r)], [0] * r,
                                   rng.sample(range(max_requests), r))
        ids = torch.randint(0, VOCAB, (layout.num_tokens,), device="cuda")
        a = tri(ids, layout, graph_state).clone()
        assert torch.equal(a, tri(ids, layout, eager_state))
        torch.testing.assert_close(a.float(), ref(ids, layout, ref_state).float(), atol=5e-2,
                                   rtol=5e-2)
