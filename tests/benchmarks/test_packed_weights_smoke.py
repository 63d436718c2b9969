"""benchmarks/packed_weights.py on the CPU (Triton interpreter, one program, so the phases run
in order): the stream kernel equals the torch chain in each weight layout, its ROTATE form deals
every tile of every phase to one of several programs, and the packing puts each (column tile,
K step) tile in one contiguous run."""

import torch

from helpers import load_benchmark


def test_both_layouts_equal_the_torch_chain():
    load_benchmark("packed_weights").smoke()  # asserts each layout against the reference


def test_pack_makes_each_tile_one_contiguous_run():
    probe = load_benchmark("packed_weights")
    w = torch.arange(64 * 96, dtype=torch.float32).view(64, 96)
    flat = probe.pack(w, 16, 32)
    assert flat.numel() == w.numel()
    for t in range(4):
        for kb in range(3):
            run = flat[(t * 3 + kb) * 16 * 32:(t * 3 + kb + 1) * 16 * 32]
            assert torch.equal(run.view(16, 32), w[t * 16:(t + 1) * 16, kb * 32:(kb + 1) * 32])


def test_shapes_argument_repeats_and_refuses_malformed_shapes():
    import argparse

    import pytest

    probe = load_benchmark("packed_weights")
    assert probe.shape_arg("2048x512*3") == [(2048, 512)] * 3
    assert probe.shape_arg("64x256") == [(64, 256)]
    for bad in ("12x", "0x256", "64x256*0", "64*256"):
        with pytest.raises(argparse.ArgumentTypeError, match="NxK or NxK\\*R"):
            probe.shape_arg(bad)


def test_program_summary_reads_the_clocks():
    probe = load_benchmark("packed_weights")
    # three programs: 0..10 us on SM 4, 0..40 us on SM 7, 5..20 us on SM 4 (ns on the timer)
    clocks = torch.tensor([[0, 10_000, 4], [0, 40_000, 7], [5_000, 20_000, 4]])
    got = probe.program_summary(clocks)
    assert got["span_us"] == 40.0 and got["min_us"] == 10.0 and got["max_us"] == 40.0
    assert got["ms"] == 0.04  # the span: every row the probe emits has its ms
    assert got["median_us"] == 15.0
    assert abs(got["busy_share"] - 65.0 / 120.0) < 1e-9
    assert got["slowest"][0] == (1, 7, 40.0) and len(got["slowest"]) == 3


def test_stream_kernel_with_clocks_compiles_for_sm90():
    """The clocks read the GPU's global timer and SM id (inline PTX, which the interpreter
    cannot run): compiled ahead of time for sm_90 outside the interpreter."""
    from aot import REPO, run_script

    out = run_script(str(REPO / "tests" / "benchmarks" / "packed_weights_clocks_aot.py"))
    assert out["globaltimer"] and out["smid"], out
