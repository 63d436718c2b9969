"""LongCat-Flash: its experts (a loop over the experts hit, with zero-compute experts that return
the token) as the experts ops plus token-wise graph code.

``frontend/longcat.py`` replaces ``LongcatFlashExperts.forward`` for the capture with one route
over the routed experts, one up and one down projection, and the zero-compute picks as
``weight * x``. Every ragged logit row equals HF's forward over that request's whole sequence
alone over a prefill and four ragged rounds (float32, CPU, reference ops), with routed and
zero-compute experts both picked; a changed experts forward is refused naming the module.
"""

import pytest
import torch

from dspark_compile import dspark_compile
from helpers import ragged_rounds_error, triton_rounds_error

longcat = pytest.importorskip("transformers.models.longcat_flash.modeling_longcat_flash")

VOCAB = 89
TOL = 1e-4


def tiny_longcat():
    from transformers import LongcatFlashConfig

    torch.manual_seed(0)
    cfg = LongcatFlashConfig(
        vocab_size=VOCAB, hidden_size=64, num_layers=2, num_attention_heads=4,
        num_key_value_heads=4, ffn_hidden_size=96, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, head_dim=8,
        n_routed_experts=4, zero_expert_num=2, moe_topk=2, expert_ffn_hidden_size=48,
        max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = longcat.LongcatFlashForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises the expert weights and the router bias to zero
        for name, p in model.named_parameters():
            if ".experts." in name or "classifier" in name:
                p.normal_(0.0, 0.2)
    return model


@pytest.fixture(scope="module")
def compiled():
    model = tiny_longcat()
    return model, dspark_compile(model)


def test_both_kinds_of_expert_are_picked(compiled):
    """The routing of a random sequence hits routed experts and zero-compute ones."""
    model, _ = compiled
    picks = []
    hooks = [m.register_forward_hook(lambda mod, args, out: picks.append(out[2].flatten()))
             for m in model.modules() if isinstance(m, longcat.LongcatFlashTopkRouter)]
    try:
        with torch.no_grad():
            model(torch.randint(3, VOCAB, (1, 24), generator=torch.Generator().manual_seed(2)))
    finally:
        for h in hooks:
            h.remove()
    ids = torch.cat(picks)
    assert (ids < 4).any() and (ids >= 4).any()


def test_experts_are_the_ops_with_no_loop(compiled):
    _, verifier = compiled
    targets = [str(n.target) for n in verifier.graph_module.graph.nodes
               if n.op == "call_function"]
    layers = sum(isinstance(m, longcat.LongcatFlashExperts)
                 for m in compiled[0].modules())
    assert layers >= 2
    for op in ("experts_route", "experts_up", "experts_down"):
        assert sum(op in t for t in targets) == layers, op


@pytest.mark.parametrize("slots,prompts", [([1, 0, 2], [7, 4, 9]), ([0], [6])])
def test_ragged_equals_hf_forward(compiled, slots, prompts):
    model, verifier = compiled
    err = ragged_rounds_error(model, verifier, slots, prompts, VOCAB, seed=5)
    assert err < TOL, f"max |ragged - HF| = {err}"


def test_changed_experts_forward_is_refused(monkeypatch):
    from dspark_compile.frontend import longcat as hook

    monkeypatch.setattr(hook, "KNOWN_SOURCES", frozenset())
    with pytest.raises(NotImplementedError,
                       match=r"LongcatFlashExperts 'model.layers.0.mlp.experts'.*refused "
                             r"rather than verified wrong"):
        dspark_compile(tiny_longcat())


@pytest.mark.gpu
def test_float32_on_gpu_through_triton_matches_hf():
    """The routed experts through the Triton routing and grouped GEMMs, on the GPU."""
    err = triton_rounds_error(tiny_longcat(), [1, 0, 2], [7, 4, 9], VOCAB, seed=5)
    assert err < 2e-3, err
