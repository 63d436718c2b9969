"""fuse_linears: a weight's matmul, with the RMSNorm (and the residual add before it) or the
SiLU-and-mul that makes its input, becomes one ``dspark::skinny_linear``.

Matches (packed graph, 16-bit activations; ``%w`` a weight placeholder ``[N, K]``)::

    %mm = aten.mm.default(%a, aten.t.default(%w))           # or aten.addmm(%bias, %a, %t)
  where %a (through same-shape views) is one of
    aten.mul.Tensor(aten.silu.default(%x[:, :K]), %x[:, K:])             # glu: %x [M, 2K]
    aten.mul.Tensor(%gamma, to16(%h32 * rsqrt(mean(%h32 ** 2, -1) + eps)))  # HF RMSNorm,
        # %h32 = to32(%h); and if %h = aten.add.Tensor(%p, %q) (the residual stream's add),
        # the add too: x = %p, residual = %q, and the add's later readers take the op's h
    anything else                                                        # plain
      ->
    %r   = dspark.skinny_linear.default(%x, %w, %bias, %gamma, eps, glu, %residual)
    %mm' = getitem(%r, 0);  %h' = getitem(%r, 1)

Why: at a verify step's few rows each of a layer's ~10 launches costs its ramp and a gap in the
CUDA graph (~0.5 us), and the norms and SiLU-and-mul are launches of a few KB. With the residual
add, the norm and the SiLU read inside the matmul's K loop, a Llama layer runs in 6 launches
(q/k/v, rotary, attention, o, gate/up, down). On the Triton lowering the op is
``kernels/skinny.py``'s kernel up to ``TargetConfig.skinny_max_m`` rows; above that it
is the launches Inductor made (the input's, then the vendor GEMM).

The reference op is the same ops in the same order (the CPU graph's values do not change). The
kernel rounds differently: the norm's ``rsqrt`` scales the matmul's fp32 result instead of its
input, and the SiLU product is rounded once, as Inductor's fused kernel does. A normalized
input read by several matmuls (q, k, v when not stacked) is recomputed by each (K values a
row, a few KB); the first one adds the residual, the others read its ``h``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .base import PassResult, source_line

__all__ = ["fuse_linears", "fuse_rotary_epilogue"]

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_HALF = (torch.bfloat16, torch.float16)


def _is(node, target) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _same_shape(a, b) -> bool:
    va, vb = _val(a), _val(b)
    return va is not None and vb is not None and tuple(va.shape) == tuple(vb.shape)


def _strip(node):
    """``node`` through views that keep its shape."""
    while any(_is(node, v) for v in _VIEWS) and _same_shape(node, node.args[0]):
        node = node.args[0]
    return node


def _last_dim(d, ndim: int) -> bool:
    return isinstance(d, int) and d % ndim == ndim - 1


def _slice_of(node, k: int):
    """``(base, start)`` if ``node`` is ``base[:, start:start + k]`` of a 2-D ``base``."""
    node = _strip(node)
    if not _is(node, aten.slice.Tensor):
        return None
    base, dim, start, end, step = (*node.args, None, None, None, None)[:5]
    if (_val(base) is None or _val(base).dim() != 2 or not _last_dim(dim, 2)
            or step not in (None, 1) or not isinstance(start, int) or not isinstance(end, int)
            or end - start != k):
        return None
    return base, start


def _glu(a, k: int):
    """``(x [M, 2K], nodes)`` if ``a`` is ``silu(x[:, :K]) * x[:, K:]``; ``nodes`` are the
    pattern's own (views, slices, silu, mul)."""
    nodes = _chain(a)
    a = _strip(a)
    if not _is(a, aten.mul.Tensor) or len(a.args) != 2:
        return None
    for s, up in (a.args, a.args[::-1]):
        if not _is(s, aten.silu.default):
            continue
        gate, upper = _slice_of(s.args[0], k), _slice_of(up, k)
        if (gate and upper and gate[0] is upper[0] and gate[1] == 0 and upper[1] == k
                and _val(gate[0]).shape[1] == 2 * k):
            return gate[0], nodes | {a, s} | _chain(s.args[0], gate[0]) | _chain(up, gate[0])
    return None


