"""BLOOM: ALiBi (a head's slope times the key's position) added by its attention itself.

``frontend/bloom.py`` replaces ``BloomAttention.forward`` for the capture: the same projection
and head split, then the capture's attention function with the heads' slopes, which
``dspark::ragged_attention`` adds as ``slope * (kpos - qpos)``. Every ragged logit row equals
HF's forward over that request's whole sequence alone over a prefill and four ragged rounds
(float32, CPU, reference ops), at a power-of-two head count and another (the slopes' second
series); slopes dropped or reversed are caught; a changed source is refused by name.
"""

import pytest
import torch

from dspark_compile import dspark_compile
from helpers import ragged_rounds_error, triton_rounds_error

bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")

VOCAB = 89
TOL = 1e-4


def tiny_bloom(heads: int = 4):
    from transformers import BloomConfig

    torch.manual_seed(0)
    cfg = BloomConfig(vocab_size=VOCAB, hidden_size=16 * heads, n_layer=2, n_head=heads,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = bloom.BloomForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" not in name:
                p.normal_(0.0, 0.2)
    return model


@pytest.mark.parametrize("heads", [4, 6])
def test_ragged_equals_hf_forward(heads):
    model = tiny_bloom(heads)
    verifier = dspark_compile(model)
    assert all(s.alibi for s in verifier.adapter.specs) and "ALiBi" in verifier.explain()
    err = ragged_rounds_error(model, verifier, [1, 0, 2], [7, 4, 9], VOCAB, seed=5)
    assert err < TOL, f"max |ragged - HF| = {err}"


@pytest.mark.parametrize("mutation", ["dropped", "reversed"])
def test_a_wrong_capture_is_caught(monkeypatch, mutation):
    from dspark_compile.frontend import bloom as hook

    real = hook.AlibiSlopes
    change = (lambda s: s * 0) if mutation == "dropped" else (lambda s: s.flip(0))
    monkeypatch.setattr(hook, "AlibiSlopes", lambda s: real(change(s)))
    model = tiny_bloom()
    err = ragged_rounds_error(model, dspark_compile(model), [1, 0], [5, 8], VOCAB, seed=3)
    assert err > 1e-2, err


def test_changed_source_is_refused(monkeypatch):
    from dspark_compile.frontend import bloom as hook

    monkeypatch.setitem(hook.KNOWN_SOURCES, "_reshape", frozenset())
    with pytest.raises(NotImplementedError,
                       match=r"BloomAttention 'transformer.h.0.self_attention'.*refused rather "
                             r"than verified wrong"):
        dspark_compile(tiny_bloom())


@pytest.mark.gpu
def test_float32_on_gpu_through_triton_matches_hf():
    """The slopes through the Triton attention kernel, on the GPU."""
    err = triton_rounds_error(tiny_bloom(6), [1, 0, 2], [7, 4, 9], VOCAB, seed=5)
    assert err < 2e-3, err
