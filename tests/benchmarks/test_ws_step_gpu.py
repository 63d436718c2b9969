"""benchmarks/ws_step.py's kernel on an sm_90 GPU: two layers and the LM head at 3 rows against
torch, every unit counted once, every KV head merged once, no wait given up; a second step over
the same inputs gives the same logits bit for bit, also six steps under the ring's stress (the
producer's L2 lookahead: refills from L2 right after a slot's release) (the merge sums the splits in split order,
whichever split counts last); the new positions' K and V are where the reference puts them and
no other cache row changed; the probe's times cover every phase a program had units in."""

import pytest
import torch

from helpers import load_benchmark

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs an sm_90 GPU (TMA, warp specialization)")]


@pytest.mark.parametrize("splits,stress,wrel,mma", [(16, False, False, 0), (8, False, False, 0),
                                                    (16, True, False, 0), (16, False, True, 0),
                                                    (16, True, True, 0), (16, False, True, 2),
                                                    (16, True, True, 2), (16, True, True, 3)])
def test_two_layers_match_torch_and_repeat_bitwise(splits, stress, wrel, mma):
    """``wrel``: each consumer warp takes and hands back the ring's slots on its own; ``mma``
    2: the matmuls on the tensor cores, the warps' partials added a group of units at a time;
    3: the same with a four-slot phase's B operands built once."""
    ws = load_benchmark("ws_step")
    look = ws.STRESS_LOOK if stress else 0
    step = ws.WsStep(2, "cuda", splits=splits)
    x = torch.randn(3, ws.HIDDEN, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    x = x.to(torch.bfloat16)
    want = step.reference(x)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kc0, vc0 = step.kc.clone(), step.vc.clone()
    outs = []
    for _ in range(6 if stress else 2):
        step.set_input(x)
        step.err.zero_()
        step.run(sms, 8, look=look, wrel=wrel, mma=mma)
        torch.cuda.synchronize()
        assert step.err.item() == 0
        assert step.counter[:len(step.units)].tolist() == step.units
        assert (step.counter[len(step.units):] == step.nsplit).all()
        outs.append(step.output().clone())
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert ws.rel_err(outs[0], want) < 0.02
    assert torch.equal(outs[0].float().argmax(-1), want.float().argmax(-1))
    # the new tokens' rotated k and v are in the cache where the reference writes them
    rows = [(layer * step.pages + step.bt[p // step.page].item()) * step.page + p % step.page
            for layer in range(2) for p in range(step.ctx, step.ctx + 3)]
    kc, vc = step.kc.clone(), step.vc.clone()
    _, ref_k, ref_v = step.reference(x, caches=True)
    assert torch.equal(step.kc, kc) and torch.equal(step.vc, vc)  # the reference copies
    assert ws.rel_err(kc[rows], ref_k[rows]) < 0.02 and ws.rel_err(vc[rows], ref_v[rows]) < 0.02
    others = torch.ones(kc.shape[0], dtype=torch.bool, device="cuda")
    others[rows] = False
    assert torch.equal(kc[others], kc0[others]) and torch.equal(vc[others], vc0[others])


def test_probe_times_every_phase_with_units():
    ws = load_benchmark("ws_step")
    step = ws.WsStep(1, "cuda")
    step.set_input(torch.randn(3, ws.HIDDEN, device="cuda").to(torch.bfloat16))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    probe = torch.zeros(sms, len(step.phases), 3, dtype=torch.int64, device="cuda")
    step.run(sms, 8, probe=probe)
    torch.cuda.synchronize()
    first = load_benchmark("ws_chain").first_unit
    for p, row in enumerate(step.tab.tolist()):
        has = torch.tensor([first(pid, sms, row[3]) < row[9] for pid in range(sms)])
        t = probe[:, p].cpu()
        assert ((t[:, 2] > 0) == has).all(), p
        assert (t[has, 0] <= t[has, 1]).all() and (t[has, 1] <= t[has, 2]).all(), p
    prof = ws.phase_profile(step, probe)
    assert prof["step_us"] > 0 and prof["attn"]["share"] > 0
