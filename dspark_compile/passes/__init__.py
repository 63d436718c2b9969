"""FX passes, run in one declared order (PASS_ORDER).

``token_axis`` proves the dense graph token-wise first; ``flat_mrope`` then checks that mRoPE
positions only become rotary angles and takes them as flat rows. ``ragged_attention``,
``ragged_conv`` and ``ragged_linear_attention`` run before ``flatten_tokens``: the ragged ops
take flat rows, so once they are rewritten the dense graph is still runnable on a uniform
layout, and ``flatten_tokens`` finds only ops that treat rows independently plus ops that are
already flat-native.
"""

from __future__ import annotations

from . import (flat_mrope, flatten_tokens, ragged_attention, ragged_conv,
               ragged_linear_attention, token_axis)
from .base import EnsureError, PassContext, PassResult, RefusedOp

__all__ = ["PASS_ORDER", "run_passes", "PassContext", "PassResult", "RefusedOp",
           "EnsureError"]

PASS_ORDER = (
    ("token_axis", token_axis.run),
    ("flat_mrope", flat_mrope.run),
    ("ragged_attention", ragged_attention.run),
    ("ragged_conv", ragged_conv.run),
    ("ragged_linear_attention", ragged_linear_attention.run),
    ("flatten_tokens", flatten_tokens.run),
)
"""(name, run) in the order they apply. A run returns a PassResult (analysis) or
(new graph, PassResult) (rewrite)."""


def run_passes(gm, ctx: PassContext, stop_after: str | None = None):
    """Apply PASS_ORDER to ``gm``; returns the final graph and one result per pass."""
    results = []
    for name, fn in PASS_ORDER:
        out = fn(gm, ctx)
        if isinstance(out, tuple):
            gm, result = out
        else:
            result = out
        results.append(result)
        if name == stop_after:
            break
    return gm, results
