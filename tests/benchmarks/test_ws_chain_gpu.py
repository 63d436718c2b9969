"""benchmarks/ws_chain.py's kernel on an sm_90 GPU: one layer's chain (q+k+v, o, gate+up, down,
then the LM head) at 3 rows against torch, every unit counted once, no wait given up; without
the waits every unit is still counted (that build's rows are not a valid chain)."""

import pytest
import torch

from helpers import load_benchmark

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs an sm_90 GPU (TMA, warp specialization)")]


@pytest.mark.parametrize("tile", [(16, 512), (32, 256)])
def test_one_layer_chain_matches_torch(tile):
    ws = load_benchmark("ws_chain")
    persistent = load_benchmark("persistent_spike")
    chain = ws.WsChain(persistent.phases(1), "cuda", bn=tile[0], bk=tile[1])
    x = torch.randn(3, 2048, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    x = x.to(torch.bfloat16)
    want = chain.reference(x)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for wait in (True, False):
        chain.set_input(x)
        chain.err.zero_()
        chain.run(sms, 8, wait)
        torch.cuda.synchronize()
        assert chain.err.item() == 0
        assert chain.counter.tolist() == chain.units
        if wait:
            err = ws.rel_err(chain.output(), want)
            assert err < 0.02, err
