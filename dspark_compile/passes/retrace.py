"""Re-trace a rewritten graph into a clean aten graph with fresh shape metadata, or add aten
nodes to one without re-tracing it.

``retrace``: re-tracing a graph under ``make_fx`` with the same fake inputs decomposes torch-level
nodes to aten, recomputes every node's ``meta["val"]``, and keeps each node's model source line
(``preserve_node_meta``: the FX interpreter hands each node's meta to the new nodes it
produces). It costs a trace of the whole graph (seconds for a 16-layer model), so the passes
that swap one op for a few aten ones use ``add_node`` instead: the new node gets its fake value
from its arguments' and the source meta of the node it replaces (``reshape_node`` writes a
reshape as its aten view or copy). That keeps every later node's fake value current only while
each replacement has the replaced node's shape and strides (``same_layout``); a pass whose
replacement does not re-traces after all.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Callable, Sequence

import torch
from torch._dispatch.python import enable_python_dispatcher
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_map_only

from ..graph_inputs import InputKind, find_input, name_placeholders
from .base import is_op

__all__ = ["retrace", "interpret", "placeholder_values", "name_placeholders", "copy_module",
           "add_node", "reshape_node", "same_layout", "start_rewrite", "replace", "finish"]


def placeholder_values(gm: fx.GraphModule) -> list:
    """The fake value of each placeholder, in order."""
    return [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]


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


_SOURCE_META = ("stack_trace", "nn_module_stack", "source_fn_stack")
"""Node meta that says which model line made a node (kept on the nodes that replace it)."""


def add_node(graph: fx.Graph, like: fx.Node, target, *args, **kwargs) -> fx.Node:
    """A ``target(*args, **kwargs)`` call node (at the graph's insert point) with its fake
    value, run on the args' fake values, and ``like``'s source meta: what a re-trace would
    record."""
    packet = getattr(target, "overloadpacket", target)
    node = graph.create_node("call_function", target, args, kwargs, name=packet.__name__)
    vals, kw = tree_map_only(fx.Node, lambda a: a.meta["val"], (args, kwargs))
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    with mode or contextlib.nullcontext():  # sizes alone (SymInt arithmetic) need no mode
        node.meta["val"] = target(*vals, **kw)
    node.meta.update({k: like.meta[k] for k in _SOURCE_META if k in like.meta})
    return node


def reshape_node(graph: fx.Graph, like: fx.Node, x: fx.Node, shape: list,
                 decide: bool = True) -> fx.Node:
    """``x.reshape(shape)``. ``decide``: as its aten decomposition, as a re-trace would record
    it (a view where ``x``'s strides allow one, else a contiguous clone and ``_unsafe_view``),
    which needs ``x``'s fake value to be current; else a ``reshape`` node for a re-trace to
    decompose. (A ``reshape`` node must not outlive the pass: ``flatten_tokens`` would turn it
    into a reshape of the flat rows, a view where the dense one copied.)"""
    aten = torch.ops.aten
    if not decide:
        return add_node(graph, like, aten.reshape.default, x, shape)
    val = x.meta["val"]
    sizes = tree_map_only(fx.Node, lambda a: a.meta["val"], shape)
    with detect_fake_mode([val]), enable_python_dispatcher():  # as retrace runs reshape
        out = val.reshape(sizes)
    base = val._base if val._is_view() else val
    if out._is_view() and out._base is base:
        return add_node(graph, like, aten.view.default, x, shape)
    copy = add_node(graph, like, aten.clone.default, x, memory_format=torch.contiguous_format)
    return add_node(graph, like, aten._unsafe_view.default, copy, shape)


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` have provably the same shape and strides (so the fake values of the
    nodes after one replaced by the other stay current)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return a.dim() == b.dim() and all(
        statically_known_true(x == y) for x, y in zip((*a.shape, *a.stride()),
                                                      (*b.shape, *b.stride())))


def start_rewrite(gm: fx.GraphModule, dense) -> tuple[fx.GraphModule, list[fx.Node],
                                                     tuple[fx.Node, fx.Node, fx.Node]]:
    """``(copy of gm, its calls of the op packet dense (or of any of a tuple of packets, in
    graph order), (bs, T, bs*T) nodes)``: a rewriting
    pass edits the copy (the graph it was given stays intact); the token counts, read off
    ``input_ids [bs, T]``, sit once before the first call, for every replacement to use."""
    gm = copy_module(gm)
    packets = dense if isinstance(dense, tuple) else (dense,)
    matches = [n for n in gm.graph.nodes if any(is_op(n, p) for p in packets)]

    ids = find_input(gm, InputKind.INPUT_IDS)
    like, aten = matches[0], torch.ops.aten
    with gm.graph.inserting_before(like):
        bs = add_node(gm.graph, like, aten.sym_size.int, ids, 0)
        t = add_node(gm.graph, like, aten.sym_size.int, ids, 1)
        rows = add_node(gm.graph, like, operator.mul, bs, t)
    return gm, matches, (bs, t, rows)


def replace(node: fx.Node, new: fx.Node, exact: bool) -> bool:
    """``node``'s uses moved to ``new`` and ``node`` erased; returns whether every fake value
    is still current (``exact`` so far, and ``new`` has ``node``'s layout: ``same_layout``)."""
    exact = exact and same_layout(node.meta["val"], new.meta["val"])
    node.replace_all_uses_with(new)
    node.graph.erase_node(node)
    return exact


def finish(gm: fx.GraphModule, exact: bool, specs: Sequence) -> fx.GraphModule:
    """A pass's graph after its ``add_node`` replacements: dead code removed and recompiled
    when every fake value is still current (``exact``), else re-traced (``retrace``)."""
    if not exact:
        gm.recompile()
        return retrace(interpret(gm), placeholder_values(gm), list(specs))
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm
