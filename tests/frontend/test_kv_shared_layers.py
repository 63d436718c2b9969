"""KV-shared layers (Gemma 3n, Gemma 4): a layer that attends over an earlier layer's keys and
values, handed on as the same tensors, reads that layer's pools (``AttentionSpec.kv_from``)
instead of a copy of its own.

Every ragged logit row equals HF's forward over that request's whole sequence alone (float32,
CPU, reference ops), with the shared layers' pools the very tensors of the layers they read,
past a sliding window (in full pools and in rings), and through a static tier session; the KV bytes are those of the
layers that compute keys. A call handed the same tensors under another window keeps pools of
its own.
"""

import pytest
import torch

from dspark_compile import dspark_compile
from helpers import Session

VOCAB = 128
TOL = 1e-4
SHAPE = dict(vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=64,
             hidden_size_per_layer_input=16, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=256, sliding_window=4,
             layer_types=["sliding_attention", "full_attention"] * 2)


def tiny_gemma3n(shared: int = 2):
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

    torch.manual_seed(0)
    cfg = Gemma3nTextConfig(**SHAPE, laurel_rank=8, num_kv_shared_layers=shared,
                            activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0])
    return Gemma3nForCausalLM(cfg).eval()


def tiny_gemma4(shared: int = 2):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(0)
    cfg = Gemma4TextConfig(**SHAPE, global_head_dim=16, num_kv_shared_layers=shared)
    return Gemma4ForCausalLM(cfg).eval()


@pytest.mark.parametrize("build", [tiny_gemma3n, tiny_gemma4], ids=["gemma3n", "gemma4"])
def test_shared_layers_read_the_pools_of_the_layers_they_share(build):
    model = build()
    verifier = dspark_compile(model)
    assert [s.kv_from for s in verifier.adapter.specs] == [None, None, 0, 1]
    assert "the K/V pools of model.layers.0.self_attn" in verifier.explain()
    state = verifier.new_state(max_requests=3, max_context=64)
    for layer, source in ((2, 0), (3, 1)):
        assert all(a is b for a, b in zip(state.kv_caches[layer], state.kv_caches[source]))
    plain = dspark_compile(build(shared=0))
    assert [s.kv_from for s in plain.adapter.specs] == [None] * 4
    own = plain.new_state(max_requests=3, max_context=64)
    nbytes = lambda s: sum({id(t): t.numel() * t.element_size()  # noqa: E731
                            for pair in s.kv_caches for t in pair}.values())
    assert 2 * nbytes(state) == nbytes(own)
    # windows of 4 under prompts of 7-9 and rounds of up to 8 tokens, in full pools and in
    # rings of window + 9 positions (which the shared layers read as their own)
    for rings in ({}, {"window_rings": True, "max_step_tokens": 10}):
        session = Session(model, verifier, [1, 0, 2], max_context=128, seed=5, **rings)
        session.vocab = VOCAB
        session.step([7, 4, 9], accept=[7, 4, 9])
        for lens in ([8, 3, 5], [2, 8, 1], [6, 6, 6], [1, 7, 4]):
            session.step(lens)
        assert session.max_err < TOL, (rings, session.max_err)


def test_shared_layers_through_a_static_session():
    from dspark_compile.zoo.check import Entry, check

    result = check(Entry("gemma3n_text", "Gemma3nForCausalLM"), static=True)
    assert result.status == "exact", (result.status, result.reason)


def test_the_same_tensors_under_another_window_get_pools_of_their_own():
    from dspark_compile.frontend.scope import CaptureScope

    scope = CaptureScope(kv_caches=[], block_table=torch.zeros(1, 1, dtype=torch.int32),
                         context_lens=torch.zeros(1, dtype=torch.int32), discovered=[])
    q, k, v = torch.zeros(1, 4, 3, 16), torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16)
    scope.attend(None, q, k, v, 0.25, window=4)
    scope.attend(None, q, k, v, 0.25, window=4)    # shares call 0's pools
    scope.attend(None, q, k, v, 0.25)              # the same tensors, no window: its own
    scope.attend(None, q, k, torch.zeros_like(v), 0.25, window=4)  # other values: its own
    scope.attend(None, q, k, v, 0.25, window=4)    # call 0's again, not call 1's
    assert [s.kv_from for s in scope.discovered] == [None, 0, None, None, 0]


def test_a_shared_layer_given_the_other_layers_pools_is_caught(monkeypatch):
    """The check above can fail: each shared layer handed the pools of the layer of the other
    attention type (0 <-> 1) verifies wrong."""
    from dspark_compile.frontend.scope import CaptureScope

    real = CaptureScope._kv_source

    def swapped(self, k, v, window, compressed):
        source = real(self, k, v, window, compressed)
        return None if source is None else 1 - source

    monkeypatch.setattr(CaptureScope, "_kv_source", swapped)
    model = tiny_gemma3n()
    verifier = dspark_compile(model)
    assert [s.kv_from for s in verifier.adapter.specs] == [None, None, 1, 0]
    session = Session(model, verifier, [1, 0, 2], max_context=128, seed=5)
    session.vocab = VOCAB
    session.step([7, 4, 9], accept=[7, 4, 9])
    session.step([8, 3, 5])
    assert session.max_err > 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("build", [tiny_gemma3n, tiny_gemma4], ids=["gemma3n", "gemma4"])
def test_float32_on_gpu_through_triton_matches_hf(build):
    """The shared pools through the Triton kernels (each shared layer writes its rows into
    the pools it shares again, the same values, then reads them)."""
    from helpers import triton_rounds_error

    err = triton_rounds_error(build(), [1, 0, 2], [7, 4, 9], VOCAB, seed=5)
    assert err < 2e-3, err
