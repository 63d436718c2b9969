"""flatten_tokens: token-major values ``[bs, ..., T, ...]`` -> flat ``[..., N, ...]``.

Runs after ``ragged_attention`` (whose op already takes flat rows), on a graph that
``token_axis`` has proven token-wise. Each value's flat form drops its request axis and puts
``N`` (all requests' rows) in place of its token axis; a ``bs*T`` axis is ``N`` already. Matches
and writes, for example::

    %view_1 = aten.view.default(%_unsafe_view, [%bs, %T, -1, 16])   # [bs, T, 4, 16]
    %transpose = aten.transpose.int(%view_1, 1, 2)                    # [bs, 4, T, 16]
    %mul_8 = aten.mul.Tensor(%transpose, %unsqueeze_1)
      ->
    %view_1 = aten.view.default(%_unsafe_view, [%N, -1, 16])          # [N, 4, 16]
    %permute = aten.permute.default(%view_1, [1, 0, 2])               # [4, N, 16]
    %mul_8 = aten.mul.Tensor(%permute, %unsqueeze_1)

The flat graph's inputs are ``input_ids [N]``, ``positions [N]`` (mRoPE models:
``mrope_positions [3, N]`` and ``vision_embeds [N, hidden]``), ``slot_mapping [N]`` and the
per-request ``query_start_loc [R + 1]``, ``seq_lens [R]``, ``block_table [R, pages]``; it
returns ``logits [N, V]``. It is built by interpreting the dense graph on flat values under
``make_fx``, so every shape is checked again by fake tensors as it is written.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch._guards import detect_fake_mode

from ..graph_inputs import InputKind, fake_input
from ..ops.compressed import COMPRESSED_RAGGED_OPS
from ..ops.experts import EXPERTS_OPS
from ..ops.linear_attention import LINEAR_RAGGED_OPS
from ..ops.sparse import SPARSE_RAGGED_OPS
from .base import EnsureError, PassContext, PassResult
from .retrace import retrace
from .token_axis import (DIM_OPS, LIKE_FACTORIES, NORM_OPS, SIZED_FACTORIES, AxisLabel,
                         is_pointwise, label_graph)

__all__ = ["run"]

aten = torch.ops.aten

SIZE_OPS = {aten.view, aten._unsafe_view, aten.reshape, aten.expand}
AS_IS = {aten.embedding, aten.index, aten.mm, aten.addmm, aten.clone, aten._to_copy, aten.alias,
         aten.detach, aten.contiguous, aten.lift_fresh_copy,
         torch.ops.dspark.ragged_attention, *LINEAR_RAGGED_OPS,  # flat-native: rows in, rows out
         *EXPERTS_OPS, *COMPRESSED_RAGGED_OPS, *SPARSE_RAGGED_OPS,
         *NORM_OPS,  # norms: trailing dims stay as they are
         *LIKE_FACTORIES, aten.view_as_complex, aten.view_as_real,  # shape follows the input
         aten.index_put, aten.index_put_}  # x[mask] = scalar: mask flattened as x (token_axis)
FLAT_INPUTS = {"input_ids", "positions", "slot_mapping", "window_slot_mapping"}


class _TokenSize:
    """Stand-in for a dense size (bs, T, bs*T) that has no meaning in the flat graph."""

    def __init__(self, node: fx.Node) -> None:
        self.node = node


def _label(node) -> AxisLabel:
    lab = node.meta.get("dspark_axis") if isinstance(node, fx.Node) else None
    return lab if isinstance(lab, AxisLabel) else AxisLabel()


def _drops_bs(lab: AxisLabel) -> bool:
    """The flat form has no request axis (a ``[c*bs]`` axis keeps its static ``c``)."""
    return lab.bs_dim is not None and lab.kind in ("token", "broadcast") and lab.bs_factor == 1


def _shrinks_bs(lab: AxisLabel) -> bool:
    """A ``[c*bs]`` axis whose flat form is ``[c]``."""
    return lab.bs_dim is not None and lab.kind in ("token", "broadcast") and lab.bs_factor > 1


def _fdim(lab: AxisLabel, d: int, rank: int) -> int:
    """Flat position of dense dim ``d`` of a value labelled ``lab`` (``d`` not the bs dim)."""
    d %= rank
    return d - 1 if _drops_bs(lab) and d > lab.bs_dim else d


class _Flattener:
    def __init__(self, num_tokens, dense_symbols: set) -> None:
        self.n = num_tokens
        self.dense_symbols = dense_symbols
        self.env: dict[fx.Node, object] = {}

    def value(self, a):
        if isinstance(a, fx.Node):
            v = self.env[a]
            if isinstance(v, _TokenSize):
                raise EnsureError(f"flatten_tokens: the dense size {a.name} is used as a value")
            return v
        if isinstance(a, (list, tuple)):
            return type(a)(self.value(x) for x in a)
        return a

    def sizes(self, node: fx.Node, sizes) -> list:
        """Dense size list of ``node``'s result -> flat size list."""
        lab, out = _label(node), []
        for d, s in enumerate(sizes):
            if _drops_bs(lab) and d == lab.bs_dim:
                continue
            if _shrinks_bs(lab) and d == lab.bs_dim:
                out.append(lab.bs_factor)
                continue
            if d == lab.flat_dim:
                out.append(self.n * lab.flat_factor)  # [bs*T*c] -> [N*c]
            else:
                out.append(self.n if d == lab.t_dim else self.value(s))
        return out

    def align(self, a: fx.Node, node: fx.Node):
        """A global operand broadcast against ``node``'s result: drop its bs-aligned dim."""
        x, lab_out = self.env[a], _label(node)
        if _label(a).token_dims or not _drops_bs(lab_out):
            return x
        shift = node.meta["val"].dim() - a.meta["val"].dim()
        pos = lab_out.bs_dim - shift
        return x.squeeze(pos) if pos >= 0 else x

    def call(self, node: fx.Node):
        packet = getattr(node.target, "overloadpacket", node.target)
        args = node.args
        if node.target is operator.getitem:
            return self.env[args[0]][args[1]]
        if not isinstance(node.meta.get("val"), torch.Tensor) and not isinstance(
                node.meta.get("val"), (tuple, list)):
            return self.symbolic(node)
        touched = [a for a in node.all_input_nodes if _label(a).token_dims]
        if packet is aten.index and _label(args[0]).token_dims:
            return self.op_index_rows(node, *args)
        if packet in AS_IS or (not touched and not _label(node).token_dims):
            return node.target(*self.value(args), **self.value(node.kwargs))
        if packet in SIZE_OPS:
            x = self.align(args[0], node) if packet is aten.expand else self.value(args[0])
            return node.target(x, self.sizes(node, args[1]), **self.value(node.kwargs))
        handler = getattr(self, f"op_{packet.__name__}", None)
        if handler is not None:
            return handler(node, *args)
        if packet in SIZED_FACTORIES:
            args = list(self.value(args[:SIZED_FACTORIES[packet]])) + [
                self.sizes(node, args[SIZED_FACTORIES[packet]])] + list(
                self.value(args[SIZED_FACTORIES[packet] + 1:]))
            return node.target(*args, **self.value(node.kwargs))
        if is_pointwise(node):
            new = [self.align(a, node) if isinstance(a, fx.Node) and
                   isinstance(a.meta.get("val"), torch.Tensor) else self.value(a) for a in args]
            return node.target(*new, **self.value(node.kwargs))
        if packet in DIM_OPS:
            return self.dim_op(node, packet)
        raise EnsureError(f"flatten_tokens: no rule for {node.target} ({node.name}); "
                          "token_axis should have refused it")

    def symbolic(self, node: fx.Node):
        val = node.meta.get("val")
        expr = val.node.expr if isinstance(val, torch.SymInt) else None
        if expr is not None and expr.free_symbols & self.dense_symbols:
            return _TokenSize(node)
        if node.target is operator.getitem:
            return self.env[node.args[0]][node.args[1]]
        return node.target(*self.value(node.args), **self.value(node.kwargs))

    # -- layout ops whose dims move
    def op_unsqueeze(self, node, x, dim):
        lab = _label(node)
        rank = node.meta["val"].dim()
        if _drops_bs(lab) and dim % rank == lab.bs_dim:
            return self.env[x]
        return self.env[x].unsqueeze(_fdim(lab, dim, rank))

    def op_squeeze(self, node, x, *dims):
        lab, rank = _label(x), x.meta["val"].dim()
        if not dims:
            return self.env[x].squeeze()
        dims = dims[0] if isinstance(dims[0], (list, tuple)) else [dims[0]]
        keep = [_fdim(lab, d, rank) for d in dims if not (_drops_bs(lab) and d % rank ==
                                                          lab.bs_dim)]
        return self.env[x].squeeze(keep) if keep else self.env[x]

    def op_permute(self, node, x, perm):
        lab_in, rank = _label(x), x.meta["val"].dim()
        flat = [_fdim(lab_in, p, rank) for p in perm
                if not (_drops_bs(lab_in) and p % rank == lab_in.bs_dim)]
        return self.env[x].permute(flat)

    def op_transpose(self, node, x, d0, d1):
        rank = x.meta["val"].dim()
        perm = list(range(rank))
        perm[d0 % rank], perm[d1 % rank] = perm[d1 % rank], perm[d0 % rank]
        return self.op_permute(node, x, perm)

    def op_t(self, node, x):
        return self.op_transpose(node, x, 0, 1) if x.meta["val"].dim() == 2 else self.env[x]

    def op_slice(self, node, x, dim=0, start=None, end=None, step=1):
        lab, rank = _label(x), x.meta["val"].dim()
        if dim % rank in lab.token_dims:  # token_axis allows only full slices here
            return self.env[x]
        return aten.slice.Tensor(self.env[x], _fdim(lab, dim, rank), start, end, step)

    def op_index_rows(self, node, x, indices):
        """``x[..., idx, ...]`` of a token value along non-token dims: the request axis's
        (empty) index goes with the axis."""
        lab = _label(x)
        keep = [i for d, i in enumerate(indices) if not (_drops_bs(lab) and d == lab.bs_dim)]
        return aten.index.Tensor(self.env[x], self.value(keep))

    def op_stack(self, node, tensors, dim=0):
        """The new axis sits among the result's dims, so it moves with the result's label."""
        return aten.stack(self.value(tensors), _fdim(_label(node), dim, node.meta["val"].dim()))

    def op_repeat(self, node, x, repeats):
        """Tiles along non-token dims or of whole flat rows: the request axis's count (1)
        goes with the axis."""
        lab, rank = _label(x), x.meta["val"].dim()
        extra = len(repeats) - rank
        keep = list(repeats[:extra]) + [r for d, r in enumerate(repeats[extra:])
                                         if not (_drops_bs(lab) and d == lab.bs_dim)]
        return aten.repeat(self.env[x], self.value(keep))

    def op_bmm(self, node, a, b):
        la, lb = _label(a), _label(b)
        xa, xb = self.env[a], self.env[b]
        if la.bs_dim is None and lb.bs_dim is None:  # [E, N, K] @ [E, K, M]: batched over E
            return torch.bmm(xa, xb)
        if la.bs_factor > 1 or lb.bs_factor > 1:  # [c, M, K] @ [c, K, N]: batched over c
            if la.bs_factor != lb.bs_factor:
                raise EnsureError(f"flatten_tokens: bmm {node.name} batches {la.bs_factor} "
                                  f"and {lb.bs_factor} rows per request")
            return torch.bmm(xa, xb)
        if la.flat_dim == 0 and lb.flat_dim == 0:  # [N*c, M, K] @ [N*c, K, P]: per row
            return torch.bmm(xa, xb)
        if la.kind == "broadcast" and lb.kind == "token":   # [M, K] @ [K, N]
            return torch.mm(xa, xb)
        if la.kind == "token" and lb.kind in ("broadcast", "global"):  # [N, K] @ [K, M]
            return torch.mm(xa, xb if lb.kind == "broadcast" else xb.squeeze(0))
        raise EnsureError(f"flatten_tokens: bmm {node.name} with operands {la.kind}, "
                          f"{lb.kind}")

    def dim_op(self, node, packet):
        index = DIM_OPS[packet]
        first = node.args[0][0] if packet is aten.cat else node.args[0]
        lab, rank = _label(first), first.meta["val"].dim()
        args = list(self.value(node.args))
        if len(args) > index and args[index] is not None:
            dims = args[index]
            args[index] = [_fdim(lab, d, rank) for d in dims] if isinstance(
                dims, (list, tuple)) else _fdim(lab, dims, rank)
        return node.target(*args, **self.value(node.kwargs))


