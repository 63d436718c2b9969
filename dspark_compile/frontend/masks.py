"""Masks proven, not built: a model's mask function read as causal attention with an optional
left window or chunks.

The ragged op computes the mask itself, so the capture's mask builder (:func:`causal_only`,
registered for the capture's attention name, and :func:`proof_object` for models that call
``scaled_dot_product_attention`` themselves) builds no tensor. It reads transformers'
``masking_utils`` closures by structure, probes each leaf on real positions against the op's own
rule, and returns a proof (None for plain causal, a :class:`WindowMask`) or an
:class:`UnprovenMask` naming what it found; the attention call that receives a mask checks it
(:func:`check_mask`), so a model that builds a mask it never uses is not refused for it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .scope import active_scope, outside_trace
from .sparse import INDEXER_KEYS, IndexerMask

__all__ = ["UnprovenMask", "WindowMask", "all_ones", "built_proofs_pass", "causal_only",
           "check_mask", "filled_with", "proof_object", "prove"]

_CAUSAL = "causal_mask_function"
"""The causal leaf."""
_WINDOW = "sliding_window_overlay.<locals>.inner_mask"
"""The left-window leaf (its closure holds ``sliding_window``)."""
_CHUNK = "chunked_overlay.<locals>.inner_mask"
"""The chunk leaf (its closure holds ``chunk_size`` and ``left_padding``)."""
_AND = "and_masks.<locals>.and_mask"
"""Intersection of ``mask_functions``."""
_TRANSPARENT = {"remap_positions_for_packed_sequence.<locals>.inner_mask": "mask_function"}
"""Combinators that keep what their child computes within one request's positions."""
_OFFSETS = "add_offsets_to_mask_function.<locals>.inner_mask"
"""Shifts q and kv positions; transparent when both shifts are the same integer."""
_ALWAYS_TRUE_IN_VERIFY = {"packed_sequence_mask_function.<locals>.inner_mask"}
"""Leaves that hold for every pair a verify computes: each request is one sequence."""
_OR = "or_masks.<locals>.or_mask"
"""Union of ``mask_functions``: proven only where every child but one is never true."""
_BLOCKWISE = "blockwise_overlay.<locals>.inner_mask"
"""Unmasks the pairs within one non-text block (ids ``>= 0``; ``-1`` is text)."""


def causal_only(*args, mask_function=None, attention_mask=None, **kwargs):
    """Mask builder for the dspark implementation. The ragged op computes the mask itself, so
    no mask tensor is built; instead the model's own mask function (transformers'
    ``masking_utils`` closures) must be proven equal to causal attention with an optional left
    window or chunks: its leaves are read by structure (``causal_mask_function``, a
    sliding-window overlay, a chunk overlay, a same-sequence test that holds in a verify),
    combined only by intersection, position remapping or equal offsets, and each leaf is
    evaluated on probe positions against the ragged op's own rule; a union (``or_masks``)
    only where every child but one is a blockwise overlay over text ids the model filled
    itself (never true). Returns None (plain causal), a ``WindowMask``, or an
    ``UnprovenMask`` naming what was found: sliding-window variants, a window with chunks,
    bidirectional overlays, blockwise overlays over ids not known to be text, other unions,
    padding and mask functions of the model's own are refused by the layer that receives
    them."""
    if attention_mask is not None and not _masks_nothing(attention_mask):
        raise NotImplementedError("the model passed an attention_mask (padding) into the "
                                  "capture; verify takes none: padding is the layout's job")
    if mask_function is None:
        return None
    proof = prove(mask_function)
    if proof is None or not proof[0]:
        return UnprovenMask(_describe(mask_function))
    if proof[1] or proof[2] or kwargs.get("allow_is_causal_skip", True) is False:
        # a model that asks for the mask to be built (DSA indexers read it) gets a proof
        # object for plain causal too, never None
        return WindowMask(proof[1], proof[2])
    return None


_SAME_VALUES = frozenset({
    "aten._to_copy.default", "aten.view.default", "aten._unsafe_view.default",
    "aten.expand.default", "aten.slice.Tensor", "aten.unsqueeze.default",
    "aten.squeeze.dim", "aten.alias.default", "aten.clone.default", "aten.reshape.default"})
"""Ops whose output holds only values of their first input (ones stay ones, or True)."""


