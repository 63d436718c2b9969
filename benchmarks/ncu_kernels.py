"""One launch of each kernel an open target is about, for Nsight Compute (``ncu``) to profile.

Nothing is timed here: the script sets up the benchmarks' own shapes and calls each kernel once
(after one warm-up call that compiles it), so that ``ncu --kernel-name ...`` reads the
hardware counters of exactly those launches. Cases:

- ``moe``: the grouped experts GEMMs of ``moe_layer.py`` (Qwen3-30B-A3B's experts, bf16, ragged
  mean 3) at ``--bs``: routing, then the up launch (gate/up + SiLU), the down launch and the
  combine;
- ``gdn`` / ``ssd``: ``ssd_kernels.py``'s GDN and Mamba-2 verify forwards at ``--bs``, all 8
  rows, then their commits;
- ``skinny``: ``skinny_kernel.py``'s skinny matmul on the 1.1B model's gate+up and down weights
  at 3 rows (bs 1, mean 3);
- ``stream``: ``packed_weights.py``'s free stream over ``--repeats`` copies of one ``--shape``
  (``N x K``), 64 x 128 tiles, 5 stages, one program a multiprocessor, ``--rotate`` to deal the
  tiles on across matmuls;
- ``paged``: the KV read at the verify step's ``--bs`` (1024 keys of context, 8 KV heads of
  128, bf16, a shuffled block table, ragged mean 3): the attention kernel, ``hbm_read.py``'s
  paged read with the attention's tiles (32 keys, 4 warps, 3 stages), the same with 64 keys on
  8 warps, and its plain read of the same bytes (16384-element blocks on 8 warps, 2 programs a
  multiprocessor), in that order (kernel names ``ragged_attention|_paged_read|_read_kernel``).

    ncu --clock-control none --kernel-name "regex:_experts_gemm|_combine" --launch-skip 3 \\
        --launch-count 3 --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        python benchmarks/ncu_kernels.py moe --bs 256

(``benchmarks/gpu_session.sh``'s ``ncu`` job runs every case; docs/benchmarks.md has the
figures.)
"""

from __future__ import annotations

import argparse

import torch

from common import mix_lens

WARMUP = 1
"""Calls before the profiled one (each case's ncu line skips ``WARMUP * launches``)."""


def moe(bs: int) -> None:
    import moe_layer as ml
    from dspark_compile.kernels import experts as kx

    s = ml.SETTINGS
    experts = ml.build(s, "cuda")
    lens = mix_lens(bs, s["block"], s["mean_len"], s["seed"])
    x, ids, weights, qsl = ml.routing(sum(lens), s, "cuda")
    for _ in range(WARMUP + 1):
        order, offsets = kx.experts_route_triton(ids, qsl, experts.num_experts)
        h = kx.experts_up_triton(x, order, offsets, experts.gate_up_proj, None, False,
                                 "silu_glu")
        kx.experts_down_triton(h, order, offsets, weights, experts.down_proj, None, False)
    torch.cuda.synchronize()


def recurrent(kind: str, bs: int, gdn_plan: str | None = None) -> None:
    import ssd_kernels as sk
    from hybrid_kernels import _gdn_args, gdn_inputs

    s = sk.SETTINGS
    plan = sk.gdn_plan(gdn_plan, bs, s, "cuda") if gdn_plan else None
    lens = [s["block"]] * bs
    acc = torch.tensor(lens, dtype=torch.int32, device="cuda")
    if kind == "gdn":
        c = gdn_inputs(lens, s, "cuda", seed=bs)
        for _ in range(WARMUP + 1):
            sk.triton_gdn.gated_delta_rule_triton(*_gdn_args(c, s), plan=plan)
            sk.triton_gdn.gated_delta_rule_commit_triton(c["state"], *c["rings"], c["qsl"],
                                                         c["slots"], acc)
    else:
        c = sk.ssd_inputs(lens, s, "cuda", seed=bs)
        for _ in range(WARMUP + 1):
            sk.triton_ssd.ssd_triton(*sk._ssd_args(c))
            sk.triton_ssd.ssd_commit_triton(c["state"], *c["rings"], c["qsl"], c["slots"], acc)
    torch.cuda.synchronize()


def skinny(rows: int) -> None:
    from dspark_compile.kernels.skinny import skinny_linear_triton

    for n, k in ((16384, 2048), (2048, 8192)):  # gate+up, down of the 1.1B model
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        for _ in range(WARMUP + 1):
            skinny_linear_triton(x, w)
    torch.cuda.synchronize()


def stream(shape: str, repeats: int, rotate: bool) -> None:
    from packed_weights import PackedChain, shape_arg

    chain = PackedChain(shape_arg(f"{shape}*{repeats}"), "cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for _ in range(WARMUP + 1):
        chain.stream(chain.w, sms, 64, 128, 0, 4, 5, rotate=rotate)
    torch.cuda.synchronize()


def paged(bs: int) -> None:
    import attention_kernel as ak
    import hbm_read as hr

    s = ak.SETTINGS
    layer = ak.build_layer(ak.verify_lengths(bs, True, s), s, "cuda", seed=bs)
    args = ak.call_args(layer, s["head_dim"] ** -0.5)
    for _ in range(WARMUP + 1):
        ak.ragged_attention_triton(*args, max_query_len=s["max_len"])  # as the step plans it
    k, v, bt = layer["k_cache"], layer["v_cache"], layer["block_table"]
    per_req = bt.shape[1]
    hkv, d, page = s["num_kv_heads"], s["head_dim"], s["page_size"]
    out = torch.empty(bs * hkv * d, device="cuda", dtype=torch.float32)
    for tile, warps, stages in ((32, 4, 3), (64, 8, 3)):
        for _ in range(WARMUP + 1):
            hr._paged_read_kernel[(bs, hkv)](k, v, bt, out, per_req, page * hkv * d, hkv * d,
                                             d, HKV=hkv, TILE=tile, PAGE=page, D=d,
                                             num_warps=warps, num_stages=stages)
    flat = k.view(-1)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sums = torch.empty(2 * sms, device="cuda", dtype=torch.float32)
    for _ in range(WARMUP + 1):
        hr._read_kernel[(2 * sms,)](flat, sums, flat.numel(), BLOCK=16384, num_warps=8)
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case", choices=("moe", "gdn", "ssd", "skinny", "stream", "paged"))
    ap.add_argument("--bs", type=int, default=64, help="batch size (skinny: rows)")
    ap.add_argument("--shape", default="2048x2048", help="stream: one matmul's N x K")
    ap.add_argument("--repeats", type=int, default=128, help="stream: matmuls in the chain")
    ap.add_argument("--rotate", action="store_true", help="stream: ROTATE")
    ap.add_argument("--gdn-plan", help="gdn: a plan of ssd_kernels.py's --gdn-plans (default: "
                                       "the op's own)")
    opts = ap.parse_args()
    torch.set_grad_enabled(False)
    if opts.case == "moe":
        moe(opts.bs)
    elif opts.case == "skinny":
        skinny(opts.bs)
    elif opts.case == "stream":
        stream(opts.shape, opts.repeats, opts.rotate)
    elif opts.case == "paged":
        paged(opts.bs)
    else:
        recurrent(opts.case, opts.bs, opts.gdn_plan)


if __name__ == "__main__":
    main()
