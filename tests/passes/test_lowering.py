"""Lowering choices: op selection per device, and the token-wise rest under Inductor (CPU)."""

import random

import pytest
import torch

from dspark_compile import DSparkConfig, dspark_compile
from helpers import PlainDecoder, Session


def test_auto_takes_the_reference_on_cpu_and_triton_on_gpu():
    assert DSparkConfig().resolve("cpu").lowering == "reference"
    assert DSparkConfig().resolve("cuda").lowering == "triton"
    assert DSparkConfig(lowering="reference").resolve("cuda").lowering == "reference"


def test_triton_on_cpu_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="lowering='reference'"):
        DSparkConfig(lowering="triton").resolve("cpu")
    with pytest.raises(ValueError, match="needs a CUDA or ROCm device"):
        dspark_compile(PlainDecoder(), lowering="triton")


def test_bad_config_values_are_refused():
    with pytest.raises(ValueError, match="lowering='cuda'"):
        DSparkConfig(lowering="cuda")
    with pytest.raises(ValueError, match="page_size=0"):
        DSparkConfig(page_size=0)
    with pytest.raises(TypeError, match="no field"):
        DSparkConfig().with_overrides(pagesize=16)


def test_inductor_rest_matches_own_forward():
    """One compile (dynamic in N) serves batches of every size."""
    model = PlainDecoder(seed=7)
    verifier = dspark_compile(model, inductor=True)
    session = Session(model, verifier, [2, 0, 1])
    session.vocab = 61
    session.step([6, 3, 9], accept=[6, 3, 9])
    rng = random.Random(1)
    for _ in range(3):
        session.step([rng.randint(1, 8) for _ in range(3)])
    assert session.max_err < 1e-5


def _attention_graph(qsl_from_lens: bool = False, q_from_input: bool = False,
                     written: bool = False):
    """A packed graph of one ragged attention: q/k/v from a matmul of the input rows (or q a
    view of an input), metadata as inputs (or query_start_loc a cumsum of lengths), and
    optionally an in-place copy into the block table before the attention."""
    import torch.fx as fx

    aten = torch.ops.aten
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    pools = [g.placeholder(n) for n in ("k_cache", "v_cache")]
    lens, qsl, seq_lens, table, slots = (g.placeholder(n) for n in (
        "lens", "query_start_loc", "seq_lens", "block_table", "slot_mapping"))
    rows = g.call_function(aten.mm.default, (x, w))
    q = g.call_function(aten.view.default, (x if q_from_input else rows, [-1, 2, 8]))
    k = v = g.call_function(aten.view.default, (rows, [-1, 2, 8]))
    if qsl_from_lens:
        qsl = g.call_function(aten.cumsum.default, (lens, 0))
    if written:
        g.call_function(aten.copy_.default, (table, lens))
    node = g.call_function(torch.ops.dspark.ragged_attention.default,
                           (q, k, v, *pools, qsl, seq_lens, table, slots, 0.5))
    g.output(node)
    return node


@pytest.mark.parametrize("case, want", [
    ({}, True),
    ({"qsl_from_lens": True}, False),   # the metadata is made in the graph
    ({"q_from_input": True}, False),    # no kernel of the graph runs before the attention
    ({"written": True}, False),         # a call of the graph writes the block table
])
def test_attention_reads_early_only_when_the_graph_shows_it_safe(case, want):
    from dspark_compile.passes.lower import early_attention_reads

    assert early_attention_reads(_attention_graph(**case)) is want


def _lowered_llama_calls(target) -> list:
    """The calls of ``target`` in a 2-layer fp16 Llama's packed graph lowered to Triton (CPU:
    lowering only, nothing runs)."""
    from helpers import packed_graph, tiny_llama

    gm, _ = packed_graph(tiny_llama(layers=2).half(), torch.float16, "cuda",
                         ("ragged", "lowering"), rotary="inductor")
    return [n for n in gm.graph.nodes if n.target is target]


def test_the_verifier_graph_lets_every_attention_read_early():
    """The packed graph of a Llama, lowered to Triton (CPU: lowering only, nothing runs):
    every attention launch is told it may read its metadata before the PDL wait."""
    calls = _lowered_llama_calls(torch.ops.dspark.ragged_attention_triton.default)
    assert len(calls) == 2 and all(n.args[-2:] == (8, True) for n in calls)


def test_skinny_weights_are_settled_only_when_no_call_writes_them():
    """The Llama's fused matmuls (lowered to Triton) take parameters or stacked weights: each
    launch may read its first weight tile before the PDL wait; a weight the graph computes,
    or writes in place, may not be, nor one whose rows are a graph input (then no kernel of
    the graph need run before the launch)."""
    import torch.fx as fx

    from dspark_compile.passes.lower import settled_weight

    calls = _lowered_llama_calls(torch.ops.dspark.skinny_linear_triton.default)
    assert len(calls) == 9 and all(n.kwargs["weight_settled"] is True for n in calls)

    aten = torch.ops.aten
    for how in ("computed", "written", "input rows"):
        g = fx.Graph()
        x, w = g.placeholder("x"), g.placeholder("w")
        if how != "input rows":  # the rows come from a kernel of the graph
            x = g.call_function(aten.relu.default, (x,))
        if how == "computed":
            w = g.call_function(aten.mul.Tensor, (w, 2.0))
        elif how == "written":
            g.call_function(aten.mul_.Tensor, (w, 2.0))
        node = g.call_function(torch.ops.dspark.skinny_linear.default,
                               (x, w, None, None, 0.0, False, None, False))
        g.output(node)
        assert settled_weight(node) is False, how
