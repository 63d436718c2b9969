"""Attention written inline in a model's own layer (GPT-Neo, XGLM, MVP, TrOCR, GPT,
GPT-NeoX-Japanese, MPT, MegatronBERT, RemBERT, RoFormer; GPT-J and CodeGen as transformers 5.17
writes them), captured through the attention function.

These layers compute ``softmax(q k^T + mask) v`` themselves instead of calling transformers'
attention interface, so the capture would meet their mask as a tensor (it proves masks instead of
building them, and refuses such a model). While a model is captured, :func:`inline_hooks`
replaces each layer's forward with one that keeps the layer's projections, head split and
scaling as written and hands the scores' part to the capture's attention function:

- **GPT-Neo** (``GPTNeoSelfAttention``): no softmax scale (1.0); a ``local`` layer attends to
  the last ``window_size`` positions, read off the layer's own band buffer (``bias``), which is
  checked to be that band. Its scores run in float32, as the op's do.
- **XGLM** (``XGLMAttention``), and MVP's and TrOCR's attention, which read the same: the
  queries scaled before the product, as written; the op's scale is then 1.0. Cross-attention
  (``key_value_states``) and MVP's prompt keys are refused.
- **GPT** (openai-gpt's ``Attention``): scores scaled by ``1/sqrt(d)`` where the layer says
  so, future keys pushed to ``-1e4`` through its causal buffer (checked to be the lower
  triangle): zero weight in float32 as in the op, whose masked keys get none. No padding mask.
- **GPT-NeoX-Japanese** (``GPTNeoXJapaneseAttention``): its partial rotary as written, the
  scores scaled by ``1/sqrt(head size)`` (its ``baddbmm``'s alpha); the layer's own output bias
  handed back as it is.
- **MPT** (``MptAttention``): ALiBi, ``slope[h] * (kpos - (L - 1))`` in the model's own
  ``position_bias`` ``[H, 1, L]``; the slopes are read off that tensor (the difference of its
  last two columns) and handed over as :class:`~.bloom.AlibiSlopes`: the op adds
  ``slope * (kpos - qpos)``, a constant per query row away, so the same softmax. ``clip_qkv``
  clamps as written. ``MptModel`` casts its mask to bool before handing it down: for the capture
  its ``create_causal_mask`` returns the proof wrapped so that this one cast gives the proof
  back.

- **GPT-J, CodeGen** (``GPTJAttention``, ``CodeGenAttention`` where they compute their scores
  in ``_attn``, as in transformers 5.17): their own head split (CodeGen's four model-parallel
  groups), interleaved rotary of the first ``rotary_dim`` channels by rows of their sinusoid
  table at each token's position, scores divided by ``sqrt(head_dim)``. The table's rows past
  its end are the position limit ``new_state`` enforces (``position_tables``).

- **BERT-style self-attention** (``MegatronBertSelfAttention``, ``RemBertSelfAttention``,
  ``RoFormerSelfAttention``): ``query``/``key``/``value``
  projections split into heads of ``attention_head_size``, scores divided by its square root, the
  model's mask added (built by ``create_causal_mask``: the capture's proof). RoFormer rotates q
  and k (and v where ``rotary_value``) by its own ``apply_rotary_position_embeddings`` with the
  sinusoid table its encoder reads at ``arange(T) + cache length``: read here at each token's own
  position instead, as the BART family's counted positions are. Cross-attention and returned
  attention weights are refused.

Only the exact classes with the sources this was derived from (transformers 5.24 and 5.17) are
taken, and only plain float weights; anything else is refused by name.
"""

from __future__ import annotations

import contextlib
import math
import sys
from typing import Callable, Iterator

import torch
from torch import nn

from .masks import WindowMask
from .bloom import AlibiSlopes
from .replaced import PLAIN_FLOATS, bind_call, known_forward, modeling_instances, \
    source_key, swapped_forward
from .counted_positions import table_at_positions
from .scope import HF_ATTENTION_NAME, outside_trace

__all__ = ["KNOWN_SOURCES", "inline_hooks"]

