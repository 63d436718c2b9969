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
        # (first row in its K's view, N, K, first unit, input half, kind, gamma row, norm index)
        assert row == [chain.offs[p] // k, n, k, ustart, p % 2, 0, 0, 0]
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
    from aot import REPO, check_ws_builds, run_script

    out = run_script(str(REPO / "tests" / "benchmarks" / "ws_chain_aot.py"))
    check_ws_builds(out)
    assert out["wait1"]["acquire"] > 0 and out["wait0"]["acquire"] == 0, out
    # the layers' input transforms: the norm's rsqrt and SiLU's exp only where asked
    assert out["wait1_layer"]["rsqrt"] > 0 and out["wait1_layer"]["ex2"] > 0, out
    assert out["wait1"]["rsqrt"] == 0 and out["wait1"]["ex2"] == 0, out
    # the tensor-core units: mma.sync (m16n8k16), no CUDA-core multiplies; the others: FMAs
    assert out["wait1_mma"]["mma"] > 0 and out["wait1_mma"]["fma"] == 0, out
    assert out["wait1"]["mma"] == 0 and out["wait1"]["fma"] > 0, out
    # the producer's L2 lookahead: bulk prefetches only where asked
    assert out["wait1"]["l2_prefetch"] == 0 and out["wait1_look"]["l2_prefetch"] > 0, out
    # each warp on its own: a slot loop with no partition barrier in it (CUDA-core and mma
    # units); the other builds have none of these loops
    for name in ("wait1_wrel", "wait1_mma_wrel", "wait1_mma2_wrel", "wait1_mma3_wrel"):
        assert out[name]["warp_slot_loops"] > 0 and out[name]["warp_slot_barriers"] == 0, out
    assert out["wait1"]["warp_slot_loops"] == 0, out


def test_layer_chain_table_and_reference():
    """``kinds``: the norm phases number their gamma rows and alternate the residual buffers;
    the reference is the layer's math (residual add, HF's 16-bit RMSNorm, SiLU-and-mul) in
    torch; kinds and widths that cannot chain are refused."""
    ws = load_benchmark("ws_chain")
    shapes, kinds = ws.layer_phases(1)
    assert kinds == [1, 0, 1, 2, 1] and shapes[3] == (2048, 8192)
    with pytest.raises(ValueError, match="one of 0"):
        ws.WsChain(shapes[:2], "cpu", kinds=[1, 3])
    with pytest.raises(ValueError, match="2 K for a SiLU input"):
        ws.WsChain([(4096, 2048), (2048, 4096 // 2 * 4)], "cpu", kinds=[0, 2])
    small = [(4096, 2048), (2048, 2048), (8192, 2048), (2048, 2048)]  # down's K: 2048 here
    chain = ws.WsChain(small, "cpu", bn=16, bk=512, kinds=[1, 0, 1, 2])
    tab = chain.tab.tolist()
    assert [r[5:] for r in tab] == [[1, 0, 0], [0, 0, 1], [1, 1, 1], [2, 0, 2]]
    assert chain.gammas.shape == (2, 2048) and chain.hidden == 2048
    x = torch.randn(3, 2048, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)

    def norm(h, g):
        hf = h.float()
        n = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
        return (g.float() * n.float()).to(torch.bfloat16)

    def mm(a, i):
        return (a.float() @ chain.weight(i).float().T).to(torch.bfloat16)

    q = mm(norm(x, chain.gammas[0]), 0)
    o = mm(q[:, :2048], 1)
    h = (x.float() + o.float()).to(torch.bfloat16)
    gu = mm(norm(h, chain.gammas[1]), 2)
    act = (torch.nn.functional.silu(gu[:, :2048].float()) * gu[:, 2048:4096].float())
    want = mm(act.to(torch.bfloat16), 3)
    assert torch.equal(chain.reference(x), want)
    chain.set_input(x)
    assert torch.equal(chain.resid[:3 * 2048].view(3, 2048), x) and not chain.act.any()


def test_unfenced_releases_counts_slots_handed_back_without_a_proxy_fence():
    from aot import unfenced_releases

    wait = "mbarrier.try_wait.parity.shared::cta.b64 %p1, [%r1], %r2;"
    fence = "fence.proxy.async.shared::cta;"
    arrive = "@%p2 mbarrier.arrive.shared::cta.b64 _, [%r3];"
    refill = "@%p3 mbarrier.arrive.expect_tx.shared.b64 _, [%r4], 16384;"
    ld = "ld.shared.v4.b32 {%r5, %r6, %r7, %r8}, [%r9];"
    sync = "bar.sync 0, 256;"
    assert unfenced_releases("\n".join([wait, ld, sync, arrive])) == 1
    assert unfenced_releases("\n".join([wait, ld, fence, sync, arrive])) == 0
    # a fence before the wait does not cover the reads after it; the producer's arrive is no
    # release
    assert unfenced_releases("\n".join([fence, wait, ld, sync, arrive, refill])) == 1
    assert unfenced_releases("\n".join([wait, ld, fence, sync, arrive, wait, ld, sync,
                                        arrive])) == 1


def test_ring_barriers_read_from_ptx_and_checked():
    """The per-warp hand-over's barrier offsets come from the build's ``mbarrier.init``s: full
    barriers count 1, empty ones the consumer warps, each array 8 bytes a slot; a build whose
    barriers are not so is refused."""
    ws = load_benchmark("ws_chain")
    lines = ["mov.b32 %r86, global_smem;"]
    for i in range(4):
        lines += [f"add.s32 %r{10 + i}, %r86, {1000 + 8 * i};",
                  f"@%p12 mbarrier.init.shared::cta.b64 [%r{10 + i}], 1;",
                  f"@%p12 mbarrier.init.shared::cta.b64 [global_smem+{2000 + 8 * i}], 8;"]
    ptx = "\n".join(lines)
    assert ws.ring_barriers(ptx, 4, 8) == (1000, 2000)
    with pytest.raises(ValueError, match="empty barriers"):
        ws.ring_barriers(ptx, 4, 4)  # no empty barriers of count 4
    with pytest.raises(ValueError, match="full barriers"):
        ws.ring_barriers(ptx.replace("1016", "1024"), 4, 8)  # a gap in the full array


def test_warp_slot_barriers_counts_barriers_in_a_slot_loop():
    from aot import warp_slot_barriers

    loop = ["take_wait:", "mbarrier.try_wait.parity.shared::cta.b64 %ready, [%bar], %r1;",
            "ld.shared.v4.b32 {%r1, %r2, %r3, %r4}, [%r5];", "fma.rn.f32 %r6, %r1, %r2, %r6;",
            "fence.proxy.async.shared::cta;", "@%lead mbarrier.arrive.shared::cta.b64 _, [%bar];"]
    assert warp_slot_barriers("\n".join(loop + ["bar.sync 0, 256;"])) == (1, 0)
    assert warp_slot_barriers("\n".join(loop[:2] + ["bar.sync 0, 256;"] + loop[2:])) == (1, 1)