def _in_discovery() -> bool:
    """Whether this is the discovery forward, which runs without a trace: nothing there says
    where a tensor came from, so the provenance tests below let it pass there, and the trace,
    which every capture runs next over the same forward, decides."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    scope = active_scope()
    return get_proxy_mode() is None and scope is not None and scope.discovered is not None


def _masks_nothing(mask) -> bool:
    """:func:`all_ones` in the capture's trace (:func:`_in_discovery`: passes there)."""
    return _in_discovery() or all_ones(mask)


def all_ones(mask) -> bool:
    """Whether the padding mask ``mask`` is, in the capture's trace, a tensor of ones the
    model made itself (``torch.ones(bs, T)`` where the caller passed no mask: BioGPT): a
    padding mask that masks nothing, so the same as none. Anything else (a mask the trace did
    not make, another factory or fill, a computed mask, one written in place) is not."""
    values = filled_with(mask)
    return values is not None and all(v == 1 for v in values)


_FILLS = {"aten.ones.default": None, "aten.ones_like.default": None,
          "aten.new_ones.default": None, "aten.full.default": 1, "aten.full_like.default": 1,
          "aten.new_full.default": 2}
"""Factories of one value: the argument that holds it (None: ones)."""
_PAD = "aten.constant_pad_nd.default"
"""``F.pad`` with a constant: the input's values and the pad value (argument 2, default 0)."""


def filled_with(tensor) -> set | None:
    """The values of ``tensor`` where, in the capture's trace, the model made it itself with one
    of the fill factories (``torch.ones``, ``torch.full``, ...) and read it through casts, views,
    slices and constant pads only, with no in-place write to it or any tensor it came from so
    far: the fill and each pad value, cast as the chain casts them. None otherwise (no trace, a
    tensor the trace did not make, a computed one, one written in place)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

    mode = get_proxy_mode()
    if mode is None or not isinstance(tensor, torch.Tensor):
        return None
    slot = get_proxy_slot(tensor, mode.tracer, None)
    node = None if slot is None else slot.proxy.node
    chain = []
    while node is not None and (str(node.target) in _SAME_VALUES or str(node.target) == _PAD):
        chain.append(node)
        node = node.args[0] if node.args and hasattr(node.args[0], "target") else None
    if node is None or str(node.target) not in _FILLS:
        return None
    if any(_writes(user, seen) for seen in (node, *chain) for user in seen.users):
        return None
    at = _FILLS[str(node.target)]
    values = {1 if at is None else node.args[at] if len(node.args) > at else None}
    for step in (node, *reversed(chain)):
        if str(step.target) == _PAD:
            values.add(step.args[2] if len(step.args) > 2 else step.kwargs.get("value", 0))
        values = {_cast(v, step) for v in values}
        if None in values:
            return None
    return values


def _cast(value, node):
    """``value`` as the output of ``node`` holds it (its dtype), or None if either is not
    known (a symbolic fill, no tensor metadata)."""
    val = node.meta.get("val")
    if type(value) not in (bool, int, float) or not isinstance(val, torch.Tensor):
        return None
    with outside_trace():
        return torch.tensor(value, dtype=torch.float64).to(val.dtype).item()


def _never_true(fn) -> bool:
    """Whether the leaf ``fn`` is false on every pair: a blockwise overlay whose ids are all
    text (negative) fills the model made itself, as Gemma 4's multimodal models build when
    given no ``mm_token_type_ids``, the only way a verify calls them (:func:`_in_discovery`:
    passes there)."""
    if _hf_mask_name(fn) != _BLOCKWISE:
        return False
    if _in_discovery():
        return True
    values = filled_with(_closure(fn, "block_sequence_ids"))
    return values is not None and all(v < 0 for v in values)


def _writes(node, source) -> bool:
    """Whether ``node`` writes ``source`` (an argument its schema marks written), or, where its
    output aliases its input (any view: a slice, a select, a transpose), whether a user of that
    output does. A node that is no aten op is taken as a write."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return True
    given = [*zip(schema.arguments, node.args),
             *((a, node.kwargs[a.name]) for a in schema.arguments if a.name in node.kwargs)]
    for arg, value in given:
        if value is source and arg.alias_info is not None and arg.alias_info.is_write:
            return True
    if any(r.alias_info is not None for r in schema.returns):
        return any(_writes(user, node) for user in node.users)
    return False


@dataclass(frozen=True)
class UnprovenMask:
    """What the mask builder returns for a mask it cannot prove. A model may build masks it
    never uses (one per layer type), so the refusal comes from the attention call that
    receives it (``check_mask``), naming the layer."""

    description: str


