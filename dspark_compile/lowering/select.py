"""Lowering: pick the implementation of each ``dspark::`` op for a device, and optionally hand
the token-wise rest of the packed graph to Inductor.

Matches (packed graph) and writes, for ``lowering="triton"``::

    %o = dspark.ragged_attention.default(%q, %k, %v, ...)
      ->
    %o = dspark.ragged_attention_triton.default(%q, %k, %v, ..., 8)    # 8: the block

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

__all__ = ["resolve_lowering", "lower", "compile_rest"]

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
                node.args = (*node.args, block)
            result.changed += 1
    left = [n.name for n in gm.graph.nodes
            if getattr(n.target, "overloadpacket", None) in table]
    if left:
        raise EnsureError(f"lower: reference ops left after lowering to {lowering}: {left}")
    gm.recompile()
    return [*grouped, result]


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
