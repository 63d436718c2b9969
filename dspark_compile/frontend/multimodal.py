"""Hugging Face vision-language models with multimodal rotary positions (mRoPE).

Qwen2-VL, Qwen2.5-VL and Qwen3-VL rotate every token by three position ids (temporal, height,
width): their text model takes ``position_ids [3, bs, T]``. Text tokens carry the same id in
all three rows; the tokens of an image carry its grid coordinates, so after an image a
request's positions run ``delta`` behind (or ahead of) its length, and every later token sits
at ``context + j + delta`` in all three rows (HF's ``rope_deltas``).

The capture runs the model on ``input_ids`` with explicit ``position_ids`` and no pixels. The
vision tower's output enters through one more token-major input, ``vision_embeds [bs, T,
hidden]``: a forward hook on the input embedding replaces the rows whose id is the image or
video token and whose vision row is not all zeros, as HF's ``masked_scatter`` does::

    is_vision = ((ids == image_token_id) | (ids == video_token_id)) & (vision_embeds != 0).any(-1)
    embeds = where(is_vision, vision_embeds, embeds)

A zero row keeps the token's own embedding: an image token in a verify step (a draft may
propose any id) is embedded as HF's forward embeds it when given no pixels.

That is a pointwise select, so ``token_axis`` proves it token-wise like the rest. Qwen3-VL's
DeepStack feature maps enter the same way: ``deepstack_embeds [L, bs, T, hidden]`` (zeros at text
rows), and a forward hook on each of the first ``L`` text decoder layers adds row ``l`` to its
output, which is what HF's ``_deepstack_process`` does at the image rows and, adding zeros,
leaves the other rows as they are. The vision tower itself runs outside the verify forward
(:func:`prefill_inputs`, once per image prompt).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from .scope import active_scope

__all__ = ["MRopeSpec", "media_notice", "mrope_spec", "vision_hook", "prefill_inputs",
           "PrefillInputs"]

log = logging.getLogger("dspark_compile")


@dataclass(frozen=True)
class MRopeSpec:
    """What the capture and the verifier need to know about an mRoPE model."""

    sections: int
    """Rows of the position ids the text model's rotary takes (3: temporal, height, width)."""
    hidden_size: int
    """Width of a vision embedding row (the text model's hidden size)."""
    vision_token_ids: tuple[int, ...]
    """Token ids whose embedding the vision tower's output replaces (image, video); empty
    where the config names none (a checkpoint's config sets them): no row is replaced, and
    ``prefill_inputs`` refuses an image."""
    deepstack_layers: int = 0
    """Text decoder layers that add a DeepStack feature map (Qwen3-VL's
    ``vision_config.deepstack_visual_indexes``, at most one a text layer; 0: none)."""


def mrope_spec(model: nn.Module) -> MRopeSpec | None:
    """The mRoPE spec of an HF vision-language model, or None for a text-only model.

    Recognised by ``model.model.get_rope_index`` (HF's own mRoPE position computation) and a
    config with ``image_token_id``.
    """
    inner = getattr(model, "model", None)
    config = model.config
    if inner is None or not hasattr(inner, "get_rope_index") or \
            not hasattr(config, "image_token_id"):
        return None
    text = config.get_text_config()
    ids = tuple(i for i in (config.image_token_id, getattr(config, "video_token_id", None))
                if i is not None)
    vision = getattr(config, "vision_config", None)
    # HF adds map i after text layer i for the maps there are layers for; the rest never reach
    # the text model
    deepstack = min(len(getattr(vision, "deepstack_visual_indexes", None) or ()),
                    getattr(text, "num_hidden_layers", None) or 0)
    return MRopeSpec(sections=3, hidden_size=text.hidden_size, vision_token_ids=ids,
                     deepstack_layers=deepstack)