KNOWN_SOURCES = {
    ("GPTNeoSelfAttention", "forward"): frozenset({"ad4d8004c2f68047"}),
    ("GPTNeoSelfAttention", "_attn"): frozenset({"c40796a749af347a"}),
    ("GPTNeoSelfAttention", "_split_heads"): frozenset({"74e7569b79f5acce"}),
    ("GPTNeoSelfAttention", "_merge_heads"): frozenset({"77783133b511675f"}),
    ("GPTNeoSelfAttention", "__init__"): frozenset({"0c3749eedbdb1245"}),
    ("XGLMAttention", "forward"): frozenset({"80931b93538263f3", "214633c2552a06d8"}),
    ("XGLMAttention", "__init__"): frozenset({"9d8431f88ddca032"}),
    ("MvpAttention", "forward"): frozenset({"510c1b5f245203c0", "7a88e4885d0d7dd5"}),
    ("MvpAttention", "__init__"): frozenset({"9d8431f88ddca032"}),
    ("TrOCRAttention", "forward"): frozenset({"084ddf1e40f1738b", "571f354bbe1f0a15"}),
    ("TrOCRAttention", "__init__"): frozenset({"141da444af6f8bd8"}),
    ("XGLMSinusoidalPositionalEmbedding", "forward"): frozenset({"f1dbfaf245e507f6",
                                                                 "ca685b075549e6c2"}),
    ("XGLMSinusoidalPositionalEmbedding", "get_embedding"): frozenset({"356597ed25c6c26a"}),
    ("XGLMSinusoidalPositionalEmbedding", "__init__"): frozenset({"9307539c5a0cb490"}),
    ("Attention", "forward"): frozenset({"1b1e08f969e157d5"}),  # openai-gpt's
    ("Attention", "_attn"): frozenset({"78bf8e63d53051e8"}),
    ("Attention", "split_heads"): frozenset({"1d5b56d9887dd0c0"}),
    ("Attention", "merge_heads"): frozenset({"65a8b304cbf25698"}),
    ("Attention", "__init__"): frozenset({"7e1af9588a8d39a7"}),
    ("GPTNeoXJapaneseAttention", "forward"): frozenset({"a9089eaad0a2ec6a",
                                                        "fb4308bda2d90355"}),
    ("GPTNeoXJapaneseAttention", "_attn"): frozenset({"454d79e6355d64c9"}),
    ("GPTNeoXJapaneseAttention", "_merge_heads"): frozenset({"d1acc31d8678add8"}),
    ("GPTNeoXJapaneseAttention", "__init__"): frozenset({"f42fdad30a6d8646"}),
    ("modeling_gpt_neox_japanese", "apply_rotary_pos_emb"): frozenset({"795d9e03deecd20c"}),
    ("MptAttention", "forward"): frozenset({"acd08620f748187a", "c38160120bf5efcb"}),
    ("MptAttention", "__init__"): frozenset({"53bdb0bfafaf1ed0"}),
    ("MptModel", "forward"): frozenset({"e67fc628f88d14ba", "b389f245c2701a25"}),
    ("MptModel", "build_mpt_alibi_tensor"): frozenset({"31a8329daad38f1c"}),
    ("modeling_mpt", "build_mpt_alibi_tensor"): frozenset({"ceac1cf0eb0d182c"}),
    ("MegatronBertSelfAttention", "forward"): frozenset({"12dd72a5c5d51c33",
                                                          "222e1db0aebc57b5"}),
    ("MegatronBertSelfAttention", "__init__"): frozenset({"94c5e7f5b8bc8f6d"}),
    ("RemBertSelfAttention", "forward"): frozenset({"3640bdb35aab6fe1", "8bfe0e96b8e1d008"}),
    ("RemBertSelfAttention", "__init__"): frozenset({"94c5e7f5b8bc8f6d"}),
    ("RoFormerSelfAttention", "forward"): frozenset({"1f1d988992c832ab", "48ced5fb3d5d67d0"}),
    ("RoFormerSelfAttention", "__init__"): frozenset({"3de09cc66edfc60a"}),
    ("RoFormerSelfAttention", "apply_rotary_position_embeddings"):
        frozenset({"b53a670b77dfe3ee"}),
    ("RoFormerSinusoidalPositionalEmbedding", "forward"): frozenset({"6307e1e648a167f7",
                                                                      "fb59f370f8725dd7"}),
    ("RoFormerEncoder", "forward"): frozenset({"0576bd618fadf2e7", "5c0480a7e69dbdc9"}),
    # GPT-J and CodeGen: their inline form only (5.17; 5.24's call the attention interface)
    ("GPTJAttention", "forward"): frozenset({"bcd9a349a34c8d90"}),
    ("GPTJAttention", "_split_heads"): frozenset({"8ab28f5fbe78e6c4"}),
    ("GPTJAttention", "__init__"): frozenset({"33ff2547bc0a231a"}),
    ("modeling_gptj", "apply_rotary_pos_emb"): frozenset({"9b5cb620ce997c13"}),
    ("modeling_gptj", "rotate_every_two"): frozenset({"19e9edb6c5eaf7b9"}),
    ("CodeGenAttention", "forward"): frozenset({"68043ab162e23fbb"}),
    ("CodeGenAttention", "_split_heads"): frozenset({"61ce852829057cb6"}),
    ("CodeGenAttention", "__init__"): frozenset({"12cbb81a5372ff3b"}),
    ("modeling_codegen", "apply_rotary_pos_emb"): frozenset({"9b5cb620ce997c13"}),
    ("modeling_codegen", "rotate_every_two"): frozenset({"19e9edb6c5eaf7b9"}),
}
"""sha256 prefixes (:func:`~.replaced.source_key`) of the methods each replacement was derived
from, by (class or module, method): transformers 5.24 and 5.17 (where a method has two, they
differ only in an argument's name or a type annotation)."""

