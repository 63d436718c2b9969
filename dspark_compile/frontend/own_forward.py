"""Is the capture's call of a model the model's own forward?

The capture calls a Hugging Face model with ``position_ids`` set to each token's place in its
sequence (``cache length + i``), because a forward without a cache cannot know the cache's
length. That is the model's own computation only where its forward, given no ``position_ids``,
would use the same numbers. Most decoders do (``arange(past, past + T)``). Some do not: the
RoBERTa family counts positions from the token ids (``padding_idx + 1 + cumsum(ids != pad)``),
so passing ``0, 1, 2, ...`` runs a different model, which verifies every draft wrong.

The capture also passes no ``attention_mask``, where ``generate`` passes an all-ones one; a
model that builds another mask (or none) without one would differ the same way.

:func:`check_own_forward` runs the model on one short real sequence as the capture calls it,
without ``position_ids``, and with an all-ones mask, and refuses the model by name where the
logits differ by more than float noise (a second run of the capture's call measures the model's
own run-to-run noise). The sequence holds the config's special token ids (a pad id among them),
so a default that counts or skips particular ids is seen. Weights that are not materialised (the
meta device) cannot run: the check is skipped and says so in one log line.

A verify is the model's decoding only where its own cached decoding is its forward.
:func:`cache_window_limit` reads the cache ``generate`` builds for the model
(``DynamicCache(config=...)``): a layer whose cache keeps only the last ``w`` positions (a
sliding-window layer of its config) while its forward attends further back (Moshi's: its mask is
plain causal, its config's ``sliding_window`` 3000) decodes otherwise than its forward once a
sequence outgrows ``w`` (and by how many tokens each step carries), so contexts are limited to
``w`` tokens, as a learned position table's rows limit them.
"""

from __future__ import annotations

import functools
import logging
import re

import torch
import torch.nn as nn

__all__ = ["TOKEN_ID_KEY", "NotOwnForwardError", "cache_window_limit", "check_cache_mode",
           "check_own_forward", "config_token_ids"]

log = logging.getLogger("dspark_compile")

_LENGTH = 12
"""Tokens of the probe sequence."""

_TOLERANCE = 1e-5
"""Largest difference allowed, times max(1, the largest |logit|), for float32 on the CPU: both
forwards run the same kernels on the same numbers where the calls agree."""

_GPU_TOLERANCE = 2e-3
"""The same for float32 on a GPU, where a mask or none may pick another attention kernel (and
TF32 matmuls move logits ~3e-4)."""

_HALF_TOLERANCE = 5e-2
"""The same in bfloat16 or float16, where another attention kernel rounds every layer
differently. A position default or mask that differs moves the logits by their own size
(RoBERTa's: 0.49 of logits under 3), so the bound still parts the two."""

_NOISE_TIMES = 8
"""Or this many times the difference between two runs of the capture's call, where the
model's kernels are not deterministic (atomics summing a mixture of experts' rows in bfloat16 on
a GPU): a position default that differs moves the logits far more than summation order."""


class NotOwnForwardError(NotImplementedError):
    """The capture's call of a model is not the model's own forward."""


_APPROXIMATE_CACHES = {
    "dory": ("recurrent_kv_cache_mode", "last_loop",
             "its cached decoding keeps the keys of its looped layers' last loop only and lets "
             "each earlier loop read them for past tokens, where its forward reads each loop's "
             "own (recurrent_kv_cache_mode='per_loop' keeps them all)"),
}
"""Model type -> (config field, value, why): configs whose own cache makes decoding differ from
the forward by design."""


def check_cache_mode(model: nn.Module) -> None:
    """Refuse a config whose own cache is an approximation of its forward
    (:data:`_APPROXIMATE_CACHES`): no verify can match both its decoding and its forward."""
    for config in _configs(getattr(model, "config", None)):
        known = _APPROXIMATE_CACHES.get(getattr(config, "model_type", None))
        if known is not None and getattr(config, known[0], None) == known[1]:
            raise NotOwnForwardError(
                f"{type(model).__name__}: {known[0]}={known[1]!r}: {known[2]}. Its cached "
                "decoding is not its forward, so no verify can match both; the model is "
                "refused")


