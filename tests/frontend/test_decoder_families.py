"""Decoders beyond the Llama family verify exactly: sliding windows smaller than the sequences
(Mistral, Qwen2, Qwen2-MoE, Phi-3, Starcoder2), alternating windows with a logit softcap
(Gemma 2) or without (Gemma 3), per-head sinks with windows and experts (GPT-OSS), fused qkv
and learned or partial positions (GPT-NeoX, GPT-2, Falcon), interleaved rotary (Cohere, GLM-4),
q/k head dim unlike v (DeepSeek-V3's MLA), and a model of linear-attention layers only
(Qwen3.5). Attention is found from each model's forward, not from attribute names.

Every verified row of a prefill and three ragged rounds equals HF's own forward over that
request's whole sequence."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from dspark_compile import dspark_compile
from helpers import prefill_and_rounds

TOL = 1e-5
VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
WINDOW = 5  # every prompt (9-11 tokens) outgrows it
MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2)

FAMILIES = {
    "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(sliding_window=WINDOW)),
    "qwen2_window": (T.Qwen2Config, T.Qwen2ForCausalLM, dict(
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "qwen2_moe_window": (T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM, dict(
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, num_experts=4,
        shared_expert_intermediate_size=32, **MOE)),
    "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, dict(sliding_window=WINDOW, head_dim=16,
                                                          attn_logit_softcapping=5.0)),
    "gemma3_text": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, dict(
        sliding_window=WINDOW, head_dim=16, layer_types=["sliding_attention",
                                                         "full_attention"])),
    "gpt_oss": (T.GptOssConfig, T.GptOssForCausalLM, dict(
        sliding_window=WINDOW, head_dim=16, num_local_experts=4, num_experts_per_tok=2)),
    "phi3": (T.Phi3Config, T.Phi3ForCausalLM, dict(sliding_window=WINDOW)),
    "starcoder2_window": (T.Starcoder2Config, T.Starcoder2ForCausalLM,
                          dict(sliding_window=WINDOW)),
    "gpt_neox": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM, dict()),
    "gpt2": (T.GPT2Config, T.GPT2LMHeadModel, dict(n_embd=64, n_layer=2, n_head=4,
                                                     n_positions=256)),
    "falcon": (T.FalconConfig, T.FalconForCausalLM, dict()),  # multi-query, calls SDPA itself
    "falcon_new_arch": (T.FalconConfig, T.FalconForCausalLM, dict(new_decoder_architecture=True,
                                                                  num_kv_heads=2)),
    "cohere": (T.CohereConfig, T.CohereForCausalLM, dict()),
    "glm4": (T.Glm4Config, T.Glm4ForCausalLM, dict(head_dim=16)),
    "deepseek_v3_mla": (T.DeepseekV3Config, T.DeepseekV3ForCausalLM, dict(
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4, first_k_dense_replace=1,
        n_group=1, topk_group=1, **MOE)),
    "qwen35_linear_only": (T.Qwen3_5TextConfig, T.Qwen3_5ForCausalLM, dict(
        layer_types=["linear_attention"] * 2, head_dim=16, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)),
}


def _build(name: str):
    config_cls, model_cls, extra = FAMILIES[name]
    torch.manual_seed(0)
    return model_cls(config_cls(**{**BASE, **extra})).eval()


def _run(model, verifier) -> float:
    return prefill_and_rounds(model, verifier, VOCAB)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_ragged_equals_hf_forward(name):
    model = _build(name)
    verifier = dspark_compile(model)
    err = _run(model, verifier)
    assert err <= TOL, f"{name}: max |ragged - HF| = {err}"


def test_each_layer_reads_its_own_semantics_off_the_forward():
    """Gemma 2 alternates windowed and full layers and softcaps both; GPT-OSS passes sinks;
    explain() lists each layer's window, softcap and sinks."""
    gemma = dspark_compile(_build("gemma2"))
    assert [(s.window, s.softcap, s.sinks) for s in gemma.adapter.specs] == \
        [(WINDOW, 5.0, False), (0, 5.0, False)]
    assert "attention model.layers.0.self_attn: window 5, softcap 5.0;" in gemma.explain()
    oss = dspark_compile(_build("gpt_oss"))
    assert [(s.window, s.sinks) for s in oss.adapter.specs] == [(WINDOW, True), (0, True)]
    assert "sinks" in oss.explain()
    mla = dspark_compile(_build("deepseek_v3_mla"))
    assert {(s.head_dim, s.value_dim) for s in mla.adapter.specs} == {(24, 12)}
    assert "24 (q/k) / 12 (v)" in mla.explain()
