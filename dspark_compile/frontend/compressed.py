"""DeepSeek-V4's compressed-attention layers (HCA and CSA) routed to the ``dspark::`` compressed
ops while a model is captured.

An HCA / CSA attention layer calls its compressor before its attention function::

    compressed_kv, block_bias = self.compressor(hidden_states, q_residual, position_ids,
                                                cache, layer_idx)
    kv = torch.cat([kv, compressed_kv], dim=2)          # window keys, then entries

and the compressor keeps state between calls (its cache layer). For the duration of a capture
each compressor module recognised by exact class (transformers' ``DeepseekV4HCACompressor`` /
``DeepseekV4CSACompressor`` with the class's own forward, whose source is the one this code was
derived from) runs :func:`_hca_forward` / :func:`_csa_forward` instead:

* the token-wise parts stay graph code: the projections ``kv_proj`` / ``gate_proj`` (and the
  indexer's, its query ``q_b_proj`` with its rotary and its ``weights_proj``);
* the state goes through the capture scope: ``dspark::dense_compress`` writes the raw rows and
  the entries of the windows the step closes (``ops/compressed.py``), a CSA layer's indexer
  picks its entries with ``dspark::dense_index_topk``;
* it returns a zero-length ``compressed_kv [bs, 1, 0, D]`` and ``block_bias=None``, so HF's
  ``torch.cat`` and mask code stay shape-neutral (``capture.py`` drops the empty cat), and
  records on the scope what the layer's next attention call adds: the entry pool, the rate and
  the picks. That call emits ``dspark::dense_compressed_attention``.

Anything else is refused naming the module: a compressor class of another model or a subclass,
a forward replaced on the instance or a forward whose source differs, a call with a cache or
unexpected arguments, a rotary whose frequencies change with the sequence (dynamic rope).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import torch
from torch import nn

from ..ops import compressed as _compressed_ops  # noqa: F401  (registers the ops)
from ..specs import CompressSpec
from .replaced import bind_call, source_key
from .rotary import FIXED_ROPE_TYPES
from .scope import active_scope

__all__ = ["compressor_hooks", "MODELING", "KNOWN_SOURCES"]

MODELING = "transformers.models.deepseek_v4.modeling_deepseek_v4"
"""The modeling module whose compressor classes are understood."""

KNOWN_SOURCES = {
    "DeepseekV4HCACompressor": {"3fb94114cb4ed493", "a2fd6956cd44f4f4"},
    "DeepseekV4CSACompressor": {"3644b0ea966e20d2", "5c2036e69d024e73"},
    "DeepseekV4Indexer": {"428c5223ef907ac9", "23401818a3b328cb"},
    "DeepseekV4IndexerScorer": {"7e1489dad5000d02"},
}
"""Class -> sha256 prefixes of the forward sources the replacements were derived from
(transformers 5.24, and 5.17, whose forwards differ only in naming the cache argument
``past_key_values``). A class whose forward reads otherwise is refused, not guessed at."""

_STATIC_ROPE = FIXED_ROPE_TYPES
"""Rotary types whose frequencies are fixed at init (no ``dynamic_rope_update``)."""


def _refuse(where: str, what: str) -> NotImplementedError:
    return NotImplementedError(
        f"{where}: {what}; dspark_compile captures transformers' DeepSeek-V4 compressors "
        "(DeepseekV4HCACompressor, DeepseekV4CSACompressor with its DeepseekV4Indexer) with "
        "their own forward only, so the model is refused rather than verified wrong")


def _check_class(module: nn.Module, where: str, modeling) -> None:
    cls = type(module)
    name = cls.__name__
    if getattr(modeling, name, None) is not cls or name not in KNOWN_SOURCES:
        raise _refuse(where, f"{cls.__module__}.{name} is not one of the known classes")
    if "forward" in module.__dict__:
        raise _refuse(where, "its forward is replaced on the instance")
    key = source_key(cls)
    if key not in KNOWN_SOURCES[name]:
        raise _refuse(where, f"{name}.forward's source (sha256 {key}) is not the one the "
                      "compressed ops were derived from (transformers 5.24)")


def _rope(rotary: nn.Module, where: str) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)`` of a compressor's ``"compress"`` rotary."""
    kind = getattr(rotary, "rope_type", {}).get("compress")
    if kind not in _STATIC_ROPE:
        raise _refuse(where, f"its compress rotary is of type {kind!r}, whose frequencies are "
                      f"not fixed (known: {sorted(_STATIC_ROPE)})")
    return rotary.compress_inv_freq, float(rotary.compress_attention_scaling)


def _arguments(where: str, args: tuple, kwargs: dict):
    given = bind_call(("hidden_states", "q_residual", "position_ids", "cache", "layer_idx"), 3,
                      args, kwargs, lambda what: _refuse(where, what), "the compressor state")
    return given["hidden_states"], given["q_residual"], given["position_ids"]


def _compress(module: nn.Module, hidden: torch.Tensor, where: str, overlap: bool):
    """One compressor's token-wise projections (graph code) and what its ``dense_compress``
    takes besides: ``(kv, gate, inv_freq, rope_scale, rate, head_dim)``."""
    scope = active_scope()
    if scope is None:
        raise RuntimeError(f"{where}'s forward was replaced by dspark_compile and runs only "
                           "inside a capture")
    kv = module.kv_proj(hidden)
    gate = module.gate_proj(hidden)
    inv_freq, rope_scale = _rope(module.rotary_emb, where)
    rate, dim = int(module.compress_rate), int(module.head_dim)
    if tuple(module.position_bias.shape) != (rate, (2 if overlap else 1) * dim):
        raise _refuse(where, f"its position_bias is {tuple(module.position_bias.shape)}")
    return kv, gate, inv_freq, rope_scale, rate, dim


