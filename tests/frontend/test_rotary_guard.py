"""Rotary types whose frequencies follow the batch's longest position: bounded or refused.

HF's ``"dynamic"`` (NTK) and ``"longrope"`` rotaries pick their frequencies from
``max(position_ids)`` of the whole batch in every forward, so a request's logits would depend on
the requests verified with it. A dynamic rotary never rescales below its original context: it
verifies exactly there, ``new_state`` refuses a longer context naming it, and one that has
already rescaled (a forward past that context) is refused, as is one whose buffers HF replaces
after the capture (a stale weight). ``"longrope"`` and a type the library does not know are
refused before any trace, naming the module and the type. Scaled types with fixed frequencies
(linear, YaRN, Llama 3) verify exactly, with sequences past their original context.
"""

from __future__ import annotations

import pytest
import torch
import transformers as T
from torch import nn

from dspark_compile import dspark_compile
from dspark_compile.frontend.rotary import FIXED_ROPE_TYPES, check_rotaries
from helpers import prefill_and_rounds

VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
ORIGINAL = 8  # the prompts (9-11 tokens) and every round pass it


def llama(rope: dict, **extra):
    torch.manual_seed(0)
    cfg = T.LlamaConfig(**BASE, max_position_embeddings=extra.pop("positions", 256),
                        rope_parameters={"rope_theta": 10000.0, **rope}, **extra)
    return T.LlamaForCausalLM(cfg).eval()


def test_dynamic_ntk_verifies_below_its_original_context_and_no_further():
    model = llama({"rope_type": "dynamic", "factor": 2.0}, positions=128)
    verifier = dspark_compile(model)
    limit = verifier.position_limit
    assert (limit.positions, limit.rotary) == (128, True)
    assert "model.rotary_emb (rope_type='dynamic')" in limit.table
    err = prefill_and_rounds(model, verifier, VOCAB)
    assert err < 1e-5, err
    verifier.new_state(max_requests=2, max_context=128)
    with pytest.raises(ValueError, match=r"max_context=129 exceeds the 128 positions below which "
                                         r"the rotary model.rotary_emb \(rope_type='dynamic'\) "
                                         r"keeps its frequencies"):
        verifier.new_state(max_requests=2, max_context=129)


def test_a_dynamic_rotary_that_rescaled_is_refused_and_one_rescaled_later_is_stale():
    from dspark_compile import StaleWeightsError, VerifyLayout

    model = llama({"rope_type": "dynamic", "factor": 2.0}, positions=ORIGINAL)
    with torch.no_grad():
        model(torch.arange(2 * ORIGINAL)[None] % VOCAB)  # past the original: it rescales
    with pytest.raises(NotImplementedError, match=r"rope_type='dynamic' has rescaled its "
                                                  r"frequencies for 16 positions"):
        dspark_compile(model)
    model = llama({"rope_type": "dynamic", "factor": 2.0}, positions=ORIGINAL)
    verifier = dspark_compile(model)
    state = verifier.new_state(max_requests=1, max_context=ORIGINAL)
    with torch.no_grad():
        model(torch.arange(2 * ORIGINAL)[None] % VOCAB)
    with pytest.raises(StaleWeightsError, match="inv_freq"):
        verifier(torch.tensor([3, 4]), VerifyLayout.pack([2], [0], [0]), state)


def test_longrope_is_refused():
    torch.manual_seed(0)
    half = 64 // 4 // 2
    cfg = T.Phi3Config(**BASE, max_position_embeddings=4 * ORIGINAL, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * half,
        "long_factor": [2.0] * half, "original_max_position_embeddings": ORIGINAL})
    with pytest.raises(NotImplementedError, match=r"rope_type='longrope' recomputes"):
        dspark_compile(T.Phi3ForCausalLM(cfg).eval())


class _Rotary(nn.Module):
    def __init__(self, rope_type):
        super().__init__()
        self.rope_type = rope_type
        self.register_buffer("sliding_attention_inv_freq", torch.ones(4), persistent=False)


class _Model(nn.Module):
    def __init__(self, rope_type):
        super().__init__()
        self.rotary = _Rotary(rope_type)


def test_per_layer_types_and_unknown_types_are_checked():
    check_rotaries(_Model({"full_attention": "default", "sliding_attention": "linear"}), {})
    model = _Model({"full_attention": "default", "sliding_attention": "longrope"})
    names = {id(model.rotary): "model.rotary"}
    with pytest.raises(NotImplementedError,
                       match=r"_Rotary 'model.rotary': rope_type\['sliding_attention'\]="
                             r"'longrope' recomputes"):
        check_rotaries(model, names)
    model = _Model({"full_attention": "default", "sliding_attention": "dynamic"})
    with pytest.raises(NotImplementedError,
                       match=r"rope_type\['sliding_attention'\]='dynamic' lacks the original "
                             r"context"):  # none of dynamic_rope_update's bookkeeping
        check_rotaries(model, {})
    with pytest.raises(NotImplementedError, match=r"rope_type='mystery' is not a rope type "
                                                  r"whose frequencies are known to be fixed"):
        check_rotaries(_Model("mystery"), {})


def test_a_rope_type_without_frequencies_is_not_a_rotary():
    """``rope_type`` alone (no ``inv_freq`` buffer) is some other module's attribute."""
    holder = nn.Module()
    holder.rope_type = "dynamic"
    check_rotaries(holder, {})


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": ORIGINAL},
], ids=lambda r: r["rope_type"])
def test_fixed_scaled_rotaries_verify_exactly(rope):
    assert rope["rope_type"] in FIXED_ROPE_TYPES
    model = llama(rope)
    err = prefill_and_rounds(model, dspark_compile(model), VOCAB)
    assert err < 1e-5, err


def test_hunyuans_fixed_alpha_ntk_is_taken():
    """Hunyuan checkpoints label their rotary "dynamic" with a fixed alpha: the model renames it
    "ntk_alpha" (frequencies fixed at init), which verifies exactly past the original
    context."""
    torch.manual_seed(0)
    cfg = T.HunYuanDenseV1Config(**BASE, head_dim=16, max_position_embeddings=ORIGINAL,
                                 rope_parameters={"rope_type": "dynamic", "alpha": 1000.0,
                                                  "factor": 1.0, "rope_theta": 10000.0})
    model = T.HunYuanDenseV1ForCausalLM(cfg).eval()
    assert model.model.rotary_emb.rope_type == "ntk_alpha"
    err = prefill_and_rounds(model, dspark_compile(model), VOCAB)
    assert err < 1e-5, err
