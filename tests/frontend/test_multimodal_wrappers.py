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
