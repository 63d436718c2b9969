"""The passes' node helpers (``passes/retrace.py``): a replacement recorded without re-tracing
the graph decomposes reshape as a re-trace would, and a pass re-traces only when a replacement
changes a value's strides."""

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from dspark_compile.frontend.adapters import adapter_for
from dspark_compile.frontend.capture import capture_dense
from dspark_compile.graph_inputs import fake_input
from dspark_compile.passes import PassContext, retrace, stage
from dspark_compile.passes.retrace import reshape_node, same_layout
from helpers import tiny_llama, tiny_qwen35

aten = torch.ops.aten


def _graph_with(shape, transpose: bool):
    """A graph with one placeholder ``x`` (a fake value), optionally transposed."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    x_val = fake_input(mode, torch.zeros(shape), "x", ())
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = x_val
    if transpose:
        with mode:
            t_val = x_val.transpose(1, 2)
        x = graph.call_function(aten.transpose.int, (x, 1, 2))
        x.meta["val"] = t_val
    return graph, x, x_val


def test_reshape_is_a_view_where_strides_allow_and_a_copy_where_not():
    graph, x, val = _graph_with((3, 4, 5), transpose=False)
    node = reshape_node(graph, x, x, [12, 5])
    assert node.target is aten.view.default
    graph, x, val = _graph_with((3, 4, 5), transpose=True)  # [3, 5, 4], not mergeable
    node = reshape_node(graph, x, x, [15, 4])
    assert node.target is aten._unsafe_view.default
    assert node.args[0].target is aten.clone.default
    assert node.meta["val"].is_contiguous()
    node = reshape_node(graph, x, x, [15, 4], decide=False)
    assert node.target is aten.reshape.default  # left for a re-trace to decompose


def test_same_layout_compares_shapes_and_strides():
    _, x, val = _graph_with((3, 4, 5), transpose=True)
    assert same_layout(val, val)
    assert not same_layout(val, x.meta["val"])  # same numel, transposed
    assert not same_layout(val, val[:, :2])


def _passes_with_retrace_counted(model, monkeypatch) -> dict:
    """Which passes re-traced while rewriting ``model``'s captured graph."""
    from dspark_compile.passes import flatten_tokens

    calls = []
    real = retrace.retrace

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(retrace, "retrace", counted)  # finish() looks it up here
    monkeypatch.setattr(flatten_tokens, "retrace", counted)
    captured = capture_dense(adapter_for(model), torch.float32, torch.device("cpu"))
    gm, ctx = captured.gm, PassContext(captured.bs, captured.tokens, list(captured.inputs))
    counts = {}
    for p in stage("ragged"):
        name, before = p.name, len(calls)
        out = p.run(gm, ctx)
        gm = out[0] if isinstance(out, tuple) else gm
        counts[name] = len(calls) - before
    return counts


def test_attention_and_gdn_rewrites_do_not_retrace_but_the_conv_does(monkeypatch):
    """Llama: ragged attention keeps the dense output's layout, so only flatten_tokens traces.
    Qwen3.5: the conv's replacement is a transposed view where the dense conv was contiguous,
    so that pass re-traces; the GDN's keeps the layout and does not."""
    llama = _passes_with_retrace_counted(tiny_llama(layers=2), monkeypatch)
    assert llama["ragged_attention"] == 0 and llama["flatten_tokens"] == 1
    hybrid = _passes_with_retrace_counted(
        tiny_qwen35(vocab=13, layer_types=("linear_attention", "full_attention")), monkeypatch)
    assert hybrid["ragged_attention"] == 0 and hybrid["ragged_linear_attention"] == 0
    assert hybrid["ragged_conv"] == 1 and hybrid["flatten_tokens"] == 1
