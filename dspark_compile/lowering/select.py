"""Lowering: pick the implementation of each ``dspark::`` op for a device, and optionally hand
the token-wise rest of the packed graph to Inductor.

Matches (packed graph) and writes, for ``lowering="triton"``::

    %o = dspark.ragged_attention.default(%q, %k, %v, ...)
      ->
    %o = dspark.ragged_attention_triton.default(%q, %k, %v, ..., 8, True)
                                           # 8: the block; True: early_attention_reads

``lowering="auto"`` takes Triton on CUDA and ROCm devices (one source; per-target choices live
in ``lowering/targets.py``) and the reference on the CPU, and says which once in the log.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.fx as fx

from ..passes.base import EnsureError, PassResult
from .concat_linear import concat_linears
from .fuse_linear import fuse_linears, fuse_rotary_epilogue
from .fuse_rotary import fuse_rotary
from .group_linear import group_linears
from .outer_product import outer_products
from .ops import LOWERED

__all__ = ["resolve_lowering", "lower", "compile_rest", "early_attention_reads",
           "settled_weight"]

log = logging.getLogger("dspark_compile")


def resolve_lowering(requested: str, device: torch.device) -> str:
    """The lowering to use on ``device``: ``"triton"`` or ``"reference"``."""
    if requested == "auto":
        chosen = "triton" if device.type == "cuda" else "reference"
        log.info("dspark_compile: lowering=%s on %s", chosen, device)
        return chosen
    if requested == "triton" and device.type != "cuda":
        raise ValueError(f"lowering='triton' needs a CUDA or ROCm device; the model is on "
                         f"{device}. Use lowering='reference' (or 'auto') on the CPU")
    return requested


def lower(gm: fx.GraphModule, lowering: str, block: int, group: str = "off",
          rotary: str = "auto", inputs: list | None = None,
          fuse: str = "off", rotary_epilogue: str = "auto") -> list[PassResult]:
    """Make each matmul over a contraction of one a multiply (``outer_products``); group the
    matmuls that share their rows per ``group`` (``DSparkConfig.group_linears``:
    ``"concat"`` stacks their weights, ``"triton"`` makes ``dspark::linear_group`` ops,
    ``"auto"`` is ``"concat"`` for ``lowering="triton"``); with ``rotary="triton"`` (``"auto"``
    with ``lowering="triton"``), fuse each layer's q/k rotation (``fuse_rotary``); then swap
    with ``fuse="on"`` (``"auto"`` with ``lowering="triton"``), make each weight's matmul with
    its norm or SiLU-and-mul and its residual add one ``dspark::skinny_linear``
    (``fuse_linears``) and, with ``rotary_epilogue`` ``"on"`` or ``"auto"``, move each q/k
    rotation into the q/k/v op (``fuse_rotary_epilogue``); then swap each reference
    ``dspark::`` op for its ``lowering`` implementation, in place. ``inputs`` (the
    ``InputSpec`` per placeholder) is kept in step when ``concat`` replaces weight inputs by
    stacked ones.

    The Triton attention also gets ``block`` as its query-tile bound (a speed choice only).
    """
    if group == "auto":
        group = "concat" if lowering == "triton" else "off"
    if rotary == "auto":
        rotary = "triton" if lowering == "triton" else "inductor"
    if group == "concat" and inputs is None:
        raise ValueError("lower(group='concat') needs the graph's inputs list to keep in step")
    grouped = [outer_products(gm)]
    grouped += [group_linears(gm)] if group == "triton" else \
        [concat_linears(gm, inputs)] if group == "concat" else []
    if rotary == "triton":
        grouped.append(fuse_rotary(gm))
    if fuse == "auto":
        fuse = "on" if lowering == "triton" else "off"
    if fuse == "on":
        grouped.append(fuse_linears(gm))
        if rotary_epilogue in ("on", "auto"):
            grouped.append(fuse_rotary_epilogue(gm))
    result = PassResult(f"lower[{lowering}]", changed=0)
    table = LOWERED.get(lowering, {})
    for node in gm.graph.nodes:
        packet = getattr(node.target, "overloadpacket", None)
        if packet in table:
            node.target = table[packet].default
            if packet is torch.ops.dspark.ragged_attention:
                node.args = (*node.args, block, early_attention_reads(node))
            elif packet is torch.ops.dspark.skinny_linear:
                node.kwargs = {**node.kwargs, "weight_settled": settled_weight(node)}
            result.changed += 1
    left = [n.name for n in gm.graph.nodes
            if getattr(n.target, "overloadpacket", None) in table]
    if left:
        raise EnsureError(f"lower: reference ops left after lowering to {lowering}: {left}")
    gm.recompile()
    return [*grouped, result]


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


def _realize_op_inputs(gm: fx.GraphModule) -> None:
    """Have Inductor write a value that several ``dspark::`` ops read once, as one buffer.

    Inductor realises an input of an op it calls (an extern kernel) at that op's strides. A
    pointwise value not yet realised when the first such op is met (the rotary's cos and sin,
    read by every layer) is copied out per reader instead: 32 cos / sin buffers filled by
    several launches for 16 layers. Ops Inductor knows to need realised inputs get the value
    realised once, where it is made."""
    ops = {n.target for n in gm.graph.nodes if n.op == "call_function"
           and getattr(getattr(n.target, "overloadpacket", None), "_qualified_op_name",
                       "").startswith("dspark::")}
    try:
        from torch._inductor.lowering import add_needs_realized_inputs
    except ImportError:  # pragma: no cover - an Inductor without the hook
        log.warning("dspark_compile: this Inductor has no add_needs_realized_inputs; a value "
                    "several dspark ops read (the rotary's cos / sin) is copied per reader")
        return
    add_needs_realized_inputs(sorted(ops, key=str))


def compile_rest(gm: fx.GraphModule) -> Callable:
    """The packed graph under Inductor (norms, activations, rotary fuse; the ``dspark::`` ops
    stay calls, and a value several of them read is realised once: ``_realize_op_inputs``).
    Automatic dynamic shapes: after the first batch size, the one recompile marks only the
    axes that changed (N, R), so weights keep static shapes."""
    _realize_op_inputs(gm)
    return torch.compile(gm, fullgraph=True)
