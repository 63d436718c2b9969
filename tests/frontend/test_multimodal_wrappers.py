"""Multimodal language models verified on text (every verify step is text): the zoo takes
every one transformers maps (LLaVA, Mistral 3, Qwen-VL, the speech LMs, ...), and three things
such wrappers do that text models do not are followed rather than crashed on."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from transformers.models.auto import modeling_auto as auto

from dspark_compile.zoo import check, select
from dspark_compile.zoo.check import TOLERANCE, Entry

MULTIMODAL = {**getattr(auto, "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES", {}),
              **getattr(auto, "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", {})}


def _entry(model_type: str) -> Entry:
    if model_type not in MULTIMODAL or not hasattr(T, MULTIMODAL[model_type]):
        pytest.skip(f"this transformers has no {model_type}")
    (entry,) = [e for e in select([model_type]) if e.name == model_type]
    return entry


def _exact(model_type: str):
    result = check(_entry(model_type))
    assert result.status == "exact", (model_type, result.status, result.reason, result.where)
    assert result.max_error <= TOLERANCE
    return result


def test_the_zoo_takes_multimodal_models_by_their_own_class():
    assert _entry("llava").architecture == "LlavaForConditionalGeneration"
    _exact("llava")


def test_a_wrappers_inner_text_model_runs_the_experts_ops():
    """Kimi-K2.5's wrapper class takes no experts implementation; its DeepSeek-V3 text model
    does (transformers' default there, grouped_mm, cannot be traced in float32): the capture
    sets the inner model's, and restores it."""
    from dspark_compile.frontend.experts import _experts_owners, experts_hooks

    entry = _entry("kimi_k25")
    from dspark_compile.zoo.tiny import tiny_config

    cls = getattr(T, entry.architecture)
    model = cls._from_config(tiny_config(entry.model_type, cls).config,
                             dtype=torch.float32).eval()
    inner = model.model.language_model
    assert _experts_owners(model) == [inner]
    before = inner.config._experts_implementation
    with experts_hooks(model):
        assert inner.config._experts_implementation == "dspark"
    assert inner.config._experts_implementation == before
    _exact("kimi_k25")


def test_a_config_naming_no_image_token_verifies_its_text():
    """MiniCPM-V 4.7's config leaves image_token_id None (a checkpoint sets it): nothing is
    merged into the embeddings, and an image prompt is refused by prefill_inputs."""
    from dspark_compile.frontend.multimodal import mrope_spec, prefill_inputs
    from dspark_compile.zoo.tiny import tiny_config

    entry = _entry("minicpmv4_7")
    cls = getattr(T, entry.architecture)
    model = cls._from_config(tiny_config(entry.model_type, cls).config,
                             dtype=torch.float32).eval()
    assert mrope_spec(model).vision_token_ids == ()
    with pytest.raises(ValueError, match="needs both its pixel values and its grid_thw"):
        prefill_inputs(model, torch.arange(4), pixel_values=torch.zeros(4, 8),
                       image_grid_thw=torch.tensor([[1, 2, 2]]))
    _exact("minicpmv4_7")


@pytest.mark.parametrize("model_type", ["qwen3_vl", "glm4v_moe"])
def test_tiny_configs_of_mrope_families_build_and_verify(model_type):
    """Qwen3-VL's tiny config keeps three DeepStack maps over two text layers (HF adds two);
    GLM-4.5V's rotary falls back to full-size mRoPE sections and rotates half its head."""
    _exact(model_type)


def test_a_wrapper_hands_its_mask_proof_to_its_text_model():
    """PaliGemma builds the mask and passes it to its text model, whose own mask creation
    returns an already-built mask as it is: so does the capture with its proof (before, the
    proof was read as a padding mask and the model refused for using its mask outside
    attention). PaliGemma is then refused for what it is, a prefix LM whose attention is not
    causal over the prompt."""
    from transformers import masking_utils

    from dspark_compile.frontend.masks import WindowMask, built_proofs_pass

    config = T.LlamaConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1,
                           vocab_size=16)
    config._attn_implementation = "sdpa"
    proof = WindowMask(8)
    embeds = torch.zeros(1, 5, 32)
    with built_proofs_pass():
        assert masking_utils.create_causal_mask(config=config, inputs_embeds=embeds,
                                                attention_mask=proof, cache=None,
                                                position_ids=torch.arange(5)[None]) is proof
    with pytest.raises(AttributeError):  # transformers' own, outside the capture
        masking_utils.create_causal_mask(config=config, inputs_embeds=embeds,
                                         attention_mask=proof, cache=None,
                                         position_ids=torch.arange(5)[None])
    result = check(_entry("paligemma"))
    assert result.status == "refused" and "is not causal (is_causal=False)" in result.reason


def test_the_lm_heads_row_selection_passed_down_to_attention_is_not_refused():
    """LLaVA-OneVision's wrapper hands ``logits_to_keep`` on down with its keywords to the
    attention function, which ignores it (it selects the LM head's rows)."""
    from dspark_compile.frontend.adapters import _check_attention_arguments

    assert _check_attention_arguments("Attn 'layer' (attention call 0)", 0.0,
                                      {"logits_to_keep": 0}, 0, torch.zeros(1, 4, 2, 8)) == \
        (0.0, None)
    _exact("llava_onevision")


def test_a_multimodal_model_without_media_rows_says_so_once(caplog):
    """LLaVA takes no image rows in the verify: the build says so in one log line naming its
    image token, and a drafted image token is verified as HF's forward embeds it given no
    pixels. A Qwen-VL model (vision rows) and a text model say nothing."""
    import logging

    from dspark_compile import VerifyLayout, dspark_compile
    from dspark_compile.frontend.multimodal import media_notice
    from dspark_compile.zoo.tiny import tiny_config
    from helpers import tiny_llama, tiny_vl

    entry = _entry("llava")
    cls = getattr(T, entry.architecture)
    config = tiny_config(entry.model_type, cls).config
    config.image_token_id = 120  # inside the tiny vocabulary (the default's is past it)
    torch.manual_seed(0)
    model = cls._from_config(config, dtype=torch.float32).eval()
    with caplog.at_level(logging.WARNING, logger="dspark_compile"):
        verifier = dspark_compile(model)
    lines = [r.getMessage() for r in caplog.records if "verified on text" in r.getMessage()]
    image = model.config.image_token_id
    assert len(lines) == 1 and f"={image}" in lines[0], lines
    seq = torch.tensor([3, 9, image, 4, image, 7])
    state = verifier.new_state(max_requests=1, max_context=16)
    got = verifier(seq, VerifyLayout.pack([6], [0], [0]), state)
    with torch.no_grad():
        want = model(input_ids=seq[None]).logits[0]
    assert (got - want).abs().max().item() < 1e-4
    assert media_notice(tiny_vl("qwen2_vl")) is not None  # (dspark_compile asks only without mRoPE)
    assert media_notice(tiny_llama(seed=0, layers=1)) is None
