"""MiniMax (lightning attention, full attention, MoE) against HF transformers' own forward.

The lightning layers' blocked linear attention is captured as ``dspark::ssd`` with no conv
(``frontend/minimax.py``). Every ragged logit row equals HF's forward (``use_cache=False``)
over that request's whole sequence alone, with HF's blocks (4 tokens here) crossed by the
prompts and rounds (float32, CPU, reference ops). A NaN token at rejected draft positions leaves
the accepted rows and the committed state bit-identical; a changed lightning forward is refused
naming the module.
"""

import pytest
import torch

from dspark_compile import dspark_compile
from helpers import assert_nan_drafts_contained, ragged_rounds_error, triton_rounds_error

minimax = pytest.importorskip("transformers.models.minimax.modeling_minimax")

VOCAB = 89
POISON = VOCAB - 1
TOL = 1e-4


def tiny_minimax():
    from transformers import MiniMaxConfig

    torch.manual_seed(0)
    cfg = MiniMaxConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, block_size=4,
        layer_types=["linear_attention", "full_attention", "linear_attention",
                     "linear_attention"], pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return minimax.MiniMaxForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def compiled():
    model = tiny_minimax()
    return model, dspark_compile(model)


def test_lightning_layers_are_scans_without_conv(compiled):
    _, verifier = compiled
    specs = verifier.adapter.linear_specs
    assert [s.kind for s in specs] == ["scan"] * 3
    assert all(s.conv_dim == 0 and (s.num_v_heads, s.head_k_dim, s.head_v_dim) == (4, 16, 16)
               for s in specs)
    done = {r.name: r.changed for r in verifier.results}
    assert done["ragged_ssd"] == 3 and done["ragged_conv"] == 0
    ops = {str(n.target) for n in verifier.graph_module.graph.nodes if n.op == "call_function"}
    assert not any("dense_" in op for op in ops), ops


@pytest.mark.parametrize("slots,prompts", [([1, 0, 2], [9, 3, 6]), ([0], [5])])
def test_ragged_equals_hf_forward(compiled, slots, prompts):
    model, verifier = compiled
    err = ragged_rounds_error(model, verifier, slots, prompts, POISON, seed=7, max_len=7)
    assert err < TOL, f"max |ragged - HF| = {err}"


@pytest.mark.parametrize("capture", [False, True])
def test_nan_draft_cannot_reach_accepted_rows_or_state(compiled, capture):
    """Through the eager commit and captured sessions' static-buffer commit alike."""
    model, verifier = compiled
    assert_nan_drafts_contained(model, verifier, POISON, [0, 1], [6, 5], [6, 3], [4, 1],
                                seed=8, capture=capture)


def test_changed_lightning_forward_is_refused(monkeypatch):
    from dspark_compile.frontend import minimax as hook

    monkeypatch.setattr(hook, "KNOWN_SOURCES", frozenset())
    with pytest.raises(NotImplementedError,
                       match="MiniMaxLightningAttention 'model.layers.0.self_attn'.*refused "
                             "rather than verified wrong"):
        dspark_compile(tiny_minimax())


@pytest.mark.gpu
def test_float32_on_gpu_through_triton_matches_hf():
    """The lightning layers through the Triton Mamba-2 scan, on the GPU."""
    from dspark_compile.frontend.replaced import source_key
    from dspark_compile.frontend.minimax import KNOWN_SOURCES

    if source_key(minimax.MiniMaxLightningAttention) not in KNOWN_SOURCES:
        pytest.skip("this transformers' lightning forward is not one the capture was derived "
                    "from: refused by name (test_changed_lightning_forward_is_refused)")
    err = triton_rounds_error(tiny_minimax(), [1, 0, 2], [9, 3, 6], POISON, seed=6, max_len=7)
    assert err < 2e-3, err
