"""benchmarks/gdn_split_spike.py's two launches on the CPU (Triton interpreter): every variant
matches the reference op on the requests' rows, and NaN / Inf in rejected rows leave the
accepted rows bit for bit."""

import pytest
import torch

from helpers import load_benchmark

NAN, INF = float("nan"), float("inf")
VARIANTS = [dict(), dict(gram16=True), dict(inv_product=True), dict(block_v=16, kc=32),
            dict(one_shot=True), dict(pair=True)]


def _case(lens, seed=1):
    ssd = load_benchmark("ssd_kernels")
    hybrid = load_benchmark("hybrid_kernels")
    s = dict(ssd.SMOKE, k_dim=32, v_dim=32)
    return s, hybrid.gdn_inputs(lens, s, "cpu", seed=seed), hybrid


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: ",".join(kw) or "default")
@pytest.mark.parametrize("lens", [[3, 8, 1, 5], [8, 0, 2, 7]])
def test_split_matches_reference(kw, lens):
    from dspark_compile.ops import linear_attention_reference as ref

    spike = load_benchmark("gdn_split_spike")
    s, c, hybrid = _case(lens)
    f32 = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
           for k, v in c.items()}
    want = ref.gated_delta_rule(*hybrid._gdn_args(f32, s))
    got = spike.split_forward(c, s, **kw)
    real = sum(lens)
    torch.testing.assert_close(got[:real].float(), want[:real], atol=2e-6, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: ",".join(kw) or "default")
def test_rejected_rows_never_reach_accepted_rows(kw):
    spike = load_benchmark("gdn_split_spike")
    lens, accepted = [6, 3, 8], [2, 3, 5]
    s, c, _ = _case(lens, seed=4)
    dirty = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in c.items()}
    start = 0
    for n, a in zip(lens, accepted):
        for j in range(a, n):
            for name, value in zip(("q", "k", "v", "g", "beta"), (NAN, INF, -INF, NAN, INF)):
                dirty[name][start + j] = value
        start += n
    clean_out = spike.split_forward(c, s, **kw).clone()
    dirty_out = spike.split_forward(dirty, s, **kw)
    start = 0
    for n, a in zip(lens, accepted):
        assert torch.equal(dirty_out[start:start + a], clean_out[start:start + a])
        start += n
