"""Decoders that count their positions themselves (``frontend/counted_positions.py``).

BART's decoder (and its copies) makes ``arange(T) + cache length`` and reads its position table
there; the capture reads it at each token's own position instead. Every ragged logit row equals
HF's forward over that request's whole sequence alone, over a prefill and four ragged rounds
(float32, CPU): BART (a learned table read two rows on), Blenderbot (a learned table), Marian
(a sinusoid table), MVP and TrOCR (BART's table under their inline attention). Positions one
off are caught; an embedding outside its decoder, a changed decoder source, MVP's prompt keys
and TrOCR's sinusoids (a table outside the buffers) are refused by name; the table bounds
the context.
"""

import pytest
import torch
import transformers as T

from dspark_compile import dspark_compile
from helpers import ragged_rounds_error, triton_rounds_error

VOCAB = 64


def _tiny(name: str, positions: int = 128, **extra):
    config, model = {"bart": (T.BartConfig, T.BartForCausalLM),
                     "blenderbot": (T.BlenderbotConfig, T.BlenderbotForCausalLM),
                     "marian": (T.MarianConfig, T.MarianForCausalLM),
                     "mvp": (T.MvpConfig, T.MvpForCausalLM),
                     "trocr": (T.TrOCRConfig, T.TrOCRForCausalLM)}[name]
    torch.manual_seed(0)
    encoder = {} if name == "trocr" else dict(encoder_layers=1, encoder_attention_heads=4,
                                              encoder_ffn_dim=64)
    cfg = config(vocab_size=VOCAB, d_model=32, decoder_layers=2, decoder_attention_heads=4,
                 decoder_ffn_dim=64, max_position_embeddings=positions, pad_token_id=1,
                 bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, **encoder, **extra)
    m = model(cfg).eval()
    with torch.no_grad():
        for pname, p in m.named_parameters():
            if "embed_positions" in pname and name == "marian":
                continue  # the sinusoid table is fixed
            if "norm" not in pname:
                p.normal_(0.0, 0.2)
    return m


def _rounds(model, **kwargs) -> float:
    return ragged_rounds_error(model, dspark_compile(model), [1, 0, 2], [7, 4, 9], VOCAB,
                               seed=5, **kwargs)


@pytest.mark.parametrize("name", ["bart", "blenderbot", "marian", "mvp", "trocr"])
def test_ragged_equals_hf_forward(name):
    err = _rounds(_tiny(name))
    assert err < 1e-4, f"max |ragged - HF| = {err}"


def test_positions_one_off_are_caught(monkeypatch):
    from dspark_compile.frontend import counted_positions as hook

    real = hook.table_at_positions

    def shifted(offsets):
        return real({k: v + 1 for k, v in offsets.items()})

    monkeypatch.setattr(hook, "table_at_positions", shifted)
    assert _rounds(_tiny("bart"), max_context=64) > 1e-2


def test_a_changed_decoder_source_is_refused(monkeypatch):
    from dspark_compile.frontend import counted_positions as hook

    monkeypatch.setitem(hook.KNOWN_SOURCES, "BartDecoder", frozenset())
    with pytest.raises(NotImplementedError, match=r"BartLearnedPositionalEmbedding "
                       r"'model.decoder.embed_positions'.*inside BartDecoder.*refused"):
        dspark_compile(_tiny("bart"))


def test_mvps_prompt_keys_and_trocrs_sinusoids_are_refused():
    """MVP's attention takes prompt keys (its causal LM never passes them: equal to HF with
    ``use_prompt`` on); given some, they are refused. TrOCR's sinusoid table is a plain tensor
    attribute, not a buffer: refused naming the model line that reads it."""
    from dspark_compile.frontend import inline

    model = _tiny("mvp", use_prompt=True, prompt_length=3, prompt_mid_dim=16)
    assert _rounds(model) < 1e-4
    attention = model.model.decoder.layers[0].self_attn
    with pytest.raises(NotImplementedError, match="MvpAttention: called with prompt keys"):
        inline._xglm_forward(attention, torch.zeros(1, 2, 32),
                             attn_prompt=torch.zeros(2, 1, 4, 3, 8))
    with pytest.raises(NotImplementedError, match=r"TrOCRForCausalLM computes with a tensor it "
                       r"holds outside its parameters and buffers.*modeling_trocr.py:\d+"):
        dspark_compile(_tiny("trocr", use_learned_position_embeddings=False))


def test_the_table_bounds_the_context():
    verifier = dspark_compile(_tiny("bart", positions=24))
    assert verifier.position_limit.positions == 24
    assert verifier.position_limit.table == "model.decoder.embed_positions.weight"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["bart", "marian"])
def test_float32_on_gpu_through_triton_matches_hf(name):
    err = triton_rounds_error(_tiny(name), [1, 0, 2], [7, 4, 9], VOCAB, seed=5)
    assert err < 2e-3, err
