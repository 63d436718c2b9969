"""masked_fma: causality by multiplying with zeros -> selects, so a non-finite value in a
masked-off (rejected, padded, future) position cannot reach a kept one.

``x * 0`` is NaN when ``x`` is NaN or Inf; ``where(m, x, 0)`` is 0. On finite values the two
agree (up to the sign of a zero), so this pass preserves semantics and also runs under
``torch.compile(backend="dspark")``. Matches (aten, any graph) and writes::

    %m = aten._to_copy.default(%mask, dtype=torch.float32)     # %mask: bool
    %y = aten.mul.Tensor(%x, %m)
      ->
    %y = aten.where.self(%mask, %x, 0)                          # then %a + %y: where(m, a + x, a)

    %t = aten.tril.default(%b, k)                                # also triu
    %y = aten.mul.Tensor(%a, %t)
      ->
    %y = aten.tril.default(aten.mul.Tensor(%a, %b), k)          # tril is a select, not a product

    %s = aten.where.self(%c, %b, 0)       # what Inductor decomposes tril/triu and masks into
    %y = aten.mul.Tensor(%a, %s)
      ->
    %y = aten.where.self(%c, aten.mul.Tensor(%a, %b), 0)

A mask made with ``prims.convert_element_type`` (Inductor's decomposed graphs) is matched too.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .base import PassResult, source_line

__all__ = ["run", "rewrite"]

aten, prims = torch.ops.aten, torch.ops.prims
_CASTS = (aten._to_copy.default, prims.convert_element_type.default)
_TRIANGLES = (aten.tril.default, aten.triu.default)


def _bool_mask(node) -> fx.Node | None:
    """The bool tensor that ``node`` casts to a number, if it is such a cast."""
    if isinstance(node, fx.Node) and node.op == "call_function" and node.target in _CASTS:
        src = node.args[0]
        val = src.meta.get("val") if isinstance(src, fx.Node) else None
        if isinstance(val, torch.Tensor) and val.dtype == torch.bool:
            return src
    return None


def _is_zero(arg) -> bool:
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return arg == 0
    return (isinstance(arg, fx.Node) and arg.op == "call_function"
            and arg.target in (aten.full.default, aten.zeros.default)
            and (arg.target is aten.zeros.default or arg.args[1] == 0))


def _zero_select(node):
    """``where(c, b, 0)`` (a select against zero), if ``node`` is one."""
    if isinstance(node, fx.Node) and node.op == "call_function" and node.target in (
            aten.where.self, aten.where.ScalarOther) and _is_zero(node.args[2]):
        return node
    return None


def _triangle(node):
    if isinstance(node, fx.Node) and node.op == "call_function" and node.target in _TRIANGLES:
        return node
    return None


def rewrite(graph: fx.Graph) -> PassResult:
    """Rewrite the multiply-by-mask patterns of ``graph`` in place."""
    result = PassResult("masked_fma", changed=0)
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.mul.Tensor:
            continue
        x, y = node.args[:2]
        for other, factor in ((x, y), (y, x)):
            mask, tri, sel = _bool_mask(factor), _triangle(factor), _zero_select(factor)
            if not isinstance(other, fx.Node) or (mask is None and tri is None and sel is None):
                continue
            with graph.inserting_before(node):
                if mask is not None:
                    new = graph.call_function(aten.where.ScalarOther, (mask, other, 0.0))
                elif sel is not None:
                    prod = graph.call_function(aten.mul.Tensor, (other, sel.args[1]))
                    prod.meta = dict(node.meta)
                    new = graph.call_function(sel.target, (sel.args[0], prod, sel.args[2]))
                else:
                    prod = graph.call_function(aten.mul.Tensor, (other, tri.args[0]))
                    prod.meta = dict(node.meta)
                    new = graph.call_function(tri.target, (prod, *tri.args[1:]))
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            result.changed += 1
            result.rewrites.append((f"{node.name} -> {new.target}", source_line(node)))
            break
    graph.eliminate_dead_code()
    _ensure(graph)
    return result


def _ensure(graph: fx.Graph) -> None:
    for node in graph.nodes:
        if node.op == "call_function" and node.target is aten.mul.Tensor and any(
                _bool_mask(a) is not None or _triangle(a) is not None or
                _zero_select(a) is not None for a in node.args[:2]):
            raise AssertionError(f"masked_fma: {node.name} still multiplies by a mask")


def run(gm: fx.GraphModule, ctx=None) -> PassResult:
    """Pass-manager entry: rewrite ``gm`` in place (an analysis-shaped result)."""
    result = rewrite(gm.graph)
    gm.recompile()
    return result
