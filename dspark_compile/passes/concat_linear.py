"""concat_linears: matmuls by weights that read the same rows become one matmul by the weights
stacked into one buffer, and column slices of its product.

Matches (packed graph; q, k and v of a layer, or gate and up)::

    %t    = aten.t.default(%q_proj_weight)                 # [Nq, K] graph input, kind param
    %view = aten.view.default(%x, [N, K])
    %mm   = aten.mm.default(%view, %t)                     # or aten.addmm(%q_bias, %view, %t)
    ... the same for %k_proj_weight, %v_proj_weight
      ->
    %qkv_w = placeholder  (kind param_concat, parts q, k, v)   # [Nq + Nk + Nv, K]
    %t     = aten.t.default(%qkv_w)
    %mm    = aten.mm.default(%view, %t)                    # or aten.addmm(%qkv_bias, ...)
    %q     = aten.slice.Tensor(%mm, 1, 0, Nq)              # %k, %v likewise

Why: at a verify batch's few rows a matmul is bound by launch and tail, not bytes. On an H200
``torch.mm`` took 31.6 us for q, k and v of the 1.1B benchmark model at M = 3 (three launches,
16 MiB: 11% of HBM bandwidth) and 21.6 us for gate and up (``benchmarks/linear_kernel.py``);
one GEMM per group streams the same bytes in one launch.

The weights are stacked once, when the verifier is built (``stack_weights``): the model's own
parameters then become row views of the stacked buffer, so no weight is stored twice and the
model's eager forward (and the dense graph) read the same memory. A weight read by anything
else (tied, shared between layers) is not grouped. Biases are stacked the same way: a group is
either all ``mm`` or all ``addmm`` with a parameter bias.

Semantics-preserving up to the GEMM's summation order: every output element is still one dot
product over ``K``, but the vendor library may split ``K`` differently for a wider matrix, so
results equal the separate matmuls to rounding, not bit for bit. ``DSparkConfig.group_linears``
says where it runs (default: with the Triton lowering only, so the CPU reference stays the
bitwise oracle of the dense graph).
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from ..graph_inputs import InputKind, InputSpec
from .base import PassResult, source_line
from .group_linear import row_source

__all__ = ["concat_linears", "stack_weights"]

log = logging.getLogger("dspark_compile")

_aten = torch.ops.aten
_MM, _ADDMM = _aten.mm.default, _aten.addmm.default
_VIEW_LIKE = (_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default,
              _aten.permute.default, _aten.transpose.int, _aten.unsqueeze.default,
              _aten.squeeze.dim, _aten.slice.Tensor, _aten.select.int, _aten.expand.default,
              _aten.t.default, _aten.unflatten.int, _aten.alias.default)


def _param(node, params: set) -> fx.Node | None:
    """``node`` if it is a parameter placeholder read by nothing but the node at hand."""
    if isinstance(node, fx.Node) and node in params and len(node.users) == 1:
        return node
    return None


def _weight(t, params: set) -> fx.Node | None:
    """The 2-D parameter that ``t = aten.t(param)`` transposes, if ``t`` feeds one matmul."""
    if not (isinstance(t, fx.Node) and t.op == "call_function" and
            t.target is _aten.t.default and len(t.users) == 1):
        return None
    w = _param(t.args[0], params)
    return w if w is not None and w.meta["val"].dim() == 2 else None


def _match(node: fx.Node, params: set):
    """(x, weight, bias or None) of a matmul by a parameter, else None."""
    if node.op != "call_function" or node.target not in (_MM, _ADDMM) or node.kwargs:
        return None
    if node.target is _MM:
        (x, t), bias = node.args, None
    else:
        bias, x, t = node.args
        bias = _param(bias, params)
        if bias is None or bias.meta["val"].dim() != 1:
            return None
    w = _weight(t, params)
    if w is None or x.meta["val"].dtype != w.meta["val"].dtype:
        return None
    return x, w, bias


def _stacked_input(gm: fx.GraphModule, parts: list[fx.Node], inputs: list,
                   kind: str) -> fx.Node:
    """A placeholder for ``parts`` stacked along dim 0, put where the first part was; the parts'
    placeholders and ``InputSpec`` entries are removed (``inputs`` is edited in place)."""
    vals = [p.meta["val"] for p in parts]
    names = tuple(p.meta["dspark_input"].name for p in parts)
    spec = InputSpec(kind, "+".join(names), names)
    with detect_fake_mode(vals):
        val = torch.empty(sum(v.shape[0] for v in vals), *vals[0].shape[1:],
                          dtype=vals[0].dtype, device=vals[0].device)
    with gm.graph.inserting_before(parts[0]):
        node = gm.graph.placeholder(parts[0].name + "_stacked")
    node.meta["val"], node.meta["dspark_input"] = val, spec
    inputs[inputs.index(parts[0].meta["dspark_input"])] = spec
    for p in parts[1:]:
        inputs.remove(p.meta["dspark_input"])
    return node


def _views_hold(node: fx.Node, val, mode) -> bool:
    """Whether every chain of view ops reading ``node`` still works when ``node`` is ``val``
    (a column slice: rows strided by the stacked width). A view that merges the token axis
    with the columns does not; the caller then makes the slice contiguous."""
    for user in node.users:
        if user.op != "call_function" or user.target not in _VIEW_LIKE:
            continue  # kernels and Inductor take the row stride; only views need a layout
        args, kwargs = fx.node.map_arg(
            (user.args, user.kwargs), lambda a: val if a is node else a.meta.get("val"))
        try:
            with mode:
                out = user.target(*args, **kwargs)
        except (RuntimeError, ValueError):  # eager views raise RuntimeError, fake ones ValueError
            return False
        if not _views_hold(user, out, mode):
            return False
    return True


def concat_linears(gm: fx.GraphModule, inputs: list) -> PassResult:
    """Rewrite ``gm`` in place (see the module docstring); ``inputs`` (the ``InputSpec`` per
    placeholder) is kept in step with the placeholders."""
    result = PassResult("concat_linears", changed=0)
    params = {n for n in gm.graph.find_nodes(op="placeholder")
              if getattr(n.meta.get("dspark_input"), "kind", None) == "param"}
    groups: dict[tuple, list] = {}
    for node in gm.graph.nodes:
        found = _match(node, params)
        if found is None:
            continue
        x, w, bias = found
        key = (row_source(x), tuple(str(s) for s in x.meta["val"].shape), bias is not None,
               str(w.meta["val"].shape[1]), w.meta["val"].dtype)
        groups.setdefault(key, []).append((node, w, bias))
    for members in groups.values():
        if len(members) < 2:
            continue
        first = members[0][0]
        x = first.args[0] if first.target is _MM else first.args[1]
        weight = _stacked_input(gm, [w for _, w, _ in members], inputs, "param_concat")
        bias = None if members[0][2] is None else \
            _stacked_input(gm, [b for _, _, b in members], inputs, "param_concat")
        with gm.graph.inserting_before(first):
            t = gm.graph.call_function(_aten.t.default, (weight,))
            mm = gm.graph.call_function(_MM, (x, t)) if bias is None else \
                gm.graph.call_function(_ADDMM, (bias, x, t))
        mode = detect_fake_mode([x.meta["val"]])
        with mode:
            t.meta["val"] = weight.meta["val"].t()
            mm.meta["val"] = torch.mm(x.meta["val"], t.meta["val"])
        mm.meta["stack_trace"] = first.meta.get("stack_trace")
        start = 0
        for node, w, b in members:
            width = int(w.meta["val"].shape[0])
            with gm.graph.inserting_before(node):
                part = gm.graph.call_function(_aten.slice.Tensor,
                                              (mm, 1, start, start + width))
            with mode:
                part.meta["val"] = mm.meta["val"][:, start:start + width]
            start += width
            node.replace_all_uses_with(part)
            if not _views_hold(part, part.meta["val"], mode):
                with gm.graph.inserting_after(part):
                    dense = gm.graph.call_function(
                        _aten.clone.default, (part,), {"memory_format": torch.contiguous_format})
                with mode:
                    dense.meta["val"] = part.meta["val"].contiguous()
                part.replace_all_uses_with(dense, delete_user_cb=lambda u: u is not dense)
                result.details["contiguous"] = result.details.get("contiguous", 0) + 1
            old_x, old_t = (node.args if node.target is _MM else node.args[1:])
            gm.graph.erase_node(node)
            gm.graph.erase_node(old_t)
            for dead in (old_x, w, b):
                if dead is not None and not dead.users and dead is not x:
                    gm.graph.erase_node(dead)
        result.changed += 1
        result.rewrites.append((" + ".join(w.name for _, w, _ in members) + " -> one "
                                + ("addmm" if bias is not None else "mm"), source_line(first)))
    result.details["groups"] = result.changed
    gm.graph.lint()
    gm.recompile()
    return result


def stack_weights(weights: dict, inputs: list) -> None:
    """Add each ``param_concat`` input of ``inputs`` to ``weights`` (name -> tensor): its parts
    stacked along dim 0 into one buffer, the parts' parameters rebound to row views of it (no
    weight stored twice). Parts already stacked by an earlier verifier are reused as they are."""
    stacked = 0
    for spec in inputs:
        if spec.kind != InputKind.PARAM_CONCAT or spec.name in weights:
            continue
        parts = [weights[name] for name in spec.parts]
        first = parts[0]
        rows = sum(p.shape[0] for p in parts)
        offsets = [first.storage_offset()]
        for p in parts[:-1]:
            offsets.append(offsets[-1] + p.numel())
        adjacent = all(p.is_contiguous() and p.untyped_storage().data_ptr() ==
                       first.untyped_storage().data_ptr() and p.storage_offset() == off
                       for p, off in zip(parts, offsets))
        if adjacent:
            buf = torch.empty(0, dtype=first.dtype, device=first.device).set_(
                first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]))
        else:
            with torch.no_grad():
                buf = torch.cat([p.detach() for p in parts], 0)
            start = 0
            for p in parts:
                p.data = buf[start:start + p.shape[0]]
                start += p.shape[0]
            stacked += 1
        weights[spec.name] = buf
    if stacked:
        log.info("dspark_compile: concat_linears stacked %d weight groups; their parameters are "
                 "now row views of the stacked buffers", stacked)
