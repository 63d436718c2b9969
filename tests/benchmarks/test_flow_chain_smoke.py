"""benchmarks/flow_chain.py on the CPU: the flow kernel (Triton interpreter, one program, so the
phases run in order and every wait passes) equals the torch chain with and without K splits;
the unit table splits small phases until they reach the programs, in whole K steps, a tile's
splits consecutive; the sm_90 builds compile with the L2 prefetch only where asked."""

import pytest
import torch

from helpers import load_benchmark


def test_flow_kernel_equals_the_torch_chain():
    load_benchmark("flow_chain").smoke()  # asserts each configuration against the reference


def test_unit_table_splits_small_phases_in_whole_k_steps():
    probe = load_benchmark("flow_chain")
    shapes = [(4096, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]
    units = probe.unit_table(shapes, 132, 64, 128)
    assert units.shape[1] == probe.UNIT_COLS.value == 6
    for p, (n, k) in enumerate(shapes):
        rows = units[units[:, 0] == p]
        splits = int(rows[0, 3])
        assert (rows[:, 3] == splits).all() and rows.shape[0] == n // 64 * splits
        assert rows.shape[0] >= 132 or k % (2 * splits * 128), (p, splits)
        assert k // splits % 128 == 0
        # a tile's splits are consecutive units, 0 .. S-1, all on one counter
        assert torch.equal(rows[:, 2], torch.arange(splits).repeat(n // 64).int())
        assert torch.equal(rows[:, 1], torch.arange(n // 64).repeat_interleave(splits).int())
        assert (rows[:, 5] == (shapes[p - 1][0] // 64 if p else 0)).all()
    # qkv 64 tiles -> 4 splits (2 make 128 units, fewer than 132), o 32 -> 8, gate+up 256 -> 1,
    # down 32 -> 8
    assert [int(units[units[:, 0] == p][0, 3]) for p in range(4)] == [4, 8, 1, 8]
    counters = units[:, 4]
    assert int(counters.max()) + 1 == sum(n // 64 for n, _ in shapes)
    with pytest.raises(ValueError, match="whole 64 x 128 tiles"):
        probe.unit_table([(4096, 2000)], 132, 64, 128)


def test_flow_kernel_compiles_for_sm90_with_the_prefetch_only_where_asked():
    from aot import REPO, run_script

    out = run_script(str(REPO / "tests" / "benchmarks" / "flow_chain_aot.py"))
    assert out == {"dep1_l20": 0, "dep1_l21": 1, "dep0_l20": 0}, out
