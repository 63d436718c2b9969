"""Programmatic dependent launch (``kernels/pdl.py``).

CPU: where PDL is used (never under the interpreter or on ROCm). The sm_90 build's order
(wait, then every read) is checked ahead of time in
``test_triton_skinny.py``. GPU: a chain of dependent skinny launches and a whole verifier,
eager and in CUDA graphs, give the same bits with PDL as without.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from dspark_compile.kernels.pdl import pdl_options, use_pdl
from dspark_compile.kernels.targets import TARGETS
from dspark_compile.kernels.skinny import plan_skinny


def test_pdl_is_used_only_on_a_cuda_device_of_a_target_that_allows_it() -> None:
    assert TARGETS["sm_90"].pdl and not TARGETS["sm_80"].pdl
    assert not any(TARGETS[name].pdl for name in ("gfx942", "gfx950"))
    assert not use_pdl(torch.device("cpu"), TARGETS["sm_90"])  # the interpreter
    assert pdl_options(True) == {"launch_pdl": True} and pdl_options(False) == {}


# --------------------------------------------------------------------------- GPU
def _chain(ws, x, residual, gamma, cfg):
    """qkv-like (residual add + norm), o-like (split), gate/up (norm + SiLU epilogue), down."""
    from dspark_compile.kernels.skinny import skinny_linear_triton as lin

    kw = dict(config=cfg)
    y1, h1 = lin(x, ws[0], gamma=gamma, eps=1e-6, residual=residual, **kw)
    y2, _ = lin(y1, ws[1], **kw)
    y3, h3 = lin(y2, ws[2], gamma=gamma, eps=1e-6, residual=h1, glu_out=True, **kw)
    y4, _ = lin(y3, ws[3], **kw)
    return y4, h3


@pytest.mark.gpu
@pytest.mark.parametrize("m", [3, 24])
def test_skinny_chain_with_pdl_equals_without_bitwise(m: int) -> None:
    from dspark_compile.kernels.device import device_target

    base, _ = device_target(torch.device("cuda"))
    if not base.pdl:
        pytest.skip("this GPU's target does not launch with PDL")
    torch.manual_seed(0)
    k = 2048
    ws = [torch.randn(n, kk, device="cuda", dtype=torch.bfloat16) / kk ** 0.5
          for n, kk in ((k, k), (k, k), (2 * 1024, k), (k, 1024))]
    gamma = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    x, res = (torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    assert plan_skinny(m, k, k, base, 132).split_k > 1  # the o-like launch merges splits
    on, off = base, dataclasses.replace(base, pdl=False)
    want = _chain(ws, x, res, gamma, off)
    assert all(torch.equal(a, b) for a, b in zip(_chain(ws, x, res, gamma, on), want))
    # in a CUDA graph, with new inputs copied in before each replay: every launch must wait for
    # the one before it, or it reads the last replay's values
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _chain(ws, x, res, gamma, on)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            outs = _chain(ws, x, res, gamma, on)
    torch.cuda.current_stream().wait_stream(side)
    for seed in range(5):
        torch.manual_seed(100 + seed)
        x.copy_(torch.randn_like(x))
        res.copy_(torch.randn_like(res))
        graph.replay()
        want = _chain(ws, x, res, gamma, off)
        assert all(torch.equal(a, b) for a, b in zip(outs, want)), seed


@pytest.mark.gpu
def test_verifier_graphs_with_pdl_equal_without_bitwise(monkeypatch) -> None:
    """A bf16 Llama through the Triton lowering (fused matmuls, rotary, attention: every
    launch of ours with PDL), graph replays over random layouts, against the same verifier
    built and captured with the target's ``pdl`` off."""
    from dspark_compile import VerifyLayout, dspark_compile
    from dspark_compile.session.tiers import tier_set
    from dspark_compile.kernels import targets
    from dspark_compile.kernels import attention as triton_attention
    from helpers import tiny_llama

    if not triton_attention.device_target(torch.device("cuda"))[0].pdl:
        pytest.skip("this GPU's target does not launch with PDL")
    model = tiny_llama(layers=2).cuda().to(torch.bfloat16)
    block, max_requests = 4, 6
    rng = random.Random(0)
    layouts = []
    for _ in range(40):
        lens = [rng.randint(1, block) for _ in range(rng.randint(1, max_requests))]
        layouts.append(VerifyLayout.pack(lens, [20] * len(lens), list(range(len(lens)))))
    ids = [torch.randint(0, 97, (layout.num_tokens,), device="cuda") for layout in layouts]

    def run() -> list[torch.Tensor]:
        verifier = dspark_compile(model, lowering="triton")
        state = verifier.new_state(max_requests=max_requests, max_context=64)
        state.committed_lens[:] = 20
        torch.manual_seed(0)
        for kc, vc in state.kv_caches:
            kc.normal_(), vc.normal_()
        verifier.capture(state, tiers=tier_set(max_requests, block), progress=False)
        return [verifier(i, layout, state).clone() for i, layout in zip(ids, layouts)]

    with_pdl = run()
    monkeypatch.setitem(targets.TARGETS, "sm_90",
                        dataclasses.replace(targets.TARGETS["sm_90"], pdl=False))
    triton_attention.device_target.cache_clear()
    try:
        without = run()
    finally:
        triton_attention.device_target.cache_clear()
    assert all(torch.equal(a, b) for a, b in zip(with_pdl, without))