def _chain(node, stop=None) -> set:
    """The nodes from ``node`` down through same-shape views and a slice, to ``stop``."""
    out = set()
    while isinstance(node, fx.Node) and node is not stop and (
            any(_is(node, v) for v in _VIEWS) or _is(node, aten.slice.Tensor)):
        out.add(node)
        node = node.args[0]
    return out


def _only_read_by(t: fx.Node, nodes: set, end: fx.Node) -> bool:
    """Every reader of ``t``, and of each of ``nodes`` but ``end``, is in ``nodes``."""
    return all(u in nodes for n in (t, *(nodes - {end})) for u in n.users)


def _rms(a, params: set):
    """``(x, gamma, eps)`` if ``a`` is HF's RMSNorm of ``x`` with weight ``gamma``."""
    a = _strip(a)
    if not _is(a, aten.mul.Tensor) or len(a.args) != 2:
        return None
    for gamma, y in (a.args, a.args[::-1]):
        if gamma not in params or _val(gamma) is None or _val(gamma).dim() != 1:
            continue
        if _is(y, aten._to_copy.default) and len(y.args) == 1:
            y = y.args[0]
        if not _is(y, aten.mul.Tensor) or len(y.args) != 2:
            continue
        for h32, r in (y.args, y.args[::-1]):
            found = _rms_stats(h32, r)
            if found is None:
                continue
            x = h32.args[0] if _is(h32, aten._to_copy.default) and len(h32.args) == 1 else h32
            if _val(x) is not None and _val(x).dtype == _val(a).dtype:
                return x, gamma, found
    return None


def _rms_stats(h32, r):
    """``eps`` if ``r`` is ``rsqrt(mean(h32 ** 2, -1, keepdim) + eps)``."""
    if not _is(r, aten.rsqrt.default) or not _is(r.args[0], aten.add.Tensor):
        return None
    mean, eps = r.args[0].args[:2]
    if not isinstance(eps, float) or r.args[0].kwargs or not _is(mean, aten.mean.dim):
        return None
    pw, dims, keep = (*mean.args, None, None)[:3]
    if (not _is(pw, aten.pow.Tensor_Scalar) or pw.args[0] is not h32 or pw.args[1] != 2
            or keep is not True or len(dims) != 1 or not _last_dim(dims[0], 2)
            or mean.kwargs.get("dtype") is not None):
        return None
    if _val(h32) is None or _val(h32).dtype != torch.float32 or _val(h32).dim() != 2:
        return None
    return eps


def _fusable_add(add, mm: fx.Node, order: dict) -> bool:
    """``add`` is ``p + q`` of two tensors of its shape and dtype (the residual stream's add),
    defined before ``mm``."""
    if not _is(add, aten.add.Tensor) or len(add.args) != 2 or add.kwargs:
        return False
    return all(isinstance(t, fx.Node) and _same_shape(t, add) and _val(t).dtype == _val(add).dtype
               for t in add.args) and order.get(add, len(order)) < order[mm]


