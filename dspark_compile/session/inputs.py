"""What the tensors of a verify call must be: packed token ids, and mRoPE models' vision and
DeepStack rows. Each refusal is a ``ValueError`` naming the argument, what it is and the rule."""

from __future__ import annotations

import torch

from ..layout import VerifyLayout

__all__ = ["check_input_ids", "check_mrope_inputs"]


def check_input_ids(input_ids, device: torch.device) -> None:
    """``input_ids``: an int64 tensor ``[N]`` on the model's device."""
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"input_ids is a {type(input_ids).__name__}; it must be a tensor")
    if input_ids.dtype != torch.int64 or input_ids.dim() != 1:
        raise ValueError(
            f"input_ids has dtype {input_ids.dtype} and shape {tuple(input_ids.shape)}; it "
            "must be int64 [N] (all requests' tokens packed)")
    if input_ids.device != device and not (
            input_ids.device.type == device.type and device.index is None):
        raise ValueError(f"input_ids is on {input_ids.device} but the model is on {device}")


def check_mrope_inputs(spec, model_name: str, dtype: torch.dtype, layout: VerifyLayout,
                       vision_embeds, num_tokens: int, deepstack_embeds=None) -> None:
    """mRoPE inputs only for mRoPE models (``spec``: the adapter's mRoPE spec, or None), in the
    shape the graph takes."""
    if spec is None:
        given = [name for name, v in (("vision_embeds", vision_embeds),
                                      ("deepstack_embeds", deepstack_embeds),
                                      ("layout.mrope_positions", layout.mrope_positions),
                                      ("layout.mrope_deltas", layout.mrope_deltas))
                 if v is not None]
        if given:
            raise ValueError(
                f"{given[0]} was given, but {model_name} has text rotary positions (context + "
                "j); mRoPE inputs apply to Qwen2-VL, Qwen2.5-VL and Qwen3-VL models only")
        return
    if vision_embeds is not None and (
            not isinstance(vision_embeds, torch.Tensor) or
            tuple(vision_embeds.shape) != (num_tokens, spec.hidden_size) or
            vision_embeds.dtype != dtype):
        what = (f"{vision_embeds.dtype} {tuple(vision_embeds.shape)}"
                if isinstance(vision_embeds, torch.Tensor) else type(vision_embeds).__name__)
        raise ValueError(
            f"vision_embeds is {what}; it must be {dtype} [{num_tokens}, {spec.hidden_size}] "
            "(one row per packed token, zeros at text rows)")
    if deepstack_embeds is None:
        return
    if not spec.deepstack_layers:
        raise ValueError(
            f"deepstack_embeds was given, but {model_name} has no DeepStack layers "
            "(vision_config.deepstack_visual_indexes is empty)")
    want = (spec.deepstack_layers, num_tokens, spec.hidden_size)
    if not isinstance(deepstack_embeds, torch.Tensor) or \
            tuple(deepstack_embeds.shape) != want or deepstack_embeds.dtype != dtype:
        what = (f"{deepstack_embeds.dtype} {tuple(deepstack_embeds.shape)}"
                if isinstance(deepstack_embeds, torch.Tensor)
                else type(deepstack_embeds).__name__)
        raise ValueError(
            f"deepstack_embeds is {what}; it must be {dtype} {list(want)} (one row per "
            "DeepStack layer and packed token, zeros at text rows)")