@dataclass(frozen=True)
class WindowMask:
    """A mask proven equal to causal attention over the last ``window`` positions, or (with
    ``chunk``) over the positions of the query's own chunk of ``chunk``."""

    window: int
    chunk: int = 0

    def __getitem__(self, key):
        """A DSA layer hands its indexer ``mask[:, 0, :, :]`` (``[:, 0]``): an
        :class:`IndexerMask` of the same proof. Slices that keep every row of every axis
        (``[:, :, 0:, :]``: Gemma 4 keeping ``logits_to_keep=0`` rows before its KV-shared
        layers) are the same mask. Any other indexing is refused: what it would select is not
        proven."""
        if isinstance(key, tuple) and key in INDEXER_KEYS:
            return IndexerMask(self.window, self.chunk)
        if _keeps_everything(key):
            return self
        raise NotImplementedError(
            f"the model indexes its attention mask with {key!r}; dspark_compile proves masks "
            "instead of building them and understands only the head axis dropped for a "
            "DeepSeek Sparse Attention indexer ([:, 0, :, :] or [:, 0]), so the model is "
            "refused rather than verified wrong")


def _keeps_everything(key) -> bool:
    """``key`` is a slice, or a tuple of slices, that selects every row of each axis it
    indexes (start 0 or none, no stop, step 1 or none)."""
    keys = key if isinstance(key, tuple) else (key,)
    return bool(keys) and all(
        isinstance(k, slice) and k.stop is None and
        all(x is None or (type(x) is int and x == keep) for x, keep in ((k.start, 0),
                                                                        (k.step, 1)))
        for k in keys)


def _hf_mask_name(fn) -> str | None:
    """The qualified name of a transformers ``masking_utils`` mask function, else None."""
    if getattr(fn, "__module__", None) != "transformers.masking_utils":
        return None
    return getattr(fn, "__qualname__", None)


def _closure(fn, var: str):
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
    return cells[var].cell_contents if var in cells else None


def _children(fn, var: str) -> tuple:
    value = _closure(fn, var)
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def prove(fn) -> tuple[bool, int, int] | None:
    """``(causal, window, chunk)`` that ``fn`` equals on every (query, key) pair of a verify,
    where ``causal`` says whether keys after the query are hidden, ``window`` is the left
    window and ``chunk`` the chunk size (0: none); None when ``fn`` is anything else."""
    name = _hf_mask_name(fn)
    if name == _CAUSAL:
        return (True, 0, 0) if _probe(fn, True, 0) else None
    if name == _WINDOW:
        window = _closure(fn, "sliding_window")
        if not _positive_int(window):
            return None
        return (False, window, 0) if _probe(fn, False, window) else None
    if name == _CHUNK:
        chunk = _closure(fn, "chunk_size")
        if not _positive_int(chunk):
            return None
        leaf = _without_left_padding(fn)
        return (False, 0, chunk) if leaf is not None and _probe(leaf, False, 0, chunk) \
            else None
    if name in _ALWAYS_TRUE_IN_VERIFY:
        return (False, 0, 0)
    if name in _TRANSPARENT:
        (child,) = _children(fn, _TRANSPARENT[name])
        return prove(child)
    if name == _OFFSETS:
        q_off, kv_off = _closure(fn, "q_offset"), _closure(fn, "kv_offset")
        if not (isinstance(q_off, int) and isinstance(kv_off, int) and q_off == kv_off):
            return None
        proof = prove(_closure(fn, "mask_function"))
        # equal shifts keep differences (causal, windows), not chunk edges unless whole chunks
        return proof if proof is None or not proof[2] or q_off % proof[2] == 0 else None
    if name == _OR:  # a union with leaves that are never true is its one other child
        kept = [k for k in _children(fn, "mask_functions") if not _never_true(k)]
        return prove(kept[0]) if len(kept) == 1 else None
    if name == _AND:
        parts = [prove(k) for k in _children(fn, "mask_functions")]
        if any(p is None for p in parts):
            return None
        windows = [w for _, w, _ in parts if w]
        chunks = {c for _, _, c in parts if c}
        if len(chunks) > 1 or (chunks and windows):
            return None  # two chunk sizes, or a window within chunks: not implemented
        return any(c for c, _, _ in parts), min(windows, default=0), min(chunks, default=0)
    return None


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _without_left_padding(fn):
    """The chunk leaf ``fn`` with its ``left_padding`` closure cell replaced by real zeros, to
    be probed outside the trace; None if the cell is not a 1-D integer tensor.

    transformers makes ``left_padding`` from the attention mask (``create_chunked_causal_mask``:
    zeros when there is none), and a verify capture never passes one (``causal_only`` refuses
    it before any leaf is read), so the zeros are the values the model computes with."""
    import types

    padding = _closure(fn, "left_padding")
    if not isinstance(padding, torch.Tensor) or padding.dim() != 1 or \
            padding.dtype not in (torch.int32, torch.int64):
        return None
    with outside_trace():
        zeros = torch.zeros(1, dtype=padding.dtype)
    cells = tuple(types.CellType(zeros) if var == "left_padding" else cell
                  for var, cell in zip(fn.__code__.co_freevars, fn.__closure__))
    return types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, cells)