def fuse_linears(gm: fx.GraphModule, dtypes=_HALF, glu_prologue: bool = False) -> PassResult:
    """Rewrite ``gm`` in place (see the module docstring). Matmuls whose result dtype is not in
    ``dtypes`` (16-bit: the Triton kernel's) are left alone. A SiLU-and-mul of a matmul this
    pass made moves into that matmul's epilogue (``glu_out``: it streams the gate and up rows of
    its columns together); of anything else it is fused into the reader's K loop only with
    ``glu_prologue`` (off: on an H200 that loop ran the 1.1B down projection at 24 us against
    15 for the unfused launches, ``benchmarks/skinny_kernel.py``, but with the launch left
    unsplit by that benchmark's capture stream; not re-timed, see targets.py)."""
    result = PassResult("fuse_linears", changed=0)
    params = {n for n in gm.graph.nodes if n.op == "placeholder"}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    counts = {"plain": 0, "glu epilogue": 0, "glu prologue": 0, "rmsnorm": 0,
              "residual add": 0}
    fused_adds: dict[fx.Node, fx.Node] = {}  # residual add -> the op output that holds it
    made: dict[fx.Node, fx.Node] = {}  # an op's output node -> the op
    touched = set()
    for node in list(gm.graph.nodes):
        if _is(node, aten.mm.default):
            bias, a, t = None, *node.args
        elif _is(node, aten.addmm.default) and not node.kwargs:
            bias, a, t = node.args
            if bias not in params or _val(bias) is None or _val(bias).dim() != 1:
                continue
        else:
            continue
        if (not _is(t, aten.t.default) or t.args[0] not in params or _val(node) is None
                or _val(node).dtype not in dtypes or _val(t.args[0]).dim() != 2):
            continue
        w = t.args[0]
        k = _val(w).shape[1]
        x, gamma, eps, glu, residual, add = a, None, 0.0, False, None, None
        found = _glu(a, k)
        if found is not None and found[0] in made and _only_read_by(found[0], found[1], a):
            producer, glu_val = made[found[0]], _val(_strip(a))
            producer.args = (*producer.args[:7], True)
            producer.meta["val"] = (glu_val, producer.meta["val"][1])
            found[0].meta["val"] = glu_val
            x = found[0]
            touched |= found[1]
            counts["glu epilogue"] += 1
            result.rewrites.append((f"silu*mul -> the epilogue of {producer.args[1].name}'s "
                                    "skinny_linear", source_line(_strip(a))))
        elif found is not None and glu_prologue:
            x, glu = found[0], True
            counts["glu prologue"] += 1
        elif (found := _rms(a, params)) is not None:
            x, gamma, eps = found
            counts["rmsnorm"] += 1
            if x in fused_adds:
                x = fused_adds[x]
            elif _fusable_add(x, node, order):
                add, (x, residual) = x, x.args
                counts["residual add"] += 1
        else:
            counts["plain"] += 1
        parts = [w.name] + (["rmsnorm"] if gamma is not None else []) + \
            (["residual add"] if add is not None else []) + (["silu*mul in"] if glu else [])
        result.rewrites.append((f"{' + '.join(parts)} -> skinny_linear", source_line(node)))
        with gm.graph.inserting_before(node):
            op = gm.graph.call_function(torch.ops.dspark.skinny_linear.default,
                                        (x, w, bias, gamma, eps, glu, residual, False))
            out = gm.graph.call_function(operator.getitem, (op, 0))
            h = gm.graph.call_function(operator.getitem, (op, 1))
        out.meta = dict(node.meta)
        h_val = _val(add) if add is not None else _val(node).new_empty((0,))
        op.meta = dict(node.meta)
        op.meta["val"] = (_val(node), h_val)
        h.meta["val"] = h_val
        node.replace_all_uses_with(out)
        made[out] = op
        if add is not None:  # its readers after the op read h (the norm's own go dead)
            fused_adds[add] = h
            for user in list(add.users):
                if order.get(user, -1) > order[node]:
                    user.replace_input_with(add, h)
            touched.add(add)
        else:
            gm.graph.erase_node(h)
        touched |= {node, t, a}
        result.changed += 1
    _erase_dead(gm, touched)
    gm.recompile()
    result.details = {k: v for k, v in counts.items() if v}
    return result


_PURE = {aten.mm.default, aten.addmm.default, aten.t.default, aten.add.Tensor, aten.mul.Tensor,
         aten.silu.default, aten.slice.Tensor, aten.rsqrt.default, aten.mean.dim,
         aten.pow.Tensor_Scalar, aten._to_copy.default, *_VIEWS}


def _erase_dead(gm: fx.GraphModule, start: set) -> None:
    """Erase the pure nodes left without users, walking from ``start`` to their inputs."""
    todo, erased = list(start), set()
    while todo:
        node = todo.pop()
        if (node in erased or node.op != "call_function" or node.target not in _PURE
                or node.users):
            continue
        todo.extend(node.all_input_nodes)
        gm.graph.erase_node(node)
        erased.add(node)