def media_notice(model: nn.Module) -> str | None:
    """For a multimodal model outside the mRoPE families (LLaVA, Mistral 3, the speech LMs,
    ...): one log line saying that it is verified on text and takes no media rows, so a
    prompt's image, video or audio tokens are embedded as HF's forward embeds them when given
    no media (the line, or None for any other model)."""
    inner = getattr(model, "model", None)
    if not any(hasattr(m, f"get_{kind}_features") for m in (model, inner)
               for kind in ("image", "video", "audio")):
        return None
    config = model.config
    tokens = sorted(f"{k}={v}" for k, v in vars(config).items()
                    if k.startswith(("image_token", "video_token", "audio_token")) and
                    isinstance(v, int) and not isinstance(v, bool))
    line = (f"{type(model).__name__}: verified on text; the verifier takes no image, video or "
            "audio rows for this model (only the Qwen-VL families take vision rows), so its "
            f"media tokens ({', '.join(tokens) or 'none named in its config'}) are embedded as "
            "HF's forward embeds them given no media, and a prompt with media cannot be "
            "prefilled through it")
    log.warning(line)
    return line


def _merge_vision(spec: MRopeSpec):
    def hook(module, args, out):
        scope = active_scope()
        if scope is None or scope.vision_embeds is None:
            return out
        ids = args[0]
        is_vision = ids == spec.vision_token_ids[0]
        for token in spec.vision_token_ids[1:]:
            is_vision = is_vision | (ids == token)
        # a zero row is no vision row (a text row, or an image token a draft proposed): the
        # token's own embedding, as HF's forward given no pixels
        rows = scope.vision_embeds.to(out.dtype)
        is_vision = is_vision & (rows != 0).any(-1)
        return torch.where(is_vision.unsqueeze(-1), rows, out)
    return hook


def _add_deepstack(index: int):
    def hook(module, args, out):
        scope = active_scope()
        if scope is None or scope.deepstack_embeds is None:
            return out
        if isinstance(out, tuple):  # older decoder layers return (hidden_states, ...)
            return (out[0] + scope.deepstack_embeds[index].to(out[0].dtype), *out[1:])
        return out + scope.deepstack_embeds[index].to(out.dtype)
    return hook


def _text_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(getattr(model, "model", None), "language_model", None), "layers",
                     None)
    if layers is None:
        raise TypeError(f"{type(model).__name__} has DeepStack layers but no "
                        "model.language_model.layers to add them to")
    return layers


