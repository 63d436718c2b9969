"""benchmarks/ws_chain.py on the CPU: the phase table, the unit dealing, the checks on the
chain's shapes and the torch reference; the kernel compiles for sm_90 (triton's Gluon, no GPU
needed) as two partitions, its weight tiles by TMA into a ring, the waits only where asked.
The kernel itself runs on an sm_90 GPU only (test_ws_chain_gpu.py)."""

import pytest
import torch

from helpers import load_benchmark


def test_phase_table_deals_every_unit_once():
    ws = load_benchmark("ws_chain")
    shapes = [(4096, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (2048, 2048)]
    chain = ws.WsChain(shapes, "cpu", bn=16, bk=512)
    tab = chain.tab.tolist()
    ustart = 0
    for p, ((n, k), row) in enumerate(zip(shapes, tab)):
        # (first row in its K's view, N, K, first unit, input half)
        assert row == [chain.offs[p] // k, n, k, ustart, p % 2]
        assert torch.equal(chain.w.view(-1, k)[row[0]:row[0] + n], chain.weight(p))
        ustart += n // 16
    assert chain.units == [n // 16 for n, _ in shapes]
    programs = 132
    for p, (n, _) in enumerate(shapes):  # the kernel's dealing, program by program
        dealt = [t for pid in range(programs)
                 for t in range(ws.first_unit(pid, programs, tab[p][3]), n // 16, programs)]
        assert sorted(dealt) == list(range(n // 16))
        # unit t of phase p is global unit ustart + t, dealt to program (ustart + t) % P
        assert all(ws.first_unit((tab[p][3] + t) % programs, programs, tab[p][3]) == t % programs
                   for t in range(min(n // 16, programs)))


def test_chain_shapes_are_checked_and_the_reference_is_the_torch_chain():
    ws = load_benchmark("ws_chain")
    with pytest.raises(ValueError, match="K must be one of"):
        ws.WsChain([(2048, 1024)], "cpu")
    with pytest.raises(ValueError, match="N a multiple of 32"):
        ws.WsChain([(2040, 2048)], "cpu", bn=32)
    with pytest.raises(ValueError, match="at most the last phase's N"):
        ws.WsChain([(2048, 2048), (2048, 8192)], "cpu")
    chain = ws.WsChain([(2048, 2048), (4096, 2048)], "cpu", bn=16, bk=512)
    x = torch.randn(3, 2048, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    a = (x.float() @ chain.weight(0).float().T).to(torch.bfloat16)
    want = (a.float() @ chain.weight(1).float().T).to(torch.bfloat16)
    assert torch.equal(chain.reference(x), want)
    chain.set_input(x)
    assert torch.equal(chain._half(0)[:, :2048], x) and not chain._half(1).any()


def test_kernel_compiles_for_sm90_as_producer_and_consumer():
    from aot import REPO, run_script

    out = run_script(str(REPO / "tests" / "benchmarks" / "ws_chain_aot.py"))
    for name, build in out.items():
        assert build["shared"] <= 232448, (name, build)  # the H200's opt-in 227 KB
        # two partitions (register budgets set per partition), weight tiles by TMA into the
        # ring, the phase's rows by cp.async, slots handed over by mbarrier waits
        assert build["setmaxnreg"] > 0 and build["tma_loads"] > 0, (name, build)
        assert build["cp_async"] > 0 and build["ring_waits"] > 0, (name, build)
        assert build["release"] > 0, (name, build)  # each phase's count
    assert out["wait1"]["acquire"] > 0 and out["wait0"]["acquire"] == 0, out