def run(gm: fx.GraphModule, ctx: PassContext) -> tuple[fx.GraphModule, PassResult]:
    label_graph(gm, ctx.bs, ctx.tokens)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    vals = [n.meta["val"] for n in placeholders]
    mode = detect_fake_mode(vals)
    flat_inputs = _flat_inputs(placeholders, mode)
    changed = sum(1 for n in gm.graph.nodes if isinstance(n.meta.get("dspark_axis"), AxisLabel)
                  and n.meta["dspark_axis"].kind == "token")

    def flat_fn(*inputs):
        fl = _Flattener(inputs[_index(ctx, "input_ids")].shape[0], {ctx.bs, ctx.tokens})
        for node, x in zip(placeholders, inputs):
            fl.env[node] = x
        for node in gm.graph.nodes:
            if node.op == "call_function":
                with fx_traceback.set_current_meta(node):  # the new nodes keep its source line
                    fl.env[node] = fl.call(node)
            elif node.op == "get_attr":  # a constant the model made (torch.tensor([...]))
                fl.env[node] = getattr(gm, node.target)
            elif node.op == "output":
                return fl.value(node.args[0])
        raise EnsureError("flatten_tokens: graph has no output")

    new_gm = retrace(flat_fn, flat_inputs, ctx.inputs)
    _ensure(new_gm, ctx)
    return new_gm, PassResult("flatten_tokens", changed=changed,
                              details={"token-major values": changed})


