"""ZAYA: compressed convolutional attention (a depthwise then a head-grouped conv over each
token's query and key channels and the tokens before it) and values half from the token
before.

``frontend/zaya.py`` replaces ``ZayaCCAProjection.forward`` for the capture: one window conv
whose state the capture owns (the query and key channels at lags ``0 .. K``, the delayed value
at lag 1), both convolutions as per-token graph code over the window, the first token's delayed
value as HF's projection of zeros. Every ragged logit row equals HF's forward over that
request's whole sequence alone over a prefill and four ragged rounds (float32, CPU, reference
ops), at HF's kernel sizes and wider ones, with biases; a window off by one token, or the
first token's value from the zero state, is caught; a changed source is refused by name.
"""

import pytest
import torch

from dspark_compile import dspark_compile
from helpers import ragged_rounds_error

zaya = pytest.importorskip("transformers.models.zaya.modeling_zaya")

VOCAB = 89
TOL = 1e-4


def tiny_zaya(k0: int = 2, k1: int = 2, bias: bool = False):
    from transformers import ZayaConfig

    torch.manual_seed(0)
    cfg = ZayaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, moe_intermediate_size=64, num_experts=4,
        num_experts_per_tok=1, router_hidden_size=32, cca_time0=k0, cca_time1=k1,
        attention_bias=bias, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    model = zaya.ZayaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name and "scale" not in name:
                p.normal_(0.0, 0.2)
    return model


@pytest.mark.parametrize("k0,k1,bias", [(2, 2, False), (3, 2, True), (2, 4, True)])
def test_ragged_equals_hf_forward(k0, k1, bias):
    model = tiny_zaya(k0, k1, bias)
    verifier = dspark_compile(model)
    width = (k0 - 1) + (k1 - 1) + 1
    convs = verifier.adapter.linear_specs
    assert [(c.conv_dim, c.conv_width) for c in convs] == [(width * (64 + 32) + 16, width)] * 2
    err = ragged_rounds_error(model, verifier, [1, 0, 2], [7, 4, 9], VOCAB, seed=5)
    assert err < TOL, f"max |ragged - HF| = {err}"


@pytest.mark.parametrize("mutation", ["lag", "first_value"])
def test_a_wrong_capture_is_caught(monkeypatch, mutation):
    from dspark_compile.frontend import zaya as hook

    if mutation == "lag":  # every window one token further back
        taps = hook.one_hot_taps
        monkeypatch.setattr(hook, "one_hot_taps", lambda lags, width, dtype: taps(
            (lags + 1).clamp(max=width - 1), width, dtype))
    else:  # a request's first token reads the zero state, not HF's projection of zeros
        real = hook.active_scope

        class NoFirstToken:
            def __init__(self, scope):
                self.positions = scope.positions + 1

        monkeypatch.setattr(hook, "active_scope", lambda: NoFirstToken(real()))
    model = tiny_zaya(bias=True)
    err = ragged_rounds_error(model, dspark_compile(model), [1, 0], [5, 8], VOCAB, seed=3)
    assert err > 1e-2, err


def test_changed_source_is_refused(monkeypatch):
    from dspark_compile.frontend import zaya as hook

    monkeypatch.setattr(hook, "KNOWN_SOURCES", frozenset())
    with pytest.raises(NotImplementedError,
                       match=r"ZayaCCAProjection 'model.layers.0.self_attn.qkv_proj'.*refused "
                             r"rather than verified wrong"):
        dspark_compile(tiny_zaya())


@pytest.mark.gpu
def test_float32_on_gpu_through_triton_matches_hf():
    """The window conv and the attention through the Triton lowering, on the GPU."""
    from helpers import triton_rounds_error

    err = triton_rounds_error(tiny_zaya(3, 2, True), [1, 0, 2], [7, 4, 9], VOCAB, seed=5)
    assert err < 2e-3, err
