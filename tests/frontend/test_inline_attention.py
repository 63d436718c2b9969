"""GPT-Neo, XGLM, GPT (openai-gpt), GPT-NeoX-Japanese, MPT, and GPT-J and CodeGen where
transformers writes them inline (5.17): attention written inline in the layer, captured through
the attention function (``frontend/inline.py``).

Every ragged logit row equals HF's forward over that request's whole sequence alone, over a
prefill and four ragged rounds (float32, CPU, reference ops): GPT-Neo's global and local layers
(a window shorter than the sequences, no softmax scale), XGLM's pre-scaled queries and its
sinusoidal positions past the table HF starts with, GPT's scaled scores under its causal
buffer, GPT-NeoX-Japanese's partial rotary, MPT's ALiBi (a power-of-two head count and
another) with clipped q/k/v, GPT-J's and CodeGen's interleaved rotary (partial and whole). A capture that drops the window, shifts the positions, drops GPT's scale
or drops the slopes is caught; a changed source, a band or causal buffer that is not one and an
unknown mask cast are refused by name.
"""

import pytest
import torch

from dspark_compile import dspark_compile
from helpers import randomised, ragged_rounds_error, triton_rounds_error

neo = pytest.importorskip("transformers.models.gpt_neo.modeling_gpt_neo")
xglm = pytest.importorskip("transformers.models.xglm.modeling_xglm")
mpt = pytest.importorskip("transformers.models.mpt.modeling_mpt")
gpt = pytest.importorskip("transformers.models.openai.modeling_openai")
neox_ja = pytest.importorskip("transformers.models.gpt_neox_japanese.modeling_gpt_neox_japanese")
gptj = pytest.importorskip("transformers.models.gptj.modeling_gptj")
codegen = pytest.importorskip("transformers.models.codegen.modeling_codegen")
INLINE_SINUSOID = hasattr(gptj.GPTJAttention, "_attn")
"""GPT-J and CodeGen score in their own ``_attn`` (transformers 5.17): the inline hook's form;
later versions call the attention interface and need none."""

VOCAB = 89
TOL = 1e-4


def tiny_neo(window: int = 3):
    from transformers import GPTNeoConfig

    torch.manual_seed(0)
    cfg = GPTNeoConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                       attention_types=[[["global", "local"], 1]], window_size=window,
                       max_position_embeddings=128, intermediate_size=64)
    return randomised(neo.GPTNeoForCausalLM(cfg))


def tiny_xglm(positions: int = 8):
    from transformers import XGLMConfig

    torch.manual_seed(0)
    cfg = XGLMConfig(vocab_size=VOCAB, d_model=32, ffn_dim=64, num_layers=2, attention_heads=4,
                     max_position_embeddings=positions, pad_token_id=1, bos_token_id=0,
                     eos_token_id=2)
    return randomised(xglm.XGLMForCausalLM(cfg))


def tiny_mpt(heads: int = 4, clip: float | None = 0.5):
    from transformers import MptConfig

    torch.manual_seed(0)
    cfg = MptConfig(vocab_size=VOCAB, d_model=8 * heads, n_heads=heads, n_layers=2,
                    max_seq_len=64, attn_config={"clip_qkv": clip})
    return randomised(mpt.MptForCausalLM(cfg))


def tiny_gpt():
    from transformers import OpenAIGPTConfig

    torch.manual_seed(0)
    cfg = OpenAIGPTConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128)
    return randomised(gpt.OpenAIGPTLMHeadModel(cfg))


def tiny_neox_ja():
    from transformers import GPTNeoXJapaneseConfig

    torch.manual_seed(0)
    cfg = GPTNeoXJapaneseConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=4, intermediate_multiple_size=2,
                                max_position_embeddings=128, rope_parameters={
                                    "rope_type": "default", "rope_theta": 10000.0,
                                    "partial_rotary_factor": 0.5})
    return randomised(neox_ja.GPTNeoXJapaneseForCausalLM(cfg))


def tiny_gptj(rotary_dim: int = 4):
    from transformers import GPTJConfig

    torch.manual_seed(0)
    cfg = GPTJConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                     rotary_dim=rotary_dim, n_inner=64)
    return randomised(gptj.GPTJForCausalLM(cfg))


