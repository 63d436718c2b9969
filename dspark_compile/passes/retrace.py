"""Re-trace a rewritten graph into a clean aten graph with fresh shape metadata.

Passes insert nodes at the torch level (``torch.Tensor`` methods on FX proxies); re-tracing the
graph under ``make_fx`` with the same fake inputs decomposes them to aten, recomputes every
node's ``meta["val"]``, and keeps each node's model source line (``preserve_node_meta``: the FX
interpreter hands each node's meta to the new nodes it produces).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch._dispatch.python import enable_python_dispatcher
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

__all__ = ["retrace", "interpret", "placeholder_values", "name_placeholders", "copy_module"]


def placeholder_values(gm: fx.GraphModule) -> list:
    """The fake value of each placeholder, in order."""
    return [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]


def name_placeholders(gm: fx.GraphModule, specs: Sequence) -> None:
    """Name placeholders after their input specs and remember the spec on each."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(specs), (
        f"{len(placeholders)} placeholders but {len(specs)} input specs")
    for node, spec in zip(placeholders, specs):
        node.name = node.target = spec.name.replace(".", "_")
        node.meta["dspark_input"] = spec


def retrace(fn: Callable, inputs: Sequence, specs: Sequence) -> fx.GraphModule:
    """Trace ``fn(*inputs)`` (fake inputs) to aten, DCE it and name its placeholders."""
    mode = detect_fake_mode(list(inputs))
    with fx_traceback.preserve_node_meta(), torch.no_grad(), mode, enable_python_dispatcher():
        gm = make_fx(fn, tracing_mode="real", record_stack_traces=True)(*inputs)
    gm.graph.eliminate_dead_code()
    name_placeholders(gm, specs)
    gm.recompile()
    return gm


def interpret(gm: fx.GraphModule) -> Callable:
    """``gm`` as a function whose ops are re-recorded (with their source meta) when traced."""
    def run(*args):
        return fx.Interpreter(gm).run(*args)
    return run


def copy_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose graph a pass may edit (node metas are copied shallowly)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)
