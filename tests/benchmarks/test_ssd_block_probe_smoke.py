"""benchmarks/ssd_block_probe.py's stream kernel on the CPU (Triton interpreter): ``C S0`` of
every request's slot against torch, at two channel blocks, with and without the Gram in its loop
(the Gram only adds a per-row constant there, so the check is on the stream alone)."""

import pytest
import torch

from helpers import load_benchmark


@pytest.mark.parametrize("block_p", [16, 32])
def test_stream_matches_torch(block_p):
    probe = load_benchmark("ssd_block_probe")
    ssd = load_benchmark("ssd_kernels")
    s = dict(ssd.SMOKE, ssd_state=32, ssd_head_dim=32)
    c = ssd.ssd_inputs([8, 8, 8], s, "cpu", seed=3)
    assert probe.check_stream(probe.stream(c, s, block_p=block_p), c, s) < 1e-4
    with_gram = probe.stream(dict(c), s, block_p=block_p, gram=True).clone()
    assert probe.check_stream(with_gram, c, s) > 1e-3  # the Gram's term is there
