"""DBRX: its experts (a loop over the experts hit, weights stored flat) as the experts ops.

``frontend/dbrx.py`` replaces ``DbrxExperts.forward`` for the capture with one route, two up
projections (gate and up, no weight copied), the module's activation as graph code and one down
projection. Every ragged logit row equals HF's forward over that request's whole sequence alone
over a prefill and four ragged rounds (float32, CPU, reference ops); a changed experts forward
is refused naming the module.
"""

import pytest
import torch

from dspark_compile import dspark_compile
from helpers import ragged_rounds_error, triton_rounds_error

dbrx = pytest.importorskip("transformers.models.dbrx.modeling_dbrx")

VOCAB = 83
TOL = 1e-4


def tiny_dbrx():
    from transformers import DbrxConfig

    torch.manual_seed(0)
    cfg = DbrxConfig(
        d_model=64, n_heads=4, n_layers=2, max_seq_len=256, vocab_size=VOCAB,
        attn_config={"kv_n_heads": 2, "rope_theta": 500000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 96, "moe_num_experts": 4, "moe_top_k": 2},
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = dbrx.DbrxForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises the flat expert weights to zero
        for name, p in model.named_parameters():
            if ".experts.mlp." in name:
                p.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module")
def compiled():
    model = tiny_dbrx()
    return model, dspark_compile(model)


def test_experts_are_the_ops_with_no_loop(compiled):
    _, verifier = compiled
    targets = [str(n.target) for n in verifier.graph_module.graph.nodes
               if n.op == "call_function"]
    assert sum("experts_route" in t for t in targets) == 2  # one per layer
    assert sum("experts_up" in t for t in targets) == 4  # gate and up per layer
    assert sum("experts_down" in t for t in targets) == 2


@pytest.mark.parametrize("slots,prompts", [([1, 0, 2], [7, 4, 9]), ([0], [6])])
def test_ragged_equals_hf_forward(compiled, slots, prompts):
    model, verifier = compiled
    err = ragged_rounds_error(model, verifier, slots, prompts, VOCAB, seed=11)
    assert err < TOL, f"max |ragged - HF| = {err}"


def test_changed_experts_forward_is_refused(monkeypatch):
    from dspark_compile.frontend import dbrx as hook

    monkeypatch.setitem(hook.KNOWN_SOURCES, "DbrxExperts", frozenset())
    with pytest.raises(NotImplementedError,
                       match=r"DbrxExperts 'transformer.blocks.0.ffn.experts'.*refused rather "
                             r"than verified wrong"):
        dspark_compile(tiny_dbrx())


def test_a_forward_set_on_the_instance_is_refused():
    """A forward set on one module (a hook library wraps instances so) would shadow the class
    forward the capture swaps in: refused, naming that module."""
    model = tiny_dbrx()
    experts = model.transformer.blocks[1].ffn.experts
    experts.forward = experts.forward  # the same code, now an instance attribute
    with pytest.raises(NotImplementedError, match=r"DbrxExperts 'transformer.blocks.1.ffn."
                                                  r"experts'.*refused rather than verified wrong"):
        dspark_compile(model)


@pytest.mark.gpu
def test_float32_on_gpu_through_triton_matches_hf():
    """The experts through the Triton routing and grouped GEMMs, on the GPU."""
    from dspark_compile.frontend.replaced import source_key
    from dspark_compile.frontend.dbrx import KNOWN_SOURCES

    if any(source_key(cls) not in KNOWN_SOURCES[cls.__name__]
           for cls in (dbrx.DbrxExperts, dbrx.DbrxExpertGLU)):
        pytest.skip("this transformers' DBRX experts forward is not one the capture was derived "
                    "from: refused by name (test_changed_experts_forward_is_refused)")
    err = triton_rounds_error(tiny_dbrx(), [1, 0, 2], [7, 4, 9], VOCAB, seed=11)
    assert err < 2e-3, err
