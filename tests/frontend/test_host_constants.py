"""Values the forward makes on the host and copies to the model's device are folded at capture.

Phi-MoE computes its rotary frequencies with ``torch.arange`` on the CPU inside ``forward`` and
moves them with ``.to(x.device)``: a host-to-device copy from pageable memory on every call,
which a CUDA graph cannot capture (the tier session failed on it on the H200). The capture
computes such values once (``frontend/capture._fold_host_constants``) and the graph reads them
as constants. The CPU tests trace onto the meta device to get the cross-device copies.
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


def test_host_values_copied_to_the_device_become_constants():
    gm = make_fx(_forward)(torch.empty(4, device="meta"))
    assert "aten.arange.start_step" in _targets(gm)
    assert _fold_host_constants(gm) == ["_dspark_host_constant0", "_dspark_host_constant1"]
    targets = _targets(gm)
    for gone in ("aten.arange.start_step", "aten.pow.Scalar", "aten.lift_fresh_copy.default"):
        assert gone not in targets
    assert targets.count("aten._to_copy.default") == 1  # the random value's copy stays
    assert "aten.rand.default" in targets
    for name in ("_dspark_host_constant0", "_dspark_host_constant1"):
        assert getattr(gm, name).device.type == "meta" and getattr(gm, name).shape == (4,)


def test_folded_constants_hold_the_forwards_values():
    """The copies retargeted to the CPU (their recorded device stays meta), so the fold runs
    and its buffers hold values to compare."""
    gm = make_fx(_forward)(torch.empty(4, device="meta"))
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten._to_copy.default:
            node.kwargs = {**node.kwargs, "device": torch.device("cpu")}
    _fold_host_constants(gm)
    want = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float) / 8))
    assert torch.equal(gm._dspark_host_constant0, want)
    assert torch.equal(gm._dspark_host_constant1, torch.tensor([1.0, 2.0, 3.0, 4.0]))


def test_values_behind_inputs_or_same_device_copies_stay():
    def forward(x, w):
        return x * w.to(x.device), torch.arange(4, dtype=torch.float).to(torch.float64)

    gm = make_fx(forward)(torch.empty(4, device="meta"), torch.ones(4))
    assert _fold_host_constants(gm) == []  # w is an input; the arange copy keeps its device
    assert _targets(gm).count("aten._to_copy.default") == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_phimoe_verifies_exact_in_tier_graphs():
    from dspark_compile.zoo import check, select

    (entry,) = [e for e in select(["phimoe"]) if e.name == "phimoe"]
    result = check(entry, device="cuda", dtype="bfloat16", static=True)
    assert result.status == "exact", (result.status, result.reason, result.where)
