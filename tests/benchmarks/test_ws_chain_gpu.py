"""benchmarks/ws_chain.py's kernel on an sm_90 GPU: one layer's chain (q+k+v, o, gate+up, down,
then the LM head) at 3 rows against torch, every unit counted once, no wait given up; without
the waits every unit is still counted (that build's rows are not a valid chain). With the
layer's input transforms (residual add + RMSNorm, SiLU-and-mul) against torch too, and the
launches with those fused as the lowering does them against the same reference."""

import pytest
import torch

from helpers import load_benchmark

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs an sm_90 GPU (TMA, warp specialization)")]


@pytest.mark.parametrize("tile, layer, mma, wrel", [((16, 512), False, False, False),
                                                    ((32, 256), False, False, False),
                                                    ((16, 512), True, False, False),
                                                    ((16, 512), False, True, False),
                                                    ((16, 512), True, False, True),
                                                    ((16, 512), False, True, True),
                                                    ((16, 512), False, 2, True),
                                                    ((16, 512), False, 3, True)])
def test_one_layer_chain_matches_torch(tile, layer, mma, wrel):
    """``wrel``: each consumer warp takes and hands back the ring's slots on its own; ``mma``
    2: the tensor-core units with the warps' partials added a group of units at a time (3:
    with a four-slot phase's B operands built once)."""
    ws = load_benchmark("ws_chain")
    persistent = load_benchmark("persistent_spike")
    shapes, kinds = ws.layer_phases(1) if layer else (persistent.phases(1), None)
    chain = ws.WsChain(shapes, "cuda", bn=tile[0], bk=tile[1], kinds=kinds)
    x = torch.randn(3, 2048, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    x = x.to(torch.bfloat16)
    want = chain.reference(x)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for wait in (True, False):
        chain.set_input(x)
        chain.err.zero_()
        chain.run(sms, 8, wait, mma=mma, wrel=wrel)
        torch.cuda.synchronize()
        assert chain.err.item() == 0
        assert chain.counter.tolist() == chain.units
        if wait:
            err = ws.rel_err(chain.output(), want)
            assert err < 0.02, err
    assert ws.rel_err(ws.skinny_chain(chain, x), want) < 0.02


@pytest.mark.parametrize("wrel, mma", [(False, 0), (True, 0), (True, 2), (True, 3)])
def test_chain_repeats_bitwise_under_the_rings_stress(wrel, mma):
    """With the producer's L2 lookahead the refills come from L2 right after a slot's release;
    a slot released before its reads had landed gave a different output on every step.
    ``wrel``: each consumer warp hands its slots back on its own."""
    ws = load_benchmark("ws_chain")
    persistent = load_benchmark("persistent_spike")
    chain = ws.WsChain(persistent.phases(2), "cuda", bn=16, bk=512)
    x = torch.randn(3, 2048, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    x = x.to(torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    outs = []
    for _ in range(6):
        chain.set_input(x)
        chain.run(sms, 8, look=128 * 1024, wrel=wrel, mma=mma)
        outs.append(chain.output().clone())
    assert chain.err.item() == 0
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert ws.rel_err(outs[0], chain.reference(x)) < 0.02