def tiny_codegen(rotary_dim: int = 4):
    from transformers import CodeGenConfig

    torch.manual_seed(0)
    cfg = CodeGenConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                        rotary_dim=rotary_dim, n_inner=64)
    return randomised(codegen.CodeGenForCausalLM(cfg))


def _rounds(model, **kwargs) -> float:
    return ragged_rounds_error(model, dspark_compile(model), [1, 0, 2], [7, 4, 9], VOCAB,
                               seed=5, **kwargs)


def test_gpt_neo_global_and_local_layers_equal_hf():
    model = tiny_neo(window=3)
    verifier = dspark_compile(model)
    assert [s.window for s in verifier.adapter.specs] == [0, 3]
    err = ragged_rounds_error(model, verifier, [1, 0, 2], [7, 4, 9], VOCAB, seed=5)
    assert err < TOL, f"max |ragged - HF| = {err}"


def test_xglm_equals_hf_past_its_first_position_table():
    """Positions run to about 40 over the rounds, where HF's table starts at 8 + 2 rows."""
    err = _rounds(tiny_xglm(positions=8), max_len=8)
    assert err < TOL, f"max |ragged - HF| = {err}"


@pytest.mark.parametrize("heads", [4, 6])
def test_mpt_alibi_equals_hf(heads):
    model = tiny_mpt(heads)
    verifier = dspark_compile(model)
    assert all(s.alibi for s in verifier.adapter.specs)
    err = ragged_rounds_error(model, verifier, [1, 0, 2], [7, 4, 9], VOCAB, seed=5)
    assert err < TOL, f"max |ragged - HF| = {err}"


def test_gpt_equals_hf():
    err = _rounds(tiny_gpt())
    assert err < TOL, f"max |ragged - HF| = {err}"


def test_gpt_neox_japanese_with_partial_rotary_equals_hf():
    err = _rounds(tiny_neox_ja())
    assert err < TOL, f"max |ragged - HF| = {err}"


@pytest.mark.parametrize("build,head", [(tiny_gptj, 8), (tiny_codegen, 16)])
@pytest.mark.parametrize("whole", [False, True])
def test_gptj_and_codegen_with_partial_and_whole_rotary_equal_hf(build, head, whole):
    """Whichever form this transformers writes them in (inline: the hook's forward)."""
    assert _rounds(build(head if whole else 4)) <= TOL


@pytest.mark.skipif(not INLINE_SINUSOID, reason="GPT-J calls the attention interface here")
def test_the_sinusoid_hooks_rotary_is_needed(monkeypatch):
    """Rows of the table at position 0 for every token (no rotation) are caught."""
    from dspark_compile.frontend import inline

    real = inline._sinusoid_rotary_forward

    def unrotated(self, *args, position_ids=None, **kwargs):
        return real(self, *args, position_ids=position_ids * 0, **kwargs)
    monkeypatch.setattr(inline, "_sinusoid_rotary_forward", unrotated)
    assert _rounds(tiny_gptj()) > 1e-2


@pytest.mark.skipif(not INLINE_SINUSOID, reason="GPT-J calls the attention interface here")
@pytest.mark.parametrize("key,build,where", [
    (("GPTJAttention", "_split_heads"), tiny_gptj, "transformer.h.0.attn"),
    (("modeling_codegen", "rotate_every_two"), tiny_codegen, "transformer.h.0.attn"),
])
def test_a_changed_sinusoid_source_is_refused(monkeypatch, key, build, where):
    from dspark_compile.frontend import inline

    monkeypatch.setitem(inline.KNOWN_SOURCES, key, frozenset())
    with pytest.raises(NotImplementedError,
                       match=rf"'{where}': .*refused rather than verified wrong"):
        dspark_compile(build())


def test_a_dropped_rotary_is_caught(monkeypatch):
    """GPT-NeoX-Japanese's layers rotate their heads' first half; a capture that did not."""
    from dspark_compile.frontend import inline

    real = inline._neox_japanese_forward

    def unrotated(self, *args, position_embeddings=None, **kwargs):
        cos, sin = position_embeddings
        return real(self, *args, position_embeddings=(torch.ones_like(cos),
                                                      torch.zeros_like(sin)), **kwargs)

    monkeypatch.setattr(inline, "_neox_japanese_forward", unrotated)
    assert _rounds(tiny_neox_ja()) > 1e-2


