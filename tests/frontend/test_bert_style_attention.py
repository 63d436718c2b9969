"""MegatronBERT, RemBERT and RoFormer as decoders: BERT-style self-attention written inline
(scores plus the model's mask), captured through the attention function
(``frontend/inline.py``).

Every ragged logit row equals HF's forward over that request's whole sequence alone, over a
prefill and four ragged rounds (float32, CPU, reference ops), RoFormer with and without its
rotated values. A capture that drops the rotation, reads RoFormer's sinusoid table one
position off or drops the scores' scale is caught; a changed source and a sinusoid table its
encoder does not own are refused by name.
"""

import pytest
import torch

from dspark_compile import dspark_compile
from helpers import randomised, ragged_rounds_error, triton_rounds_error

megatron = pytest.importorskip("transformers.models.megatron_bert.modeling_megatron_bert")
rembert = pytest.importorskip("transformers.models.rembert.modeling_rembert")
roformer = pytest.importorskip("transformers.models.roformer.modeling_roformer")

VOCAB = 89
TOL = 1e-4


def tiny_megatron():
    from transformers import MegatronBertConfig

    torch.manual_seed(0)
    cfg = MegatronBertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                             num_attention_heads=4, intermediate_size=64,
                             max_position_embeddings=128, is_decoder=True)
    return randomised(megatron.MegatronBertForCausalLM(cfg))


def tiny_rembert():
    from transformers import RemBertConfig

    torch.manual_seed(0)
    cfg = RemBertConfig(vocab_size=VOCAB, hidden_size=32, input_embedding_size=16,
                        output_embedding_size=24, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=128, is_decoder=True)
    return randomised(rembert.RemBertForCausalLM(cfg))


def tiny_roformer(rotary_value: bool = False):
    from transformers import RoFormerConfig

    torch.manual_seed(0)
    cfg = RoFormerConfig(vocab_size=VOCAB, hidden_size=32, embedding_size=32,
                         num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                         max_position_embeddings=128, is_decoder=True,
                         rotary_value=rotary_value)
    return randomised(roformer.RoFormerForCausalLM(cfg))


def _rounds(model, **kwargs) -> float:
    return ragged_rounds_error(model, dspark_compile(model), [1, 0, 2], [7, 4, 9], VOCAB,
                               seed=5, **kwargs)


@pytest.mark.parametrize("build", [tiny_megatron, tiny_rembert, tiny_roformer,
                                   lambda: tiny_roformer(rotary_value=True)],
                         ids=["megatron_bert", "rembert", "roformer", "roformer_rotary_value"])
def test_equals_hf(build):
    err = _rounds(build())
    assert err < TOL, f"max |ragged - HF| = {err}"


def test_a_dropped_rotation_is_caught(monkeypatch):
    from dspark_compile.frontend import inline

    monkeypatch.setattr(inline, "_roformer_rotate", lambda self, table, q, k, v: (q, k, v))
    assert _rounds(tiny_roformer()) > 1e-2


def test_positions_one_off_are_caught(monkeypatch):
    """The table read at each token's position, not at ``arange(T)``: one off is caught (and
    ``arange`` itself is refused by the capture, the positions then being no request's own)."""
    from dspark_compile.frontend import counted_positions, scope

    real = scope.active_scope

    class Shifted:
        def __init__(self, inner):
            self.positions = inner.positions + 1

    monkeypatch.setattr(counted_positions, "active_scope", lambda: Shifted(real()))
    assert _rounds(tiny_roformer(), max_context=64) > 1e-2


def test_an_unscaled_attention_is_caught(monkeypatch):
    from dspark_compile.frontend import inline

    real = inline._attention

    def unscaled():
        attend = real()
        return lambda *args, scaling, **kwargs: attend(*args, scaling=1.0, **kwargs)

    monkeypatch.setattr(inline, "_attention", unscaled)
    assert _rounds(tiny_megatron()) > 1e-2


@pytest.mark.parametrize("key,build,where", [
    (("MegatronBertSelfAttention", "forward"), tiny_megatron,
     "bert.encoder.layer.0.attention.self"),
    (("RemBertSelfAttention", "__init__"), tiny_rembert, "rembert.encoder.layer.0.attention.self"),
    (("RoFormerSelfAttention", "apply_rotary_position_embeddings"), tiny_roformer,
     "roformer.encoder.layer.0.attention.self"),
    (("RoFormerEncoder", "forward"), tiny_roformer, "roformer.encoder"),
])
def test_changed_source_is_refused(monkeypatch, key, build, where):
    from dspark_compile.frontend import inline

    monkeypatch.setitem(inline.KNOWN_SOURCES, key, frozenset())
    with pytest.raises(NotImplementedError,
                       match=rf"'{where}': .*refused rather than verified wrong"):
        dspark_compile(build())


def test_a_sinusoid_table_its_encoder_does_not_own_is_refused():
    """A second table hung off the model: read at the capture's positions only where the encoder
    that asks for ``arange(T)`` is its owner."""
    model = tiny_roformer()
    model.extra_positions = roformer.RoFormerSinusoidalPositionalEmbedding(128, 8)
    with pytest.raises(NotImplementedError, match=r"'extra_positions': .*refused"):
        dspark_compile(model)


@pytest.mark.gpu
@pytest.mark.parametrize("build", [tiny_megatron, tiny_rembert, tiny_roformer])
def test_float32_on_gpu_through_triton_matches_hf(build):
    model = build()
    ids = torch.arange(8)[None] % VOCAB
    with torch.no_grad():
        prefix, whole = model(ids[:, :5]).logits, model(ids).logits[:, :5]
    if not torch.allclose(prefix, whole, atol=1e-5):  # transformers 5.17: a bidirectional mask
        with pytest.raises(NotImplementedError, match="bidirectional_mask_function"):
            dspark_compile(model)
        pytest.skip(f"{type(model).__name__} attends both ways under this transformers, and is "
                    "refused by its mask")
    err = triton_rounds_error(model, [1, 0, 2], [7, 4, 9], VOCAB, seed=5)
    assert err < 2e-3, err
