"""Every attention kernel compiles ahead of time for cuda:90, hip:gfx942 and hip:gfx950 on the CPU.

``triton.compile(ASTSource(...), target=GPUTarget(...))`` needs no device. It cannot run under
``TRITON_INTERPRET=1`` (the interpreter swaps ``@triton.jit`` functions for Python ones when the
kernel module is imported, and ``make test`` sets it), so the compile runs in a subprocess
started with TRITON_INTERPRET removed: this file run as a script, printing one JSON line.
"""

from __future__ import annotations

import json
import os

import pytest

from aot import TARGET_NAMES, aot_tests, compile_kernel

# case -> (kernel, dtype of q/k/v/pools/out, shape (N, R, H, Hkv, D, page, max_query_len),
# split count[, semantics: Dv, window / softcap / sinks / chunk / rel switches]); constexprs and launch
# options
# come from plan_attention, as at run time.
CASES = {
    "attention_bf16": ("_ragged_attention_kernel", "bf16", (512, 64, 16, 8, 128, 16, 8), 1),
    # float32 (the target's fp32 dot precision: no TF32 on AMD), GQA 8, 64-row tiles, split
    "attention_fp32_split": ("_ragged_attention_kernel", "fp32", (24, 3, 8, 1, 64, 32, 8), 4),
    # bs 1 verify: 8 splits merged in the launch (atomic counter, 8 partials per row)
    "attention_bf16_split_fold": ("_ragged_attention_kernel", "bf16", (3, 1, 16, 8, 128, 16, 8),
                                  8),
    "split_reduce_bf16": ("_split_reduce_kernel", "bf16", (8, 1, 16, 8, 128, 16, 8), 4),
    # head dim 8 (small test models): tiled as 16, since tl.dot needs K >= 16 on a GPU
    "attention_fp32_d8": ("_ragged_attention_kernel", "fp32", (12, 3, 4, 2, 8, 16, 4), 1),
    "split_reduce_fp32_d8": ("_split_reduce_kernel", "fp32", (12, 3, 4, 2, 8, 16, 4), 2),
    # every semantics switch at once, DeepSeek MLA's expanded heads (Dk 192, Dv 128), bs 1
    # verify folded over 8 splits (sinks join in split 0, the merge counts them once). One
    # case: each switch is a constexpr subset of it, and each case costs ~10 s a target cold
    "attention_bf16_mla_window_softcap_sinks": (
        "_ragged_attention_kernel", "bf16", (3, 1, 16, 16, 192, 16, 8), 8,
        dict(dv=128, window=True, softcap=True, sinks="fp32")),
    # chunked attention (Llama 4): the window's code with per-row chunk starts, split 4
    "attention_bf16_chunked": ("_ragged_attention_kernel", "bf16", (24, 3, 8, 2, 128, 16, 8),
                               4, dict(window=True, chunk=True)),
    # relative logits (Inkling) under a window, split 4: every step adds its tile's logits
    "attention_bf16_relative_window": ("_ragged_attention_kernel", "bf16",
                                       (24, 3, 8, 2, 128, 16, 8), 4,
                                       dict(window=True, rel="bf16")),
    # ALiBi slopes (BLOOM), fp32 slopes, split 4
    "attention_bf16_alibi": ("_ragged_attention_kernel", "bf16", (24, 3, 8, 2, 128, 16, 8), 4,
                             dict(alibi="fp32")),
}


SCALARS = {"scale_log2": "fp32", "softcap_log2": "fp32"}
"""Float scalars of the attention kernel (every other scalar is an i32)."""


