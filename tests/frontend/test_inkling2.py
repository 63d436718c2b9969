"""Inkling 2 and Inkling 2 Loop: relative logits and a sink a token and head in every attention
layer, dynamic short convolutions (per-token taps) on the full layers' K and V, block attention
residuals across layers, and (Loop) a block of layers run several times in one forward.

``frontend/inkling2.py`` replaces the relative bias (its logits handed to the attention as
``rel``), the dynamic convolution (its window from a capture-owned conv over the input repeated
once a tap) and the block residuals (their softmax over each token's blocks as graph code); the
attention function takes the known attention classes' ``sinks`` as one logit a row and head.
Every ragged logit row equals HF's forward over that request's whole sequence alone over a
prefill and four ragged rounds (float32, CPU, reference ops); each replaced piece, left out,
is caught; a changed source is refused by name.
"""

import pytest
import torch

from dspark_compile import dspark_compile
from helpers import ragged_rounds_error

inkling2 = pytest.importorskip("transformers.models.inkling2.modeling_inkling2")
loop = pytest.importorskip("transformers.models.inkling2_loop.modeling_inkling2_loop")

VOCAB = 89
TOL = 1e-4


def _config(cls, **extra):
    return cls(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4,
        swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=5, d_rel=8,
        rel_extent=6, log_scaling_n_floor=3, log_scaling_alpha=0.5,
        layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
        n_layers_per_attn_res_block=1, moe_intermediate_size=48, n_routed_experts=4,
        num_experts_per_tok=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
        **extra)


def tiny(looped: bool = False):
    from transformers import Inkling2LoopTextConfig, Inkling2TextConfig

    torch.manual_seed(0)
    if looped:
        model = loop.Inkling2LoopForCausalLM(_config(
            Inkling2LoopTextConfig, loop_layer_index_start=1, loop_layer_index_end=3,
            loop_num_passes=2, loop_gate_rank=16))
    else:
        model = inkling2.Inkling2ForCausalLM(_config(Inkling2TextConfig))
    with torch.no_grad():  # HF zeroes the residual queries and the static taps
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.1)
    return model.eval()


@pytest.fixture(scope="module", params=[False, True], ids=["inkling2", "loop"])
def compiled(request):
    model = tiny(request.param)
    return model, dspark_compile(model)


def test_layers_and_states(compiled):
    """Every attention layer takes relative logits and row sinks; the looped layers' modules
    run twice, so their attention and convolutions are two layers each."""
    model, verifier = compiled
    looped = isinstance(model, loop.Inkling2LoopForCausalLM)
    specs = verifier.adapter.specs
    assert len(specs) == (6 if looped else 4)
    assert all(s.sinks and s.relative for s in specs)
    convs = verifier.adapter.linear_specs
    assert len(convs) == 4 * len(specs)  # K, V, after attention, after the MLP
    dynamic = [c for c in convs if c.conv_dim == 4 * 2 * 16]  # W = 4 taps x 2 heads x 16
    assert len(dynamic) == 2 * sum(s.window == 0 for s in specs)


@pytest.mark.parametrize("slots,prompts", [([1, 0, 2], [7, 4, 9]), ([0], [11])])
def test_ragged_equals_hf_forward(compiled, slots, prompts):
    model, verifier = compiled
    err = ragged_rounds_error(model, verifier, slots, prompts, VOCAB, seed=5)
    assert err < TOL, f"max |ragged - HF| = {err}"


@pytest.mark.parametrize("mutation", ["relative", "sinks", "dynamic_taps", "block_queries"])
def test_a_wrong_capture_is_caught(monkeypatch, mutation):
    from dspark_compile.frontend import adapters
    from dspark_compile.frontend import inkling2 as hook

    if mutation == "relative":
        real = hook.RelativeLogits
        monkeypatch.setattr(hook, "RelativeLogits", lambda x: real(torch.zeros_like(x)))
    elif mutation == "sinks":
        monkeypatch.setattr(adapters, "row_sinks_module", lambda m: False)
        check = adapters._check_attention_arguments
        monkeypatch.setattr(adapters, "_check_attention_arguments",
                            lambda where, dropout, kw, *a: check(
                                where, dropout, {k: v for k, v in kw.items() if k != "sinks"},
                                *a))
    elif mutation == "dynamic_taps":
        conv = hook._dynamic_conv_forward
        monkeypatch.setitem(hook._REPLACED, "DynamicShortConvolution",
                            lambda self, h, dyn, *a, **k: conv(self, h, dyn * 0, *a, **k))
    else:
        block = hook._block_residual_forward
        monkeypatch.setitem(hook._REPLACED, "BlockAttentionResidual",
                            lambda self, b, p: block(self, b * 0, p))
    model = tiny()
    err = ragged_rounds_error(model, dspark_compile(model), [1, 0], [5, 8], VOCAB, seed=3)
    assert err > 1e-2, err


def test_loop_passes_keep_their_own_conv_states(monkeypatch):
    """Both passes of a looped layer reading one conv state is refused by the call check
    (each run is a layer of its own)."""
    from dspark_compile.frontend import recurrent

    site = recurrent.RecurrentLayers.site

    def first_run(self, function):
        s = site(self, function)
        return s if s.layer is None else recurrent.Site(s.scope, s.module, s.where,
                                                        self.index[id(s.module)][0])

    monkeypatch.setattr(recurrent.RecurrentLayers, "site", first_run)
    with pytest.raises(RuntimeError, match=r"made the calls \['conv', 'conv'\] while captured "
                                           r"but \['conv'\]"):
        dspark_compile(tiny(looped=True))


@pytest.mark.parametrize("role", ["RelativePositionBias", "DynamicShortConvolution",
                                  "BlockAttentionResidual"])
def test_changed_source_is_refused(monkeypatch, role):
    from dspark_compile.frontend import inkling2 as hook

    monkeypatch.setitem(hook.KNOWN_SOURCES, role, frozenset())
    with pytest.raises(NotImplementedError, match=rf"Inkling2{role} .*refused rather than "
                                                  r"verified wrong"):
        dspark_compile(tiny())


def test_sinks_of_an_unknown_eager_are_refused(monkeypatch):
    from dspark_compile.frontend import inkling2 as hook

    monkeypatch.setitem(hook.KNOWN_SOURCES, "eager_attention_forward", frozenset())
    with pytest.raises(NotImplementedError, match=r"passes sinks=a tensor"):
        dspark_compile(tiny())
