"""A stable text form of a graph, for snapshot tests and ``explain``.

One line per op: ``name = op(args)  # shape``. Size symbols are renamed ``s0``, ``s1``, ... in
order of first appearance among the placeholders' dims (substituted in the sympy expressions,
so products print in a stable order), so the text does not depend on how the shape environment
numbered them.
"""

from __future__ import annotations

import re

import sympy
import torch
import torch.fx as fx

from ..graph_inputs import WEIGHT_KINDS

__all__ = ["graph_text"]


def _fmt(arg, names: dict) -> str:
    if isinstance(arg, fx.Node):
        return names.get(arg, arg.name)
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(_fmt(a, names) for a in arg)
        return f"[{inner}]"
    if isinstance(arg, torch.dtype):
        return str(arg).replace("torch.", "")
    if isinstance(arg, float):
        return f"{arg:.6g}"
    return repr(arg)


def _size(s, names: dict) -> str:
    if not isinstance(s, torch.SymInt):
        return str(s)
    expr = s.node.expr
    for sym in sorted(expr.free_symbols, key=str):
        names.setdefault(sym, sympy.Symbol(f"s{len(names)}", positive=True, integer=True))
    return str(expr.xreplace(names))


def _shape(node: fx.Node, names: dict) -> str:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return "[" + ", ".join(_size(s, names) for s in val.shape) + "]"
    if isinstance(val, torch.SymInt):
        return _size(val, names)
    return ""


def _op_name(target) -> str:
    name = getattr(target, "__name__", str(target))
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        ns = getattr(target, "namespace", "aten")
        return f"{ns}.{packet.__name__}"
    return name


def _node_names(gm: fx.GraphModule) -> dict:
    """Placeholders keep their names; ops are numbered per base name in graph order (FX's own
    suffixes depend on how many nodes were made and erased on the way)."""
    names, counts = {}, {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        base = re.sub(r"_\d+$", "", node.name)
        counts[base] = counts.get(base, -1) + 1
        names[node] = f"{base}_{counts[base]}" if counts[base] else base
    return names


def graph_text(gm: fx.GraphModule, weights: bool = False) -> str:
    """The graph as text. Weight placeholders are summarised unless ``weights``."""
    lines, names, node_names = [], {}, _node_names(gm)
    for node in gm.graph.find_nodes(op="placeholder"):
        _shape(node, names)  # number the symbols by the inputs' dims first
    inputs = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            spec = node.meta.get("dspark_input")
            if weights or spec is None or spec.kind not in WEIGHT_KINDS:
                inputs.append(f"{node.name}{_shape(node, names)}")
        elif node.op == "call_function":
            args = ", ".join([_fmt(a, node_names) for a in node.args] +
                             [f"{k}={_fmt(v, node_names)}" for k, v in node.kwargs.items()])
            shape = _shape(node, names)
            lines.append(f"{node_names[node]} = {_op_name(node.target)}({args})" +
                         (f"  # {shape}" if shape else ""))
        elif node.op == "output":
            lines.append(f"return {_fmt(node.args[0], node_names)}")
    return "inputs: " + ", ".join(inputs) + "\n" + "\n".join(lines)
