"""``torch.compile(model, backend="dspark")``: the dense signature, semantics-preserving rewrites.

Registered through the ``torch_dynamo_backends`` entry point (pyproject.toml). The model keeps
its own calling convention; the backend hands the graph to Inductor with the
``masked_fma`` pass installed on Inductor's post-grad (aten) graph, so multiply-by-mask
causality becomes selects and a non-finite value in a masked-off position stays there. No
packing happens here: for packed-ragged verify use ``dspark_compile(model)``.
"""

from __future__ import annotations

import logging

import torch

from .passes import masked_fma

__all__ = ["dspark_backend", "MaskedFmaPass"]

log = logging.getLogger("dspark_compile")


def _custom_pass_base():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


class MaskedFmaPass(_custom_pass_base()):
    """masked_fma as an Inductor post-grad custom pass (hashable for Inductor's cache)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        result = masked_fma.rewrite(graph)
        if result.changed:
            log.info("dspark backend: masked_fma rewrote %d multiply-by-mask ops",
                     result.changed)

    def uuid(self):
        from torch._inductor.custom_graph_pass import get_hash_for_files

        return get_hash_for_files((masked_fma.__file__, __file__))


def dspark_backend(gm: torch.fx.GraphModule, example_inputs):
    """A dynamo backend: Inductor with the semantics-preserving dspark passes."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    with inductor_config.patch(post_grad_custom_pre_pass=MaskedFmaPass()):
        return compile_fx(gm, example_inputs)
