"""BLOOM's attention (ALiBi) captured as ``dspark::ragged_attention(alibi=)``.

``BloomAttention`` does not go through the attention interface: it adds the model's ALiBi
tensor (``slope[h] * kpos``, built from the padding mask's cumulative sum, one row a request)
and the causal mask to its scores itself. While a model is captured, :func:`bloom_hooks`
replaces its forward with :func:`_forward`: the same fused projection and head split, then the
attention function with the heads' slopes (read off the model's own ``build_alibi_tensor`` at
position 1) as :class:`AlibiSlopes`, which the attention function hands to the op. The op adds
``slope[h] * (kpos - qpos)``: per query row a constant away from BLOOM's ``slope[h] * kpos``, so
the same softmax. (BLOOM builds its ALiBi tensor in the model's dtype: in 16 bits it rounds
``slope * kpos`` at long contexts, where the op's float32 distances do not.) Only the exact class
with the sources this was derived from (transformers 5.24 and 5.17 read the same) is taken,
and ``pretraining_tp > 1`` with ``slow_but_exact`` is refused.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from .replaced import PLAIN_FLOATS, known_forward, modeling_instances, swapped_forward
from .scope import HF_ATTENTION_NAME

__all__ = ["AlibiSlopes", "KNOWN_SOURCES", "bloom_hooks"]

KNOWN_SOURCES = {"forward": frozenset({"34225381cf82d048"}),
                 "_reshape": frozenset({"fa38c0d038c189f6"})}
"""sha256 prefixes of ``BloomAttention``'s methods (transformers 5.24 and 5.17 read the same)."""


@dataclass(frozen=True)
class AlibiSlopes:
    """What the replaced forward passes as ``alibi=``: ``slopes [H]`` float32."""

    slopes: torch.Tensor


def _forward(self, hidden_states, residual, alibi, attention_mask, layer_past=None,
             use_cache: bool = False, output_attentions: bool = False, cache=None, **kwargs):
    """``BloomAttention.forward`` through the attention function (module docstring)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if layer_past is not None or cache is not None:
        raise NotImplementedError(f"{type(self).__name__}: called with a cache; the capture "
                                  "runs use_cache=False and owns the KV")
    modeling = sys.modules[type(self).__module__]
    bs, t, _ = hidden_states.shape
    query, key, value = self._reshape(self.query_key_value(hidden_states))
    ones = torch.ones(1, 2, device=hidden_states.device)
    slopes = modeling.build_alibi_tensor(ones, self.num_heads, torch.float32)[:, 0, 1]
    # the capture's attention function itself, by its registered name: BLOOM cannot choose an
    # implementation, so its config names "sdpa", whose HF wrapper would drop alibi=
    attention = ALL_ATTENTION_FUNCTIONS[HF_ATTENTION_NAME]
    out, _ = attention(self, query, key, value, attention_mask, scaling=self.inv_norm_factor,
                       alibi=AlibiSlopes(slopes))
    output = self.dense(out.reshape(bs, t, -1))
    return modeling.dropout_add(output, residual, self.hidden_dropout, self.training), None


@contextlib.contextmanager
def bloom_hooks(model: nn.Module, names: dict[int, str]) -> Iterator[None]:
    """Run ``model``'s BLOOM attention through the attention function for the capture; restored
    after. A model without it is left untouched."""
    classes, found = modeling_instances(model, "transformers.models.bloom.modeling_bloom",
                                        ("BloomAttention",))
    if not found:
        yield
        return
    BloomAttention, = classes
    for m in found:
        known = all(known_forward(m, BloomAttention, keys, method)
                    for method, keys in KNOWN_SOURCES.items()) and \
            not (m.pretraining_tp > 1 and m.slow_but_exact) and m.beta == 1.0 and \
            {p.dtype for p in m.parameters()} <= PLAIN_FLOATS
        if not known:
            raise NotImplementedError(
                f"{type(m).__name__} {names.get(id(m), '?')!r}: BLOOM's attention is captured "
                "from its own forward (transformers 5.24, 5.17) with beta 1, no slow tensor-"
                "parallel path and plain float weights only, and this one reads otherwise; the "
                "model is refused rather than verified wrong")
    with swapped_forward(BloomAttention, _forward):
        yield
