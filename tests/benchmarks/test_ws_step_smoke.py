"""benchmarks/ws_step.py on the CPU: the phase table and its dealing, the weight orders the
epilogues rely on (q+k+v rows paired with their rotary partners, gate+up rows by unit), the
torch reference against an independent one (HF's rotary, torch's SDPA), the checks on the
splits and tiles, the probe summary; the kernel compiles for sm_90 (triton's Gluon, no GPU
needed). The kernel itself runs on an sm_90 GPU only (test_ws_step_gpu.py)."""

import pytest
import torch

from helpers import load_benchmark


def _step(layers: int = 1, **kw):
    ws = load_benchmark("ws_step")
    return ws, ws.WsStep(layers, "cpu", **kw)


def test_phase_table_deals_every_unit_once():
    ws, step = _step(2)
    names = [p[0] for p in step.phases]
    assert names == ["qkv", "attn", "o", "gate_up", "down"] * 2 + ["head"]
    tab = step.tab.tolist()
    ustart, norms, m = 0, 0, 0
    for p, ((name, n, k, kind, epi), row) in enumerate(zip(step.phases, tab)):
        units = ws.KV_HEADS * step.nsplit if kind == ws.ATTN else n // step.bn
        # (first weight row, N, K, first unit, input half, kind, gamma row, norm index,
        # epilogue, units, layer)
        assert row[1:11] == [n, k, ustart, p % 2, kind, norms if kind == ws.NORM else 0, norms,
                             epi, units, p // 5], (name, row)
        if kind != ws.ATTN:
            assert torch.equal(step.w.view(-1, k)[row[0]:row[0] + n], step.weight(m))
            m += 1
        first_unit = load_benchmark("ws_chain").first_unit  # the kernels' dealing
        dealt = sorted(t for pid in range(132)
                       for t in range(first_unit(pid, 132, ustart), units, 132))
        assert dealt == list(range(units))
        ustart += units
        norms += kind == ws.NORM
    assert [r[8] for r in tab[:5]] == [2, 0, 0, 1, 0]  # rotary + cache, -, -, SiLU, -


def test_weight_rows_pair_what_the_epilogues_pair():
    ws, step = _step()
    hb, half = step.bn // 2, ws.HEAD_DIM // 2
    cols = step.qkv_columns()
    assert sorted(cols.tolist()) == list(range(ws.HIDDEN + 2 * ws.KV_HEADS * ws.HEAD_DIM))
    rot_units = (ws.HEADS + ws.KV_HEADS) * half // hb
    for t in range(rot_units):  # a q or k unit: columns and their partners HD / 2 on
        first, second = cols[t * step.bn:t * step.bn + hb], cols[t * step.bn + hb:(t + 1) * step.bn]
        assert torch.equal(second, first + half)
        assert (first % ws.HEAD_DIM < half).all()
    assert torch.equal(cols[rot_units * step.bn:],
                       torch.arange(rot_units * step.bn, len(cols)))  # v units in order
    w = step.weight(0)
    assert torch.equal(step.qkv(0)[cols], w)  # the model's weight, row for row
    gate, up = step.gate_up(2)
    gu = step.weight(2)
    for t in (0, 5, 1023):
        assert torch.equal(gu[t * step.bn:t * step.bn + hb], gate[t * hb:(t + 1) * hb])
        assert torch.equal(gu[t * step.bn + hb:(t + 1) * step.bn], up[t * hb:(t + 1) * hb])


def _independent(step, x):
    """One layer and the head in torch with HF's rotary and torch's SDPA over the cache's
    positions in order (the block table walked here, not as the reference walks it)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    ws = load_benchmark("ws_step")
    f = torch.nn.functional

    def mm(a, w):
        return (a.float() @ w.float().T).to(torch.bfloat16)

    def norm(h, g):
        hf = h.float()
        return (g.float() * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + step.eps))
                .to(torch.bfloat16).float()).to(torch.bfloat16)

    ctx, n = step.ctx, ws.ROWS
    pos = torch.arange(ctx, ctx + n)
    qkv = mm(norm(x, step.gammas[0]), step.qkv(0))
    hd, kvd = ws.HEAD_DIM, ws.KV_HEADS * ws.HEAD_DIM
    q = qkv[:, :ws.HIDDEN].view(n, ws.HEADS, hd).transpose(0, 1)[None]
    k = qkv[:, ws.HIDDEN:ws.HIDDEN + kvd].view(n, ws.KV_HEADS, hd).transpose(0, 1)[None]
    v = qkv[:, ws.HIDDEN + kvd:].view(n, ws.KV_HEADS, hd).transpose(0, 1)[None]
    q, k = apply_rotary_pos_emb(q, k, step.cos[pos][None], step.sin[pos][None])
    rows = torch.stack([step.bt[p // step.page].long() * step.page + p % step.page
                        for p in range(ctx)])
    keys = torch.cat([step.kc[rows].permute(1, 0, 2)[None], k], dim=2)
    vals = torch.cat([step.vc[rows].permute(1, 0, 2)[None], v], dim=2)
    group = ws.HEADS // ws.KV_HEADS
    mask = torch.arange(ctx + n)[None, :] <= pos[:, None]
    att = f.scaled_dot_product_attention(
        q.float(), keys.repeat_interleave(group, 1).float(),
        vals.repeat_interleave(group, 1).float(), attn_mask=mask).to(torch.bfloat16)
    h = (x.float() + mm(att[0].transpose(0, 1).reshape(n, ws.HIDDEN), step.weight(1)).float())
    h = h.to(torch.bfloat16)
    gate_w, up_w = step.gate_up(2)
    a = norm(h, step.gammas[1])
    act = (f.silu(mm(a, gate_w).float()).to(torch.bfloat16).float() * mm(a, up_w).float())
    h = (h.float() + mm(act.to(torch.bfloat16), step.weight(3)).float()).to(torch.bfloat16)
    return mm(norm(h, step.gammas[2]), step.weight(4))


def test_reference_is_the_model_and_leaves_the_cache_alone():
    ws, step = _step(1)
    x = torch.randn(3, ws.HIDDEN, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    kc = step.kc.clone()
    got = step.reference(x)
    assert torch.equal(step.kc, kc)
    want = _independent(step, x)
    assert ws.rel_err(got, want) < 0.01  # HF's rotary rounds each op to bf16; ours once
    assert torch.equal(got.float().argmax(-1), want.float().argmax(-1))


def test_splits_and_tiles_are_checked():
    ws = load_benchmark("ws_step")
    with pytest.raises(ValueError, match="BN / 2 dividing 64"):
        ws.WsStep(1, "cpu", bn=24)
    with pytest.raises(ValueError, match="none that every row sees"):
        ws.WsStep(1, "cpu", ctx=16, splits=16)
    step = ws.WsStep(1, "cpu", splits=8)
    assert (step.span, step.ch) == (129, 256)
    assert (step.nsplit - 1) * step.span <= step.ctx < step.nsplit * step.span


def test_phase_profile_shares_add_up_to_the_step():
    ws, step = _step(1)
    phases = len(step.phases)
    t = torch.zeros(4, phases, 3, dtype=torch.int64)
    for p in range(phases):  # program i arrives at 1000 p + i, waits 100, works 500 + 10 i
        for i in range(4):
            t[i, p] = torch.tensor([1000 * p + i, 1000 * p + i + 100, 1000 * p + 600 + 11 * i])
    t[3, 1] = 0  # program 3 had no unit of phase 1
    prof = ws.phase_profile(step, t)
    assert prof["step_us"] == pytest.approx((1000 * (phases - 1) + 633) / 1e3, abs=0.05)
    assert sum(v["share"] * v["phases"] for k, v in prof.items() if k != "step_us") \
        == pytest.approx(prof["step_us"], abs=0.05)
    assert prof["qkv"]["work_max"] == pytest.approx(0.53)
    assert prof["attn"]["work_max"] == pytest.approx(0.52)  # program 3 left out


def test_kernel_compiles_for_sm90_as_producer_and_consumer():
    from aot import REPO, check_ws_builds, run_script

    out = run_script(str(REPO / "tests" / "benchmarks" / "ws_step_aot.py"))
    check_ws_builds(out)
    step, free = out["step"], out["free_probe"]
    # data another program wrote is read through L2; the merge's count is acq_rel
    assert step["ld_cg"] > 0 and step["acq_rel"] > 0 and step["acquire"] > 0
    assert step["globaltimer"] == 0 and free["globaltimer"] > 0
    assert free["acquire"] == 0 and free["acq_rel"] == 0  # no waits, no attention: none
    # the producer's L2 lookahead: bulk prefetches only where asked
    assert step["l2_prefetch"] == 0 and out["step_look"]["l2_prefetch"] > 0
    # each warp on its own: both unit-sum loops free of partition barriers; the tensor-core
    # form's one slot loop too, with mma.sync and no CUDA-core multiplies in its matmuls
    wrel, mma = out["step_wrel"], out["step_wrel_mma"]
    assert wrel["warp_slot_loops"] == 2 and wrel["warp_slot_barriers"] == 0, wrel
    assert mma["warp_slot_loops"] == 1 and mma["warp_slot_barriers"] == 0, mma
    assert mma["mma"] > 0 and step["mma"] == 0 and wrel["mma"] == 0
    # with a four-slot phase's B operands built once: that phase's four slots unrolled beside
    # the loop of the others
    mma_b = out["step_wrel_mma_b"]
    assert mma_b["warp_slot_loops"] == 5 and mma_b["warp_slot_barriers"] == 0, mma_b
    assert step["warp_slot_loops"] == 0


def test_reporter_writes_versions_settings_and_every_row(tmp_path, monkeypatch):
    import json

    ws = load_benchmark("ws_chain")
    monkeypatch.setenv("OUT", str(tmp_path))
    report, emit = ws.reporter("x.json", rows=3, sms=132)
    emit({"kind": "a", "ms": 1.0})
    emit({"kind": "b", "ms": 2.0})
    got = json.loads((tmp_path / "x.json").read_text())
    assert got == report and [r["kind"] for r in got["results"]] == ["a", "b"]
    assert got["rows"] == 3 and got["sms"] == 132 and got["timing"] == ws.TIMING
    assert {"gpu", "torch", "triton", "command"} <= set(got)


def test_kv_bytes_count_every_layers_positions():
    ws, step = _step(2)
    assert step.kv_bytes() == 2 * (step.ctx + 3) * ws.KV_HEADS * ws.HEAD_DIM * 2 * 2
