"""ragged_attention: dense cached attention -> ``dspark::ragged_attention`` over the paged pool.

Matches (dense verify graph, every request ``T`` tokens)::

    %o = dspark.dense_cached_attention.default(%q, %k, %v, %k_cache_0, %v_cache_0,
                                               %block_table, %context_lens, 0.25)
        # q [bs, H, T, D], k/v [bs, Hkv, T, D] -> o [bs, T, H, D]

Writes (aten nodes with their fake values, so the graph is not re-traced)::

    %q_rows = reshape(transpose(%q, 1, 2), [bs*T, H, D])         # same for k, v
    %o_rows = dspark.ragged_attention.default(%q_rows, %k_rows, %v_rows, %k_cache_0,
                  %v_cache_0, %query_start_loc, %seq_lens, %block_table, %slot_mapping, 0.25)
    %o = view(%o_rows, [bs, T, H, D])

A compressed layer's ops (DeepSeek-V4, ``ops/compressed.py``) are rewritten the same way, their
``[bs, T, ...]`` operands as ``[bs*T, ...]`` rows and the layout's metadata in place of
``context_lens``::

    %f = dspark.dense_compress.default(%kv, %gate, %compress_pool_0, %compress_pool_1,
                                       %compress_pool_2, %block_table, %context_lens, ...)
      -> view(dspark.compress.default(%kv_rows, %gate_rows, ..., %query_start_loc,
                                      %seq_lens, %block_table, %slot_mapping, ...), [bs, T, D])
    dense_index_topk -> index_topk, dense_compressed_attention -> compressed_attention

A sparse layer's ops (DeepSeek Sparse Attention, ``ops/sparse.py``) likewise:
``dense_sparse_index -> sparse_index`` and ``dense_block_index -> block_index`` (with
``slot_mapping``) and ``dense_sparse_attention -> sparse_attention``, the picks as ``[bs*T, P]``
(``[bs*T, Hp, P]``) rows.

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

from ..graph_inputs import InputKind, InputSpec
from .base import PassContext, PassResult, is_op, source_line
from .retrace import add_node, finish, replace, reshape_node, start_rewrite

__all__ = ["run"]

DENSE = torch.ops.dspark.dense_cached_attention
RAGGED = torch.ops.dspark.ragged_attention
COMPRESSED = {  # DeepSeek-V4's compressed layers (ops/compressed.py): dense -> ragged
    torch.ops.dspark.dense_compress: torch.ops.dspark.compress,
    torch.ops.dspark.dense_index_topk: torch.ops.dspark.index_topk,
    torch.ops.dspark.dense_compressed_attention: torch.ops.dspark.compressed_attention,
}
SPARSE = {  # DeepSeek Sparse Attention layers (ops/sparse.py): dense -> ragged
    torch.ops.dspark.dense_sparse_index: torch.ops.dspark.sparse_index,
    torch.ops.dspark.dense_sparse_attention: torch.ops.dspark.sparse_attention,
    torch.ops.dspark.dense_block_index: torch.ops.dspark.block_index,
}


def _arguments(node: fx.Node) -> dict:
    """The call's arguments by schema name, defaults filled in."""
    schema = node.target._schema
    out = {}
    for i, a in enumerate(schema.arguments):
        if i < len(node.args):
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        else:
            out[a.name] = a.default_value
    return out


