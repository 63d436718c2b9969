"""The capture's call must be the model's own forward (``frontend/own_forward.py``): its own
positions and an all-ones mask; BERT-family decoders read their ``token_type_ids`` buffer at
each token's position.

The RoBERTa family counts its positions from the token ids (``padding_idx + 1 + cumsum``): given
``0, 1, 2, ...`` it runs another model. It is refused by name; with the check taken out it
compiles and verifies wrong, which is what the check is for. BERT's own positions are
``0, 1, 2, ...``; its ``token_type_ids`` buffer, expanded over the requests and gathered at each
position, is a table lookup: ragged rounds equal HF's forward.
"""

import logging

import pytest
import torch
import transformers as T

from dspark_compile import dspark_compile
from helpers import ragged_rounds_error

VOCAB = 64


def _tiny(config_cls, model_cls, **extra):
    torch.manual_seed(0)
    cfg = config_cls(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=64, max_position_embeddings=128,
                     is_decoder=True, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, **extra)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" not in name:
                p.normal_(0.0, 0.2)
    return model


def _roberta():
    return _tiny(T.RobertaConfig, T.RobertaForCausalLM, pad_token_id=1)


def _rounds(model) -> float:
    return ragged_rounds_error(model, dspark_compile(model), [1, 0, 2], [7, 4, 9], VOCAB,
                               seed=3, max_context=64)


@pytest.mark.parametrize("name", ["bert", "electra"])
def test_bert_family_decoders_equal_hf(name):
    config_cls, model_cls, extra = {
        "bert": (T.BertConfig, T.BertLMHeadModel, {}),
        "electra": (T.ElectraConfig, T.ElectraForCausalLM, dict(embedding_size=16)),
    }[name]
    err = _rounds(_tiny(config_cls, model_cls, **extra))
    assert err < 1e-4, f"max |ragged - HF| = {err}"


def test_roberta_is_refused_by_name():
    with pytest.raises(NotImplementedError, match=r"RobertaForCausalLM: over 12 tokens its "
                       r"logits without position_ids differ from those with position_ids "
                       r"0\.\.11: it computes its own positions when given none, and they are "
                       r"not 0, 1, 2, \.\.\., by [0-9.e+-]+ \(the most at token 0\).*refused"):
        dspark_compile(_roberta())


def test_without_the_check_roberta_verifies_wrong(monkeypatch):
    from dspark_compile.frontend import capture

    monkeypatch.setattr(capture, "check_own_forward", lambda *args: None)
    assert _rounds(_roberta()) > 1e-2


def test_positions_that_count_a_pad_id_are_caught(monkeypatch):
    """A default that skips the pad id only where it appears (no offset): the probe holds the
    config's pad id inside the sequence, so this default differs from 0, 1, 2, ..."""
    model = _tiny(T.BertConfig, T.BertLMHeadModel, pad_token_id=5)
    embeddings = model.bert.embeddings

    class Counted(type(embeddings)):  # a class of its own: a forward set on the instance is
        def forward(self, input_ids=None, token_type_ids=None, position_ids=None, **kwargs):
            if position_ids is None and input_ids is not None:  # refused as a hook
                position_ids = (input_ids != 5).long().cumsum(-1) - 1
            return super().forward(input_ids=input_ids, token_type_ids=token_type_ids,
                                   position_ids=position_ids, **kwargs)

    monkeypatch.setattr(embeddings, "__class__", Counted)
    with pytest.raises(NotImplementedError, match="BertLMHeadModel: .* computes its own positions"):
        dspark_compile(model)


def test_meta_weights_and_a_forward_that_needs_positions_are_logged(caplog):
    from dspark_compile.frontend.own_forward import check_own_forward

    model = _tiny(T.BertConfig, T.BertLMHeadModel)

    def needs_positions(call, ids, positions):
        if positions is None:
            raise ValueError("position_ids are required")
        return call(input_ids=ids, position_ids=positions, use_cache=False).logits

    with caplog.at_level(logging.WARNING, logger="dspark_compile"):
        check_own_forward(model, needs_positions, None)
        check_own_forward(model.to("meta"), needs_positions, None)
    assert "its forward without position_ids fails (ValueError: position_ids are required), so " \
        "the positions the capture passes (0, 1, 2, ...) are taken as its own" in caplog.text
    assert "BertLMHeadModel: its weights are on the meta device" in caplog.text


def test_a_model_that_differs_under_an_all_ones_mask_is_refused(monkeypatch):
    """``generate`` passes an all-ones mask; the capture none. A model whose forward differs
    between the two (here: one that drops the last token's embedding where a mask is given)
    is refused by name."""
    model = _tiny(T.BertConfig, T.BertLMHeadModel)

    class MaskedDiffers(type(model.bert)):
        def forward(self, *args, attention_mask=None, **kwargs):
            out = super().forward(*args, attention_mask=attention_mask, **kwargs)
            if attention_mask is not None:
                out.last_hidden_state[:, -1] = 0.0
            return out

    monkeypatch.setattr(model.bert, "__class__", MaskedDiffers)
    with pytest.raises(NotImplementedError, match=r"BertLMHeadModel: over 12 tokens its logits "
                       r"with an all-ones attention_mask \(as generate calls it\) differ from "
                       r"those without one, by .* \(the most at token 11\)\. dspark_compile passes "
                       r"no mask"):
        dspark_compile(model)