_CACHE_NAMES = ("layer_past", "cache", "past_key_values")


def _refuse(self, what: str) -> NotImplementedError:
    return NotImplementedError(
        f"{type(self).__name__}: {what}; its attention is captured for a verify "
        "(use_cache=False, the capture owns the KV, no attention weights returned), so the "
        "model is refused rather than verified wrong")


def _plain_call(self, kwargs: dict) -> None:
    """Refuses a cache, returned attention weights or cross-attention states."""
    for name in _CACHE_NAMES:
        if kwargs.get(name) is not None:
            raise _refuse(self, f"called with a cache ({name}=)")
    if kwargs.get("output_attentions"):
        raise _refuse(self, "called with output_attentions=True")
    if kwargs.get("key_value_states") is not None:
        raise _refuse(self, "called as cross-attention (key_value_states=)")


def _attention():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[HF_ATTENTION_NAME]


def _causal(self, mask):
    """The proof a layer received, which must be plain causal (None or a window of 0)."""
    if mask is None or (isinstance(mask, WindowMask) and not mask.window and not mask.chunk):
        return mask
    raise _refuse(self, f"handed the mask {mask!r}, where its model builds plain causal")


def _gpt_neo_forward(windows: dict[int, int]) -> Callable:
    def forward(self, hidden_states, attention_mask=None, layer_past=None, use_cache=False,
                output_attentions=False, **kwargs):
        """``GPTNeoSelfAttention.forward`` through the attention function (module docstring)."""
        _plain_call(self, dict(kwargs, layer_past=layer_past,
                               output_attentions=output_attentions))
        bs, t, _ = hidden_states.shape
        query = self._split_heads(self.q_proj(hidden_states), self.num_heads, self.head_dim)
        key = self._split_heads(self.k_proj(hidden_states), self.num_heads, self.head_dim)
        value = self._split_heads(self.v_proj(hidden_states), self.num_heads, self.head_dim)
        mask = _causal(self, attention_mask)
        if windows[id(self)]:
            mask = WindowMask(windows[id(self)])
        out, _ = _attention()(self, query, key, value, mask, scaling=1.0)
        out = self.out_proj(out.reshape(bs, t, -1))
        return self.resid_dropout(out), None
    return forward


def _xglm_forward(self, hidden_states, key_value_states=None, cache=None, attention_mask=None,
                  attn_prompt=None, **kwargs):
    """``XGLMAttention.forward`` through the attention function (module docstring); MVP's and
    TrOCR's attention read the same, MVP's prompt keys (``attn_prompt``) refused."""
    _plain_call(self, dict(kwargs, cache=cache, key_value_states=key_value_states))
    if attn_prompt is not None:
        raise _refuse(self, "called with prompt keys (attn_prompt=, MVP's use_prompt)")
    bs, t, _ = hidden_states.shape
    shape = (bs, t, -1, self.head_dim)
    query = (self.q_proj(hidden_states) * self.scaling).view(shape).transpose(1, 2)
    key = self.k_proj(hidden_states).view(shape).transpose(1, 2)
    value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
    out, _ = _attention()(self, query, key, value, _causal(self, attention_mask), scaling=1.0,
                          dropout=0.0)
    return self.out_proj(out.reshape(bs, t, self.embed_dim)), None


def _xglm_positions_forward(dtypes: dict[int, torch.dtype]) -> Callable:
    def forward(self, position_ids, *args, **kwargs):
        """``XGLMSinusoidalPositionalEmbedding.forward`` (:func:`_xglm_positions`)."""
        return _xglm_positions(self, position_ids, dtypes[id(self)])
    return forward


def _xglm_positions(self, position_ids, dtype: torch.dtype):
    """The rows of ``get_embedding`` computed at the positions themselves, as the same float32
    products, so any position is covered (HF grows its table on a length check the capture
    cannot branch on, replacing the buffer, which is therefore never read here: ``dtype`` is
    the table's, taken when the hook starts)."""
    index = position_ids + self.offset
    half = self.embedding_dim // 2
    step = math.log(10000) / (half - 1)
    freqs = torch.exp(torch.arange(half, dtype=torch.int64, device=index.device).float() * -step)
    angles = index.float().unsqueeze(-1) * freqs
    emb = torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)
    if self.embedding_dim % 2 == 1:
        emb = torch.nn.functional.pad(emb, (0, 1))
    if self.padding_idx is not None:
        emb = emb.masked_fill((index == self.padding_idx).unsqueeze(-1), 0.0)
    return emb.to(torch.get_default_dtype()).to(dtype).detach()


def _openai_forward(self, x, attention_mask=None, output_attentions=False):
    """openai-gpt's ``Attention.forward`` through the attention function (module docstring)."""
    _plain_call(self, {"output_attentions": output_attentions})
    if attention_mask is not None:
        raise _refuse(self, "called with a padding mask")
    query, key, value = self.c_attn(x).split(self.split_size, dim=2)
    query, key, value = (self.split_heads(t) for t in (query, key, value))
    scaling = value.shape[-1] ** -0.5 if self.scale else 1.0
    out, _ = _attention()(self, query, key, value, None, scaling=scaling, dropout=0.0)
    return [self.resid_dropout(self.c_proj(out.reshape(*x.shape[:-1], -1)))]


def _neox_japanese_forward(self, hidden_states, attention_mask=None, position_ids=None,
                           layer_past=None, use_cache=False, output_attentions=False,
                           position_embeddings=None, **kwargs):
    """``GPTNeoXJapaneseAttention.forward`` through the attention function (module docstring)."""
    _plain_call(self, dict(kwargs, layer_past=layer_past, output_attentions=output_attentions))
    modeling = sys.modules[type(self).__module__]
    size, rot = self.head_size, self.rotary_ndims
    qkv = self.query_key_value(hidden_states)
    qkv = qkv.view(*qkv.shape[:-1], self.num_attention_heads, 3 * size)
    query, key, value = (qkv[..., i * size:(i + 1) * size].permute(0, 2, 1, 3)
                         for i in range(3))
    cos, sin = position_embeddings
    query_rot, key_rot = modeling.apply_rotary_pos_emb(query[..., :rot], key[..., :rot], cos, sin)
    query = torch.cat((query_rot, query[..., rot:]), dim=-1)
    key = torch.cat((key_rot, key[..., rot:]), dim=-1)
    out, _ = _attention()(self, query, key, value, _causal(self, attention_mask),
                          scaling=1.0 / self.norm_factor, dropout=0.0)
    return self.dense(out.reshape(*hidden_states.shape[:-1], -1)), None, self.dense_bias


def _mpt_forward(self, hidden_states, position_bias=None, cache=None, attention_mask=None,
                 **kwargs):
    """``MptAttention.forward`` through the attention function (module docstring)."""
    _plain_call(self, dict(kwargs, cache=cache))
    heads = self.n_heads
    if not isinstance(position_bias, torch.Tensor) or position_bias.dim() != 3 or \
            position_bias.shape[0] != heads or position_bias.shape[1] != 1 or \
            position_bias.shape[2] < 2:
        shape = tuple(position_bias.shape) if isinstance(position_bias, torch.Tensor) else \
            position_bias
        raise _refuse(self, f"handed position_bias {shape}, where MptModel builds "
                            f"[{heads}, 1, max_seq_len] ALiBi")
    slopes = (position_bias[:, 0, -1] - position_bias[:, 0, -2]).float()
    bs, t, _ = hidden_states.shape
    mixed = self.Wqkv(hidden_states)
    if self.clip_qkv:
        mixed = mixed.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    query, key, value = (s.reshape(bs, t, heads, self.head_dim).transpose(1, 2)
                         for s in mixed.chunk(3, dim=2))
    out, _ = _attention()(self, query, key, value, _causal(self, attention_mask),
                          scaling=self.softmax_scale, dropout=0.0, alibi=AlibiSlopes(slopes))
    return self.out_proj(out.reshape(bs, t, -1)), None


class _BoolCast:
    """What ``MptModel``'s ``create_causal_mask`` returns for the capture: the proof, given back
    by the one cast the model applies (``.to(torch.bool)``); any other use is refused."""

    def __init__(self, proof):
        self.proof = proof

    def to(self, *args, **kwargs):
        if args == (torch.bool,) and not kwargs:
            return self.proof
        raise NotImplementedError(f"MptModel casts its mask with .to{args, kwargs}; only "
                                  ".to(torch.bool) is understood, so the model is refused")


@contextlib.contextmanager
def _mpt_mask(modeling) -> Iterator[None]:
    original = modeling.create_causal_mask
    modeling.create_causal_mask = lambda *a, **k: _BoolCast(original(*a, **k))
    try:
        yield
    finally:
        modeling.create_causal_mask = original


def _local_window(m: nn.Module) -> int | None:
    """A GPT-Neo layer's left window read off its band buffer (0: global), None where the
    buffer is not the band its attention type names."""
    with outside_trace():
        return _band_window(m)


def _band_window(m: nn.Module) -> int | None:
    bias = getattr(m, "bias", None)
    if not isinstance(bias, torch.Tensor) or bias.dtype != torch.bool or bias.dim() != 4 or \
            bias.shape[-1] != bias.shape[-2] or m.attention_type not in ("global", "local"):
        return None
    n = bias.shape[-1]
    window = int(bias[0, 0, -1].sum()) if m.attention_type == "local" else n
    if window < 1:
        return None
    distance = torch.arange(n).view(n, 1) - torch.arange(n).view(1, n)
    band = (distance >= 0) & (distance < window)
    if tuple(bias.shape[:2]) != (1, 1) or not torch.equal(bias[0, 0].cpu(), band):
        return None
    return window if m.attention_type == "local" and window < n else 0


def _taken(m: nn.Module, cls: type, methods: tuple[str, ...]) -> bool:
    """``m`` is exactly ``cls``, each of its ``methods`` reads as a source in
    :data:`KNOWN_SOURCES`, and its weights are plain floats."""
    return all(known_forward(m, cls, KNOWN_SOURCES[(cls.__name__, method)], method)
               for method in methods) and \
        {p.dtype for p in m.parameters()} <= PLAIN_FLOATS


@contextlib.contextmanager
def inline_hooks(model: nn.Module, names: dict[int, str]) -> Iterator[None]:
    """Run ``model``'s inline attention (module docstring) through the attention function for
    the capture; restored after. A model without it is left untouched."""
    with contextlib.ExitStack() as stack:
        for hook in (_gpt_neo, _xglm, _one_class("mvp", "MvpAttention", "MVP", _xglm_forward),
                     _one_class("trocr", "TrOCRAttention", "TrOCR", _xglm_forward), _openai,
                     _neox_japanese, _mpt, *_BERT_STYLE_HOOKS, _roformer,
                     _sinusoid_rotary("gptj", "GPTJAttention", "GPT-J"),
                     _sinusoid_rotary("codegen", "CodeGenAttention", "CodeGen")):
            stack.enter_context(hook(model, names))
        yield


def _refuse_layer(m, names, family: str) -> NotImplementedError:
    return NotImplementedError(
        f"{type(m).__name__} {names.get(id(m), '?')!r}: {family}'s attention is captured from "
        "its own sources (transformers 5.24, 5.17) with plain float weights only, and this one "
        "reads otherwise; the model is refused rather than verified wrong")


