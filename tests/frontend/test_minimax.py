"""MiniMax (lightning attention, full attention, MoE) against HF transformers' own forward.

The lightning layers' blocked linear attention is captured as ``dspark::ssd`` with no conv
(``frontend/minimax.py``). Every ragged logit row equals HF's forward (``use_cache=False``)
over that request's whole sequence alone, with HF's blocks (4 tokens here) crossed by the
prompts and rounds (float32, CPU, reference ops). A NaN token at rejected draft positions leaves
the accepted rows and the committed state bit-identical; a changed lightning forward is refused
naming the module.
"""

import random

import pytest
import torch

from dspark_compile import VerifyLayout, dspark_compile
from helpers import Session

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
    session = Session(model, verifier, slots, seed=7)
    session.vocab = POISON
    session.step(prompts, accept=prompts)
    rng = random.Random(7)
    for _ in range(4):
        session.step([rng.randint(1, 7) for _ in slots])
    assert session.max_err < TOL, f"max |ragged - HF| = {session.max_err}"


def test_nan_draft_cannot_reach_accepted_rows_or_state(compiled):
    """Through the eager commit and a captured session's static-buffer commit alike."""
    model, verifier = compiled
    gen = torch.Generator().manual_seed(8)
    slots, prompts = [0, 1], [6, 5]
    states = [verifier.new_state(max_requests=2, max_context=64) for _ in range(2)]
    verifier.capture(states[1], block=8, use_graphs=False)  # the static-buffer commit too
    embed = model.get_input_embeddings().weight
    with torch.no_grad():
        saved = embed[POISON].clone()
        embed[POISON] = float("nan")
    try:
        prompt = [torch.randint(0, POISON, (n,), generator=gen) for n in prompts]
        for state in states:
            layout = VerifyLayout.pack(prompts, [0, 0], slots)
            verifier(torch.cat(prompt), layout, state)
            verifier.commit(layout, prompts, state)
        drafts = [torch.randint(0, POISON, (n,), generator=gen) for n in (6, 3)]
        accept = [4, 1]
        dirty = [d.clone() for d in drafts]
        for d, a in zip(dirty, accept):
            d[a:] = POISON
        outs = []
        for state, tokens in zip(states, (drafts, dirty)):
            layout = VerifyLayout.pack([6, 3], prompts, slots)
            outs.append(verifier(torch.cat(tokens), layout, state))
            verifier.commit(layout, accept, state)
        qsl = layout.query_start_loc.tolist()
        for i, a in enumerate(accept):
            rows = slice(qsl[i], qsl[i] + a)
            assert torch.equal(outs[0][rows], outs[1][rows]), f"request {i}"
        for clean, poisoned in zip(states[0].linear.recurrent_states,
                                   states[1].linear.recurrent_states):
            assert torch.equal(clean, poisoned)
    finally:
        with torch.no_grad():
            embed[POISON] = saved


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
    model = tiny_minimax().cuda()
    verifier = dspark_compile(model, lowering="triton")
    session = Session(model, verifier, [1, 0, 2], seed=6, device="cuda")
    session.vocab = POISON
    session.step([9, 3, 6], accept=[9, 3, 6])
    rng = random.Random(6)
    for _ in range(4):
        session.step([rng.randint(1, 7) for _ in range(3)])
    assert session.max_err < 2e-3, session.max_err
