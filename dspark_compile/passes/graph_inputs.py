"""Graph inputs the rewriting passes add: layout metadata and replay rings.

A pass that needs a new input appends a placeholder after the last one (with a fake value, so
shapes keep propagating) and records its ``InputSpec`` in ``ctx.inputs``; inputs that already
exist (``query_start_loc`` added by an earlier pass) are reused, not duplicated.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from ..frontend.capture import InputSpec
from .base import PassContext

__all__ = ["find_input", "add_input", "query_start_loc", "RING_SAMPLE_ROWS"]

RING_SAMPLE_ROWS = 16
"""Rows of a replay ring's placeholder value. The rings are static-shaped graph inputs; the
state allocates ``max_step_tokens`` rows and the ops need only ``rows >= N``."""


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def find_input(gm: fx.GraphModule, kind: str) -> fx.Node | None:
    """The placeholder of input kind ``kind``, or None."""
    return next((n for n in _placeholders(gm) if n.meta["dspark_input"].kind == kind), None)


def add_input(gm: fx.GraphModule, ctx: PassContext, kind: str, name: str, shape,
              dtype: torch.dtype) -> fx.Node:
    """Append a placeholder ``name`` of kind ``kind`` with a fake value of ``shape``."""
    last = _placeholders(gm)[-1]
    mode = detect_fake_mode([last.meta["val"]])
    with mode:
        val = torch.empty(shape, dtype=dtype, device=last.meta["val"].device)
    with gm.graph.inserting_after(last):
        node = gm.graph.placeholder(name)
    spec = InputSpec(kind, name)
    node.meta["val"], node.meta["dspark_input"] = val, spec
    ctx.inputs.append(spec)
    return node


def query_start_loc(gm: fx.GraphModule, ctx: PassContext) -> fx.Node:
    """The ``query_start_loc [bs + 1]`` input, added if no earlier pass made it."""
    node = find_input(gm, "query_start_loc")
    if node is not None:
        return node
    bs = find_input(gm, "input_ids").meta["val"].shape[0]
    return add_input(gm, ctx, "query_start_loc", "query_start_loc", (bs + 1,), torch.int32)