_ROTARY = torch.ops.dspark.rotary_apply.default
_SKINNY = torch.ops.dspark.skinny_linear.default


def _head_view(v):
    """``(output, slice, first column, end column, head dim)`` when ``v [N, H, D]`` is a plain
    head split of columns of a ``dspark::skinny_linear`` ``output`` (its getitem 0): a column
    slice, then views that only split the last dim, each read by the next alone. Else None."""
    val = _val(v)
    if val is None or val.dim() != 3:
        return None
    node, rows = v, str(val.shape[0])
    while any(_is(node, t) for t in _VIEWS):  # each keeps the rows and splits the columns
        if len(node.users) != 1 or str(_val(node).shape[0]) != rows:
            return None
        node = node.args[0]
    if not (_is(node, aten.slice.Tensor) and len(node.users) == 1 and len(node.args) >= 4
            and _last_dim(node.args[1], 2) and isinstance(node.args[2], int)
            and isinstance(node.args[3], int)):
        return None
    src = node.args[0]
    if not (_is(src, operator.getitem) and src.args[1] == 0 and _is(src.args[0], _SKINNY)):
        return None
    width = _val(src).shape[1]
    start, stop = node.args[2], min(node.args[3], width)
    d = val.shape[2]  # (the views' recorded strides predate concat_linears: not used)
    if not isinstance(d, int) or val.shape[1] * d != stop - start \
            or str(_val(node).shape[0]) != rows:
        return None
    return src, node, start, stop, d


def _columns_from(node, start: int) -> bool:
    """``node`` slices columns at or past ``start`` of a 2-D tensor."""
    return (_is(node, aten.slice.Tensor) and len(node.args) >= 3 and _last_dim(node.args[1], 2)
            and isinstance(node.args[2], int) and node.args[2] >= start)


def fuse_rotary_epilogue(gm: fx.GraphModule) -> PassResult:
    """Each ``dspark::rotary_apply(q, k, cos, sin)`` whose q and k are head views of the first
    columns of one ``dspark::skinny_linear`` output (q from column 0, k right after it: the
    stacked q/k/v matmul) becomes that op's rotary epilogue (``cos``, ``sin``, ``rot_cols``):
    the readers of the rotated q and k read the views, which now hold rotated values. The
    matmul must have no SiLU epilogue, every other reader of its output must slice columns
    past k, cos and sin must come before it, and the head dim must be a power of two (the
    kernel's half-head tiles); other rotations stay ``rotary_apply``."""
    result = PassResult("fuse_rotary_epilogue", changed=0)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        if not _is(node, _ROTARY):
            continue
        x, y, cos, sin = node.args
        hx, hy = _head_view(x), _head_view(y)
        if hx is None or hy is None or hx[0] is not hy[0]:
            continue
        out, mm, d, rot_cols = hx[0], hx[0].args[0], hx[4], hy[3]
        if (hx[2] != 0 or hy[2] != hx[3] or hy[4] != d or d < 2 or d & (d - 1)
                or mm.args[7] or (len(mm.args) > 10 and mm.args[10])
                or order[cos] > order[mm] or order[sin] > order[mm]):
            continue
        if any(u not in (hx[1], hy[1]) and not _columns_from(u, rot_cols) for u in out.users):
            continue
        outs = [u for u in node.users if _is(u, operator.getitem)]
        if len(outs) != len(node.users):
            continue
        mm.args = (*mm.args[:8], cos, sin, rot_cols)
        for u in outs:
            u.replace_all_uses_with(x if u.args[1] == 0 else y)
            gm.graph.erase_node(u)
        gm.graph.erase_node(node)
        result.changed += 1
        result.rewrites.append((f"rotary_apply of {rot_cols // d} heads -> the epilogue of "
                                f"{mm.args[1].name}'s skinny_linear", source_line(node)))
    if result.changed:
        gm.recompile()
    return result
