"""What reaches HF's attention function is implemented or refused by name: keywords (sinks,
softcaps, windows) and masks (proven causal, with an optional left window, from the model's own
mask functions). Models that once compiled and verified wrong (GPT-OSS's sinks, a window that
lives only in the mask) are exact now; what is still outside the op is refused."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from dspark_compile import dspark_compile
from dspark_compile.frontend.adapters import _check_attention_arguments
from dspark_compile.frontend.masks import UnprovenMask, WindowMask, causal_only
from helpers import with_forward

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _model(config_cls, model_cls, **kw):
    torch.manual_seed(0)
    return model_cls(config_cls(**{**SMALL, **kw})).eval()


def test_an_unknown_attention_keyword_is_refused(monkeypatch):
    """A keyword HF adds later (here: an 'alibi' bias on a Llama) is refused, not dropped."""
    model = _model(T.LlamaConfig, T.LlamaForCausalLM)
    from transformers.models.llama import modeling_llama

    real = modeling_llama.LlamaAttention.forward

    def with_bias(self, *args, **kwargs):
        return real(self, *args, alibi=torch.zeros(4), **kwargs)
    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", with_bias)
    with pytest.raises(NotImplementedError, match=r"LlamaAttention 'model.layers.0.self_attn' "
                       r"\(attention call 0\) passes alibi=a tensor \(4,\)"):
        dspark_compile(model)


def test_attention_keywords_are_implemented_or_refused():
    where = "Attn 'layer' (attention call 3)"
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(NotImplementedError, match=r"call 3\) passes dropout=0.1"):
        _check_attention_arguments(where, 0.1, {})
    assert _check_attention_arguments(where, 0.0, {
        "position_ids": torch.zeros(2), "use_cache": True, "sliding_window": None,
        "is_causal": True}, 0, q) == (0.0, None)
    sinks = torch.zeros(4)
    softcap, got = _check_attention_arguments(where, 0.0, {"softcap": 30.0, "s_aux": sinks,
                                                           "sliding_window": 8}, 8, q)
    assert softcap == 30.0 and got is sinks
    # the keyword window must be the one the mask proves
    with pytest.raises(NotImplementedError, match="sliding_window=8 but its mask proves plain"):
        _check_attention_arguments(where, 0.0, {"sliding_window": 8}, 0, q)
    for bad in ({"softcap": -1.0}, {"softcap": float("nan")}, {"s_aux": torch.zeros(3)},
                {"s_aux": torch.zeros(4, dtype=torch.long)}, {"s_aux": torch.zeros(1, 4)},
                {"softcap": True}):
        with pytest.raises(NotImplementedError, match=f"passes {next(iter(bad))}="):
            _check_attention_arguments(where, 0.0, bad, 0, q)


def test_mask_functions_are_proven_by_structure_and_probe():
    from transformers import masking_utils as M

    assert causal_only(mask_function=M.causal_mask_function) is None
    packed = M.and_masks(M.remap_positions_for_packed_sequence(
        M.causal_mask_function, torch.zeros(1, 4, dtype=torch.long)),
        M.packed_sequence_mask_function(torch.zeros(1, 4, dtype=torch.long)))
    assert causal_only(mask_function=packed) is None
    assert causal_only(mask_function=M.sliding_window_causal_mask_function(8)) == \
        WindowMask(8)
    nested = M.and_masks(M.sliding_window_causal_mask_function(4096), M.causal_mask_function)
    assert causal_only(mask_function=nested) == WindowMask(4096)
    assert causal_only(mask_function=M.add_offsets_to_mask_function(
        M.sliding_window_causal_mask_function(5), 3, 3)) == WindowMask(5)
    assert causal_only(mask_function=M.chunked_causal_mask_function(
        8, torch.zeros(1, dtype=torch.long))) == WindowMask(0, 8)
    for unproven in (M.chunked_overlay(8, torch.zeros(1, dtype=torch.long)),  # no causality
                     M.sliding_window_overlay(8),  # a window without causality
                     M.bidirectional_mask_function,
                     M.sliding_window_bidirectional_mask_function(8),
                     M.or_masks(M.causal_mask_function, M.bidirectional_mask_function),
                     M.add_offsets_to_mask_function(M.causal_mask_function, 0, 2),
                     lambda b, h, q, kv: kv <= q):  # causal, but not provably so: refused
        assert isinstance(causal_only(mask_function=unproven), UnprovenMask), unproven
    with pytest.raises(NotImplementedError, match="attention_mask"):
        causal_only(mask_function=M.causal_mask_function, attention_mask=torch.ones(1, 4))


def _traced_all_ones(make_mask) -> bool:
    """:func:`all_ones` of the mask ``make_mask(x)`` builds inside a trace over ``x [2, 5]``."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from dspark_compile.frontend.masks import all_ones

    seen = []

    def f(x):
        seen.append(all_ones(make_mask(x)))
        return x + 1

    make_fx(f, tracing_mode="symbolic")(torch.zeros(2, 5, dtype=torch.long))
    return seen[0]


