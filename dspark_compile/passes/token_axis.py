"""token_axis: label every value's token axes and prove every op outside the ragged families
is token-wise. Analysis only; the graph is not changed.

Labels come from the symbolic shapes (sympy): a dimension of size ``bs`` is the request axis,
``T`` the per-request token axis, ``bs*T`` the flat token axis, and ``bs*T*c`` (``c`` a static
factor) a flat axis whose rows are ``c`` consecutive sub-rows per token (Qwen3.5's GDN runs
its gated norm over ``core_attn_out.reshape(-1, head_v_dim)``: ``[bs*T*Hv, V]``; its flat
form is ``[N*Hv, V]``); ``c*bs`` is a static axis merged in front of the request axis
(transformers 5.17's mRoPE batches its rotary matmul over ``[3*bs, ...]``; flat form ``[3,
...]``). Any other size that involves ``bs`` or ``T`` (``2*T``, ``T*H``)
means the op mixed the token axis into another one, and is refused. Per value::

    token-major   [bs, T, 64], [bs, H, T, D]     rows of requests' tokens
    flat          [bs*T, 64], [bs*T*4, 16]        the same rows, merged (times a factor)
    request       [bs, pages] (from the layout)  one row per request
    broadcast     [bs, 32, 1] (expand of a weight) the same for every request
    global        [64, 64]                        weights, constants

Ops, by family (checked in that order)::

    %o = dspark.dense_cached_attention(%q, %k, %v, ...)   known ragged family: allowed
    %o = aten.mul.Tensor(%a, %b)                         pointwise: token dims must line up
    %o = aten.view.default(%x, [%bs, %T, -1, 16])        layout: bs before T, both whole
    %o = aten.view.default(%x, [-1, 16])  [bs,T,4,16]->[bs*T*4,16]: token-major order kept
    %o = aten.mm.default(%x, %w)                         linear: %w global, K not a token dim
    %o = aten.bmm.default(%w_rows, %x)  [N*k, M, K] @ [N*k, K, 1]: batched over flat rows
    %o = aten.index.Tensor(%w, [%ids])   [E, M, K][N*k] -> [N*k, M, K]: %w global, like embedding
    %o = aten.index_put_(%x, [%mask], %v)  x[mask] = v: mask on x's token dims, v one scalar
    %o = aten.mean.dim(%x, [-1], True)                   dim op: dims must not be token dims
    %o = aten.stack.default([%a, %b], -1)      along a non-token dim, whatever the op's name:
    %o = aten.scatter.value(%x, -1, %ids, -inf)  operands hold %x's token axes at its dims
    %o = aten.ones_like.default(%x)                      constant fill: token-wise by shape
    %o = aten.repeat.default(%x, [4, 1])   [N, H] -> [4*N, H]: 4 tiles, the factor in front
    %o = aten.cumsum.default(%x, 1)    on [bs, T, ...]   refused: mixes tokens

A refusal names the op, the model source line (``node.meta["stack_trace"]``) and what to do.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from ..graph_inputs import REQUEST_KINDS
from ..ops import DENSE_OPS, RAGGED_OPS
from .base import PassContext, PassResult, RefusedOp

__all__ = ["AxisLabel", "label_of", "run", "TokenAxisError"]

aten = torch.ops.aten

# Ops that only move, copy or cast data: the shape labels alone say whether they are safe.
# view_as_complex / view_as_real fold and unfold a trailing pair of size 2 (never a token dim).
LAYOUT_OPS = {
    aten.view, aten._unsafe_view, aten.reshape, aten.unsqueeze, aten.squeeze,
    aten.transpose, aten.permute, aten.t, aten.expand, aten.clone, aten._to_copy,
    aten.alias, aten.detach, aten.slice, aten.contiguous, aten.lift_fresh_copy,
    aten.view_as_complex, aten.view_as_real,
}
# Elementwise (broadcasting) ops that torch does not tag ``pointwise``.
ELEMENTWISE_OPS = {aten.polar, aten.complex}
# Ops whose semantics are "along these dims": arg index of the dim (or dim list). Each treats
# every fibre along its dims on its own, so it is token-wise exactly when those dims avoid the
# token axes and its tensor operands line up (checked by family below).
DIM_OPS = {
    aten.mean: 1, aten.sum: 1, aten.amax: 1, aten.amin: 1, aten.var: 1, aten.std: 1,
    aten.var_mean: 1, aten.prod: 1, aten.argmax: 1, aten.argmin: 1, aten.max: 1,
    aten.min: 1, aten.logsumexp: 1, aten.norm: 2, aten.linalg_vector_norm: 2,
    aten.nansum: 1, aten.any: 1, aten.all: 1, aten.count_nonzero: 1, aten.median: 1,
    aten.nanmedian: 1, aten.mode: 1, aten.kthvalue: 2,
    aten._softmax: 1, aten._log_softmax: 1, aten.softmax: 1, aten.log_softmax: 1, aten.glu: 1,
    aten.cumsum: 1, aten.cumprod: 1, aten.cummax: 1, aten.cummin: 1, aten.logcumsumexp: 1,
    aten.sort: 1, aten.argsort: 1, aten.topk: 2, aten.flip: 1, aten.roll: 2,
    aten.cat: 1, aten.stack: 1,
    aten.split: 2, aten.split_with_sizes: 2, aten.unsafe_split: 2, aten.chunk: 2,
    aten.unsafe_chunk: 2, aten.tensor_split: 2, aten.unbind: 1, aten.select: 1,
    aten.narrow: 1,
    aten.index_select: 1, aten.gather: 1,
    aten.scatter: 1, aten.scatter_: 1, aten.scatter_add: 1, aten.scatter_add_: 1,
    aten.scatter_reduce: 1, aten.scatter_reduce_: 1, aten.index_add: 1, aten.index_add_: 1,
    aten.index_copy: 1, aten.index_copy_: 1, aten.index_fill: 1, aten.index_fill_: 1,
}
# Dim ops over a list of tensors that must all hold the same token axes.
_JOIN_OPS = {aten.cat, aten.stack}
# Dim ops whose index (and src) give each row of ``self`` its own entries: they must hold the
# same token axes as ``self``.
_PER_ROW_INDEX_OPS = {aten.gather, aten.scatter, aten.scatter_, aten.scatter_add,
                      aten.scatter_add_, aten.scatter_reduce, aten.scatter_reduce_}
# Dim ops with one 1-D index along ``dim``, the same for every row: it must hold no token
# axis (an id per token along another dim would write one token's values into other rows).
_INDEX_VECTOR_OPS = {aten.index_select, aten.index_add, aten.index_add_, aten.index_copy,
                     aten.index_copy_, aten.index_fill, aten.index_fill_}
# Normalisations over the trailing dims ``normalized_shape`` (arg 1) names; torch 2.11 keeps
# nn.RMSNorm as one _fused_rms_norm op where 2.13 decomposes it.
NORM_OPS = {aten.native_layer_norm, aten.layer_norm, aten._fused_rms_norm, aten.rms_norm}
# Dim ops that are undefined without a dim argument over the whole tensor (mixing it all).
_WHOLE_TENSOR_DEFAULT = {aten.mean, aten.sum, aten.amax, aten.amin, aten.var, aten.std,
                         aten.prod, aten.argmax, aten.argmin, aten.max, aten.min, aten.norm,
                         aten.linalg_vector_norm, aten.var_mean, aten.nansum, aten.any,
                         aten.all, aten.count_nonzero, aten.median, aten.nanmedian,
                         aten.roll}

# Dim ops whose dim argument defaults to the last dim (topk over the experts of each token).
_LAST_DIM_DEFAULT = {aten.topk, aten.sort, aten.argsort, aten.mode, aten.kthvalue, aten.glu}

# Factories whose every element is the same constant (never the row's position, as arange's
# are): token-wise whatever their shape, given the shape keeps the request axis before the
# token axis. ``*_like`` take the shape of their input; the others an explicit size (arg
# index of the size list).
LIKE_FACTORIES = {aten.zeros_like, aten.ones_like, aten.full_like, aten.empty_like}
SIZED_FACTORIES = {aten.full: 0, aten.zeros: 0, aten.ones: 0, aten.empty: 0, aten.new_full: 1,
                   aten.new_zeros: 1, aten.new_ones: 1, aten.new_empty: 1}


class TokenAxisError(RefusedOp):
    """An op mixes the token axis in a way no pass can rewrite."""


@dataclass(frozen=True)
class AxisLabel:
    """Where a value's token axes are. All None: a global value."""

    bs_dim: int | None = None
    """Dim of size ``bs_factor*bs`` (the request axis)."""
    t_dim: int | None = None
    """Dim of size ``T`` (tokens of one request)."""
    flat_dim: int | None = None
    """Dim of size ``bs*T*flat_factor`` (the flat token axis)."""
    flat_factor: int = 1
    """Sub-rows per token of the flat axis (1: one row per token)."""
    flat_outer: bool = False
    """The flat axis's ``flat_factor`` sits in front of the tokens (``[c, bs*T] -> [c*bs*T]``:
    ``c`` blocks of every token's row, as ``repeat`` tiles them for Llama 4's experts) instead
    of behind them (``[bs*T, c] -> [bs*T*c]``: token-major). The shape alone cannot tell the
    two apart; :func:`label_graph` follows each value's producer."""
    bs_factor: int = 1
    """A static axis merged in front of the request axis (``[c, bs] -> [c*bs]``: batched
    matmuls over mRoPE sections, transformers 5.17); its flat form keeps ``c``."""
    from_request: bool = False
    """Derived from per-request layout inputs (block tables, context lengths)."""

    @property
    def token_dims(self) -> tuple[int, ...]:
        return tuple(d for d in (self.bs_dim, self.t_dim, self.flat_dim) if d is not None)

    @property
    def kind(self) -> str:
        if self.flat_dim is not None or (self.bs_dim is not None and self.t_dim is not None):
            return "token"
        if self.t_dim is not None:
            return "per-position"
        if self.bs_dim is not None:
            return "request" if self.from_request else "broadcast"
        return "global"


def _dim_label(size, bs: sympy.Symbol, tokens: sympy.Symbol) -> tuple[str, int] | None:
    """``(kind, flat factor)`` of one size: bs, t, flat (``bs*T*c``), mixed; None if neither."""
    if not isinstance(size, torch.SymInt):
        return None  # a static size holds neither symbol
    return _expr_label(size.node.expr, bs, tokens)


@functools.lru_cache(maxsize=4096)
def _expr_label(expr: sympy.Expr, bs: sympy.Symbol,
                tokens: sympy.Symbol) -> tuple[str, int] | None:
    """:func:`_dim_label` of a symbolic size (a graph repeats a few sizes thousands of times,
    and each ``sympy.cancel`` costs about a millisecond)."""
    if not expr.free_symbols & {bs, tokens}:
        return None
    if expr == bs or expr == bs + 1:  # bs + 1: query_start_loc, one entry per request + 1
        return "bs", 1
    if expr == tokens:
        return "t", 1
    per_request = sympy.cancel(expr / bs)
    if per_request.is_Integer and per_request > 0:
        return "bs", int(per_request)
    factor = sympy.cancel(expr / (bs * tokens))
    if factor.is_Integer and factor > 0:
        return "flat", int(factor)
    return "mixed", 1


def label_of(val: torch.Tensor, bs: sympy.Symbol, tokens: sympy.Symbol,
             from_request: bool = False) -> AxisLabel | str:
    """The label of a (fake) tensor value, or a string saying why it has none."""
    found: dict[str, int] = {}
    factor = bs_factor = 1
    for d, size in enumerate(val.shape):
        label = _dim_label(size, bs, tokens)
        if label is None:
            continue
        kind, c = label
        if kind == "mixed" or kind in found:
            return f"its shape {tuple(val.shape)} merges the token axis with another axis"
        found[kind] = d
        factor = c if kind == "flat" else factor
        bs_factor = c if kind == "bs" else bs_factor
    if "flat" in found and len(found) > 1:
        return f"its shape {tuple(val.shape)} holds the flat token axis twice"
    return AxisLabel(found.get("bs"), found.get("t"), found.get("flat"), flat_factor=factor,
                     from_request=from_request, bs_factor=bs_factor)