def test_an_unscaled_gpt_is_caught(monkeypatch):
    """GPT's layers scale their scores (``scale=True``); a capture that read them unscaled."""
    from dspark_compile.frontend import inline

    model = tiny_gpt()
    assert all(block.attn.scale for block in model.transformer.h)

    real = inline._openai_forward

    def unscaled(self, *args, **kwargs):
        self.scale = False
        try:
            return real(self, *args, **kwargs)
        finally:
            self.scale = True

    monkeypatch.setattr(inline, "_openai_forward", unscaled)
    assert _rounds(model) > 1e-2


def test_a_dropped_window_is_caught(monkeypatch):
    from dspark_compile.frontend import inline

    monkeypatch.setattr(inline, "_local_window", lambda m: 0)
    assert _rounds(tiny_neo(window=2)) > 1e-2


def test_shifted_positions_are_caught(monkeypatch):
    from dspark_compile.frontend import inline

    real = inline._xglm_positions

    def shifted(self, position_ids, dtype):
        return real(self, position_ids + 1, dtype)

    monkeypatch.setattr(inline, "_xglm_positions", shifted)
    assert _rounds(tiny_xglm()) > 1e-2


def test_dropped_slopes_are_caught(monkeypatch):
    from dspark_compile.frontend import inline

    real = inline.AlibiSlopes
    monkeypatch.setattr(inline, "AlibiSlopes", lambda s: real(s * 0))
    assert _rounds(tiny_mpt()) > 1e-2


@pytest.mark.parametrize("key,build,where", [
    (("GPTNeoSelfAttention", "_attn"), tiny_neo, "transformer.h.0.attn.attention"),
    (("XGLMSinusoidalPositionalEmbedding", "get_embedding"), tiny_xglm,
     "model.embed_positions"),
    (("MptModel", "forward"), tiny_mpt, "transformer"),
    (("Attention", "split_heads"), tiny_gpt, "transformer.h.0.attn"),
    (("GPTNeoXJapaneseAttention", "_attn"), tiny_neox_ja, "gpt_neox_japanese.layers.0.attention"),
])
def test_changed_source_is_refused(monkeypatch, key, build, where):
    from dspark_compile.frontend import inline

    monkeypatch.setitem(inline.KNOWN_SOURCES, key, frozenset())
    with pytest.raises(NotImplementedError,
                       match=rf"'{where}': .*refused rather than verified wrong"):
        dspark_compile(build())


def test_a_causal_buffer_that_is_not_the_triangle_is_refused():
    model = tiny_gpt()
    with torch.no_grad():
        model.transformer.h[1].attn.bias[0, 0, 3, 5] = 1.0
    with pytest.raises(NotImplementedError, match=r"Attention 'transformer.h.1.attn'.*refused"):
        dspark_compile(model)


def test_a_band_that_is_not_the_window_is_refused():
    model = tiny_neo(window=3)
    with torch.no_grad():
        model.transformer.h[1].attn.attention.bias[0, 0, 10, 2] = True
    with pytest.raises(NotImplementedError, match=r"GPTNeoSelfAttention "
                       r"'transformer.h.1.attn.attention'.*refused"):
        dspark_compile(model)


def test_only_the_bool_cast_of_mpts_mask_is_understood():
    from dspark_compile.frontend.inline import _BoolCast
    from dspark_compile.frontend.masks import WindowMask

    proof = WindowMask(0)
    assert _BoolCast(proof).to(torch.bool) is proof
    for args in ((torch.float32,), ("cpu",)):
        with pytest.raises(NotImplementedError, match="only .to\\(torch.bool\\) is understood"):
            _BoolCast(proof).to(*args)


@pytest.mark.gpu
@pytest.mark.parametrize("build", [tiny_neo, tiny_xglm, tiny_gpt, tiny_neox_ja,
                                   lambda: tiny_mpt(6), tiny_gptj, tiny_codegen])
def test_float32_on_gpu_through_triton_matches_hf(build):
    """The window, the positions and the slopes through the Triton kernels, on the GPU."""
    model = build()
    try:
        with torch.no_grad():
            model(torch.arange(4)[None])
    except RuntimeError as err:  # transformers 5.17's GPT-NeoX-Japanese: rotary of the full
        pytest.skip(f"HF's own forward fails here: {err}")  # head under a partial factor
    err = triton_rounds_error(model, [1, 0, 2], [7, 4, 9], VOCAB, seed=5)
    assert err < 2e-3, err
