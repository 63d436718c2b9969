"""Rotary types whose frequencies follow the batch's longest position: bounded or refused.

HF's ``"dynamic"`` (NTK) and ``"longrope"`` rotaries pick their frequencies from
``max(position_ids)`` of the whole batch in every forward, so a request's logits would depend on
the requests verified with it. A dynamic rotary never rescales below its original context: it
verifies exactly there, ``new_state`` refuses a longer context naming it, and one that has
already rescaled (a forward past that context) is refused, as is one whose buffers HF replaces
after the capture (a stale weight). A longrope rotary uses its short factors below its original
context: it verifies exactly there, reading them whatever the model's own long forwards left in
``inv_freq``; one whose forward is not transformers' decorator, and a type the library does not
know, are refused before any trace, naming the module and the type. Scaled types with fixed frequencies
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


LONG = 128  # a longrope's original context: every position of prefill_and_rounds is below it


def phi3_longrope(original: int = LONG):
    torch.manual_seed(0)
    half = 64 // 4 // 2
    cfg = T.Phi3Config(**BASE, max_position_embeddings=4 * original,
                       original_max_position_embeddings=original, rope_parameters={
                           "rope_type": "longrope", "rope_theta": 10000.0,
                           "short_factor": [1.0 + 0.1 * i for i in range(half)],
                           "long_factor": [4.0 + i for i in range(half)]})
    return T.Phi3ForCausalLM(cfg).eval()


def test_longrope_verifies_below_its_original_context_and_no_further():
    model = phi3_longrope()
    verifier = dspark_compile(model)
    limit = verifier.position_limit
    assert (limit.positions, limit.rotary) == (LONG, True)
    assert "model.rotary_emb (rope_type='longrope')" in limit.table
    err = prefill_and_rounds(model, verifier, VOCAB)
    assert err < 1e-5, err
    verifier.new_state(max_requests=2, max_context=LONG)
    with pytest.raises(ValueError, match=rf"max_context={LONG + 1} exceeds the {LONG} positions "
                                         r"below which the rotary model.rotary_emb "
                                         r"\(rope_type='longrope'\) keeps its frequencies"):
        verifier.new_state(max_requests=2, max_context=LONG + 1)


def _long_forward(model):
    """The model's own forward past its original context: transformers gives the rotary its long
    factors (written into ``inv_freq``, in place or as a new buffer by version)."""
    rotary = model.model.rotary_emb
    with torch.no_grad():
        model(torch.arange(2 * LONG)[None] % VOCAB)
    assert not torch.equal(rotary.inv_freq, rotary.original_inv_freq)


def test_longrope_reads_its_short_factors_whatever_the_models_own_forwards_left():
    """A long forward of the model's own before the build, or between verifies, leaves the long
    factors in ``inv_freq``; below the original context transformers uses the short ones, and so
    does the verify (the graphs read ``original_inv_freq``), with no stale-weight refusal."""
    model = phi3_longrope()
    _long_forward(model)
    verifier = dspark_compile(model)
    assert verifier.position_limit.positions == LONG
    _long_forward(model)
    err = prefill_and_rounds(model, verifier, VOCAB)
    assert err < 1e-5, err
    model = phi3_longrope()
    verifier = dspark_compile(model)
    _long_forward(model)
    err = prefill_and_rounds(model, verifier, VOCAB)
    assert err < 1e-5, err
    model = phi3_longrope()  # a short forward first: transformers 5.17 then makes inv_freq the
    with torch.no_grad():  # short tensor itself, and a long forward swaps in another
        model(torch.arange(8)[None])
    verifier = dspark_compile(model)
    _long_forward(model)
    err = prefill_and_rounds(model, verifier, VOCAB)
    assert err < 1e-5, err


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
    with pytest.raises(NotImplementedError,  # its forward is not transformers' decorator
                       match=r"_Rotary 'model.rotary': rope_type\['sliding_attention'\]="
                             r"'longrope' is taken where the module's forward is transformers' "
                             r"dynamic_rope_update"):
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
    if model.model.rotary_emb.rope_type == "dynamic":  # transformers 5.17 keeps the label, and
        # its own forward past the original context rescales as dynamic NTK does: bounded
        assert dspark_compile(model).position_limit.positions == ORIGINAL
        return
    assert model.model.rotary_emb.rope_type == "ntk_alpha"
    err = prefill_and_rounds(model, dspark_compile(model), VOCAB)
    assert err < 1e-5, err


def phimoe(rope: dict):
    torch.manual_seed(0)
    cfg = T.PhimoeConfig(**BASE, num_local_experts=4, num_experts_per_tok=2,
                         max_position_embeddings=4 * LONG, rope_parameters=rope)
    return T.PhimoeForCausalLM(cfg).eval()


def test_phimoes_longrope_verifies_below_its_original_context():
    """PhiMoE's rotary recomputes its frequencies from the config and scales cos and sin by
    short_mscale below the original context, long_mscale past it (a branch on the batch's
    longest position): taken below it, bounded there."""
    half = 64 // 4 // 2
    model = phimoe({"rope_type": "longrope", "rope_theta": 10000.0,
                    "short_factor": [1.0 + 0.1 * i for i in range(half)],
                    "long_factor": [4.0 + i for i in range(half)],
                    "short_mscale": 1.125, "long_mscale": 1.5,
                    "original_max_position_embeddings": LONG})
    verifier = dspark_compile(model)
    assert verifier.position_limit.positions == LONG
    err = prefill_and_rounds(model, verifier, VOCAB)
    assert err < 1e-5, err


def test_phimoes_other_scaled_rotaries_are_refused_by_name():
    model = phimoe({"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0,
                    "short_mscale": 1.0, "long_mscale": 1.0,
                    "original_max_position_embeddings": LONG})
    with pytest.raises(NotImplementedError, match=r"PhimoeRotaryEmbedding 'model.rotary_emb': "
                                                  r"PhiMoE's scaled rotary is taken as longrope"):
        dspark_compile(model)


def test_a_longrope_whose_short_factors_are_no_buffer_is_refused():
    """The capture binds the short factors as a buffer of the model; held as a plain attribute
    (as older transformers kept them) they are not one, so the module is refused by name."""
    model = phi3_longrope()
    rotary = model.model.rotary_emb
    short = rotary._buffers.pop("original_inv_freq")
    object.__setattr__(rotary, "original_inv_freq", short)
    with pytest.raises(NotImplementedError, match=r"rope_type='longrope' lacks the original "
                                                  r"context .* or the short frequencies"):
        dspark_compile(model)