def _launch_spec(kernel_name: str, dtype: str, shape: tuple, splits: int, cfg,
                 sem: dict | None = None) -> tuple:
    """(pointer dtypes by argument, constexprs, compile options) of one case on one target."""
    from dspark_compile.kernels.attention import _max_splits, head_dim_pad, plan_attention

    n, r, h, hkv, d, page, max_q = shape
    sem = sem or {}
    dv = sem.get("dv", d)
    plan = plan_attention(n, r, h, hkv, 1024, max_q, cfg, cfg.default_sm_count, splits,
                          head_dim_pad=max(head_dim_pad(d), head_dim_pad(dv)))
    pointers = {"out_ptr": dtype, "part_acc_ptr": "fp32", "part_ml_ptr": "fp32",
                "query_start_loc_ptr": "i32"}
    if kernel_name == "_split_reduce_kernel":
        consts = dict(NUM_HEADS=h, HEADS_PAD=h, HEAD_DIM=dv, HEAD_DIM_PAD=head_dim_pad(dv),
                      MAX_SPLITS=_max_splits(plan.num_splits))
        return pointers, consts, {"num_warps": cfg.reduce_num_warps}
    pointers.update({name: dtype for name in ("q_ptr", "k_ptr", "v_ptr", "k_cache_ptr",
                                              "v_cache_ptr")})
    pointers.update(seq_lens_ptr="i32", block_table_ptr="i32", slot_mapping_ptr="i64",
                    counter_ptr="i32", sinks_ptr=sem.get("sinks", dtype),
                    rel_ptr=sem.get("rel", dtype), alibi_ptr=sem.get("alibi", dtype))
    consts = dict(NUM_HEADS=h, GROUP=h // hkv, GROUP_PAD=plan.group_pad, HEAD_DIM=d,
                  HEAD_DIM_PAD=head_dim_pad(d), HEAD_DIM_V=dv, HEAD_DIM_V_PAD=head_dim_pad(dv),
                  HAS_WINDOW=sem.get("window", False), HAS_SOFTCAP=sem.get("softcap", False),
                  HAS_SINKS="sinks" in sem, CHUNKED=sem.get("chunk", False),
                  POS_BIAS=("rel" in sem) + 2 * ("alibi" in sem), PAGE_SIZE=page,
                  BLOCK_Q=plan.block_q,
                  BLOCK_M=plan.block_m,
                  TILE_N=plan.tile_n, NEW_N=plan.new_n, SEARCH=plan.search,
                  SEARCH_ONCE=r + 1 <= plan.search, SPLIT=plan.num_splits > 1,
                  FOLD=plan.num_splits > 1, MAX_SPLITS=_max_splits(plan.num_splits),
                  UPCAST=False,
                  DOT_PRECISION=cfg.fp32_dot_precision, EARLY=False)
    options = {"num_warps": plan.num_warps, "num_stages": plan.num_stages}
    if plan.max_registers is not None and cfg.backend == "cuda":
        options["maxnreg"] = plan.max_registers
    return pointers, consts, options


def _compile_all() -> dict:
    """Compile every case for every target; return ``{case: {target: [artifact kinds]}}``."""
    from dspark_compile.kernels import attention as triton_attention
    from dspark_compile.kernels.targets import TARGETS

    result: dict = {}
    ptx: dict = {}  # the bs-1 launch's order around the PDL wait (sm_90), EARLY off and on
    for case, (kernel_name, dtype, shape, splits, *sem) in CASES.items():
        kernel = getattr(triton_attention, kernel_name)
        for name in TARGET_NAMES:
            pointers, consts, options = _launch_spec(kernel_name, dtype, shape, splits,
                                                     TARGETS[name], *sem)
            asm = ptx.setdefault(False, {}) if (case, name) == (
                "attention_bf16_split_fold", "sm_90") else None
            result.setdefault(case, {})[name] = compile_kernel(
                kernel, pointers, consts, name, options, scalars=SCALARS, asm=asm)
    pointers, consts, options = _launch_spec(*CASES["attention_bf16_split_fold"],
                                             TARGETS["sm_90"])
    compile_kernel(triton_attention._ragged_attention_kernel, pointers, {**consts, "EARLY": True},
                   "sm_90", options, scalars=SCALARS, asm=ptx.setdefault(True, {}))
    for early, asm in ptx.items():
        result[f"pdl_order_early_{early}"] = {op: asm["ptx"].find(op) for op in (
            "griddepcontrol.wait", "griddepcontrol.launch_dependents", "ld.global",
            "st.global", "atom.global")}
    return result


compiled, test_kernel_compiles_ahead_of_time = aot_tests(__file__, CASES)


def test_sm90_attention_reads_early_only_when_told(compiled: dict) -> None:
    """With PDL the attention kernel waits for the launch before it before any load, unless
    ``EARLY``: then the request lookup and first K/V tile loads come before the wait, and
    still no store or atomic (``kernels/pdl.py``)."""
    late, early = compiled["pdl_order_early_False"], compiled["pdl_order_early_True"]
    for at in (late, early):
        assert min(at.values()) >= 0, at
        assert at["griddepcontrol.wait"] < at["griddepcontrol.launch_dependents"], at
        assert at["griddepcontrol.wait"] < min(at["st.global"], at["atom.global"]), at
    assert late["griddepcontrol.wait"] < late["ld.global"], late
    assert early["ld.global"] < early["griddepcontrol.wait"], early


def test_gpu_targets_match_the_table() -> None:
    from dspark_compile.kernels.targets import gpu_target

    got = {name: (t.backend, t.arch, t.warp_size) for name in TARGET_NAMES
           for t in [gpu_target(name)]}
    assert got == {"sm_90": ("cuda", 90, 32), "gfx942": ("hip", "gfx942", 64),
                   "gfx950": ("hip", "gfx950", 64)}
    with pytest.raises(ValueError, match="unknown target"):
        gpu_target("sm_75")


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") != "1", "AOT compile needs TRITON_INTERPRET unset"
    print(json.dumps(_compile_all()))