@contextlib.contextmanager
def vision_hook(model: nn.Module, spec: MRopeSpec) -> Iterator[None]:
    """For the duration of a capture, merge ``vision_embeds`` into the input embeddings (and
    add ``deepstack_embeds`` to the outputs of the first text decoder layers)."""
    handles = [model.get_input_embeddings().register_forward_hook(_merge_vision(spec))] \
        if spec.vision_token_ids else []  # a config naming no image token: text rows only
    if spec.deepstack_layers:
        layers = _text_layers(model)
        handles += [layers[i].register_forward_hook(_add_deepstack(i))
                    for i in range(spec.deepstack_layers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass(frozen=True)
class PrefillInputs:
    """One request's image prompt, prepared for a packed prefill."""

    positions: torch.Tensor
    """int64 ``[3, L]``: HF's ``get_rope_index`` positions of the prompt."""
    delta: int
    """``max(positions) + 1 - L`` (HF's ``rope_deltas``): later tokens sit at
    ``context + j + delta``."""
    vision_embeds: torch.Tensor
    """``[L, hidden]``: the vision tower's output at image/video rows, zeros elsewhere."""
    deepstack_embeds: torch.Tensor | None = None
    """``[layers, L, hidden]``: the DeepStack feature maps at the image rows, zeros elsewhere
    (Qwen3-VL with ``deepstack_visual_indexes``); None for models without them."""


def prefill_inputs(model: nn.Module, input_ids: torch.Tensor,
                   pixel_values: torch.Tensor | None = None,
                   image_grid_thw: torch.Tensor | None = None,
                   pixel_values_videos: torch.Tensor | None = None,
                   video_grid_thw: torch.Tensor | None = None) -> PrefillInputs:
    """Positions, rope delta and vision rows of one prompt ``input_ids [L]`` with images and/or
    videos (HF's ``pixel_values``/``image_grid_thw``, ``pixel_values_videos``/
    ``video_grid_thw``).

    Runs HF's own ``get_rope_index`` and vision tower (host work, once per prompt); a vision
    tower with DeepStack features (Qwen3-VL's ``deepstack_visual_indexes``) also gives their
    rows, which the verifier adds to the first text decoder layers' outputs.
    """
    spec = mrope_spec(model)
    if spec is None:
        raise TypeError(f"prefill_inputs: {type(model).__name__} has no get_rope_index; it is "
                        "not a Qwen2-VL / Qwen2.5-VL / Qwen3-VL model")
    if input_ids.dim() != 1:
        raise ValueError(f"prefill_inputs: input_ids has shape {tuple(input_ids.shape)}; pass "
                         "one request's prompt, int64 [L]")
    media = [(kind, token, pixels, grid) for kind, token, pixels, grid in (
        ("image", model.config.image_token_id, pixel_values, image_grid_thw),
        ("video", getattr(model.config, "video_token_id", None), pixel_values_videos,
         video_grid_thw)) if pixels is not None or grid is not None]
    for kind, token, pixels, grid in media:
        if pixels is None or grid is None or token is None:
            raise ValueError(f"prefill_inputs: a {kind} needs both its pixel values and its "
                             f"grid_thw (and the model a {kind}_token_id)")
    if not media:
        raise ValueError("prefill_inputs: no image or video given; a text prompt's positions "
                         "are context + j (no prefill_inputs needed)")
    ids = input_ids[None]
    mm_types = torch.zeros_like(ids, dtype=torch.int32)
    for kind, token, _, _ in media:
        mm_types[ids == token] = 1 if kind == "image" else 2
    vision = deepstack = None
    with torch.no_grad():
        positions, deltas = model.model.get_rope_index(
            ids, mm_token_type_ids=mm_types, image_grid_thw=image_grid_thw,
            video_grid_thw=video_grid_thw)
        for kind, token, pixels, grid in media:
            get = model.model.get_image_features if kind == "image" else \
                model.model.get_video_features
            features = get(pixels, grid)
            rows = torch.cat(features.pooler_output, dim=0)
            at = input_ids == token
            if int(at.sum()) != rows.shape[0]:
                raise ValueError(
                    f"prefill_inputs: the prompt has {int(at.sum())} {kind} tokens but the "
                    f"vision tower made {rows.shape[0]} rows for {kind}_grid_thw="
                    f"{grid.tolist()}; each needs t*h*w/merge^2 {kind} tokens")
            if vision is None:
                vision = torch.zeros(input_ids.numel(), spec.hidden_size, dtype=rows.dtype)
            vision[at] = rows
            if spec.deepstack_layers:
                deepstack = _deepstack_rows(features, spec, at, deepstack, rows.dtype)
    return PrefillInputs(positions[:, 0], int(deltas.reshape(-1)[0]), vision, deepstack)


def _deepstack_rows(features, spec: MRopeSpec, at: torch.Tensor, into: torch.Tensor | None,
                    dtype: torch.dtype) -> torch.Tensor:
    """``into`` (zeros ``[layers, L, hidden]`` if None) with the DeepStack maps at rows ``at``."""
    maps = list(getattr(features, "deepstack_features", None) or ())
    if len(maps) < spec.deepstack_layers:
        raise ValueError(
            f"prefill_inputs: the vision tower made {len(maps)} DeepStack feature maps; the "
            f"text model adds {spec.deepstack_layers} (deepstack_visual_indexes, at most one a "
            "text layer)")
    maps = maps[:spec.deepstack_layers]  # those past the text model's layers: HF drops them
    if into is None:
        into = torch.zeros(spec.deepstack_layers, at.numel(), spec.hidden_size, dtype=dtype)
    for i, m in enumerate(maps):  # per layer: one tensor, or one per image / video (HF 5.x)
        m = torch.cat(list(m), dim=0) if isinstance(m, (tuple, list)) else m
        into[i, at] = m.to(dtype)
    return into