@contextlib.contextmanager
def _gpt_neo(model, names) -> Iterator[None]:
    classes, found = modeling_instances(
        model, "transformers.models.gpt_neo.modeling_gpt_neo", ("GPTNeoSelfAttention",))
    if not found:
        yield
        return
    cls, = classes
    windows = {}
    for m in found:
        window = _local_window(m)
        if window is None or not _taken(
                m, cls, ("forward", "_attn", "_split_heads", "_merge_heads", "__init__")):
            raise _refuse_layer(m, names, "GPT-Neo")
        windows[id(m)] = window
    with swapped_forward(cls, _gpt_neo_forward(windows)):
        yield


@contextlib.contextmanager
def _xglm(model, names) -> Iterator[None]:
    classes, found = modeling_instances(
        model, "transformers.models.xglm.modeling_xglm",
        ("XGLMAttention", "XGLMSinusoidalPositionalEmbedding"), held=2)
    if not found:
        yield
        return
    attention, positions = classes
    dtypes = {id(m): m.weights.dtype for m in found if isinstance(m, positions)}
    for m in found:
        cls = attention if isinstance(m, attention) else positions
        own = ("forward", "__init__", "get_embedding") if cls is positions else \
            ("forward", "__init__")
        if not _taken(m, cls, own):
            raise _refuse_layer(m, names, "XGLM")
    with swapped_forward(attention, _xglm_forward), swapped_forward(positions,
                                                                 _xglm_positions_forward(dtypes)):
        yield


def _one_class(family: str, name: str, title: str, forward: Callable) -> Callable:
    """The hook that runs the inline attention class ``name`` of ``family``'s modeling module
    through ``forward``, where each instance is exactly that class with the known sources of
    its ``forward`` and ``__init__``."""
    @contextlib.contextmanager
    def hook(model, names) -> Iterator[None]:
        classes, found = modeling_instances(
            model, f"transformers.models.{family}.modeling_{family}", (name,))
        if not found:
            yield
            return
        cls, = classes
        for m in found:
            if not _taken(m, cls, ("forward", "__init__")):
                raise _refuse_layer(m, names, title)
        with swapped_forward(cls, forward):
            yield
    return hook


@contextlib.contextmanager
def _openai(model, names) -> Iterator[None]:
    classes, found = modeling_instances(
        model, "transformers.models.openai.modeling_openai", ("Attention",))
    if not found:
        yield
        return
    cls, = classes
    for m in found:
        if not (_taken(m, cls, ("forward", "_attn", "split_heads", "merge_heads", "__init__"))
                and _lower_triangle(m.bias)):
            raise _refuse_layer(m, names, "GPT")
    with swapped_forward(cls, _openai_forward):
        yield


def _lower_triangle(bias) -> bool:
    """openai-gpt's causal buffer is ones on and below the diagonal and zeros above."""
    with outside_trace():
        if not isinstance(bias, torch.Tensor) or bias.dim() != 4 or \
                tuple(bias.shape[:2]) != (1, 1) or bias.shape[2] != bias.shape[3]:
            return False
        n = bias.shape[-1]
        return torch.equal(bias[0, 0].cpu(), torch.ones(n, n, dtype=bias.dtype).tril())


@contextlib.contextmanager
def _neox_japanese(model, names) -> Iterator[None]:
    classes, found = modeling_instances(
        model, "transformers.models.gpt_neox_japanese.modeling_gpt_neox_japanese",
        ("GPTNeoXJapaneseAttention",))
    if not found:
        yield
        return
    cls, = classes
    modeling = sys.modules[cls.__module__]
    rotary = source_key(modeling, "apply_rotary_pos_emb") in \
        KNOWN_SOURCES[("modeling_gpt_neox_japanese", "apply_rotary_pos_emb")]
    for m in found:
        if not (rotary and _taken(m, cls, ("forward", "_attn", "_merge_heads", "__init__"))):
            raise _refuse_layer(m, names, "GPT-NeoX-Japanese")
    with swapped_forward(cls, _neox_japanese_forward):
        yield


@contextlib.contextmanager
def _mpt(model, names) -> Iterator[None]:
    classes, found = modeling_instances(
        model, "transformers.models.mpt.modeling_mpt", ("MptAttention", "MptModel"), held=2)
    if not found:
        yield
        return
    attention, mpt_model = classes
    modeling = sys.modules[attention.__module__]
    shared = source_key(modeling, "build_mpt_alibi_tensor") in \
        KNOWN_SOURCES[("modeling_mpt", "build_mpt_alibi_tensor")]
    for m in found:
        cls = attention if isinstance(m, attention) else mpt_model
        own = ("forward", "__init__") if cls is attention else \
            ("forward", "build_mpt_alibi_tensor")
        if not (shared and _taken(m, cls, own)):
            raise _refuse_layer(m, names, "MPT")
    with swapped_forward(attention, _mpt_forward), _mpt_mask(modeling):
        yield


