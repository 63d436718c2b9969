"""Lowering: pick the implementation of each ``dspark::`` op for the resolved lowering (the
last pass of the pipeline).

Matches (packed graph) and writes, for ``lowering="triton"``::

    %o = dspark.ragged_attention.default(%q, %k, %v, ...)
      ->
    %o = dspark.ragged_attention_triton.default(%q, %k, %v, ..., 8, True)
                                           # 8: the block; True: early_attention_reads

``lowering="auto"`` takes Triton on CUDA and ROCm devices (one source; per-target choices live
in ``kernels/targets.py``) and the reference on the CPU (``DSparkConfig.resolve``).
"""

from __future__ import annotations

import torch
import torch.fx as fx

import logging

from ..kernels.ops import LOWERED
from .base import EnsureError, PassContext, PassResult, source_line

__all__ = ["run", "early_attention_reads", "settled_weight", "REFERENCE_ONLY",
           "reference_only_ops"]

log = logging.getLogger(__name__)

REFERENCE_ONLY: tuple = ()
"""Ops with no kernel in some lowering (none at present): under a lowering
other than the reference they run their pure-torch reference on the device, which reads the
layout on the host (a sync per call), so the tier graphs cannot capture them. ``lower`` says so
(a warning and its result), and ``Verifier.capture`` refuses CUDA graphs for such a graph."""


def reference_only_ops(gm: fx.GraphModule) -> list[str]:
    """Names of the :data:`REFERENCE_ONLY` ops ``gm`` calls, sorted."""
    return sorted({str(n.target.overloadpacket) for n in gm.graph.nodes
                   if getattr(n.target, "overloadpacket", None) in REFERENCE_ONLY})


def run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Swap each reference ``dspark::`` op for its implementation under
    ``ctx.settings.lowering``, in place (the pipeline's last pass). The Triton attention also
    gets the block as its query-tile bound (a speed choice only) and whether it may read early
    (``early_attention_reads``); the skinny matmul whether its weight is settled."""
    lowering = ctx.settings.lowering
    result = PassResult(f"lower[{lowering}]", changed=0)
    table = LOWERED.get(lowering, {})
    for node in gm.graph.nodes:
        packet = getattr(node.target, "overloadpacket", None)
        if packet in table:
            node.target = table[packet].default
            if packet is torch.ops.dspark.ragged_attention:
                # the Triton op takes its launch choices after the ten leading arguments and
                # the switches (window, softcap, sinks, chunk, rel, alibi) as keywords
                switches = dict(zip(("window", "softcap", "sinks", "chunk", "rel", "alibi"),
                                    node.args[10:]))
                node.args = (*node.args[:10], ctx.settings.block, early_attention_reads(node))
                node.kwargs = {**switches, **node.kwargs}
            elif packet is torch.ops.dspark.skinny_linear:
                node.kwargs = {**node.kwargs, "weight_settled": settled_weight(node)}
            result.changed += 1
    if lowering != "reference":
        for node in gm.graph.nodes:
            if getattr(node.target, "overloadpacket", None) in REFERENCE_ONLY:
                result.rewrites.append((f"{node.name}: no {lowering} kernel yet, runs its "
                                        "pure-torch reference on the device",
                                        source_line(node)))
        missing = reference_only_ops(gm)
        if missing:
            result.details["reference ops on the device"] = len(result.rewrites)
            log.warning("dspark_compile: %s have no %s kernel yet; they run their pure-torch "
                        "reference on the device (a host sync per call; the tier graphs cannot "
                        "capture them: Verifier.capture needs use_graphs=False)",
                        ", ".join(missing), lowering)
    left = [n.name for n in gm.graph.nodes
            if getattr(n.target, "overloadpacket", None) in table]
    if left:
        raise EnsureError(f"lower: reference ops left after lowering to {lowering}: {left}")
    gm.recompile()
    return result


_VIEWS = {torch.ops.aten.view, torch.ops.aten._unsafe_view, torch.ops.aten.reshape,
          torch.ops.aten.transpose, torch.ops.aten.permute, torch.ops.aten.select,
          torch.ops.aten.slice, torch.ops.aten.unsqueeze, torch.ops.aten.squeeze,
          torch.ops.aten.expand, torch.ops.aten.t, torch.ops.aten.alias,
          torch.ops.aten.as_strided, torch.ops.aten.unflatten, torch.ops.aten.flatten}
"""Ops that launch no kernel of their own (a value behind them is still its source's)."""


def _writes(node: fx.Node, value: fx.Node) -> bool:
    """Whether ``node`` may write ``value`` in place (an argument its schema marks written;
    a call without a schema counts as writing every argument it takes)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return value in node.all_input_nodes
    for i, arg in enumerate(schema.arguments):
        given = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        written = arg.alias_info is not None and arg.alias_info.is_write
        if written and (given is value or (isinstance(given, (list, tuple))
                                           and value in given)):
            return True
    return False


def early_attention_reads(node: fx.Node) -> bool:
    """Whether a ``dspark::ragged_attention`` call may read its metadata and committed KV
    before its PDL wait (``ragged_attention_triton(early_reads=True)``).

    With PDL a launch may start while the launch before it runs, and every launch before that
    one has finished (each of our kernels lets the next one start only after its own wait).
    So reading early is safe when the launch just before cannot write what is read early:
    ``query_start_loc``, ``seq_lens``, ``block_table`` and the pools are graph inputs that no
    call in the graph writes (the pools' committed rows are not written by any launch of a
    step: a ragged attention writes only rows at or past a request's context), and q, k and v
    are computed in the graph (not views of inputs), so some kernel of this graph runs
    between whatever wrote the inputs and this launch."""
    q, k, v, k_cache, v_cache, query_start_loc, seq_lens, block_table = node.args[:8]
    meta = (query_start_loc, seq_lens, block_table)
    if not all(isinstance(a, fx.Node) and a.op == "placeholder"
               for a in (*meta, k_cache, v_cache)):
        return False
    return all(_computed(t) for t in (q, k, v)) and not any(_written(m) for m in meta)


def _computed(value) -> bool:
    """Whether ``value`` is made by a call of the graph (not an input or a view of one), so
    some kernel of the graph runs before a launch that reads it."""
    while (isinstance(value, fx.Node) and value.op == "call_function"
           and getattr(value.target, "overloadpacket", None) in _VIEWS):
        value = value.args[0]
    return isinstance(value, fx.Node) and value.op == "call_function"


def _written(value: fx.Node) -> bool:
    """Whether some call of the graph may write ``value`` in place."""
    return any(_writes(user, value) for user in value.users if user.op == "call_function")


def settled_weight(node: fx.Node) -> bool:
    """Whether a ``dspark::skinny_linear`` call's weight is a graph input (a parameter, or the
    stacked weights ``concat_linears`` makes) that no call in the graph writes, and its rows
    ``x`` are computed in the graph: then the launch just before this one is a kernel of the
    graph, which does not write the weight, and the skinny kernel may read its first tile
    before the PDL wait (``skinny_linear_triton(weight_settled=True)``; the reasoning of
    :func:`early_attention_reads`)."""
    x, w = node.args[:2]
    return (isinstance(w, fx.Node) and w.op in ("placeholder", "get_attr") and not _written(w)
            and _computed(x))