def _index(ctx: PassContext, kind: str) -> int:
    return next(i for i, s in enumerate(ctx.inputs) if s.kind == kind)


def _flat_inputs(placeholders: list[fx.Node], mode) -> list:
    """Fresh fake inputs for the flat graph: ``N`` and ``R`` symbols of their own."""
    num_tokens, num_requests = 11, 4  # distinct sample sizes, not 0/1, not each other
    out = []
    for node in placeholders:
        spec, val = node.meta["dspark_input"], node.meta["val"]
        dynamic = (0,)
        if spec.kind in FLAT_INPUTS:
            shape = (num_tokens,)
        elif spec.kind == "mrope_positions":  # [3, bs*T] -> [3, N]
            shape, dynamic = (val.shape[0], num_tokens), (1,)
        elif spec.kind == "vision_embeds":  # [bs, T, hidden] -> [N, hidden]
            shape = (num_tokens, val.shape[2])
        elif spec.kind == "deepstack_embeds":  # [layers, bs, T, hidden] -> [layers, N, hidden]
            shape, dynamic = (val.shape[0], num_tokens, val.shape[3]), (1,)
        elif spec.kind == "query_start_loc":
            shape = (num_requests + 1,)
        elif spec.kind in ("seq_lens", "block_table", "window_block_table",
                           "entry_block_table", "slots"):
            shape = (num_requests, *val.shape[1:])
        else:
            out.append(val)
            continue
        sample = torch.zeros(shape, dtype=val.dtype, device=val.device)
        out.append(fake_input(mode, sample, "flat_" + spec.name, dynamic))
    return out


def _ensure(gm: fx.GraphModule, ctx: PassContext) -> None:
    """The flat graph returns ``[N, V]`` and no value keeps a dense ``bs`` or ``T`` axis."""
    ids = next(n for n in gm.graph.nodes if n.op == "placeholder"
               and n.meta["dspark_input"].kind == InputKind.INPUT_IDS)
    n_expr = ids.meta["val"].shape[0].node.expr
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    shape = out.meta["val"].shape
    if len(shape) != 2 or not isinstance(shape[0], torch.SymInt) or \
            shape[0].node.expr != n_expr:
        raise EnsureError(f"flatten_tokens: the flat graph returns {tuple(shape)}, not [N, V]")
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and any(
                isinstance(s, torch.SymInt) and s.node.expr.free_symbols & {ctx.bs, ctx.tokens}
                for s in val.shape):
            raise EnsureError(f"flatten_tokens: {node.name} still has a dense axis {val.shape}")