def _written(x):
    mask = torch.ones(x.shape[0], x.shape[1])
    mask[:, 0] = 0
    return mask


def _view_written(x):
    mask = torch.ones(x.shape[0], x.shape[1])
    mask.view(-1)[1:3].zero_()
    return mask.bool()


@pytest.mark.parametrize("make_mask, ones", [
    (lambda x: torch.ones(x.shape[0], x.shape[1]), True),
    (lambda x: torch.ones_like(x), True),
    (lambda x: torch.ones(x.shape[0], x.shape[1], dtype=torch.long).bool()[:, -3:], True),
    (lambda x: torch.ones(x.shape[0], x.shape[1]) * 2, False),
    (lambda x: torch.zeros(x.shape[0], x.shape[1]), False),
    (lambda x: x, False),  # the traced input: its values are not known
    (lambda x: x.ne(7), False),
    (_written, False),
    (_view_written, False),
])
def test_a_padding_mask_is_taken_only_as_ones_the_model_made(make_mask, ones):
    """BioGPT builds ``torch.ones(bs, T)`` where it is passed no mask: a padding mask that masks
    nothing. The trace's provenance proves it (a ones factory, read through casts, views and
    slices, never written in place); any other mask stays refused."""
    assert _traced_all_ones(make_mask) is ones


def test_biogpt_with_its_own_ones_mask_equals_hf():
    from helpers import ragged_rounds_error

    torch.manual_seed(0)
    cfg = T.BioGptConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=4, intermediate_size=64, pad_token_id=0)
    model = T.BioGptForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" not in name:
                p.normal_(0.0, 0.2)
    err = ragged_rounds_error(model, dspark_compile(model), [1, 0], [6, 3], 64, seed=2)
    assert err < 1e-4, err


def test_a_leaf_that_computes_something_else_under_a_known_name_fails_the_probe():
    """The structure names the leaves; the probe evaluates each one: a window overlay that
    admitted one key more than HF's rule (``>=``) is not taken for a window."""
    from transformers import masking_utils as M

    def overlay(sliding_window):
        def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
            return kv_idx >= q_idx - sliding_window
        return inner_mask

    impostor = overlay(8)
    impostor.__module__ = "transformers.masking_utils"
    impostor.__qualname__ = "sliding_window_overlay.<locals>.inner_mask"
    mask = causal_only(mask_function=M.and_masks(impostor, M.causal_mask_function))
    assert isinstance(mask, UnprovenMask)
    assert "sliding_window_overlay(8)" in mask.description

    def chunked(chunk_size, left_padding):  # chunk edges one position off HF's
        def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
            return (kv_idx + 1 - left_padding[batch_idx]) // chunk_size == \
                (q_idx + 1 - left_padding[batch_idx]) // chunk_size
        return inner_mask

    impostor = chunked(8, torch.zeros(1, dtype=torch.long))
    impostor.__module__ = "transformers.masking_utils"
    impostor.__qualname__ = "chunked_overlay.<locals>.inner_mask"
    mask = causal_only(mask_function=M.and_masks(impostor, M.causal_mask_function))
    assert isinstance(mask, UnprovenMask)
    assert "chunked_overlay(8)" in mask.description