def test_in_bfloat16_roberta_is_still_refused_and_bert_is_not():
    """Half precision is judged at 5e-2 of the logits' scale (another attention kernel may
    round differently): RoBERTa's positions still move them past it, BERT's call passes."""
    from dspark_compile.frontend.own_forward import check_own_forward

    def call(call, ids, positions):
        return call(input_ids=ids, position_ids=positions, use_cache=False).logits

    with pytest.raises(NotImplementedError, match="computes its own positions"):
        check_own_forward(_roberta().to(torch.bfloat16), call, None)
    check_own_forward(_tiny(T.BertConfig, T.BertLMHeadModel).to(torch.bfloat16), call, None)


def test_config_token_ids_reads_sub_configs_and_index_keys():
    from dspark_compile.frontend.own_forward import config_token_ids

    d = {"bos_token_id": 3, "eos_token_id": [4, 5], "pad_index": 6, "use_cache": True,
         "tie_token_ids": False, "vocab_size": 99,
         "text_config": {"model_type": "x", "image_token_id": 7, "hidden_size": 8},
         "plain": {"pad_token_id": 9}}  # a dict that is no sub-config: not read
    assert config_token_ids(d) == {3, 4, 5, 6, 7}


def _moshi(window):
    from dspark_compile.zoo.tiny import tiny_config

    torch.manual_seed(0)
    config = tiny_config("moshi", T.MoshiForCausalLM, {"sliding_window": window}).config
    return T.MoshiForCausalLM._from_config(config, dtype=torch.float32).eval()


def test_contexts_are_limited_to_the_positions_the_models_own_cache_keeps():
    """Moshi's config names a sliding window that shapes the cache generate builds
    (DynamicCache keeps its last 8 positions) while its mask is plain causal: past 8 tokens its
    cached decoding differs from its forward (measured here), so no verify can match both. A
    state of more tokens is refused by name; up to 8 the rows equal HF's forward."""
    from helpers import Session

    model = _moshi(8)
    ids = torch.randint(3, 120, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits[0, 8:]
        out = model(input_ids=ids[:, :8], use_cache=True)
        cached = model(input_ids=ids[:, 8:], cache=out.cache, use_cache=True).logits[0]
    assert (full - cached).abs().max() > 1e-2
    verifier = dspark_compile(model)
    limit = verifier.position_limit
    assert (limit.positions, limit.cache, limit.table) == (8, True,
                                                           "0 ('model.layers.0.self_attn')")
    with pytest.raises(ValueError, match=r"max_context=64 exceeds the 8 positions that the cache "
                       r"generate builds for the model keeps of layer 0 .*at most 8 tokens"):
        verifier.new_state(max_requests=3, max_context=64)
    session = Session(model, verifier, [1, 0, 2], max_context=8, seed=5)
    session.vocab = 120
    session.step([3, 2, 4], accept=[3, 2, 4])
    session.step([3, 3, 3])
    assert session.max_err < 1e-4
    wide = _moshi(256)  # its positions' own bound: every context keeps every key
    assert dspark_compile(wide).position_limit.positions == 256


def test_a_window_the_cache_keeps_verifies():
    """Mistral's window shapes its mask and its cache alike: not refused."""
    torch.manual_seed(0)
    cfg = T.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=128, sliding_window=4)
    model = T.MistralForCausalLM(cfg).eval()
    assert ragged_rounds_error(model, dspark_compile(model), [1, 0, 2], [7, 4, 9], VOCAB,
                               seed=5) < 1e-4


def _dory(mode):
    from transformers.models.dory.modeling_dory import DoryForCausalLM

    torch.manual_seed(0)
    cfg = T.CONFIG_MAPPING["dory"](
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_hidden_layers=6, n_input_layers=2,
        n_recurrent_layers=2, n_output_layers=2, sliding_window=4, max_position_embeddings=128,
        layer_types=["sliding_attention", "mlp", "full_attention", "mlp", "sliding_attention",
                     "mlp"], recurrent_kv_cache_mode=mode)
    return DoryForCausalLM(cfg).eval()


def test_a_cache_mode_that_approximates_the_forward_is_refused():
    """Dory's looped section: 'per_loop' keeps each loop's keys and verifies (a pool per loop);
    'last_loop' keeps the last loop's only, and its one-token decoding differs from its forward
    (measured here), so it is refused by name."""
    from dspark_compile.frontend.own_forward import NotOwnForwardError

    model = _dory("last_loop")
    ids = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids).logits[0]
        cache = model(ids[:, :7], use_cache=True).cache
        steps = torch.stack([model(ids[:, p:p + 1], cache=cache, use_cache=True).logits[0, 0]
                             for p in range(7, 10)])
    assert (full[7:] - steps).abs().max() > 1e-3 * full.abs().max()
    with pytest.raises(NotOwnForwardError, match=r"recurrent_kv_cache_mode='last_loop'"):
        dspark_compile(model)
    plain = _dory("per_loop")
    verifier = dspark_compile(plain)
    assert len(verifier.adapter.specs) == 4  # the looped attention layer once a loop
    assert ragged_rounds_error(plain, verifier, [1, 0, 2], [7, 4, 9], VOCAB, seed=5) < 1e-4
