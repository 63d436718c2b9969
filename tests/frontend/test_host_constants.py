"""Values the forward makes on the host and copies to the model's device are folded at capture.

Phi-MoE computes its rotary frequencies with ``torch.arange`` on the CPU inside ``forward`` and
moves them with ``.to(x.device)`` (transformers 5.17 after an expand to the batch size): a
host-to-device copy from pageable memory on every call, which a CUDA graph cannot capture (the
tier session failed on it on the H200). The capture computes such values once
(``frontend/capture._fold_host_constants``) and the graph reads them as constants. The CPU tests
trace onto the meta device to get the cross-device copies.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dspark_compile.frontend.capture import _fold_host_constants


def _forward(x):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float) / 8))
    table = torch.tensor([1.0, 2.0, 3.0, 4.0])
    noise = torch.rand(4)  # random on every call: never a constant
    return x * inv_freq.to(x.device) + table.to(device=x.device) + noise.to(x.device)


def _targets(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def _host_copies(gm) -> list[str]:
    """Copies whose source is on another device than their result."""
    return [n.format_node() for n in gm.graph.nodes
            if n.target is torch.ops.aten._to_copy.default
            and n.args[0].meta["val"].device != n.meta["val"].device]


def test_host_values_copied_to_the_device_become_constants():
    gm = make_fx(_forward)(torch.empty(4, device="meta"))
    assert len(_host_copies(gm)) == 3
    assert _fold_host_constants(gm) == ["_dspark_host_constant0", "_dspark_host_constant1"]
    targets = _targets(gm)
    for gone in ("aten.arange.start_step", "aten.pow.Scalar"):
        assert gone not in targets
    assert _host_copies(gm) == [
        n.format_node() for n in gm.graph.nodes if n.target is torch.ops.aten._to_copy.default
        and n.args[0].target is torch.ops.aten.rand.default]  # the random value's copy stays
    for name in ("_dspark_host_constant0", "_dspark_host_constant1"):
        assert getattr(gm, name).device.type == "meta" and getattr(gm, name).shape == (4,)


def test_a_constant_expanded_to_the_batch_is_moved_before_the_expand():
    """transformers 5.17's Phi-MoE rotary: ``inv_freq[None, :, None].expand(bs, -1, 1)
    .to(float, x.device)``: the copied value has the batch's symbolic size, the constant behind
    the expand does not; the expand is replayed on the device copy."""
    def forward(x, positions):
        inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float) / 8))
        expanded = inv_freq[None, :, None].expand(positions.shape[0], -1, 1).to(
            dtype=torch.float, device=x.device)
        return expanded @ positions[:, None, :].float()

    gm = make_fx(forward, tracing_mode="symbolic")(torch.empty(4, device="meta"),
                                                    torch.zeros(3, 5, dtype=torch.long,
                                                                device="meta"))
    assert len(_host_copies(gm)) == 1
    assert _fold_host_constants(gm) == ["_dspark_host_constant0"]
    assert _host_copies(gm) == []
    (expand,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.expand.default
                 and n.args[0].target is torch.ops.aten.lift_fresh_copy.default]
    assert expand.meta["val"].device.type == "meta"
    assert isinstance(expand.meta["val"].shape[0], torch.SymInt)
    assert gm._dspark_host_constant0.shape == (1, 4, 1)


def test_values_behind_inputs_or_same_device_copies_stay():
    def forward(x, w):
        return x * w.to(x.device), torch.arange(4, dtype=torch.float).to(torch.float64)

    gm = make_fx(forward)(torch.empty(4, device="meta"), torch.ones(4))
    assert _fold_host_constants(gm) == []  # w is an input; the arange copy keeps its device
    assert _targets(gm).count("aten._to_copy.default") == 2


def test_phimoe_on_another_device_compiles_without_host_copies():
    """The whole pipeline on a Phi-MoE whose weights are on the meta device (a device other
    than the host, as a GPU is): no host-to-device copy is left in the packed graph."""
    import transformers

    from dspark_compile.verifier import dspark_compile
    from dspark_compile.zoo.tiny import tiny_config

    tiny = tiny_config("phimoe", transformers.PhimoeForCausalLM)
    model = transformers.PhimoeForCausalLM(tiny.config).eval().to("meta")
    verifier = dspark_compile(model)
    for gm in (verifier.graph_module, verifier.dense_graph_module):
        assert _host_copies(gm) == []
        assert "aten.arange.start_step" not in _targets(gm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_phimoe_verifies_exact_in_tier_graphs():
    from dspark_compile.zoo import check, select

    (entry,) = [e for e in select(["phimoe"]) if e.name == "phimoe"]
    result = check(entry, device="cuda", dtype="bfloat16", static=True)
    assert result.status == "exact", (result.status, result.reason, result.where)


def test_a_host_value_that_cannot_be_computed_stays_and_is_logged(caplog, monkeypatch):
    from dspark_compile.frontend import capture, evaluate as evaluate_module

    gm = make_fx(_forward)(torch.empty(4, device="meta"))
    evaluate = evaluate_module.evaluate_node

    def failing(gm, node, values):  # the torch.tensor table's value cannot be had
        if node.op == "get_attr":
            raise RuntimeError("no host copy of this constant")
        return evaluate(gm, node, values)

    monkeypatch.setattr(capture, "evaluate_node", failing)  # the capture's call
    monkeypatch.setattr(evaluate_module, "evaluate_node", failing)  # and its recursion
    with caplog.at_level("WARNING", logger="dspark_compile"):
        assert _fold_host_constants(gm) == ["_dspark_host_constant0"]  # the arange one only
    assert "copied to meta on every call could not be computed once at capture " \
        "(RuntimeError: no host copy of this constant)" in caplog.text
    assert len(_host_copies(gm)) == 2  # the table's copy stays, beside the random one