def test_a_chunk_added_to_the_mask_becomes_the_layers_chunk():
    """A chunk that lives only in the mask (Llama 4's chunked layers) is read off the mask,
    not off a config field: every layer gets chunks of 4."""
    from transformers.models.llama import modeling_llama
    from transformers import masking_utils as M

    model = _model(T.LlamaConfig, T.LlamaForCausalLM)
    real = modeling_llama.create_causal_mask

    def chunked(*args, **kwargs):
        kwargs["and_mask_function"] = M.chunked_overlay(4, torch.zeros(1, dtype=torch.long))
        return real(*args, **kwargs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(modeling_llama, "create_causal_mask", chunked)
        verifier = dspark_compile(model)
    assert [(s.window, s.chunk) for s in verifier.adapter.specs] == [(0, 4)] * 2


def test_qwen2_moe_builds_a_window_mask_no_layer_uses():
    """Its forward builds a sliding-window mask for a layer type no layer has: every layer
    is plain causal."""
    verifier = dspark_compile(_model(
        T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM, use_sliding_window=True, sliding_window=16,
        max_window_layers=0, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2))
    assert [s.window for s in verifier.adapter.specs] == [0, 0]


def test_alibi_and_a_scan_keeping_its_state_are_refused_by_name(monkeypatch):
    with pytest.raises(NotImplementedError, match="alibi=True adds an ALiBi position bias"):
        dspark_compile(_model(T.FalconConfig, T.FalconForCausalLM, alibi=True))
    from transformers.models.jamba import modeling_jamba

    real = modeling_jamba.JambaMambaMixer.forward

    def keeps_state(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        # the capture's replacement, looked up now; swapped back by hand (not by monkeypatch,
        # whose undo would reinstate the replacement after the capture restored HF's own)
        scan = modeling_jamba.mamba_selective_scan

        def with_state(*args, **kw):
            return scan(*args, **{**kw, "return_last_state": True})
        modeling_jamba.mamba_selective_scan = with_state
        try:
            return real(self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        finally:
            modeling_jamba.mamba_selective_scan = scan
    monkeypatch.setattr(modeling_jamba.JambaMambaMixer, "forward", keeps_state)
    original = modeling_jamba.mamba_selective_scan
    with pytest.raises(NotImplementedError, match=r"JambaMambaMixer 'model.layers.0.mamba' "
                       r"\(mamba_selective_scan\) asks for its last state"):
        dspark_compile(_model(T.JambaConfig, T.JambaForCausalLM, num_experts=4,
                              num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1,
                              expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8,
                              mamba_dt_rank=8))
    assert modeling_jamba.mamba_selective_scan is original, "the capture restored HF's scan"


def test_a_model_with_no_attention_calls_is_refused():
    model = _model(T.LlamaConfig, T.LlamaForCausalLM)
    for layer in model.model.layers:
        with_forward(layer.self_attn, lambda self, hidden_states, **kw: (
            torch.zeros_like(hidden_states), None))
    with pytest.raises(TypeError, match="no module of LlamaForCausalLM called the attention"):
        dspark_compile(model)


def test_a_model_that_uses_its_mask_outside_attention_is_refused_at_its_line(monkeypatch):
    """The capture proves masks and builds none: a model that uses its mask as a tensor is
    refused naming the line, not crashed. Dropping the head axis (``[:, 0]``, what a DeepSeek
    Sparse Attention layer hands its indexer) gives the indexer's mask proof; the model's use of
    that as a tensor is the refused line."""
    from transformers.models.llama import modeling_llama

    real = modeling_llama.LlamaDecoderLayer.forward

    def slicing(self, hidden_states, attention_mask=None, **kwargs):
        bias = attention_mask[:, 0]  # the mask as a tensor, outside attention
        return real(self, hidden_states + bias.sum(), attention_mask=attention_mask, **kwargs)
    monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "forward", slicing)
    with pytest.raises(NotImplementedError, match=r"LlamaForCausalLM uses its attention mask "
                       r"outside the attention function.*test_attention_whitelist.py:\d+ in "
                       r"slicing: return real\(self, hidden_states \+ bias.sum\(\)"):
        dspark_compile(_model(T.LlamaConfig, T.LlamaForCausalLM))


def test_data_dependent_control_flow_is_refused_at_its_line(monkeypatch):
    from transformers.models.llama import modeling_llama

    real = modeling_llama.LlamaMLP.forward

    def branching(self, x):
        if (x > 0).any():  # a branch on data: one graph cannot hold both sides
            return real(self, x)
        return x
    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", branching)
    with pytest.raises(NotImplementedError, match=r"branches on a value known only at run "
                       r"time.*in branching: if \(x > 0\).any\(\)"):
        dspark_compile(_model(T.LlamaConfig, T.LlamaForCausalLM))


def _traced(build):
    """What ``build(x)`` returns, computed inside a symbolic trace over ``x [2, 5]`` (the
    provenance tests read the trace while it runs)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    seen = []

    def f(x):
        seen.append(build(x))
        return x + 1

    make_fx(f, tracing_mode="symbolic")(torch.zeros(2, 5, dtype=torch.long))
    return seen[0]


def _filled(make):
    from dspark_compile.frontend.masks import filled_with

    return _traced(lambda x: filled_with(make(x)))


def _text_ids_written(x):
    ids = torch.full((x.shape[0], x.shape[1]), -1)
    ids[:, 2] = 0  # a vision block written in place
    return ids


@pytest.mark.parametrize("make, values", [
    (lambda x: torch.full((x.shape[0], x.shape[1]), -1), {-1}),
    (lambda x: torch.full((x.shape[0], x.shape[1]), -1).to(torch.float32)[:, 1:], {-1.0}),
    # F.pad as transformers' maybe_pad_block_sequence_ids does it: the pad value joins
    (lambda x: torch.nn.functional.pad(torch.full((2, 5), -1), (0, 3), value=-1), {-1}),
    (lambda x: torch.nn.functional.pad(torch.full((2, 5), -1), (0, 3)), {-1, 0}),
    (lambda x: torch.full((2, 5), -1).bool(), {True}),  # a cast that changes the value
    (lambda x: torch.full((2, 5), -1).to(torch.uint8), {255}),
    (lambda x: x.new_full((2, 5), -3), {-3}),
    (lambda x: torch.ones_like(x), {1}),
    (lambda x: torch.full((2, 5), -1) + 0, None),  # computed
    (lambda x: torch.where(x == 3, x, -1), None),  # from the input's values
    (lambda x: x, None),
    (_text_ids_written, None),
])
def test_filled_with_reads_a_fill_the_model_made_through_the_trace(make, values):
    assert _filled(make) == values


def test_a_blockwise_overlay_is_dropped_only_over_text_ids_the_model_filled():
    """Gemma 4's multimodal models build ``or_masks(causal..., blockwise_overlay(ids))`` with
    ids ``torch.full(..., -1)`` when given no token types (every verify): the overlay is never
    true, so the union is its causal child. The same union over ids with a vision block, ids
    computed from the input, or ids from outside the trace stays refused."""
    from transformers import masking_utils as M

    def union(ids):
        return causal_only(mask_function=M.or_masks(
            M.sliding_window_causal_mask_function(8), M.blockwise_overlay(ids)))

    assert _traced(lambda x: union(torch.full((x.shape[0], x.shape[1]), -1))) == WindowMask(8)
    padded = lambda x: torch.nn.functional.pad(torch.full((2, 5), -1), (0, 3), value=-1)  # noqa
    assert _traced(lambda x: union(padded(x))) == WindowMask(8)
    for ids in (lambda x: torch.full((2, 5), 0),  # one vision block
                lambda x: torch.nn.functional.pad(torch.full((2, 5), -1), (0, 3), value=2),
                lambda x: torch.where(x == 3, 0, -1),
                _text_ids_written):
        got = _traced(lambda x: union(ids(x)))
        assert isinstance(got, UnprovenMask) and "blockwise_overlay" in got.description
    # outside a trace nothing says where the ids came from
    assert isinstance(union(torch.full((2, 5), -1)), UnprovenMask)
    # two children that may be true: a union the op does not compute
    assert isinstance(_traced(lambda x: causal_only(mask_function=M.or_masks(
        M.causal_mask_function, M.sliding_window_overlay(4)))), UnprovenMask)


def test_gemma4_multimodal_verifies_exact_under_the_vision_mask_and_refuses_all():
    """Gemma 4's multimodal model with its default bidirectional vision mask, text-only as
    every verify is, and with none: each ragged row equals HF's forward. Bidirectional
    attention over every token ("all") is refused."""
    from dspark_compile.zoo import check, select
    from dspark_compile.zoo.check import TOLERANCE, Entry

    if not hasattr(T, "Gemma4UnifiedForConditionalGeneration"):
        pytest.skip("this transformers has no Gemma 4 Unified")
    (base,) = [e for e in select(["gemma4_unified"]) if e.name == "gemma4_unified"]
    key = "use_bidirectional_attention"
    for mode in ("vision", None, "all"):
        result = check(Entry(base.model_type, base.architecture, "", ((key, mode),)))
        if mode == "all":
            assert result.status == "refused", (result.status, result.reason)
            continue
        assert result.status == "exact", (mode, result.reason, result.where)
        assert result.max_error <= TOLERANCE, mode
