"""Kimi Linear (KDA: a gated delta rule with one decay a key channel, MLA, MoE) against HF.

KDA layers call ``chunk_kimi_delta_attention`` (the same signature as Qwen3-Next's rule, with
``g [bs, T, H, K]``); the capture routes them to ``dspark::gated_delta_rule`` with channel gates
and their conv to ``dspark::causal_conv1d``. Every ragged logit row equals HF's forward
(``use_cache=False``) over that request's whole sequence alone, over a prefill and verify /
commit rounds with random lengths and accepted prefixes (float32, CPU, reference ops). A NaN
token at rejected draft positions leaves the accepted rows and the committed state
bit-identical.
"""

import pytest
import torch

from dspark_compile import dspark_compile
from helpers import assert_nan_drafts_contained, ragged_rounds_error, triton_rounds_error

kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")

VOCAB = 97
POISON = VOCAB - 1
TOL = 1e-4


def tiny_kimi():
    from transformers import KimiLinearConfig

    torch.manual_seed(0)
    cfg = KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_experts=4,
        num_experts_per_tok=2, linear_attn_config={"kda_layers": [1, 2, 4],
                                                   "full_attn_layers": [3], "num_heads": 4,
                                                   "head_dim": 16, "short_conv_kernel_size": 4},
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = kimi.KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():  # decays and gates away from their init values: every term counts
        for name, p in model.named_parameters():
            if "A_log" in name or "dt_bias" in name:
                p.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module")
def compiled():
    model = tiny_kimi()
    return model, dspark_compile(model)


def test_kda_layers_take_the_channel_gate_op(compiled):
    _, verifier = compiled
    assert [s.kind for s in verifier.adapter.linear_specs] == ["gdn"] * 3
    done = {r.name: r.changed for r in verifier.results}
    assert done["ragged_conv"] == 3 and done["ragged_linear_attention"] == 3
    rings = [n for n in verifier.graph_module.graph.nodes
             if n.op == "placeholder" and n.name.startswith("gdn_ring_g")]
    assert len(rings) == 3 and all(n.meta["val"].dim() == 3 for n in rings), \
        "one gate a key channel: ring_g rows are [H, K]"
    ops = {str(n.target) for n in verifier.graph_module.graph.nodes if n.op == "call_function"}
    assert not any("dense_" in op for op in ops), ops


@pytest.mark.parametrize("slots,prompts", [([2, 0, 1], [6, 9, 4]), ([0], [7])])
def test_ragged_equals_hf_forward(compiled, slots, prompts):
    model, verifier = compiled
    err = ragged_rounds_error(model, verifier, slots, prompts, POISON, seed=3)
    assert err < TOL, f"max |ragged - HF| = {err}"


def test_nan_draft_cannot_reach_accepted_rows_or_state(compiled):
    model, verifier = compiled
    assert_nan_drafts_contained(model, verifier, POISON, [1, 0], [5, 6], [5, 4], [2, 3],
                                seed=4)


@pytest.mark.gpu
def test_float32_on_gpu_through_triton_matches_hf():
    """The KDA layers through the Triton gated delta rule with channel gates, on the GPU."""
    err = triton_rounds_error(tiny_kimi(), [2, 0, 1], [6, 9, 4], POISON, seed=5)
    assert err < 2e-3, err
