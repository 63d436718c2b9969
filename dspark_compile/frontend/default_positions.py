"""Are the positions the capture passes the model's own?

The capture calls a Hugging Face model with ``position_ids`` set to each token's place in its
sequence (``cache length + i``), because a forward without a cache cannot know the cache's
length. That is the model's own computation only where its forward, given no ``position_ids``,
would use the same numbers. Most decoders do (``arange(past, past + T)``). Some do not: the
RoBERTa family counts positions from the token ids (``padding_idx + 1 + cumsum(ids != pad)``),
so passing ``0, 1, 2, ...`` runs a different model, which verifies every draft wrong.

:func:`check_default_positions` runs the model on one short real sequence with and without
``position_ids`` (the capture's own call otherwise), and refuses the model by name where the
logits differ by more than float noise (a second run with the positions measures the model's
own run-to-run noise). The sequence holds the config's special token ids (a pad id among them), so a
default that counts or skips particular ids is seen. Weights that are not materialised (the meta
device) cannot run: the check is skipped and says so in one log line.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

__all__ = ["PositionsNotOwnError", "check_default_positions"]

log = logging.getLogger("dspark_compile")

_LENGTH = 12
"""Tokens of the probe sequence."""

_TOLERANCE = 1e-5
"""Largest difference allowed, times max(1, the largest |logit|): both forwards run the same
kernels on the same numbers where the positions agree."""


_NOISE_TIMES = 8
"""Or this many times the difference between two forwards with the same positions, where the
model's kernels are not deterministic (atomics summing a mixture of experts' rows in bfloat16 on
a GPU): a position default that differs moves the logits far more than summation order."""


class PositionsNotOwnError(NotImplementedError):
    """The model's own positions (without ``position_ids``) are not ``cache length + i``."""


def _special_ids(config, vocab: int) -> list[int]:
    """The config's token ids (pad, bos, eos, ...) within the vocabulary, in a fixed order."""
    ids: set[int] = set()
    configs = [config] + [getattr(config, name) for name in ("text_config", "decoder")
                          if hasattr(config, name) and getattr(config, name) is not None]
    for c in configs:
        for key, value in vars(c).items():
            if not key.endswith("token_id"):
                continue
            for x in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(x, int) and not isinstance(x, bool) and 0 <= x < vocab:
                    ids.add(x)
    return sorted(ids)


def _probe_ids(model: nn.Module, device: torch.device) -> torch.Tensor:
    """``[1, _LENGTH]``: ordinary ids with the special ids (and 0 and 1, the usual pad ids)
    placed inside the sequence, not only at its start."""
    vocab = model.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(2, max(vocab, 3), (_LENGTH,), generator=generator)
    special = ([0, 1] if vocab > 1 else [0]) + _special_ids(model.config, vocab)
    for j, x in enumerate(dict.fromkeys(special)):
        place = 2 + 3 * j
        if place >= _LENGTH:
            break
        ids[place] = x
    return ids[None].to(device)


def check_default_positions(model: nn.Module, forward, mrope_sections: int | None) -> None:
    """Refuse ``model`` where its forward without ``position_ids`` differs from its forward
    with ``position_ids = 0, 1, ..., T-1`` (``forward(ids, positions_or_None) -> logits``, the
    capture's call on the real model). ``mrope_sections``: positions ``[sections, 1, T]``."""
    tensors = [*model.parameters(), *model.buffers()]
    if any(t.device.type == "meta" for t in tensors):
        log.warning("%s: its weights are on the meta device, so whether its own positions are "
                    "0, 1, 2, ... (the positions the capture passes) was not checked",
                    type(model).__name__)
        return
    device = tensors[0].device if tensors else torch.device("cpu")
    ids = _probe_ids(model, device)
    positions = torch.arange(_LENGTH, device=device)[None]
    if mrope_sections is not None:
        positions = positions[None].expand(mrope_sections, 1, _LENGTH)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            given = forward(ids, positions).float()
            again = forward(ids, positions).float()
            try:
                own = forward(ids, None).float()
            except Exception as err:  # noqa: BLE001 - any failure: the default cannot be run
                log.warning("%s: its forward without position_ids fails (%s: %s), so the "
                            "positions the capture passes (0, 1, 2, ...) are taken as its own",
                            type(model).__name__, type(err).__name__, str(err)[:200])
                return
    finally:
        model.train(was_training)
    diff = (given - own).abs().nan_to_num(nan=float("inf"))
    noise = (given - again).abs().nan_to_num(nan=0.0).amax().item()
    bound = max(_TOLERANCE * max(1.0, own.abs().nan_to_num(nan=0.0).amax().item()),
                _NOISE_TIMES * noise)
    if diff.amax().item() > bound:
        row = int(diff.amax(-1).flatten().argmax())
        raise PositionsNotOwnError(
            f"{type(model).__name__} computes its own positions when given none, and they are "
            f"not 0, 1, 2, ...: over {_LENGTH} tokens its logits without position_ids differ "
            f"from those with position_ids 0..{_LENGTH - 1} by {diff.amax().item():.3g} (first "
            f"at token {row}). dspark_compile passes each token's place in its sequence as its "
            "position, which would run a different model; the model is refused")
