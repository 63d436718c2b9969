"""Chunked attention (Llama 4's ``attention_chunk_size``): the mask proof reads transformers'
``chunked_overlay`` and the ragged op computes it; a Llama 4 text model with chunked and full
layers verifies exact against HF's own forward while contexts cross chunk edges, with its
NoPE layers' query temperature tuning applied per token (``frontend/llama4.py``). What the
proof does not cover (two chunk sizes, a window inside chunks, offsets that move the chunk
edges) is refused, and so is a tuning forward other than the one the capture was derived
from."""

from __future__ import annotations

import random

import pytest
import torch

from dspark_compile import dspark_compile
from dspark_compile.frontend import masks
from helpers import Session

tf = pytest.importorskip("transformers")
mu = pytest.importorskip("transformers.masking_utils")

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             head_dim=16, num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=96)


def _llama4(**extra):
    torch.manual_seed(0)
    return tf.Llama4ForCausalLM(tf.Llama4TextConfig(**{**SMALL, **extra})).eval()


def test_llama4_chunks_equal_hf_across_chunk_edges():
    model = _llama4(attention_chunk_size=5, attn_temperature_tuning=False)
    verifier = dspark_compile(model)
    kinds = [line for line in verifier.explain().splitlines() if "attention model." in line]
    assert [("chunks of 5" in k, "causal" in k) for k in kinds] == \
        [(True, False)] * 3 + [(False, True)], kinds  # three chunked layers, then a full one
    session = Session(model, verifier, [7, 0], seed=1)
    session.vocab = SMALL["vocab_size"]
    session.step([5, 7], accept=[5, 7])
    rng = random.Random(1)
    for _ in range(4):  # contexts 7..~30: every round crosses or ends on a chunk edge
        session.step([rng.randint(1, 5) for _ in range(2)])
    assert session.max_err <= 1e-5, f"max |ragged - HF| = {session.max_err}"


def test_llama4_temperature_tuning_equals_hf_per_token():
    """The NoPE layers' query temperature tuning, with floor_scale 4 so that the scales change
    every 4 positions of the rounds (at Llama 4's 8192 they stay 1 in any short test): applied
    per token from each request's own positions, equal to HF's forward of that request."""
    model = _llama4(attention_chunk_size=5, attn_temperature_tuning=True, floor_scale=4,
                    attn_scale=0.5)
    tuned = [m for m in model.modules() if getattr(m, "attn_temperature_tuning", False)
             and not m.use_rope]
    assert tuned, "the config has a NoPE layer with temperature tuning"
    session = Session(model, dspark_compile(model), [6, 0, 3], seed=2)
    session.vocab = SMALL["vocab_size"]
    session.step([6, 2, 3], accept=[6, 2, 3])
    rng = random.Random(2)
    for _ in range(4):
        session.step([rng.randint(1, 5) for _ in range(3)])
    assert session.max_err <= 1e-5, f"max |ragged - HF| = {session.max_err}"
    assert all(m.attn_temperature_tuning for m in tuned), "the capture restored the modules"


def test_llama4_temperature_tuning_from_another_forward_is_refused(monkeypatch):
    from dspark_compile.frontend import llama4

    monkeypatch.setattr(llama4, "KNOWN_SOURCES", frozenset())
    with pytest.raises(NotImplementedError, match="temperature tuning is captured from "
                       "Llama4TextAttention's own forward"):
        dspark_compile(_llama4(attention_chunk_size=5))


def test_chunk_proof_reads_the_overlay_and_refuses_what_it_does_not_cover():
    zeros = torch.zeros(1, dtype=torch.long)
    chunked = mu.chunked_causal_mask_function(4, zeros)
    assert masks.prove(chunked) == (True, 0, 4)
    assert masks.causal_only(mask_function=chunked) == masks.WindowMask(0, 4)
    window_in_chunks = mu.and_masks(chunked, mu.sliding_window_overlay(3))
    two_sizes = mu.and_masks(chunked, mu.chunked_overlay(6, zeros))
    for fn in (window_in_chunks, two_sizes):
        assert masks.prove(fn) is None
        assert isinstance(masks.causal_only(mask_function=fn), masks.UnprovenMask)
    shifted = mu.add_offsets_to_mask_function(chunked, 2, 2)  # moves the chunk edges
    assert masks.prove(shifted) is None
    assert masks.prove(mu.add_offsets_to_mask_function(chunked, 8, 8)) == (True, 0, 4)
    with pytest.raises(NotImplementedError, match=r"layer: the model builds and_masks\("
                       r"and_masks\(chunked_overlay\(4\), causal_mask_function\), "
                       r"sliding_window_overlay\(3\)\), not causal attention"):
        masks.check_mask("layer", masks.causal_only(mask_function=window_in_chunks))