# ---------------------------------------------------------------------- labelling
def _tensor_args(node: fx.Node) -> list[fx.Node]:
    out = []
    for a in node.all_input_nodes:
        if isinstance(a.meta.get("val"), torch.Tensor):
            out.append(a)
    return out


def label_graph(gm: fx.GraphModule, bs: sympy.Symbol, tokens: sympy.Symbol) -> None:
    """Store an :class:`AxisLabel` (or a reason string) in ``node.meta["dspark_axis"]``."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, (tuple, list)):
            val = next((v for v in val if isinstance(v, torch.Tensor)), None)
        if not isinstance(val, torch.Tensor):
            continue
        spec = node.meta.get("dspark_input")
        from_request = (spec is not None and spec.kind in REQUEST_KINDS) or any(
            isinstance(a.meta.get("dspark_axis"), AxisLabel) and a.meta["dspark_axis"].from_request
            for a in node.all_input_nodes)
        label = label_of(val, bs, tokens, from_request)
        if isinstance(label, AxisLabel) and label.flat_dim is not None and label.flat_factor > 1:
            label = _flat_order(node, label)
        node.meta["dspark_axis"] = label


def _flat_order(node: fx.Node, label: AxisLabel) -> AxisLabel:
    """``label`` with its flat factor in front of the tokens where ``node`` put it there: a
    view of ``[c, N, ...]`` to ``[c*N, ...]`` (the same product in front of the tokens), a
    ``repeat`` that tiles the flat rows; any other op keeps the order of an operand with the
    same factor. The checks refuse what does not line up."""
    outer = dataclasses.replace(label, flat_outer=True)
    inputs = [a for a in node.all_input_nodes if isinstance(a.meta.get("dspark_axis"), AxisLabel)
              and isinstance(a.meta.get("val"), torch.Tensor)]
    packet = _packet(node) if node.op == "call_function" else None
    x = node.args[0] if node.args and node.args[0] in inputs else None
    if packet in (aten.view, aten._unsafe_view, aten.reshape) and x is not None:
        lab_in, shape = axis(x), node.meta["val"].shape
        if lab_in.token_dims and _token_ordered(lab_in):
            front = _prefix(x.meta["val"].shape, lab_in)
            if _prefix(shape, label) != front and _prefix(shape, outer) == front:
                return outer
        return label
    if packet is aten.repeat and x is not None:
        lab_in = axis(x)
        if lab_in.flat_dim is not None and lab_in.flat_factor != label.flat_factor:
            return outer  # tiles of the rows ([r, N] from [N], [r, c, N] from [c, N])
    for a in inputs:
        lab = a.meta["dspark_axis"]
        if lab.flat_dim is not None and lab.flat_factor == label.flat_factor:
            return dataclasses.replace(label, flat_outer=lab.flat_outer)
    return label


def axis(node: fx.Node) -> AxisLabel:
    label = node.meta.get("dspark_axis", AxisLabel())
    assert isinstance(label, AxisLabel), f"{node.name} has no valid axis label: {label}"
    return label


# ---------------------------------------------------------------------- checks
def _packet(node: fx.Node):
    target = node.target
    return getattr(target, "overloadpacket", target)


def _norm_dims(dims, rank: int) -> list[int]:
    if dims is None:
        return list(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    return [d % rank if rank else 0 for d in dims]


def is_pointwise(node: fx.Node) -> bool:
    """An elementwise op: tagged pointwise, one of :data:`ELEMENTWISE_OPS`, or ``copy_``."""
    packet = _packet(node)
    return packet is aten.copy_ or packet in ELEMENTWISE_OPS or (
        isinstance(node.target, torch._ops.OpOverload) and torch.Tag.pointwise in
        node.target.tags)


def _check_pointwise(node: fx.Node, out: AxisLabel) -> str | None:
    rank = node.meta["val"].dim()
    for a in _tensor_args(node):
        lab = axis(a)
        if lab.kind == "request":
            return (f"the per-request value {a.name} {tuple(a.meta['val'].shape)} meets token "
                    "rows; per-request values may only feed the ragged ops")
        shift = rank - a.meta["val"].dim()
        if lab.bs_dim is not None and lab.bs_factor != out.bs_factor:
            return (f"operand {a.name} merges {lab.bs_factor} rows into its request axis but "
                    f"the result {out.bs_factor}")
        if lab.flat_dim is not None and lab.flat_factor != out.flat_factor:
            return (f"operand {a.name} has {lab.flat_factor} rows per token but the result "
                    f"{out.flat_factor}")
        if lab.flat_dim is not None and lab.flat_outer != out.flat_outer:
            return (f"operand {a.name} holds its flat rows in {_order(lab)} but another "
                    f"operand in {_order(out)}")
        for mine, theirs in ((lab.bs_dim, out.bs_dim), (lab.t_dim, out.t_dim),
                             (lab.flat_dim, out.flat_dim)):
            if mine is not None and mine + shift != theirs:
                return f"operand {a.name} has its token axis at a different dim than the result"
    return None


def _check_layout(node: fx.Node, out: AxisLabel) -> str | None:
    packet = _packet(node)
    labels = [axis(a) for a in _tensor_args(node)]
    for lab in [out, *labels]:
        if lab.kind == "token" and lab.flat_dim is None and lab.bs_dim > lab.t_dim:
            return "it puts the token axis before the request axis"
    if packet in (aten.view, aten._unsafe_view, aten.reshape):
        return _check_view(node.args[0], node, labels[0], out)
    if packet is aten.slice:
        x, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
        lab = axis(x)
        dim = dim % x.meta["val"].dim()
        if dim in lab.token_dims and node.meta["val"].shape[dim] != x.meta["val"].shape[dim]:
            return "it slices along the token axis"
    return None


def _order(lab: AxisLabel) -> str:
    """How a flat axis holds its rows, in words."""
    if lab.flat_factor == 1:
        return "one row per token"
    if lab.flat_outer:
        return f"{lab.flat_factor} tiles of every token's row ([{lab.flat_factor}, N] order)"
    return f"token-major order ({lab.flat_factor} rows per token, [N, {lab.flat_factor}])"


def _segments(shape, lab: AxisLabel) -> list:
    """Products of the sizes before, between and after the token axes."""
    cuts = sorted(d for d in (lab.bs_dim, lab.t_dim) if d is not None)
    bounds = [-1, *cuts, len(shape)]
    out = [sympy.prod([sympy.sympify(s.node.expr if isinstance(s, torch.SymInt) else s)
                       for s in shape[a + 1:b]]) for a, b in zip(bounds, bounds[1:])]
    out[0] *= lab.bs_factor  # [c*bs] is [c, bs]: c belongs to the sizes before the request axis
    return out


def _token_ordered(lab: AxisLabel) -> bool:
    """Rows in token-major order: a flat axis, or the request axis right before the token axis."""
    return lab.flat_dim is not None or (lab.bs_dim is not None and lab.t_dim == lab.bs_dim + 1)


def _prefix(shape, lab: AxisLabel):
    """Product of the sizes in front of the tokens: before the first token axis, times a
    static factor merged in front of the request axis or the flat axis (``[c*bs]``, an outer
    ``[c*bs*T]``). Read as ``[prefix, bs, T, rest]``, a value keeps its rows under a view
    exactly when the view keeps this product."""
    first = min(lab.token_dims)
    front = lab.bs_factor * (lab.flat_factor if lab.flat_outer else 1)
    return front * sympy.prod([sympy.sympify(s.node.expr if isinstance(s, torch.SymInt) else s)
                               for s in shape[:first]])


def _check_factor_view(x: fx.Node, node: fx.Node, lab_in: AxisLabel,
                       out: AxisLabel) -> str | None:
    """A view to or from ``bs*T*c`` rows keeps token-major order with the same leading dims."""
    if not (_token_ordered(lab_in) and _token_ordered(out)) or \
            _prefix(x.meta["val"].shape, lab_in) != _prefix(node.meta["val"].shape, out):
        return ("it merges the token axis with a neighbouring axis out of token-major order "
                "(only [bs, T, c, ...] <-> [bs*T*c, ...] keeps each token's rows together)")
    return None


def _check_bs_factor_view(x: fx.Node, node: fx.Node, lab_in: AxisLabel,
                          out: AxisLabel) -> str | None:
    """A view to or from ``[c*bs, ...]`` only merges or splits ``[c, bs]``, in that order."""
    if lab_in.bs_dim is None or out.bs_dim is None or lab_in.flat_dim is not None or \
            out.flat_dim is not None or (lab_in.t_dim is None) != (out.t_dim is None) or \
            _segments(x.meta["val"].shape, lab_in) != _segments(node.meta["val"].shape, out):
        return ("it merges a static axis into the request axis out of order (only "
                "[c, bs, ...] <-> [c*bs, ...] keeps each request's rows apart)")
    return None


def _check_view(x: fx.Node, node: fx.Node, lab_in: AxisLabel, out: AxisLabel) -> str | None:
    """A reshape may merge/split [bs, T] <-> [bs*T] (<-> [bs*T*c] in token-major order), or
    reshape around axes that stay put."""
    if (lab_in.flat_dim is not None and lab_in.flat_factor != 1) or \
            (out.flat_dim is not None and out.flat_factor != 1):
        return _check_factor_view(x, node, lab_in, out)

    if lab_in.bs_factor != 1 or out.bs_factor != 1:
        return _check_bs_factor_view(x, node, lab_in, out)

    def separate_non_adjacent(lab, shape):
        # only size-1 dims between the request and the token axis ([bs, 1, T]) keep rows in
        # token-major order, as if they were adjacent
        return lab.kind == "token" and lab.flat_dim is None and lab.t_dim != lab.bs_dim + 1 \
            and not (lab.bs_dim < lab.t_dim and _segments(shape, lab)[1] == 1)
    if not (separate_non_adjacent(lab_in, x.meta["val"].shape) or
            separate_non_adjacent(out, node.meta["val"].shape)):
        return None
    # both sides keep a request axis and a token axis apart, with the same products before,
    # between and after them: the view regroups static dims within those segments only (e.g.
    # [bs, T, r] -> [bs, 1, T, r]), so every (request, token) keeps its own entries
    if _kinds(lab_in) == _kinds(out) and _segments(x.meta["val"].shape, lab_in) == \
            _segments(node.meta["val"].shape, out):
        return None
    return "it reshapes across a request axis and a token axis that are not adjacent"


def _check_linear(node: fx.Node) -> str | None:
    packet = _packet(node)
    args = node.args[1:] if packet is aten.addmm else node.args
    a, b = args[0], args[1]
    la, lb = axis(a), axis(b)
    if packet in (aten.mm, aten.addmm):
        if 1 in la.token_dims or 0 in lb.token_dims:
            return "it contracts over the token axis"
        if lb.token_dims:
            return "its right operand holds token rows (token rows multiplied by token rows)"
        return None
    # bmm: batch dim may be the request axis when one side is a broadcast weight.
    if 2 in la.token_dims or 1 in lb.token_dims:
        return "it contracts over the token axis"
    if la.token_dims == lb.token_dims == (0,) and la.flat_dim == lb.flat_dim == 0:
        if _axes(la) != _axes(lb):  # row i of one is not row i of the other
            return (f"its operands hold flat rows in different orders ({_order(la)} against "
                    f"{_order(lb)}): only rows in the same token-major order or the same "
                    "tiling pair up")
        return None  # one product per flat row: a (token, expert) row times its gathered weights
    if la.kind == "token" and lb.kind == "token":
        return "both operands hold token rows (tokens attend to tokens outside cached attention)"
    if {la.kind, lb.kind} - {"token", "broadcast", "global"}:
        return "a per-request value meets token rows"
    return None


def _check_gather(node: fx.Node) -> str | None:
    """``aten.index.Tensor(%w, [%ids])``: rows of a global table picked per token (expert
    weights by each token's expert ids), like an embedding."""
    table, indices = node.args[0], node.args[1]
    lab = axis(table)
    if lab.token_dims:
        # x[..., idx, ...]: fixed entries of every token's own row, picked along non-token
        # dims by indices that hold no tokens, in one block (torch moves the dims of split
        # index blocks to the front)
        used = [d for d, i in enumerate(indices) if i is not None]
        if any(d in lab.token_dims or (lab.flat_dim is not None and d == lab.flat_dim)
               for d in used) or any(axis(indices[d]).kind not in ("global", "broadcast")
                                     for d in used) or \
                used != list(range(used[0], used[-1] + 1)):
            return ("it gathers rows of a token value by index (a token would read another "
                    "token's row); index only weights or constants by per-token ids, or a "
                    "token value along its other dims by constant indices")
        return None
    used = [i for i in indices if i is not None]
    if indices[0] is None or len(used) != 1:
        return ("it indexes a table with several index tensors or not along its first dim; "
                "only table[ids] with one per-token index tensor is known to be token-wise")
    return None


def _check_masked_fill(node: fx.Node) -> str | None:
    """``x[mask] = value`` (``index_put(x, [mask], value)``): an elementwise select when the
    one index is a boolean mask holding ``x``'s token axes at the same dims and the value is
    one scalar; per-position values (the i-th value to the i-th hit) or integer indices along a
    token axis would move values between tokens."""
    x, indices, values = node.args[0], node.args[1], node.args[2]
    lab = axis(x)
    used = [i for i in indices if i is not None]
    if len(used) != 1 or indices[0] is None or used[0].meta["val"].dtype != torch.bool:
        return ("it writes by index tensors; only x[mask] = scalar with one boolean mask over "
                "x's leading dims is known to be token-wise")
    mask = used[0]
    lm = axis(mask)
    if _axes(lm) != _axes(lab) or not set(lab.token_dims) <= set(range(mask.meta["val"].dim())):
        return (f"its mask {mask.name} {tuple(mask.meta['val'].shape)} does not hold the token "
                f"axes of {x.name} {tuple(x.meta['val'].shape)} at the same dims")
    if not isinstance(values, fx.Node) or values.meta["val"].numel() != 1 or axis(values).token_dims:
        return ("it writes a tensor of values in mask order (the i-th value to the i-th masked "
                "entry mixes tokens); only one scalar value is known to be token-wise")
    return None


def _arg(node: fx.Node, index: int):
    """Argument ``index`` of ``node``'s schema, positional or by keyword (None if absent)."""
    if len(node.args) > index:
        return node.args[index]
    schema = getattr(node.target, "_schema", None)
    if schema is not None and index < len(schema.arguments):
        return node.kwargs.get(schema.arguments[index].name)
    return None


def _axes(lab: AxisLabel) -> tuple:
    """Where a label's token axes are and how rows sit in them (equal: the same rows)."""
    return lab.bs_dim, lab.t_dim, lab.flat_dim, lab.flat_factor, lab.flat_outer, lab.bs_factor


def _kinds(lab: AxisLabel) -> tuple:
    """Which token axes a label has, wherever they are."""
    return (lab.bs_dim is not None, lab.t_dim is not None, lab.flat_dim is not None,
            lab.flat_factor, lab.flat_outer, lab.bs_factor)


def _dim_operands(node: fx.Node, packet) -> tuple[fx.Node, list[fx.Node]]:
    """``(self, other tensor operands)`` of a dim op (a join's first tensor is its self)."""
    if packet in _JOIN_OPS:
        tensors = [t for t in node.args[0] if isinstance(t, fx.Node)]
        return tensors[0], tensors[1:]
    first = node.args[0]
    return first, [a for a in _tensor_args(node) if a is not first]


def _check_operands(node: fx.Node, packet, x: fx.Node, others: list[fx.Node]) -> str | None:
    """The operands of a dim op line up with ``self``: joins and per-row indices hold its
    token axes at the same dims; a shared 1-D index holds none."""
    lab = axis(x)
    for a in others:
        la = axis(a)
        if packet in _INDEX_VECTOR_OPS and a is _arg(node, 2):
            if la.token_dims and lab.token_dims:
                return (f"its index {a.name} {tuple(a.meta['val'].shape)} holds token rows "
                        "but picks along a dim of every row (one token's ids would reach "
                        "other tokens' rows)")
            if la.token_dims and packet is not aten.index_select:
                return (f"it writes along a shared value by the per-token index {a.name} "
                        "(tokens would write into one another's entries)")
            continue
        if not la.token_dims and a.meta["val"].dim() == 0:
            continue  # a scalar tensor: the same value for every row
        if a.meta["val"].dim() == x.meta["val"].dim() and la.flat_dim == lab.flat_dim and \
                la.flat_dim is not None and _axes(la) != _axes(lab):
            return (f"operand {a.name} holds its flat rows in {_order(la)} but {x.name} in "
                    f"{_order(lab)} (row i of one is not row i of the other)")
        if a.meta["val"].dim() != x.meta["val"].dim() or _axes(la) != _axes(lab):
            return (f"operand {a.name} {tuple(a.meta['val'].shape)} does not hold the token "
                    f"axes of {x.name} {tuple(x.meta['val'].shape)} at the same dims (each "
                    "row must meet only its own token's values)")
    return None


def _check_dims(node: fx.Node, packet, out: AxisLabel) -> str | None:
    """An op along ``dim``: token-wise when the dim avoids the token axes, the operands line
    up with ``self`` and the result keeps ``self``'s token axes (ops along a non-token dim are
    token-wise whatever their name: stack, unbind, scatter, gather, ...)."""
    x, others = _dim_operands(node, packet)
    lab = axis(x)
    if packet is aten.gather and lab.kind == "broadcast":
        return _check_table_gather(node, x)
    why = _check_operands(node, packet, x, others)
    if why is not None:
        return why
    if not lab.token_dims:
        return None  # a global table read by per-token ids (index_select, like an embedding)
    rank = x.meta["val"].dim() + (packet is aten.stack)  # stack's dim counts the new axis
    dims = _arg(node, DIM_OPS[packet])
    if packet in _WHOLE_TENSOR_DEFAULT and (dims is None or dims == [] or dims == ()):
        dims = None  # no dim (or dim=[]): over the whole tensor
    elif dims is None:
        dims = -1 if packet in _LAST_DIM_DEFAULT else 0
    token_dims = out.token_dims if packet is aten.stack else lab.token_dims
    if set(_norm_dims(dims, rank)) & set(token_dims):
        return "it reduces, scans or reorders along the token axis"
    if _kinds(out) != _kinds(lab):
        return (f"its result {tuple(node.meta['val'].shape)} does not keep the token axes of "
                f"{x.name} {tuple(x.meta['val'].shape)} (it drops or narrows some tokens' rows)")
    return None


def _check_table_gather(node: fx.Node, table: fx.Node) -> str | None:
    """``gather(table, dim, ids)`` of a table that is the same for every request (a buffer
    expanded over the request axis: BERT's ``token_type_ids`` read at each token's position):
    ``out[b, t] = table[b, ids[b, t]]`` reads row ``b`` of the table only along ``dim``, so it is
    a lookup by each token's own ids when the ids hold the request axis where the table does
    and the token axis at ``dim`` itself (at any other dim a token would read the table's row
    of its own position, which no flat row knows)."""
    ids, lab, rank = _arg(node, 2), axis(table), table.meta["val"].dim()
    lab_ids = axis(ids)
    dim = _arg(node, 1) % rank
    if lab.bs_factor != 1 or lab_ids.bs_factor != 1 or lab_ids.bs_dim != lab.bs_dim or \
            lab_ids.t_dim != dim or lab_ids.flat_dim is not None:
        return (f"it gathers along dim {dim} of {table.name} {tuple(table.meta['val'].shape)}, "
                f"the same for every request, by {ids.name} {tuple(ids.meta['val'].shape)}; "
                "only ids holding the request axis where the table does and the token axis at "
                "the gathered dim are known to read each token's own entries")
    return None


def _check_repeat(node: fx.Node) -> str | None:
    """``repeat`` tiles a value: along non-token dims, or whole tiles of its flat rows (Llama
    4 feeds every expert all tokens as ``[E*N, H]``); never along the request or token axis."""
    x, reps = node.args[0], list(node.args[1])
    lab = axis(x)
    shift = len(reps) - x.meta["val"].dim()
    for d in (lab.bs_dim, lab.t_dim):
        if d is not None and reps[d + shift] != 1:
            return ("it tiles along the request or token axis (tile the flat [N, ...] rows "
                    "instead)")
    if lab.flat_dim is not None and reps[lab.flat_dim + shift] != 1 and \
            lab.flat_factor > 1 and not lab.flat_outer:
        return "it tiles token-major sub-rows (a tile would interleave tokens' rows)"
    return None


def _check_factory(node: fx.Node, packet, out: AxisLabel) -> str | None:
    """A constant fill: token-wise if ``*_like`` keeps its input's axes, or the explicit size
    keeps the request axis before the token axis."""
    if packet in LIKE_FACTORIES and _axes(out) != _axes(axis(node.args[0])):
        return "its result does not have its input's token axes"
    if out.kind == "token" and out.flat_dim is None and out.bs_dim > out.t_dim:
        return "it puts the token axis before the request axis"
    return None


def check_node(node: fx.Node) -> str | None:
    """Why ``node`` is not token-wise, or None if it is (or touches no token value)."""
    if node.op != "call_function" or "dspark_axis" not in node.meta:
        return None  # symbolic-size arithmetic and non-tensor values
    out = node.meta.get("dspark_axis")
    if isinstance(out, str):
        return out
    args = _tensor_args(node)
    for a in args:
        if isinstance(a.meta.get("dspark_axis"), str):
            return None  # refused where that value was made
    packet = _packet(node)
    if packet in DENSE_OPS or packet in RAGGED_OPS or packet is operator.getitem:
        return None  # known ragged families; getitem only picks one output of a checked op
    labels = [axis(a) for a in args] + ([out] if isinstance(out, AxisLabel) else [])
    if not any(lab.token_dims for lab in labels):
        return None
    if isinstance(out, AxisLabel) and out.kind == "per-position":
        return ("it makes a per-position value with no request axis (e.g. arange(T)); pass "
                "positions explicitly so every row carries its own")
    if packet in LAYOUT_OPS:
        return _check_layout(node, out)
    if is_pointwise(node):
        return _check_pointwise(node, out)  # copy_: mRoPE sections recomposed by slice copy
    if packet in (aten.mm, aten.addmm, aten.bmm):
        return _check_linear(node)
    if packet is aten.embedding:
        return None if not axis(node.args[0]).token_dims else "its table holds token rows"
    if packet is aten.index:
        return _check_gather(node)
    if packet in (aten.index_put, aten.index_put_):
        return _check_masked_fill(node)
    if packet in LIKE_FACTORIES or packet in SIZED_FACTORIES:
        return _check_factory(node, packet, out)
    if packet is aten.repeat:
        return _check_repeat(node)
    if packet in DIM_OPS:
        return _check_dims(node, packet, out)
    if packet in NORM_OPS:
        x, rank = node.args[0], node.args[0].meta["val"].dim()
        trailing = set(range(rank - len(node.args[1]), rank))
        return "it normalises over the token axis" if trailing & set(axis(x).token_dims) \
            else None
    return f"{packet} is not known to be token-wise"


def run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Label every value and refuse the first op that is not token-wise."""
    label_graph(gm, ctx.bs, ctx.tokens)
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        why = check_node(node)
        if why is not None:
            raise TokenAxisError(node, why)
        label = node.meta.get("dspark_axis")
        if isinstance(label, AxisLabel) and node.op == "call_function":
            counts[label.kind] = counts.get(label.kind, 0) + 1
    return PassResult("token_axis", changed=0, details=counts)