def _add_inputs(gm: fx.GraphModule, ctx: PassContext) -> dict[str, fx.Node]:
    """Append the ragged metadata placeholders (with symbolic fake values)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ids = next(n for n in placeholders if n.meta["dspark_input"].kind == InputKind.INPUT_IDS)
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
            node.meta["dspark_input"] = InputSpec(name, name)
            new[name] = node
    ctx.inputs.extend(new[name].meta["dspark_input"] for name in vals)
    return new


def _metadata_inputs(gm: fx.GraphModule, ctx: PassContext, meta: dict,
                     inputs: tuple) -> list[fx.Node]:
    """The placeholders ``inputs`` (``(kind, name, like)``: a fake value shaped like ``like``'s),
    each added once after the last placeholder and recorded in ``meta`` by name;
    ``VerifierState.device_metadata`` fills them by name."""
    missing = [(kind, name, like) for kind, name, like in inputs if name not in meta]
    if missing:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        mode = detect_fake_mode([missing[0][2].meta["val"]])
        with gm.graph.inserting_after(placeholders[-1]):
            for kind, name, like in reversed(missing):
                node = gm.graph.placeholder(name)
                with mode:
                    node.meta["val"] = torch.empty_like(like.meta["val"])
                node.meta["dspark_input"] = InputSpec(kind, name)
                meta[name] = node
        ctx.inputs.extend(meta[name].meta["dspark_input"] for _, name, _ in missing)
    return [meta[name] for _, name, _ in inputs]


def _window_inputs(gm: fx.GraphModule, ctx: PassContext, meta: dict, block_table: fx.Node,
                   span: int) -> tuple[fx.Node, fx.Node]:
    """The block table and slot mapping of ``span``'s ring (``VerifierState.window_maps``;
    shaped like the batch's own)."""
    table, slots = _metadata_inputs(gm, ctx, meta, (
        (InputKind.WINDOW_BLOCK_TABLE, f"window_block_table_{span}", block_table),
        (InputKind.WINDOW_SLOT_MAPPING, f"window_slot_mapping_{span}", meta["slot_mapping"])))
    return table, slots


def _entry_table(gm: fx.GraphModule, ctx: PassContext, meta: dict, block_table: fx.Node,
                 rate: int) -> fx.Node:
    """The block table of the entry pools of compression rate ``rate``
    (``VerifierState.entry_maps``)."""
    return _metadata_inputs(gm, ctx, meta, (
        (InputKind.ENTRY_BLOCK_TABLE, f"entry_block_table_{rate}", block_table),))[0]


def run(gm: fx.GraphModule, ctx: PassContext) -> tuple[fx.GraphModule, PassResult]:
    result = PassResult("ragged_attention", changed=0)
    packets = (DENSE, *COMPRESSED, *SPARSE)
    if not any(is_op(n, p) for n in gm.graph.nodes for p in packets):
        # a model without attention layers (all linear attention) reads no context lengths
        _drop_unused_input(gm, ctx, next(i for i, s in enumerate(ctx.inputs)
                                         if s.kind == InputKind.CONTEXT_LENS))
        return gm, result
    # a copy: the dense graph stays intact for Verifier.run_dense
    gm, matches, (bs, t, rows) = start_rewrite(gm, packets)
    meta = _add_inputs(gm, ctx)
    graph, aten = gm.graph, torch.ops.aten
    exact = True  # every fake value after the replacements so far is current (retrace.py)
    for node in matches:
        packet = node.target.overloadpacket
        if packet in COMPRESSED or packet in SPARSE:
            with graph.inserting_before(node):
                out = (_compressed if packet in COMPRESSED else _sparse)(
                    gm, ctx, node, packet, meta, bs, t, rows, exact)
            exact = replace(node, out, exact)
            result.changed += 1
            twin = COMPRESSED.get(packet) or SPARSE[packet]
            result.rewrites.append((f"{node.name} -> {twin.__name__}", source_line(node)))
            continue
        q, k, v, k_cache, v_cache, block_table, _context_lens, scale, *semantics = node.args
        if node.kwargs:  # window / softcap / sinks / chunk / rel / alibi, as the capture gave
            names = ("window", "softcap", "sinks", "chunk", "rel", "alibi")[len(semantics):]
            semantics += [node.kwargs[n] for n in names if n in node.kwargs]
        _, heads, _, dim = q.meta["val"].shape
        kv_heads, v_dim = k.meta["val"].shape[1], v.meta["val"].shape[-1]
        window = int(_arguments(node).get("window") or 0)
        table, slots = (block_table, meta["slot_mapping"]) if window <= 0 else \
            _window_inputs(gm, ctx, meta, block_table, window)
        with graph.inserting_before(node):
            def to_rows(x: fx.Node, n_heads: int, d: int) -> fx.Node:
                x_t = add_node(graph, node, aten.transpose.int, x, 1, 2)  # [bs, T, h, d]
                return reshape_node(graph, node, x_t, [rows, n_heads, d], decide=exact)

            if len(semantics) > 4 and semantics[4] is not None:  # rel [bs, H, T, E] -> rows
                semantics[4] = to_rows(semantics[4], heads, semantics[4].meta["val"].shape[-1])
            sinks = semantics[2] if len(semantics) > 2 else None
            if isinstance(sinks, fx.Node) and sinks.meta["val"].dim() == 3:  # [bs, H, T] rows
                sinks_t = add_node(graph, node, aten.transpose.int, sinks, 1, 2)
                semantics[2] = reshape_node(graph, node, sinks_t, [rows, heads], decide=exact)
            out = add_node(graph, node, RAGGED.default, to_rows(q, heads, dim),
                           to_rows(k, kv_heads, dim), to_rows(v, kv_heads, v_dim), k_cache,
                           v_cache, meta["query_start_loc"], meta["seq_lens"], table, slots,
                           scale, *semantics)
            dense_out = add_node(graph, node, aten.view.default, out, [bs, t, heads, v_dim])
        exact = replace(node, dense_out, exact)
        result.changed += 1
        result.rewrites.append((f"{node.name} -> ragged_attention", source_line(node)))
    ctx_idx = next(i for i, s in enumerate(ctx.inputs) if s.kind == InputKind.CONTEXT_LENS)
    gm = finish(gm, exact, ctx.inputs)  # DCE: the dense attention's inputs (its mask) go
    _drop_unused_input(gm, ctx, ctx_idx)
    _check_all_rewritten(gm, result)
    return gm, result


def _check_all_rewritten(gm: fx.GraphModule, result: PassResult) -> None:
    """No dense op of the family is left, and the ragged ops are as many as the rewrites."""
    from .base import EnsureError

    pairs = ((DENSE, RAGGED), *COMPRESSED.items(), *SPARSE.items())
    left = [n.name for n in gm.graph.nodes for d, _ in pairs if is_op(n, d)]
    if left:
        raise EnsureError(f"{result.name}: dense ops left in the graph: {left}")
    found = sum(1 for n in gm.graph.nodes for _, r in pairs if is_op(n, r))
    if found != result.changed:
        raise EnsureError(f"{result.name}: rewrote {result.changed} calls but the graph has "
                          f"{found} ragged ones")


def _row_views(graph: fx.Graph, node: fx.Node, rows, exact: bool):
    """``(flat, to_rows)``, the row views a rewrite inserts before ``node``: ``[bs, T, *rest]
    -> [bs*T, *rest]`` (None stays None) and ``[bs, h, T, d] -> [bs*T, h, d]``."""

    def flat(x: fx.Node | None) -> fx.Node | None:
        if x is None:
            return None
        return reshape_node(graph, node, x, [rows, *x.meta["val"].shape[2:]], decide=exact)

    def to_rows(x: fx.Node) -> fx.Node:
        _, h, _, d = x.meta["val"].shape
        x_t = add_node(graph, node, torch.ops.aten.transpose.int, x, 1, 2)
        return reshape_node(graph, node, x_t, [rows, h, d], decide=exact)

    return flat, to_rows


def _compressed(gm: fx.GraphModule, ctx: PassContext, node: fx.Node, packet, meta: dict, bs,
                t, rows, exact: bool) -> fx.Node:
    """The ragged twin of one dense compressed-layer op, its rows viewed back to ``[bs, T,
    ...]`` (the dense op's shape). A compressor reads raw rows no older than ``span = rate``
    (``2 * rate`` with overlap) positions before its step: they go through that span's ring
    inputs (``_window_inputs``), its entries through the block table."""
    graph, aten = gm.graph, torch.ops.aten
    a = _arguments(node)
    flat, to_rows = _row_views(graph, node, rows, exact)

    entry_table = _entry_table(gm, ctx, meta, a["block_table"], a["rate"])
    layout = (meta["query_start_loc"], meta["seq_lens"], entry_table)
    if packet is torch.ops.dspark.dense_compress:
        out = add_node(graph, node, torch.ops.dspark.compress.default, flat(a["kv"]),
                       flat(a["gate"]), a["kv_pool"], a["gate_pool"], a["entry_pool"], *layout,
                       meta["slot_mapping"], a["position_bias"], a["norm_weight"],
                       a["inv_freq"], a["rate"], a["overlap"], a["eps"], a["rope_scale"],
                       *_window_inputs(gm, ctx, meta, a["block_table"],
                                       a["rate"] * (2 if a["overlap"] else 1)))
        width = a["entry_pool"].meta["val"].shape[-1]
        return add_node(graph, node, aten.view.default, out, [bs, t, width])
    if packet is torch.ops.dspark.dense_index_topk:
        out = add_node(graph, node, torch.ops.dspark.index_topk.default, flat(a["q"]),
                       flat(a["weights"]), a["entry_pool"], flat(a["fresh"]), *layout,
                       a["rate"], a["topk"], a["softmax_scale"])
        return add_node(graph, node, aten.view.default, out, [bs, t, a["topk"]])

    heads, v_dim = a["q"].meta["val"].shape[1], a["v"].meta["val"].shape[-1]
    kv_table, kv_slots = (a["block_table"], meta["slot_mapping"]) if a["window"] <= 0 else \
        _window_inputs(gm, ctx, meta, a["block_table"], a["window"])
    out = add_node(graph, node, torch.ops.dspark.compressed_attention.default,
                   to_rows(a["q"]), to_rows(a["k"]), to_rows(a["v"]), a["k_cache"],
                   a["v_cache"], *layout[:2], kv_table, kv_slots,
                   a["scale"], a["window"], a["softcap"], a["sinks"], a["entries"],
                   flat(a["fresh"]), a["rate"], flat(a["topk"]), entry_table)
    return add_node(graph, node, aten.view.default, out, [bs, t, heads, v_dim])


def _sparse(gm: fx.GraphModule, ctx: PassContext, node: fx.Node, packet, meta: dict, bs, t,
            rows, exact: bool) -> fx.Node:
    """The ragged twin of one dense sparse-layer op, its rows viewed back to ``[bs, T, ...]``
    (a sparse layer has no window: its keys and indexer keys follow the block table)."""
    graph, aten = gm.graph, torch.ops.aten
    a = _arguments(node)
    flat, to_rows = _row_views(graph, node, rows, exact)

    layout = (meta["query_start_loc"], meta["seq_lens"], a["block_table"], meta["slot_mapping"])
    if packet is torch.ops.dspark.dense_sparse_index:
        out = add_node(graph, node, torch.ops.dspark.sparse_index.default, flat(a["q"]),
                       flat(a["weights"]), flat(a["k"]), a["key_pool"], *layout, a["topk"],
                       a["softmax_scale"])
        return add_node(graph, node, aten.view.default, out, [bs, t, a["topk"]])
    if packet is torch.ops.dspark.dense_block_index:
        heads = a["q"].meta["val"].shape[2]
        out = add_node(graph, node, torch.ops.dspark.block_index.default, flat(a["q"]),
                       flat(a["k"]), a["key_pool"], *layout, a["block_size"], a["topk"],
                       a["local"])
        return add_node(graph, node, aten.view.default, out, [bs, t, heads, a["topk"]])

    heads, v_dim = a["q"].meta["val"].shape[1], a["v"].meta["val"].shape[-1]
    # pick_block only where a layer has one: a token-picks layer's node is as before
    extra = (a["pick_block"],) if a["pick_block"] != 1 else ()
    out = add_node(graph, node, torch.ops.dspark.sparse_attention.default, to_rows(a["q"]),
                   to_rows(a["k"]), to_rows(a["v"]), a["k_cache"], a["v_cache"], *layout,
                   a["scale"], flat(a["picks"]), a["sinks"], *extra)
    return add_node(graph, node, aten.view.default, out, [bs, t, heads, v_dim])


def _drop_unused_input(gm: fx.GraphModule, ctx: PassContext, index: int) -> None:
    node = [n for n in gm.graph.nodes if n.op == "placeholder"][index]
    if not node.users:
        gm.graph.erase_node(node)
        del ctx.inputs[index]
        gm.recompile()
