"""Every FX rewrite, run by one runner in one declared order (``PIPELINE``).

Stage ``ragged`` turns the dense verify graph into the packed-ragged one: ``token_axis`` proves
the dense graph token-wise first; ``flat_mrope`` then checks that mRoPE positions only become
rotary angles and takes them as flat rows. ``ragged_attention``, ``ragged_conv``,
``ragged_linear_attention`` and ``ragged_ssd`` run before ``flatten_tokens``: the ragged ops
take flat rows, so once they are rewritten the dense graph is still runnable on a uniform
layout, and ``flatten_tokens`` finds only ops that treat rows independently plus ops that are
already flat-native.
``ragged_experts`` bounds the experts' routing (flat-native from the capture on) by the
layout's real rows, so padding routes nowhere.

Stage ``lowering`` works on the packed graph: token-wise fusions, each enabled by the resolved
configuration (``DSparkConfig.resolve``), then ``lower`` swaps every reference ``dspark::`` op
for its implementation. ``masked_fma`` is not in the pipeline: it is the one rewrite of the
dense-signature ``torch.compile(backend="dspark")`` path (``backend.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

import torch.fx as fx

from ..config import ResolvedConfig
from . import (concat_linear, flat_mrope, flatten_tokens, fuse_linear, fuse_rotary,
               group_linear, lower, outer_product, ragged_attention, ragged_conv,
               ragged_experts, ragged_linear_attention, ragged_ssd, token_axis)
from .base import EnsureError, PassContext, PassResult, RefusedOp

__all__ = ["PIPELINE", "Pass", "run_pipeline", "stage", "PassContext", "PassResult",
           "RefusedOp", "EnsureError"]

PassOutput = Union[PassResult, "tuple[fx.GraphModule, PassResult]"]


def _always(settings: ResolvedConfig) -> bool:
    return True


@dataclass(frozen=True)
class Pass:
    """One entry of the pipeline."""

    name: str
    """The name ``explain()`` and ``run_pipeline(stop_after=...)`` use."""
    run: Callable[[fx.GraphModule, PassContext], PassOutput]
    """Returns a PassResult (analysis, or a rewrite in place) or (new graph, PassResult)."""
    stage: str
    """``"ragged"`` (dense -> packed) or ``"lowering"`` (packed -> packed)."""
    enabled: Callable[[ResolvedConfig], bool] = _always
    """Whether it runs under the resolved configuration."""


PIPELINE = (
    Pass("token_axis", token_axis.run, "ragged"),
    Pass("flat_mrope", flat_mrope.run, "ragged"),
    Pass("ragged_attention", ragged_attention.run, "ragged"),
    Pass("ragged_conv", ragged_conv.run, "ragged"),
    Pass("ragged_linear_attention", ragged_linear_attention.run, "ragged"),
    Pass("ragged_ssd", ragged_ssd.run, "ragged"),
    Pass("ragged_experts", ragged_experts.run, "ragged"),
    Pass("flatten_tokens", flatten_tokens.run, "ragged"),
    Pass("outer_products", lambda gm, ctx: outer_product.outer_products(gm), "lowering"),
    Pass("group_linears", lambda gm, ctx: group_linear.group_linears(gm), "lowering",
         lambda s: s.group_linears == "triton"),
    Pass("concat_linears", lambda gm, ctx: concat_linear.concat_linears(gm, ctx.inputs),
         "lowering", lambda s: s.group_linears == "concat"),
    Pass("fuse_rotary", lambda gm, ctx: fuse_rotary.fuse_rotary(gm), "lowering",
         lambda s: s.rotary == "triton"),
    Pass("fuse_linears", lambda gm, ctx: fuse_linear.fuse_linears(gm), "lowering",
         lambda s: s.fuse_linears),
    Pass("fuse_rotary_epilogue", lambda gm, ctx: fuse_linear.fuse_rotary_epilogue(gm),
         "lowering", lambda s: s.fuse_linears and s.rotary_epilogue),
    Pass("lower", lower.run, "lowering"),
)
"""Every pass, in the order it applies."""


def stage(name: str) -> tuple[Pass, ...]:
    """The passes of stage ``name``, in order."""
    return tuple(p for p in PIPELINE if p.stage == name)


def run_pipeline(gm: fx.GraphModule, ctx: PassContext,
                 stages: tuple[str, ...] = ("ragged", "lowering"),
                 stop_after: str | None = None) -> tuple[fx.GraphModule, list[PassResult]]:
    """Run the enabled passes of ``stages`` on ``gm`` in ``PIPELINE`` order; returns the final
    graph and one result per pass that ran."""
    results = []
    for p in PIPELINE:
        if p.stage not in stages or not p.enabled(ctx.settings):
            continue
        out = p.run(gm, ctx)
        if isinstance(out, tuple):
            gm, result = out
        else:
            result = out
        results.append(result)
        if p.name == stop_after:
            break
    return gm, results