TOKEN_ID_KEY = re.compile(r"token_id$|token_ids$|^(unk|mask|pad|bos|eos)_index$")
"""A config key that names special token ids (``pad_token_id``, ``eos_token_ids``,
``pad_index``, ...)."""


def config_token_ids(d: dict) -> set[int]:
    """Every integer id a config's dict (``config.to_dict()``) names under a
    :data:`TOKEN_ID_KEY` key, its sub-configs (a dict with a ``model_type``: ``text_config``,
    ``decoder``, ...) included."""
    ids: set[int] = set()
    todo = [d]
    while todo:
        d = todo.pop()
        for key, value in d.items():
            if isinstance(value, dict) and "model_type" in value:
                todo.append(value)
            elif TOKEN_ID_KEY.search(key):
                for x in value if isinstance(value, list) else [value]:
                    if isinstance(x, int) and not isinstance(x, bool):
                        ids.add(x)
    return ids


def _probe_ids(model: nn.Module, device: torch.device, id_limit: int | None = None
               ) -> torch.Tensor:
    """``[1, _LENGTH]``: ordinary ids with the config's special ids, then 0 and 1 (the usual pad
    ids), at every other place from the second on (inside the sequence, not only at its
    start); all below ``id_limit`` where a table the ids index has fewer rows than the
    embedding (ids past it are refused before any verify)."""
    vocab = model.get_input_embeddings().num_embeddings
    if id_limit is not None:
        vocab = min(vocab, id_limit)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(2 if vocab > 2 else 0, vocab, (_LENGTH,), generator=generator)
    special = [*sorted(config_token_ids(model.config.to_dict())), 0, 1]
    special = [x for x in dict.fromkeys(special) if 0 <= x < vocab][:_LENGTH // 2]
    ids[1:2 * len(special):2] = torch.tensor(special, dtype=ids.dtype)
    return ids[None].to(device)


def check_own_forward(model: nn.Module, forward, mrope_sections: int | None,
                      id_limit: int | None = None) -> None:
    """Refuse ``model`` where the capture's call of it differs from its own forward on a short
    real sequence: without ``position_ids`` (its own positions), or with an all-ones
    ``attention_mask`` (as ``generate`` calls it). ``forward(call, ids, positions_or_None) ->
    logits`` is the capture's call (``call``: the model, or the model with a mask bound);
    ``mrope_sections``: positions ``[sections, 1, T]``; ``id_limit``: the ids the model can
    take (``position_tables.token_id_limit``), the probe's bound."""
    check_cache_mode(model)
    tensors = [*model.parameters(), *model.buffers()]
    if any(t.device.type == "meta" for t in tensors):
        log.warning("%s: its weights are on the meta device, so whether its own positions are "
                    "0, 1, 2, ... (the positions the capture passes) and an all-ones attention "
                    "mask is no mask was not checked", type(model).__name__)
        return
    device = tensors[0].device if tensors else torch.device("cpu")
    ids = _probe_ids(model, device, id_limit)
    positions = torch.arange(_LENGTH, device=device)[None]
    if mrope_sections is not None:
        positions = positions[None].expand(mrope_sections, 1, _LENGTH)
    masked = functools.partial(model, attention_mask=torch.ones_like(ids))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            given = forward(model, ids, positions).float()
            again = forward(model, ids, positions).float()
            noise = (given - again).abs().nan_to_num(nan=0.0, posinf=0.0).amax().item()
            scale = given.abs().nan_to_num(nan=0.0, posinf=0.0).amax().item()
            bound = max(_tolerance(_model_dtype(model), device) * max(1.0, scale),
                        _NOISE_TIMES * noise)
            _compare(model, given, _run(model, lambda: forward(masked, ids, positions),
                                        "with an all-ones attention_mask", "no mask is"), bound,
                     "with an all-ones attention_mask (as generate calls it) differ from those "
                     "without one", "passes no mask")
            _compare(model, given, _run(model, lambda: forward(model, ids, None),
                                        "without position_ids", "the positions the capture "
                                        "passes (0, 1, 2, ...) are"), bound,
                     f"without position_ids differ from those with position_ids "
                     f"0..{_LENGTH - 1}: it computes its own positions when given none, and "
                     "they are not 0, 1, 2, ...", "passes each token's place in its sequence "
                     "as its position")
    finally:
        model.train(was_training)


def _model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model computes in: its floating parameters' (float32 where it has none)."""
    floats = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return floats[0] if floats else torch.float32


def _tolerance(dtype: torch.dtype, device: torch.device) -> float:
    if dtype in (torch.bfloat16, torch.float16):
        return _HALF_TOLERANCE
    return _TOLERANCE if device.type == "cpu" else _GPU_TOLERANCE


def _run(model: nn.Module, call, how: str, taken: str) -> torch.Tensor | None:
    """The logits of ``call()`` in float32, or None (said in one log line) where the model's
    forward fails called ``how``: then what the capture passes is taken as its own."""
    try:
        return call().float()
    except Exception as err:  # noqa: BLE001 - any failure: that call cannot be compared
        log.warning("%s: its forward %s fails (%s: %s), so %s taken as its own",
                    type(model).__name__, how, type(err).__name__, str(err)[:200], taken)
        return None


def _compare(model: nn.Module, given: torch.Tensor, own: torch.Tensor | None, bound: float,
             what: str, capture: str) -> None:
    if own is None:
        return
    same = (given == own) | (given.isnan() & own.isnan())  # a poisoned row in both, or inf
    diff = torch.where(same, 0.0, (given - own).abs().nan_to_num(nan=float("inf")))
    if diff.amax().item() > bound:
        row = int(diff.amax(-1).flatten().argmax())
        raise NotOwnForwardError(
            f"{type(model).__name__}: over {_LENGTH} tokens its logits {what}, by "
            f"{diff.amax().item():.3g} (the most at token {row}). dspark_compile {capture}, "
            "which would run a different model; the model is refused")


def cache_window_limit(model: nn.Module, specs):
    """The :class:`~dspark_compile.specs.PositionLimit` of ``model``'s own cache: the fewest
    positions the cache ``generate`` builds for it (``DynamicCache(config=...)``) keeps of an
    attention layer whose forward reads further back (``specs``: the capture's attention specs,
    by module name; a layer is found by its module's ``layer_idx``), or None. Up to that many
    tokens a sequence's cached decoding reads every key its forward does; past it, not. Layers
    reading another's keys (``kv_from``), compressed or sparse layers, and layers without a
    ``layer_idx`` are not compared. Where the cache cannot be built for a config that names a
    window, one log line says the check was skipped."""
    from ..specs import PositionLimit

    config = getattr(model, "config", None)
    try:
        from transformers import DynamicCache

        layers = DynamicCache(config=config).layers
    except Exception as err:  # noqa: BLE001 - a model generate builds another cache for
        if any(isinstance(getattr(c, "sliding_window", None), int)
               for c in _configs(config)):
            log.warning("%s: transformers' DynamicCache cannot be built for its config (%s: "
                        "%s), so whether its cache keeps every position its forward reads was "
                        "not checked", type(model).__name__, type(err).__name__, str(err)[:200])
        return None
    limit = None
    for spec in specs:
        if spec.kv_from is not None or spec.compress is not None or spec.sparse:
            continue
        try:
            idx = getattr(model.get_submodule(spec.name), "layer_idx", None)
        except AttributeError:
            continue
        if type(idx) is not int or not 0 <= idx < len(layers):
            continue
        keep = getattr(layers[idx], "sliding_window", None)
        reach = spec.chunk or spec.window
        if type(keep) is int and keep > 0 and (reach == 0 or reach > keep) and \
                (limit is None or keep < limit.positions):
            limit = PositionLimit(keep, f"{idx} ({spec.name!r})", keep, cache=True)
    if limit is not None:
        log.info("%s: its own cache keeps %s; contexts are limited to %d tokens",
                 type(model).__name__, limit.reason(), limit.positions)
    return limit


def _configs(config) -> list:
    """``config`` and its text (decoder) config, where it has one."""
    out = [config]
    try:
        out.append(config.get_text_config(decoder=True))
    except Exception:  # noqa: BLE001 - a config without sub-configs
        pass
    return out
