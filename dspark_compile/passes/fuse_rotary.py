"""fuse_rotary: a layer's rotary on q and on k becomes one ``dspark::rotary_apply``.

Matches (packed graph, HF's ``apply_rotary_pos_emb`` on a flat ``[N, H, D]`` head view ``%a``
that the graph permutes to ``[H, N, D]``; the same for k with the same ``%cos``/``%sin``)::

    %x    = aten.permute.default(%a, [1, 0, 2])              # [H, N, D]
    %c    = aten.unsqueeze.default(%cos, 0)                  # cos [N, D] -> [1, N, D]
    %s    = aten.unsqueeze.default(%sin, 0)
    %m1   = aten.mul.Tensor(%x, %c)
    %lo   = aten.slice.Tensor(%x, 2, 0, D/2)
    %hi   = aten.slice.Tensor(%x, 2, D/2, end)
    %cat  = aten.cat.default([aten.neg(%hi), %lo], 2)        # rotate_half
    %m2   = aten.mul.Tensor(%cat, %s)
    %out  = aten.add.Tensor(%m1, %m2)
    %back = aten.permute.default(%out, [1, 0, 2])            # [N, H, D], all %out is used for
      ->
    %r    = dspark.rotary_apply.default(%a_q, %a_k, %cos, %sin)
    %back_q = getitem(%r, 0); %back_k = getitem(%r, 1)

The reference op is the same math in the same dtype (the CPU graph's values do not change); the
Triton lowering rotates q and k in one launch, where Inductor runs a kernel for each. Only
rotations whose input, cos and sin share a dtype, and that come in a q/k pair over one
cos/sin, are rewritten; the rest stay as they were (partial rotary, other layouts).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .base import PassResult

__all__ = ["fuse_rotary"]

aten = torch.ops.aten


def _is(node, target) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target


def _dim(d, ndim: int = 3) -> int:
    return d % ndim


def _match(add: fx.Node):
    """(a [N, H, D], cos [N, D], sin [N, D], back, its nodes) of one rotation ending in ``add``,
    or None."""
    if not _is(add, aten.add.Tensor) or len(add.args) != 2:
        return None
    for m1, m2 in (add.args, add.args[::-1]):
        if not (_is(m1, aten.mul.Tensor) and _is(m2, aten.mul.Tensor)):
            continue
        for x, c in (m1.args, m1.args[::-1]):
            if not (_is(x, aten.permute.default) and list(x.args[1]) == [1, 0, 2]
                    and _is(c, aten.unsqueeze.default) and _dim(c.args[1]) == 0):
                continue
            for cat, s in (m2.args, m2.args[::-1]):
                if not (_is(cat, aten.cat.default) and _is(s, aten.unsqueeze.default)
                        and _dim(s.args[1]) == 0 and _rotate_half_of(cat, x)):
                    continue
                found = _checked(x, c.args[0], s.args[0], add)
                if found is not None:
                    neg, lo = cat.args[0]
                    return (*found, {found[3], add, m1, m2, x, c, s, cat, neg, lo,
                                     neg.args[0]})
    return None


def _rotate_half_of(cat: fx.Node, x: fx.Node) -> bool:
    """``cat`` is ``cat([-x[..., D/2:], x[..., :D/2]], -1)``."""
    parts = cat.args[0]
    dim = cat.args[1] if len(cat.args) > 1 else 0
    if len(parts) != 2 or _dim(dim) != 2:
        return False
    neg, lo = parts
    if not (_is(neg, aten.neg.default) and _is(neg.args[0], aten.slice.Tensor)
            and _is(lo, aten.slice.Tensor)):
        return False
    hi = neg.args[0]
    d = x.meta["val"].shape[2]
    if not isinstance(d, int) or d % 2:
        return False

    def spans(sl, start, end_at_least):
        _, sdim, sstart, send = (*sl.args, None, None, None)[:4]
        return (sl.args[0] is x and _dim(sdim) == 2 and sstart == start
                and isinstance(send, int) and send >= end_at_least)

    return spans(hi, d // 2, d) and spans(lo, 0, d // 2) and lo.args[3] == d // 2


def _checked(x: fx.Node, cos: fx.Node, sin: fx.Node, add: fx.Node):
    a = x.args[0]
    vals = [n.meta.get("val") for n in (a, cos, sin)]
    if any(v is None for v in vals) or vals[0].dim() != 3 or vals[1].dim() != 2:
        return None
    if len({v.dtype for v in vals}) != 1 or tuple(vals[1].shape) != tuple(vals[2].shape):
        return None
    users = list(add.users)
    if len(users) != 1 or not _is(users[0], aten.permute.default) or \
            list(users[0].args[1]) != [1, 0, 2]:
        return None
    return a, cos, sin, users[0]


def _placeable(first: tuple, second: tuple, order: dict) -> bool:
    """Whether one op after both rotations' inputs still comes before every use of either
    result. All layers share one cos/sin, so the match before a rotation over the same cos/sin
    may be another layer's: a layer whose q (or k) rotation takes another form leaves its
    partner unpaired, and pairing that one with the next layer's would define a result after
    the attention that reads it."""
    ax, cos, sin, back_x, _ = first
    ay, _, _, back_y, _ = second
    last = max(order[n] for n in (ax, ay, cos, sin))
    return all(order[u] > last for u in (*back_x.users, *back_y.users))


def fuse_rotary(gm: fx.GraphModule) -> PassResult:
    """Rewrite ``gm`` in place (see the module docstring)."""
    result = PassResult("fuse_rotary", changed=0)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    pending: dict[tuple[fx.Node, fx.Node], tuple] = {}
    pairs, dead = [], set()
    for node in list(gm.graph.nodes):
        found = _match(node)
        if found is None:
            continue
        key = (found[1], found[2])  # one cos/sin: a layer's q and k
        if key in pending and _placeable(pending[key], found, order):
            pairs.append((pending.pop(key), found))
        else:  # the first of a pair, or one whose partner is not a rotation this pass matches
            pending[key] = found
    for (ax, cos, sin, back_x, nodes_x), (ay, _, _, back_y, nodes_y) in pairs:
        last = max((ax, ay, cos, sin), key=order.__getitem__)  # every input is defined here
        with gm.graph.inserting_after(last):
            op = gm.graph.call_function(torch.ops.dspark.rotary_apply.default,
                                        (ax, ay, cos, sin))
        op.meta["val"] = [back_x.meta["val"], back_y.meta["val"]]
        with gm.graph.inserting_after(op):
            items = [gm.graph.call_function(operator.getitem, (op, i)) for i in (1, 0)][::-1]
        for item, back in zip(items, (back_x, back_y)):
            item.meta["val"] = back.meta["val"]
            back.replace_all_uses_with(item)
        dead |= nodes_x | nodes_y
        result.changed += 1
    for node in reversed(list(gm.graph.nodes)):  # the old rotations, consumers first
        if node in dead and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()
    result.details = {"q/k pairs": result.changed}
    return result
