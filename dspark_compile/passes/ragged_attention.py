"""ragged_attention: dense cached attention -> ``dspark::ragged_attention`` over the paged pool.

Matches (dense verify graph, every request ``T`` tokens)::

    %o = dspark.dense_cached_attention.default(%q, %k, %v, %k_cache_0, %v_cache_0,
                                               %block_table, %context_lens, 0.25)
        # q [bs, H, T, D], k/v [bs, Hkv, T, D] -> o [bs, T, H, D]

Writes::

    %q_rows = reshape(transpose(%q, 1, 2), [bs*T, H, D])         # same for k, v
    %o_rows = dspark.ragged_attention.default(%q_rows, %k_rows, %v_rows, %k_cache_0,
                  %v_cache_0, %query_start_loc, %seq_lens, %block_table, %slot_mapping, 0.25)
    %o = view(%o_rows, [bs, T, H, D])

``query_start_loc``, ``seq_lens`` and ``slot_mapping`` become graph inputs and
``context_lens`` goes away. On a uniform layout (every length ``T``) the rewritten graph
computes exactly what the dense one did, so it can run between passes; ``flatten_tokens``
then lets the rows be any ragged split. Matching is by op packet, so every overload of the
dense op is caught, and the pass ensures that none is left.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.proxy import GraphAppendingTracer

from ..frontend.capture import InputSpec
from .base import PassContext, PassResult, check_rewritten, is_op, source_line
from .retrace import copy_module, interpret, placeholder_values, retrace

__all__ = ["run"]

DENSE = torch.ops.dspark.dense_cached_attention
RAGGED = torch.ops.dspark.ragged_attention


def _add_inputs(gm: fx.GraphModule, ctx: PassContext) -> dict[str, fx.Node]:
    """Append the ragged metadata placeholders (with symbolic fake values)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ids = next(n for n in placeholders if n.meta["dspark_input"].kind == "input_ids")
    bs, t = ids.meta["val"].shape
    mode = detect_fake_mode([ids.meta["val"]])
    with mode:
        vals = {
            "query_start_loc": torch.empty(bs + 1, dtype=torch.int32),
            "seq_lens": torch.empty(bs, dtype=torch.int32),
            "slot_mapping": torch.empty(bs * t, dtype=torch.int64),
        }
    new = {}
    with gm.graph.inserting_after(placeholders[-1]):
        for name in reversed(vals):  # inserting_after: reverse keeps the declared order
            node = gm.graph.placeholder(name)
            node.meta["val"] = vals[name]
            new[name] = node
    ctx.inputs.extend(InputSpec(name, name) for name in vals)
    return new


def _rows(x: fx.Proxy, rows, heads: int, dim: int) -> fx.Proxy:
    return x.transpose(1, 2).reshape(rows, heads, dim)


def run(gm: fx.GraphModule, ctx: PassContext) -> tuple[fx.GraphModule, PassResult]:
    result = PassResult("ragged_attention", changed=0)
    if not any(is_op(n, DENSE) for n in gm.graph.nodes):
        return gm, result
    gm = copy_module(gm)  # the dense graph stays intact for Verifier.run_dense
    matches = [n for n in gm.graph.nodes if is_op(n, DENSE)]
    meta = _add_inputs(gm, ctx)
    ids = next(n for n in gm.graph.nodes
               if n.op == "placeholder" and n.meta["dspark_input"].kind == "input_ids")
    tracer = GraphAppendingTracer(gm.graph)
    for node in matches:
        q, k, v, k_cache, v_cache, block_table, _context_lens, scale = node.args
        _, heads, _, dim = q.meta["val"].shape
        kv_heads = k.meta["val"].shape[1]
        with gm.graph.inserting_before(node):
            ids_p = fx.Proxy(ids, tracer)
            bs, t = ids_p.size(0), ids_p.size(1)
            rows = bs * t
            q_r = _rows(fx.Proxy(q, tracer), rows, heads, dim)
            k_r = _rows(fx.Proxy(k, tracer), rows, kv_heads, dim)
            v_r = _rows(fx.Proxy(v, tracer), rows, kv_heads, dim)
            out = gm.graph.call_function(RAGGED.default, (
                q_r.node, k_r.node, v_r.node, k_cache, v_cache, meta["query_start_loc"],
                meta["seq_lens"], block_table, meta["slot_mapping"], scale))
            dense_out = fx.Proxy(out, tracer).view(bs, t, heads, dim)
        node.replace_all_uses_with(dense_out.node)
        gm.graph.erase_node(node)
        result.changed += 1
        result.rewrites.append((f"{node.name} -> ragged_attention", source_line(node)))
    ctx_idx = next(i for i, s in enumerate(ctx.inputs) if s.kind == "context_lens")
    specs = list(ctx.inputs)
    gm.recompile()
    new_gm = retrace(interpret(gm), placeholder_values(gm), specs)
    _drop_unused_input(new_gm, ctx, ctx_idx)
    check_rewritten(new_gm, DENSE, RAGGED, result)
    return new_gm, result


def _drop_unused_input(gm: fx.GraphModule, ctx: PassContext, index: int) -> None:
    node = [n for n in gm.graph.nodes if n.op == "placeholder"][index]
    if not node.users:
        gm.graph.erase_node(node)
        del ctx.inputs[index]
        gm.recompile()
