"""Hand the token-wise rest of a packed graph to Inductor (``DSparkConfig.inductor``), after
the pass pipeline: the ``dspark::`` ops stay calls."""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.fx as fx

__all__ = ["compile_rest"]

log = logging.getLogger("dspark_compile")


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