def _emit(scope, pools: list, kv, gate, module, inv_freq, rope_scale, rate, overlap):
    """``dense_compress`` over the layer's raw and entry pools; ``(entry pool, its rows)``."""
    kv_pool, gate_pool, entry_pool = pools
    fresh = torch.ops.dspark.dense_compress(
        kv, gate, kv_pool, gate_pool, entry_pool, scope.block_table, scope.context_lens,
        module.position_bias, module.kv_norm.weight, inv_freq, rate, overlap,
        float(module.kv_norm.variance_epsilon), rope_scale)
    return entry_pool, fresh


def _hca_forward(module: nn.Module, where: str, *args, **kwargs):
    hidden, _, _ = _arguments(where, args, kwargs)
    kv, gate, inv_freq, rope_scale, rate, dim = _compress(module, hidden, where, False)
    scope = active_scope()
    if scope.discovered is not None:
        scope.expect_compressed(module, CompressSpec(rate, dim))
    else:
        pools = scope.compress_pools_of(scope.attention_calls)
        entries, fresh = _emit(scope, pools[:3], kv, gate, module, inv_freq, rope_scale,
                               rate, False)
        scope.expect_compressed(module, (entries, fresh, rate, None))
    return hidden.new_zeros(hidden.shape[0], 1, 0, dim), None


def _csa_forward(module: nn.Module, where: str, modeling, *args, **kwargs):
    hidden, q_residual, position_ids = _arguments(where, args, kwargs)
    indexer = module.indexer
    iwhere = f"{where}.indexer"
    _check_class(indexer, iwhere, modeling)
    _check_class(indexer.scorer, f"{iwhere}.scorer", modeling)
    if int(indexer.compress_rate) != int(module.compress_rate):
        raise _refuse(where, f"its indexer compresses every {indexer.compress_rate} tokens but "
                      f"the compressor every {module.compress_rate}")
    kv, gate, inv_freq, rope_scale, rate, dim = _compress(module, hidden, where, True)
    ikv, igate, iinv, iscale, _, idim = _compress(indexer, hidden, iwhere, True)
    # the indexer's query and weights: token-wise graph code, as the indexer computes them
    batch, seq_len = hidden.shape[:2]
    cos_q, sin_q = indexer.rotary_emb(hidden, position_ids=position_ids,
                                      layer_type=indexer.rope_layer_type)
    q = indexer.q_b_proj(q_residual).view(batch, seq_len, -1, idim).transpose(1, 2)
    q = modeling.apply_rotary_pos_emb(q, cos_q, sin_q).transpose(1, 2)  # [bs, T, Hi, Di]
    weights = indexer.scorer.weights_proj(hidden).float() * indexer.scorer.weights_scaling
    topk = int(indexer.index_topk)
    scope = active_scope()
    if scope.discovered is not None:
        scope.expect_compressed(module, CompressSpec(rate, dim, True, topk,
                                                     int(indexer.num_heads), idim))
    else:
        pools = scope.compress_pools_of(scope.attention_calls)
        entries, fresh = _emit(scope, pools[:3], kv, gate, module, inv_freq, rope_scale,
                               rate, True)
        ientries, ifresh = _emit(scope, pools[3:6], ikv, igate, indexer, iinv, iscale, rate,
                                 True)
        picks = torch.ops.dspark.dense_index_topk(
            q, weights, ientries, ifresh, scope.block_table, scope.context_lens, rate, topk,
            float(indexer.scorer.softmax_scale))
        scope.expect_compressed(module, (entries, fresh, rate, picks))
    return hidden.new_zeros(hidden.shape[0], 1, 0, dim), None


def _is_compressor_like(module: nn.Module, modeling) -> bool:
    """A module that may run compress code: any class named like a compressor, or a subclass
    of the known ones."""
    known = tuple(getattr(modeling, n) for n in KNOWN_SOURCES if hasattr(modeling, n)) \
        if modeling is not None else ()
    return "Compressor" in type(module).__name__ or isinstance(module, known)


@contextlib.contextmanager
def compressor_hooks(model: nn.Module, names: dict[int, str]) -> Iterator[None]:
    """Replace every DeepSeek-V4 compressor's forward on its instance for the duration of a
    capture (module docstring); refuse any other compressor-like module. A model without one
    is left untouched."""
    modeling = sys.modules.get(MODELING)
    found = [m for m in model.modules() if _is_compressor_like(m, modeling)]
    if not found:
        yield
        return
    patched = []
    try:
        for m in found:
            where = f"{type(m).__name__} {names.get(id(m), '?')!r}"
            if modeling is None:
                raise _refuse(where, "transformers' DeepSeek-V4 modeling module is not loaded")
            if type(m).__name__ in ("DeepseekV4Indexer", "DeepseekV4IndexerScorer"):
                continue  # run by their CSA compressor's replacement
            _check_class(m, where, modeling)
            if type(m) is modeling.DeepseekV4HCACompressor:
                fn = (lambda mod, w: lambda *a, **k: _hca_forward(mod, w, *a, **k))(m, where)
            else:
                fn = (lambda mod, w: lambda *a, **k: _csa_forward(mod, w, modeling, *a, **k))(
                    m, where)
            m.forward = fn
            patched.append(m)
        yield
    finally:
        for m in patched:
            m.__dict__.pop("forward", None)
