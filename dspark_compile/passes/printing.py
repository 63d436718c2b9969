"""A stable text form of a graph, for snapshot tests and ``explain``.

One line per op: ``name = op(args)  # shape``. Size symbols are renamed by first appearance
(``s0``, ``s1``, ...) so that the text does not depend on how the shape environment numbered
them.
"""

from __future__ import annotations

import re

import torch
import torch.fx as fx

__all__ = ["graph_text"]

_SYMBOL = re.compile(r"\bs\d+\b")


def _fmt(arg) -> str:
    if isinstance(arg, fx.Node):
        return arg.name
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(_fmt(a) for a in arg)
        return f"[{inner}]"
    if isinstance(arg, torch.dtype):
        return str(arg).replace("torch.", "")
    if isinstance(arg, float):
        return f"{arg:.6g}"
    return repr(arg)


def _shape(node: fx.Node) -> str:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return "[" + ", ".join(str(s) for s in val.shape) + "]"
    if isinstance(val, torch.SymInt):
        return str(val)
    return ""


def _op_name(target) -> str:
    name = getattr(target, "__name__", str(target))
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        ns = getattr(target, "namespace", "aten")
        return f"{ns}.{packet.__name__}"
    return name


def graph_text(gm: fx.GraphModule, weights: bool = False) -> str:
    """The graph as text. Weight placeholders are summarised unless ``weights``."""
    lines, names = [], {}

    def rename(match):
        return names.setdefault(match.group(0), f"s{len(names)}")

    inputs = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            spec = node.meta.get("dspark_input")
            if weights or spec is None or spec.kind not in ("param", "buffer"):
                inputs.append(f"{node.name}{_shape(node)}")
        elif node.op == "call_function":
            args = ", ".join([_fmt(a) for a in node.args] +
                             [f"{k}={_fmt(v)}" for k, v in node.kwargs.items()])
            shape = _shape(node)
            lines.append(f"{node.name} = {_op_name(node.target)}({args})" +
                         (f"  # {shape}" if shape else ""))
        elif node.op == "output":
            lines.append(f"return {_fmt(node.args[0])}")
    text = "inputs: " + ", ".join(inputs) + "\n" + "\n".join(lines)
    return _SYMBOL.sub(rename, text)
