"""DeepSeek Sparse Attention (DSA) layers routed to the ``dspark::`` sparse ops while a model is
captured: DeepSeek-V3.2 and the models whose attention transformers derives from it.

A DSA attention layer runs its lightning indexer before its attention function::

    topk_indices = self.indexer(hidden_states, q_resid, position_embeddings,
                                attention_mask[:, 0, :, :], position_ids, cache=cache)
    ...                                  # eager / sdpa: fold the picks into the mask
    attention_interface(self, q, k, v, attention_mask, ..., indices=topk_indices)

and the indexer keeps one key per token in its cache. For the duration of a capture each
indexer recognised by exact class and forward source (:data:`KNOWN_INDEXERS`) runs
:func:`_index_forward` instead:

* the token-wise parts stay graph code, as the class computes them: the query ``wq_b`` with its
  rotary, the key ``k_norm(wk(x))`` with its rotary, the head weights ``weights_proj``;
* the key store and the scoring go through ``dspark::dense_sparse_index`` over the layer's key
  pool (``ops/sparse_reference.py``), which returns the picks;
* the picks are recorded on the scope, so the attention function accepts ``indices=`` only
  when it is a tensor an indexer of this capture returned, from a layer whose class and
  forward are known (:data:`KNOWN_ATTENTION`: forwards that hand the picks on or reuse an
  earlier layer's, and whose eager path masks every key not picked). That call emits
  ``dspark::dense_sparse_attention``.

The indexer takes the mask's ``[:, 0, :, :]`` (``[:, 0]``): the capture's mask builder returns
a proof object for masks the model asks to be built (``allow_is_causal_skip=False``), whose
indexing gives :class:`IndexerMask`; the indexer replacement accepts plain causal only.

MiniMax-M3's block-sparse layers run a block indexer the same way::

    block_indices = self.indexer(hidden_states, position_embeddings, cache, position_ids)
    attention_interface(self, q, k, v, attention_mask, ..., block_indices=block_indices)

Its replacement (:func:`_block_index_forward`) keeps the query ``q_norm(q_proj(x))``, the key
``k_norm(k_proj(x))`` and their rotary as graph code and emits ``dspark::dense_block_index``:
each query's top blocks per indexer head. It takes ``position_ids`` only as the capture's own
positions (the ops number positions by the block table), and its ``build_block_mask`` (the
eager path's dense mask) is refused for the capture. The attention call accepts
``block_indices=`` only as such picks, from a known attention class, and emits
``dspark::dense_sparse_attention`` with ``pick_block`` the indexer's block size.

Anything else is refused naming the module: an indexer class of another model or a subclass,
a forward replaced on the instance or whose source differs, a call with a cache or unexpected
arguments.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from ..ops import sparse as _sparse_ops  # noqa: F401  (registers the ops)
from ..specs import IndexSpec
from .replaced import bind_call, helper_keys, source_key
from .scope import active_scope

__all__ = ["IndexerMask", "KNOWN_ATTENTION", "KNOWN_INDEXERS", "indexer_hooks",
           "sparse_attention_module"]


@dataclass(frozen=True)
class _Variant:
    """How one indexer class computes its query, key and weights (read off its source)."""

    interleaved: bool = False
    """Its rotary rotates interleaved pairs (``apply_rotary_pos_emb_interleave``), not halves."""
    rope_last: bool = False
    """The rotated channels are the last ``qk_rope_head_dim`` of a head, not the first."""
    scale_in_weights: bool = False
    """``softmax_scale`` multiplies the head weights instead of the scores (before the ReLU);
    the key's norm runs in its weight's dtype."""
    blocks: bool = False
    """A block indexer (MiniMax-M3): per-head block picks, :func:`_block_index_forward`."""


_V32 = _Variant()
_INTERLEAVED = _Variant(interleaved=True)
_HY = _Variant(rope_last=True, scale_in_weights=True)
_BLOCKS = _Variant(blocks=True)

_ROPE_HALVES = {"apply_rotary_pos_emb": "ea234325c15de475"}
_ROPE_INTERLEAVE = {"apply_rotary_pos_emb_interleave": "8ed90f4983a65a1e"}
_ROPE_MINIMAX = {"apply_rotary_pos_emb": "8e62703ac8727b8f"}

KNOWN_INDEXERS: dict[tuple[str, str], tuple[_Variant, frozenset[str], dict[str, str]]] = {
    ("deepseek_v32", "DeepseekV32Indexer"): (_V32, frozenset({"d661c778bc189986",
                                                                "f05b6543a2da203a"}),
                                             _ROPE_HALVES),
    ("axk2", "AXK2Indexer"): (_V32, frozenset({"d661c778bc189986", "f05b6543a2da203a"}),
                              _ROPE_HALVES),
    ("glm_moe_dsa", "GlmMoeDsaIndexer"): (_INTERLEAVED, frozenset({"5b484bc355c707d6",
                                                                   "c0bfda4dc45e68ce"}),
                                          _ROPE_INTERLEAVE),
    ("dots3_note", "Dots3NoteTextIndexer"): (_INTERLEAVED, frozenset({"5b484bc355c707d6"}),
                                             _ROPE_INTERLEAVE),
    ("hy_v4", "HYV4Indexer"): (_HY, frozenset({"1dc7cea02eefd0a1", "5657afa6a7bbcc74"}),
                               _ROPE_HALVES),
    ("minimax_m3_vl", "MiniMaxM3VLIndexer"): (_BLOCKS, frozenset({"83606351ef7f4edc",
                                                                  "a2cd7f4feb57909a"}),
                                              _ROPE_MINIMAX),
}
"""``(model package, indexer class)`` -> (how it computes, sha256 prefixes of the forward
sources this was derived from: transformers 5.24, and 5.17 where the model exists there; the
two differ only in naming the cache argument; and the sources of the functions of its module
that the forward names, ``helper_keys``, the same in both). The replacement re-implements those
functions too, so a module whose helper differs under the same forward source is not the
indexer it was derived from (HY-V4-VL's forward is HY-V4's, its rotary interleaved)."""

KNOWN_ATTENTION: dict[tuple[str, str], frozenset[str]] = {
    ("deepseek_v32", "DeepseekV32Attention"): frozenset({"202d73849640ee95", "0f8f2e70b43847d2"}),
    ("axk2", "AXK2Attention"): frozenset({"83157782bef25a65", "521526ef9fdf464d"}),
    ("glm_moe_dsa", "GlmMoeDsaAttention"): frozenset({"1dc62df14565fc63", "d15c9f26274052a3"}),
    ("dots3_note", "Dots3NoteTextAttention"): frozenset({"1251aa0ebdba74be"}),
    ("hy_v4", "HYV4Attention"): frozenset({"a1d3323c39ea3041", "bb7041dd79b52549"}),
    ("minimax_m3_vl", "MiniMaxM3VLAttention"): frozenset({"513b464442143bf9",
                                                          "0c1064c50a140cd4"}),
}
"""``(model package, attention class)`` -> forward sources whose ``indices=`` (or
``block_indices=``) are the picks of the layer's indexer (or of an earlier layer's, handed on
by the model) and whose eager path attends to the picked keys (blocks) only, causally."""


@dataclass(frozen=True)
class IndexerMask:
    """What a proven causal mask's ``[:, 0, :, :]`` (or ``[:, 0]``) gives: the ``[bs, T, S]``
    mask a DSA indexer scores under. Only an indexer replacement accepts it."""

    window: int = 0
    chunk: int = 0


INDEXER_KEYS = ((slice(None), 0, slice(None), slice(None)), (slice(None), 0))
"""The indexing of a proven mask that gives an :class:`IndexerMask` (the head axis dropped)."""


def _package(cls) -> str | None:
    """``deepseek_v32`` for a class of ``transformers.models.deepseek_v32.modeling_...``."""
    parts = cls.__module__.split(".")
    if len(parts) == 4 and parts[:2] == ["transformers", "models"] and \
            parts[3] == f"modeling_{parts[2]}":
        return parts[2]
    return None


def _known(module: nn.Module, table: dict) -> object | None:
    """``table``'s entry for ``module``'s exact class (its forward the class's own, of a known
    source), else None."""
    cls = type(module)
    entry = table.get((_package(cls), cls.__name__))
    if entry is None or "forward" in module.__dict__:
        return None
    modeling = sys.modules.get(cls.__module__)
    if modeling is None or getattr(modeling, cls.__name__, None) is not cls:
        return None
    sources = entry[1] if isinstance(entry, tuple) else entry
    return entry if source_key(cls) in sources else None


def sparse_attention_module(module: nn.Module) -> bool:
    """``module`` is a DSA attention layer of a known class and forward
    (:data:`KNOWN_ATTENTION`)."""
    return _known(module, KNOWN_ATTENTION) is not None


def _refuse(where: str, what: str) -> NotImplementedError:
    return NotImplementedError(
        f"{where}: {what}; dspark_compile captures the sparse-attention indexers of "
        f"{sorted(c for _, c in KNOWN_INDEXERS)} with their own forward only, so the model is "
        "refused rather than verified wrong")


_ARGUMENTS = ("hidden_states", "q_resid", "position_embeddings", "attention_mask",
              "position_ids", "cache")


def _arguments(where: str, args: tuple, kwargs: dict) -> dict:
    given = bind_call(_ARGUMENTS, 4, args, kwargs, lambda what: _refuse(where, what),
                      "the indexer's keys")
    mask = given["attention_mask"]
    if not isinstance(mask, IndexerMask) or mask.window or mask.chunk:
        what = f"window {mask.window}, chunk {mask.chunk}" if isinstance(mask, IndexerMask) \
            else f"a {type(mask).__name__}"
        raise _refuse(where, f"its mask is {what}, not the proven plain causal mask (the "
                      "sparse ops pick among every earlier position)")
    return given


def _query_key_weights(module: nn.Module, variant: _Variant, modeling, hidden: torch.Tensor,
                       q_resid: torch.Tensor, position_embeddings):
    """The indexer's rotated query ``[bs, T, Hi, Di]``, key ``[bs, T, Di]``, float32 weights
    ``[bs, T, Hi]`` and the scale left for the scores, as the class computes them."""
    bs, t, _ = hidden.shape
    heads, dim, rope = int(module.n_heads), int(module.head_dim), int(module.qk_rope_head_dim)
    cos, sin = position_embeddings
    q = module.wq_b(q_resid).view(bs, t, heads, dim)
    if variant.scale_in_weights:
        k = module.k_norm(module.wk(hidden).to(module.k_norm.weight.dtype)).to(hidden.dtype)
    else:
        k = module.k_norm(module.wk(hidden))
    k = k.unsqueeze(2)
    split = [dim - rope, rope] if variant.rope_last else [rope, dim - rope]
    q_a, q_b = torch.split(q, split, dim=-1)
    k_a, k_b = torch.split(k, split, dim=-1)
    rotate = modeling.apply_rotary_pos_emb_interleave if variant.interleaved else \
        modeling.apply_rotary_pos_emb
    if variant.rope_last:
        q_b, k_b = rotate(q_b, k_b, cos, sin, unsqueeze_dim=2)
    else:
        q_a, k_a = rotate(q_a, k_a, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_a, q_b], dim=-1)
    k = torch.cat([k_a, k_b], dim=-1).squeeze(2)
    weights = module.weights_proj(hidden.to(module.weights_proj.weight.dtype)).float() * \
        (heads ** -0.5)
    scale = float(module.softmax_scale)
    if variant.scale_in_weights:
        weights, scale = weights * scale, 1.0
    return q, k, weights, scale


def _index_forward(module: nn.Module, where: str, variant: _Variant, *args, **kwargs):
    given = _arguments(where, args, kwargs)
    scope = active_scope()
    if scope is None:
        raise RuntimeError(f"{where}'s forward was replaced by dspark_compile and runs only "
                           "inside a capture")
    modeling = sys.modules[type(module).__module__]
    hidden = given["hidden_states"]
    q, k, weights, scale = _query_key_weights(module, variant, modeling, hidden,
                                              given["q_resid"], given["position_embeddings"])
    spec = IndexSpec(int(module.index_topk), int(module.n_heads), int(module.head_dim))
    if scope.discovered is not None:
        picks = torch.zeros(*hidden.shape[:2], spec.topk, dtype=torch.int64,
                            device=hidden.device)
    else:
        pool = scope.index_pool_of(scope.attention_calls)
        picks = torch.ops.dspark.dense_sparse_index(q, weights, k, pool, scope.block_table,
                                                     scope.context_lens, spec.topk, scale)
    # HF's indexer returns int32 positions: the conversion is graph code, and the attention
    # call recognises the result as this capture's picks
    out = picks.to(torch.int32)
    scope.picks_made.append((out, 1))
    scope.expect_index(module, spec, out)
    return out


_BLOCK_ARGUMENTS = ("hidden_states", "position_embeddings", "cache", "position_ids")


def _block_index_forward(module: nn.Module, where: str, *args, **kwargs):
    """A block indexer's forward for the capture (module docstring): its picks
    ``int64 [bs, T, Hi, topk]`` block ids."""
    given = bind_call(_BLOCK_ARGUMENTS, 4, args, kwargs, lambda what: _refuse(where, what),
                      "the indexer's keys")
    scope = active_scope()
    if scope is None:
        raise RuntimeError(f"{where}'s forward was replaced by dspark_compile and runs only "
                           "inside a capture")
    positions, own = given["position_ids"], scope.positions
    if own is None or not (positions is own or (
            getattr(positions, "_base", None) is own and positions.shape == own.shape)):
        raise _refuse(where, "its position_ids are not the positions the capture called the "
                      "model with (the block ops number keys and blocks by the block table)")
    modeling = sys.modules[type(module).__module__]
    hidden = given["hidden_states"]
    bs, t, _ = hidden.shape
    heads, dim = int(module.num_heads), int(module.head_dim)
    # the class's own computation, in its layout: [bs, Hi, T, Di] and [bs, 1, T, Di]
    q = module.q_norm(module.q_proj(hidden).view(bs, t, -1, dim)).transpose(1, 2)
    k = module.k_norm(module.k_proj(hidden).view(bs, t, 1, dim)).transpose(1, 2)
    cos, sin = given["position_embeddings"]
    q, k = modeling.apply_rotary_pos_emb(q, k, cos[..., :dim], sin[..., :dim])
    spec = IndexSpec(int(module.topk_blocks), heads, dim, block=int(module.block_size),
                     local=int(module.local_blocks))
    if scope.discovered is not None:
        picks = torch.zeros(bs, t, heads, spec.topk, dtype=torch.int64, device=hidden.device)
    else:
        pool = scope.index_pool_of(scope.attention_calls)
        picks = torch.ops.dspark.dense_block_index(
            q.transpose(1, 2), k[:, 0], pool, scope.block_table, scope.context_lens,
            spec.block, spec.topk, spec.local)
    scope.picks_made.append((picks, spec.block))
    scope.expect_index(module, spec, picks)
    return picks


def _no_block_mask(where: str, *args, **kwargs):
    raise _refuse(where, "its build_block_mask (the eager path's dense block mask) ran during "
                  "the capture; the block picks reach the attention function as "
                  "block_indices= instead")


@contextlib.contextmanager
def indexer_hooks(model: nn.Module, names: dict[int, str]) -> Iterator[None]:
    """Replace every known DSA indexer's forward on its instance for the duration of a capture
    (module docstring); refuse any other module that a layer owns as ``.indexer``. A model
    without one is left untouched. DeepSeek-V4's indexers (owned and run by its compressors,
    ``compressed.py``) are not this module's."""
    owned = {id(m.indexer) for m in model.modules()
             if isinstance(getattr(m, "indexer", None), nn.Module)
             and "Compressor" not in type(m).__name__}
    found = [m for m in model.modules() if id(m) in owned]
    patched = []
    try:
        for m in found:
            where = f"{type(m).__name__} {names.get(id(m), '?')!r}"
            entry = _known(m, KNOWN_INDEXERS)
            cls = type(m)
            helpers = helper_keys(cls) if entry is not None else None
            if entry is None or helpers != entry[2]:
                what = "its forward is replaced on the instance" if "forward" in m.__dict__ \
                    else f"{cls.__module__}.{cls.__name__}.forward (sha256 {source_key(cls)}) " \
                    "is not one of the known indexer forwards" if entry is None \
                    else f"the functions its forward calls in {cls.__module__} ({helpers}) " \
                    "are not those its replacement was derived from"
                raise _refuse(where, what)
            if entry[0].blocks:
                m.forward = (lambda mod, w: lambda *a, **k: _block_index_forward(
                    mod, w, *a, **k))(m, where)
                m.build_block_mask = (lambda w: lambda *a, **k: _no_block_mask(w, *a, **k))(
                    where)
            else:
                m.forward = (lambda mod, w, v: lambda *a, **k: _index_forward(
                    mod, w, v, *a, **k))(m, where, entry[0])
            patched.append(m)
        yield
    finally:
        for m in patched:
            m.__dict__.pop("forward", None)
            m.__dict__.pop("build_block_mask", None)
