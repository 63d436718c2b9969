"""RecurrentGemma (Griffin): recurrent blocks (a temporal conv, then the RG-LRU, a gated
diagonal linear recurrence) beside local attention.

``frontend/griffin.py`` replaces the recurrent block's forward for the capture: its conv through
a capture-owned conv layer, its recurrence as a one-state-channel Mamba-1 scan (decay ``exp(r *
A)``, input divided by ``r``). Every ragged logit row equals HF's forward over that request's
whole sequence alone over a prefill and four ragged rounds (float32, CPU, reference ops) with
contexts past the attention window; leaving out the conv's bias, the input's division or the
first token's reset is caught; a changed source is refused by name.
"""

import pytest
import torch

from dspark_compile import dspark_compile
from helpers import ragged_rounds_error

griffin = pytest.importorskip("transformers.models.recurrent_gemma.modeling_recurrent_gemma")

VOCAB = 89
TOL = 1e-4


def tiny_griffin():
    from transformers import RecurrentGemmaConfig

    torch.manual_seed(0)
    cfg = RecurrentGemmaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, lru_width=64,
        attention_window_size=6, conv1d_width=4, block_types=["recurrent", "attention"],
        pad_token_id=0, eos_token_id=1, bos_token_id=2)
    model = griffin.RecurrentGemmaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.2)
    return model


@pytest.fixture(scope="module")
def compiled():
    model = tiny_griffin()
    return model, dspark_compile(model)


def test_recurrent_blocks_are_conv_and_scan_layers(compiled):
    model, verifier = compiled
    specs = verifier.adapter.linear_specs
    blocks = sum(isinstance(m, griffin.RecurrentGemmaRecurrentBlock) for m in model.modules())
    assert blocks == 2
    assert [(s.kind, s.conv_dim, s.conv_width, s.num_v_heads, s.head_k_dim, s.head_v_dim)
            for s in specs] == [("ssd", 64, 4, 64, 1, 1)] * blocks
    assert [s.window for s in verifier.adapter.specs] == [6]


@pytest.mark.parametrize("slots,prompts", [([1, 0, 2], [7, 4, 9]), ([0], [11])])
def test_ragged_equals_hf_forward(compiled, slots, prompts):
    model, verifier = compiled
    err = ragged_rounds_error(model, verifier, slots, prompts, VOCAB, seed=5)
    assert err < TOL, f"max |ragged - HF| = {err}"


@pytest.mark.parametrize("mutation", ["conv_bias", "division", "reset"])
def test_a_wrong_capture_is_caught(monkeypatch, mutation):
    from dspark_compile.frontend import griffin as hook

    if mutation == "conv_bias":
        window = hook.window
        monkeypatch.setattr(hook, "window", lambda x, taps, bias=None: window(x, taps))
    elif mutation == "division":  # the scan's input not divided by r (it multiplies by r)
        scan = hook.diagonal_scan
        monkeypatch.setattr(hook, "diagonal_scan", lambda x, dt, *a: scan(x * dt, dt, *a))
    else:  # no token is a request's first: its input keeps sqrt(1 - a^2)
        rg_lru = hook._rg_lru
        monkeypatch.setattr(hook, "_rg_lru", lambda lru, x, pos: rg_lru(lru, x, pos + 1))
    model = tiny_griffin()
    err = ragged_rounds_error(model, dspark_compile(model), [1, 0], [5, 8], VOCAB, seed=3)
    assert err > 1e-2, err


def test_changed_source_is_refused(monkeypatch):
    from dspark_compile.frontend import griffin as hook

    monkeypatch.setitem(hook.KNOWN_SOURCES, ("RecurrentGemmaRglru", "_rnn_scan"), frozenset())
    with pytest.raises(NotImplementedError,
                       match=r"RecurrentGemmaRecurrentBlock 'model.layers.0.temporal_block'.*"
                             r"refused rather than verified wrong"):
        dspark_compile(tiny_griffin())
