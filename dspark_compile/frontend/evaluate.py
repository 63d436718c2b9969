"""Evaluating a captured graph's nodes on real values, outside the trace."""

from __future__ import annotations

import torch.fx as fx

__all__ = ["evaluate_node"]


def evaluate_node(gm: fx.GraphModule, node: fx.Node, values: dict):
    """The real value of ``node``: its ops run on real values (``values`` caches them; seed it
    with the inputs a computation starts from). A host constant's ops run on the values they
    ran on while traced."""
    if node not in values:
        if node.op == "get_attr":
            values[node] = getattr(gm, node.target)
        else:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs),
                                           lambda n: evaluate_node(gm, n, values))
            values[node] = node.target(*args, **kwargs)
    return values[node]
