"""benchmarks/persistent_spike.py's chain kernel on the CPU (Triton interpreter, one program,
so its grid barriers pass at once): every form (per tile with and without the weight prefetch,
the flattened loop, the CUDA-core rows) equals the torch chain of the same roundings."""

import pytest
import torch

from helpers import load_benchmark


def test_every_form_equals_the_torch_chain():
    load_benchmark("persistent_spike").smoke()  # asserts each form against the reference


def test_phase_table_refuses_unaligned_shapes():
    spike = load_benchmark("persistent_spike")
    with pytest.raises(ValueError, match="multiple of 256"):
        spike.Chain([(256, 200)], "cpu", dtype=torch.float16)


def test_chain_reads_each_phase_from_the_last_output():
    spike = load_benchmark("persistent_spike")
    chain = spike.Chain([(512, 256), (256, 512)], "cpu", dtype=torch.float16)
    assert chain.tab[1, 3].item() == chain.tab[0, 4].item()  # phase 1 reads what 0 wrote
    assert chain.tab[0, 3].item() != chain.tab[0, 4].item()  # and never its own input


def test_chain_refuses_a_phase_wider_than_the_last_output():
    spike = load_benchmark("persistent_spike")
    with pytest.raises(ValueError, match="phase 1 is N x K = 256 x 768 after N = 512"):
        spike.Chain([(512, 256), (256, 768)], "cpu", dtype=torch.float16)