def _sinusoid_rotary_forward(self, hidden_states, layer_past=None, attention_mask=None,
                             position_ids=None, use_cache=False, output_attentions=False,
                             **kwargs):
    """GPT-J's and CodeGen's inline ``forward`` (transformers 5.17) through the attention
    function: their projections and head split as written (CodeGen's one ``qkv_proj`` cut in
    its four model-parallel groups, query / value / key, by its own ``_split_heads``), q and k
    rotated in interleaved pairs by their module's ``apply_rotary_pos_emb`` with the rows of
    their ``embed_positions`` table at ``position_ids`` (GPT-J gathers those same rows, cast to
    the keys' dtype), scores divided by ``sqrt(head_dim)``. Their scores run in float32, as the
    op's do; q and k reach the op in v's dtype (CodeGen's float32 table leaves them float32:
    its own cached decoding stores the keys in the model's dtype)."""
    _plain_call(self, dict(kwargs, layer_past=layer_past, output_attentions=output_attentions))
    if position_ids is None:
        raise _refuse(self, "called without position_ids, which its rotary reads")
    modeling = sys.modules[type(self).__module__]
    heads, dim = self.num_attention_heads, self.head_dim
    if hasattr(self, "qkv_proj"):  # CodeGen
        qkv = self.qkv_proj(hidden_states)
        qkv = qkv.reshape(qkv.shape[:-1] + (4, -1))
        query, value, key = torch.split(qkv, dim * heads // 4, dim=-1)
        query, key, value = (self._split_heads(t, heads, dim, mp_num=4)
                             for t in (query, key, value))
        value = value.permute(0, 2, 1, 3)
        sincos = self.embed_positions[position_ids]
    else:  # GPT-J
        query, key = (self._split_heads(proj(hidden_states), heads, dim, True)
                      for proj in (self.q_proj, self.k_proj))
        value = self._split_heads(self.v_proj(hidden_states), heads, dim, False)
        sincos = self.embed_positions[position_ids].to(key.dtype)
    sin, cos = torch.split(sincos, sincos.shape[-1] // 2, dim=-1)
    rot = self.rotary_dim if self.rotary_dim is not None else dim
    query, key = (torch.cat([modeling.apply_rotary_pos_emb(t[..., :rot], sin, cos),
                             t[..., rot:]], dim=-1).permute(0, 2, 1, 3).to(value.dtype)
                  for t in (query, key))
    out, _ = _attention()(self, query, key, value, _causal(self, attention_mask),
                          scaling=1.0 / self.scale_attn, dropout=0.0)
    out = self.out_proj(out.reshape(*hidden_states.shape[:-1], heads * dim))
    return self.resid_dropout(out), None


def _sinusoid_rotary(family: str, name: str, title: str) -> Callable:
    """The hook of GPT-J's or CodeGen's attention: only their inline form (which has an
    ``_attn``) is replaced, where every instance reads as :data:`KNOWN_SOURCES` says; a class
    without ``_attn`` calls the attention interface and is left as it is."""
    @contextlib.contextmanager
    def hook(model, names) -> Iterator[None]:
        classes, found = modeling_instances(
            model, f"transformers.models.{family}.modeling_{family}", (name,))
        if not found or not hasattr(classes[0], "_attn"):
            yield
            return
        cls, = classes
        modeling = sys.modules[cls.__module__]
        shared = all(source_key(modeling, fn) in KNOWN_SOURCES[(f"modeling_{family}", fn)]
                     for fn in ("apply_rotary_pos_emb", "rotate_every_two"))
        for m in found:
            if not (shared and _taken(m, cls, ("forward", "_split_heads", "__init__"))):
                raise _refuse_layer(m, names, title)
        with swapped_forward(cls, _sinusoid_rotary_forward):
            yield
    return hook


_BERT_CALL = ("hidden_states", "attention_mask", "encoder_hidden_states", "cache",
              "output_attentions")
_ROFORMER_CALL = ("hidden_states", "attention_mask", "sinusoidal_pos", "encoder_hidden_states",
                  "cache", "output_attentions", "position_ids")
"""RoFormer's layers hand their keywords down to the attention, the capture's ``position_ids``
among them, which its own forward never reads (its positions are the sinusoid table's)."""


def _bert_forward(params: tuple[str, ...], rotary: bool = False) -> Callable:
    def forward(self, *args, **kwargs):
        """A BERT-style self-attention's forward through the attention function (module
        docstring); ``params`` are its own forward's parameters."""
        call = bind_call(params, 1, args, kwargs, lambda what: _refuse(self, what), "the KV")
        if call.get("encoder_hidden_states") is not None:
            raise _refuse(self, "called as cross-attention (encoder_hidden_states=)")
        if call.get("output_attentions"):
            raise _refuse(self, "called with output_attentions=True")
        hidden = call["hidden_states"]
        shape = (*hidden.shape[:-1], -1, self.attention_head_size)
        query, key, value = (proj(hidden).view(shape).transpose(1, 2)
                             for proj in (self.query, self.key, self.value))
        if rotary:
            query, key, value = _roformer_rotate(self, call.get("sinusoidal_pos"), query, key,
                                                 value)
        out, _ = _attention()(self, query, key, value,
                              _causal(self, call.get("attention_mask")),
                              scaling=1.0 / math.sqrt(self.attention_head_size), dropout=0.0)
        return out.reshape(*hidden.shape[:-1], self.all_head_size), None
    return forward


def _roformer_rotate(self, table, query, key, value):
    """q and k (and v where the layer says so) rotated as the layer's own
    ``apply_rotary_position_embeddings`` does, by the table rows
    :func:`~.counted_positions.table_at_positions` read at each token's position: ``[bs, T,
    D]`` there, indexed ``[None, None]`` by the encoder, so ``[1, 1, bs, T, D]`` here and
    ``[bs, 1, T, D]`` (one row a token, every head) handed on."""
    if not isinstance(table, torch.Tensor) or table.dim() != 5 or \
            tuple(table.shape[:2]) != (1, 1) or table.shape[-1] != query.shape[-1]:
        shape = tuple(table.shape) if isinstance(table, torch.Tensor) else table
        raise _refuse(self, f"handed sinusoidal_pos {shape}, where its encoder indexes the "
                            "position rows read at each token's position with [None, None]")
    table = table[0, 0].unsqueeze(1)
    if self.rotary_value:
        return self.apply_rotary_position_embeddings(table, query, key, value)
    query, key = self.apply_rotary_position_embeddings(table, query, key)
    return query, key, value


_BERT_STYLE_HOOKS = (
    _one_class("megatron_bert", "MegatronBertSelfAttention", "MegatronBERT",
               _bert_forward(_BERT_CALL)),
    _one_class("rembert", "RemBertSelfAttention", "RemBERT", _bert_forward(_BERT_CALL)),
)


@contextlib.contextmanager
def _roformer(model, names) -> Iterator[None]:
    """RoFormer: its self-attention through :func:`_bert_forward` with its rotation, and its
    sinusoid table read at each token's position, only where the table is its encoder's own
    and the encoder reads as :data:`KNOWN_SOURCES` says (the ``[None, None]`` indexing)."""
    classes, found = modeling_instances(
        model, "transformers.models.roformer.modeling_roformer",
        ("RoFormerSelfAttention", "RoFormerSinusoidalPositionalEmbedding", "RoFormerEncoder"),
        held=3)
    if not found:
        yield
        return
    attention, positions, encoder = classes
    owned = {id(m.embed_positions) for m in found
             if isinstance(m, encoder) and _taken(m, encoder, ("forward",))}
    for m in found:
        if isinstance(m, attention):
            own = _taken(m, attention,
                         ("forward", "__init__", "apply_rotary_position_embeddings"))
        elif isinstance(m, positions):
            own = id(m) in owned and _taken(m, positions, ("forward",))
        else:
            own = _taken(m, encoder, ("forward",))
        if not own:
            raise _refuse_layer(m, names, "RoFormer")
    with swapped_forward(attention, _bert_forward(_ROFORMER_CALL, rotary=True)), \
            swapped_forward(positions, table_at_positions(
                {id(m): 0 for m in found if isinstance(m, positions)})):
        yield