_PROBE_SPAN = 64
"""Positions probed past each window edge."""


def _probe(fn, causal: bool, window: int, chunk: int = 0) -> bool:
    """Evaluate the leaf ``fn`` itself on real index tensors (outside the trace) at query
    positions around 0, the window or chunk edges and far out, and check it equals the rule the
    proof claims for it: ``k <= q`` (causal), ``k > q - window`` (window) and
    ``k // chunk == q // chunk`` (chunk; keys probed below the chunk too)."""
    span = window or chunk
    edges = {0, 1, 2, _PROBE_SPAN, 10_007} | ({span - 1, span, span + 1, 2 * span + 3}
                                             if span else set())
    with outside_trace():
        for q in sorted(e for e in edges if e >= 0):
            kv = torch.arange(max(0, q - span - _PROBE_SPAN), q + _PROBE_SPAN)
            qi = torch.full_like(kv, q)
            zero = torch.zeros_like(kv)
            got = torch.as_tensor(fn(zero, zero, qi, kv), dtype=torch.bool).expand_as(kv)
            want = (kv <= qi) if causal else (kv // chunk == qi // chunk) if chunk else \
                (kv > qi - window)
            if not torch.equal(got, want):
                return False
    return True


def _describe(fn) -> str:
    name = _hf_mask_name(fn)
    if name == _AND or name in _TRANSPARENT or name == _OFFSETS or name == _OR:
        var = {_AND: "mask_functions", _OR: "mask_functions",
               _OFFSETS: "mask_function", **_TRANSPARENT}[name]
        parts = ", ".join(_describe(k) for k in _children(fn, var))
        return f"{name.split('.')[0]}({parts})"
    if name == _WINDOW:
        return f"sliding_window_overlay({_closure(fn, 'sliding_window')!r})"
    if name == _CHUNK:
        return f"chunked_overlay({_closure(fn, 'chunk_size')!r})"
    return name.split(".")[0] if name else getattr(fn, "__qualname__", repr(fn))


def check_mask(where: str, attention_mask) -> tuple[int, int]:
    """``(window, chunk)`` a layer's mask proves (both 0: plain causal); anything else is
    refused."""
    if attention_mask is None:
        return 0, 0
    if isinstance(attention_mask, WindowMask):
        return attention_mask.window, attention_mask.chunk
    what = f"builds {attention_mask.description}" if isinstance(attention_mask, UnprovenMask) \
        else f"passes a mask of type {type(attention_mask).__name__} built outside the capture"
    raise NotImplementedError(
        f"{where}: the model {what}, not causal attention with an optional left window or "
        "chunks. dspark::ragged_attention computes causal, sliding-window and chunked "
        "attention only (bidirectional, blockwise or padding masks are not implemented), so "
        "the model is refused rather than verified wrong")




@contextlib.contextmanager
def built_proofs_pass():
    """For the duration of a capture, a mask proof handed back into transformers' mask
    creation is returned as it is, as transformers returns a 4-D mask it already built: a
    multimodal wrapper (PaliGemma) builds the mask and passes it to its text model, whose own
    ``create_causal_mask`` would otherwise read it as a padding mask. The early exit is
    transformers' own for a built mask (its 7-tuple, the same in 5.17 and 5.24)."""
    from transformers import masking_utils

    original = masking_utils._preprocess_mask_arguments

    def preprocess(config, inputs_embeds, attention_mask, *args, **kwargs):
        if isinstance(attention_mask, WindowMask):
            return True, attention_mask, None, None, None, None, None
        return original(config, inputs_embeds, attention_mask, *args, **kwargs)

    masking_utils._preprocess_mask_arguments = preprocess
    try:
        yield
    finally:
        masking_utils._preprocess_mask_arguments = original


def proof_object(*args, **kwargs):
    """``causal_only`` for models that test ``mask is None`` on their own: plain causal comes
    back as ``WindowMask(0)`` so the model never branches on its (symbolic) length."""
    proof = causal_only(*args, **kwargs)
    return WindowMask(0) if proof is None else proof
