"""The Mamba-2 (SSD) forward and commit kernels compile ahead of time for cuda:90, hip:gfx942
and gfx950 (the Nemotron-H forward with its block form for verify widths).

Same harness as ``test_linear_ops_aot.py`` (a subprocess without ``TRITON_INTERPRET``, one JSON
line). Shapes are Nemotron-H's (128 heads of P = 64, 8 groups of N = 128) in bf16 with the fp32
state pool.
"""

from __future__ import annotations

import json
import os

from aot import TARGET_NAMES, aot_tests, compile_kernel

_LAYOUT = {"query_start_loc_ptr": "i32", "slots_ptr": "i32"}
_RINGS = {"ring_x_ptr": "fp32", "ring_b_ptr": "fp32", "ring_da_ptr": "fp32"}
_SHAPE = {"H": 128, "G": 8, "NS": 128, "P": 64, "N_PAD": 128, "BLOCK_P": 32, "NUM_PB": 2}


_FORWARD = {"out_ptr": "fp32", "x_ptr": "bf16", "dt_ptr": "bf16", "a_ptr": "fp32",
            "b_ptr": "bf16", "c_ptr": "bf16", "d_ptr": "fp32", "dt_bias_ptr": "fp32",
            "state_ptr": "fp32", **_RINGS, **_LAYOUT}
_NEMOTRON = {**_SHAPE, "HAS_D": True, "HAS_DT_BIAS": True, "SOFTPLUS": True, "PAD_ROWS": 16,
             "HEADS_FIRST": False, "BLOCK_ROWS": 8, "BLOCK_FROM": 1, "BLOCK_N": 16,
             "WALK_P": 0}

CASES = {
    # the block form's own launch, the row walk's after it, and both forms in one launch
    "ssd_forward_block_bf16": ("_ssd_forward_kernel", _FORWARD, {**_NEMOTRON, "ROLE": 1}),
    "ssd_forward_rows_bf16": ("_ssd_forward_kernel", _FORWARD, {**_NEMOTRON, "ROLE": 2}),
    "ssd_forward_bf16": ("_ssd_forward_kernel", _FORWARD, {**_NEMOTRON, "ROLE": 0}),
    # the block form's launch walking the other requests itself (SsdPlan.block_walk_p)
    "ssd_forward_block_walk_bf16": ("_ssd_forward_kernel", _FORWARD,
                                    {**_NEMOTRON, "ROLE": 1, "WALK_P": 16}),
    "ssd_commit": ("_ssd_commit_kernel",
                   {"state_ptr": "fp32", **_RINGS, "accept_lens_ptr": "i32", **_LAYOUT},
                   {**_SHAPE, "HEADS_FIRST": False}),
    # a Mamba-1 mixer's one-element heads (Falcon-Mamba-7B: 8192 x 16 of them), heads first
    "mamba1_forward_bf16": ("_ssd_forward_kernel",
                            {"out_ptr": "fp32", "x_ptr": "bf16", "dt_ptr": "bf16",
                             "a_ptr": "fp32", "b_ptr": "bf16", "c_ptr": "bf16", "d_ptr": "fp32",
                             "dt_bias_ptr": "fp32", "state_ptr": "fp32", **_RINGS, **_LAYOUT},
                            {"H": 131072, "G": 16, "NS": 1, "P": 1, "N_PAD": 1, "BLOCK_P": 1,
                             "NUM_PB": 1, "HAS_D": False, "HAS_DT_BIAS": True,
                             "SOFTPLUS": True, "PAD_ROWS": 16, "HEADS_FIRST": True,
                             "BLOCK_ROWS": 0, "BLOCK_FROM": 1, "BLOCK_N": 16, "ROLE": 0,
                             "WALK_P": 0}),
    "mamba1_commit": ("_ssd_commit_kernel",
                      {"state_ptr": "fp32", **_RINGS, "accept_lens_ptr": "i32", **_LAYOUT},
                      {"H": 131072, "G": 16, "NS": 1, "P": 1, "N_PAD": 1, "BLOCK_P": 1,
                       "NUM_PB": 1, "HEADS_FIRST": True}),
}


def _compile_all() -> dict:
    """Compile every case for every target; return ``{case: {target: [artifact kinds]}}``."""
    from dspark_compile.kernels import ssd

    warps = ssd.SsdPlan.num_warps  # the launches' default

    result: dict = {}
    for case, (attr, pointers, constexprs) in CASES.items():
        kernel = getattr(ssd, attr)
        missing = (set(pointers) | set(constexprs)) - set(kernel.arg_names)
        assert not missing, f"{case}: {attr} has no arguments {sorted(missing)}"
        for name in TARGET_NAMES:
            result.setdefault(case, {})[name] = compile_kernel(
                kernel, pointers, constexprs, name, {"num_warps": warps},
                scalars={"dt_min": "fp32", "dt_max": "fp32"})
    return result


compiled, test_ssd_kernel_compiles_ahead_of_time = aot_tests(__file__, CASES)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") != "1", "AOT compile needs TRITON_INTERPRET unset"
    print(json.dumps(_compile_all()))
