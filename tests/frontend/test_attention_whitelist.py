"""What reaches HF's attention function is implemented or refused by name: keywords (sinks,
windows) and masks (a window that lives only in the mask). Each case here used to compile and
verify wrong; a plain causal model of the same families still compiles."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from dspark_compile import dspark_compile
from dspark_compile.frontend.adapters import _causal_only, _UnprovenMask

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
           num_experts_per_tok=2)


def _model(config_cls, model_cls, **kw):
    torch.manual_seed(0)
    return model_cls(config_cls(**{**SMALL, **kw})).eval()


def test_qwen2_moe_window_in_the_mask_only_is_refused_at_its_layer():
    model = _model(T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM, use_sliding_window=True,
                   sliding_window=16, max_window_layers=2, **MOE)
    assert model.config.layer_types[0] == "sliding_attention"
    with pytest.raises(NotImplementedError, match=r"Qwen2MoeAttention \(layer 0\).*"
                       r"sliding_window"):
        dspark_compile(model)


def test_qwen2_moe_without_sliding_layers_still_compiles():
    """Its forward builds a sliding-window mask for a layer type no layer has: unused, so no
    refusal."""
    dspark_compile(_model(T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM, use_sliding_window=True,
                          sliding_window=16, max_window_layers=0, **MOE))


def test_gpt_oss_is_refused_naming_what_it_passes():
    model = _model(T.GptOssConfig, T.GptOssForCausalLM, num_local_experts=4,
                   num_experts_per_tok=2, head_dim=8, sliding_window=4096)
    with pytest.raises(NotImplementedError, match=r"GptOssAttention \(layer 0\) passes "
                       r"(sliding_window|s_aux)"):
        dspark_compile(model)


def test_an_unknown_attention_keyword_is_refused(monkeypatch):
    """A keyword HF adds later (here: sinks on a Llama) is refused, not dropped."""
    model = _model(T.LlamaConfig, T.LlamaForCausalLM)
    from transformers.models.llama import modeling_llama

    real = modeling_llama.LlamaAttention.forward

    def with_sinks(self, *args, **kwargs):
        return real(self, *args, s_aux=torch.zeros(4), **kwargs)
    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", with_sinks)
    with pytest.raises(NotImplementedError, match=r"passes s_aux=a tensor \(4,\)"):
        dspark_compile(model)


def test_dropout_must_be_zero():
    """The capture runs the model in eval mode; a model that still hands dropout to attention
    is refused (a dropped dropout would verify a different function)."""
    from dspark_compile.frontend.adapters import _check_attention_arguments

    layer = torch.nn.Module()
    layer.layer_idx = 3
    with pytest.raises(NotImplementedError, match=r"Module \(layer 3\) passes dropout=0.1"):
        _check_attention_arguments(layer, 0.1, {})
    _check_attention_arguments(layer, 0.0, {"position_ids": torch.zeros(2), "use_cache": True,
                                            "sliding_window": None, "is_causal": True})


def test_mask_functions_are_proven_causal_by_structure():
    from transformers import masking_utils as M

    assert _causal_only(mask_function=M.causal_mask_function) is None
    packed = M.and_masks(M.remap_positions_for_packed_sequence(
        M.causal_mask_function, torch.zeros(1, 4, dtype=torch.long)),
        M.packed_sequence_mask_function(torch.zeros(1, 4, dtype=torch.long)))
    assert _causal_only(mask_function=packed) is None
    for unproven in (M.sliding_window_causal_mask_function(8),
                     M.chunked_causal_mask_function(8, None),
                     M.bidirectional_mask_function,
                     M.or_masks(M.causal_mask_function, M.bidirectional_mask_function),
                     lambda b, h, q, kv: kv <= q):  # causal, but not provably so: refused
        assert isinstance(_causal_only(mask_function=unproven), _UnprovenMask)
    with pytest.raises(NotImplementedError, match="attention_mask"):
        _causal_only(mask_function=M.causal_mask_function, attention_mask=torch.ones(1, 4))
