"""The conv1d and gated-delta-rule kernels compile ahead of time for cuda:90, hip:gfx942, gfx950.

Same harness as ``test_aot_compile.py``: ``triton.compile(ASTSource(...), target=GPUTarget)``
needs no device but cannot run under ``TRITON_INTERPRET=1`` (the interpreter replaces the
``@triton.jit`` functions at import), so the compile runs in a subprocess without it: this
file run as a script, printing one JSON line. Shapes are Qwen3-Next's (conv dim 8192, width 4;
16 key heads, 32 value heads, K = V = 128) in bf16 with the fp32 state pool.
"""

from __future__ import annotations

import json
import os

from aot import TARGET_NAMES, aot_tests, compile_kernel
_LAYOUT = {"query_start_loc_ptr": "i32", "slots_ptr": "i32"}
_GDN_SHAPE = {"HK": 16, "HV": 32, "KD": 128, "VD": 128, "K_PAD": 128, "BLOCK_V": 32,
              "NUM_VB": 4}
# the block form's launch (both kinds of program, or the stream programs alone)
_GDN_BLOCK_PTRS = {"out_ptr": "bf16", "q_ptr": "bf16", "k_ptr": "bf16", "v_ptr": "bf16",
                   "g_ptr": "fp32", "beta_ptr": "bf16", "state_ptr": "fp32", "w_ptr": "fp32",
                   "c_ptr": "fp32", "ready_ptr": "i32", "ring_k_ptr": "fp32",
                   "ring_v_ptr": "fp32", "ring_g_ptr": "fp32", "ring_beta_ptr": "fp32",
                   "state_desc": "fp32", **_LAYOUT}
_GDN_BLOCK_CONSTS = {**_GDN_SHAPE, "V_PAD": 128, "BLOCK_V": 64, "NUM_VB": 2, "WALK_V": 16,
                     "T": 8, "KC": 16, "L2NORM": True, "PAD_ROWS": 16, "WEIGHTS_FIRST": True,
                     "POLLS": 64, "STREAM_DOT": "bf16x3", "STREAM_KC": 16, "BF16_DOTS": True,
                     "STATE_DESC": False}

# case -> (module, kernel attribute, pointer dtypes by argument, constexprs); the other
# arguments are i32, except ``scale`` (fp32).
CASES = {
    "conv_bf16_silu": ("conv", "_causal_conv1d_kernel",
                       {"out_ptr": "bf16", "x_ptr": "bf16", "weight_ptr": "bf16",
                        "bias_ptr": "bf16", "state_ptr": "bf16", "ring_ptr": "bf16", **_LAYOUT},
                       {"WIDTH": 4, "HAS_BIAS": True, "ACT": 1, "BLOCK_T": 8,
                        "BLOCK_D": 256, "SEARCH": 256}),
    "conv_bf16_gelu_tanh": ("conv", "_causal_conv1d_kernel",
                            {"out_ptr": "bf16", "x_ptr": "bf16", "weight_ptr": "bf16",
                             "bias_ptr": "bf16", "state_ptr": "bf16", "ring_ptr": "bf16",
                             **_LAYOUT},
                            {"WIDTH": 4, "HAS_BIAS": True, "ACT": 3, "BLOCK_T": 8,
                             "BLOCK_D": 256, "SEARCH": 256}),
    "conv_fp32_nobias_w3": ("conv", "_causal_conv1d_kernel",
                            {"out_ptr": "fp32", "x_ptr": "fp32", "weight_ptr": "fp32",
                             "bias_ptr": "fp32", "state_ptr": "fp32", "ring_ptr": "fp32",
                             **_LAYOUT},
                            {"WIDTH": 3, "HAS_BIAS": False, "ACT": 0, "BLOCK_T": 16,
                             "BLOCK_D": 128, "SEARCH": 2}),
    "conv_fp32_gelu": ("conv", "_causal_conv1d_kernel",
                       {"out_ptr": "fp32", "x_ptr": "fp32", "weight_ptr": "fp32",
                        "bias_ptr": "fp32", "state_ptr": "fp32", "ring_ptr": "fp32", **_LAYOUT},
                       {"WIDTH": 3, "HAS_BIAS": False, "ACT": 2, "BLOCK_T": 16,
                        "BLOCK_D": 128, "SEARCH": 2}),
    "conv_commit_bf16": ("conv", "_conv_commit_kernel",
                         {"state_ptr": "bf16", "ring_ptr": "bf16", "accept_lens_ptr": "i32",
                          **_LAYOUT},
                         {"KEEP": 3, "KEEP_PAD": 4, "BLOCK_D": 256}),
    "gdn_forward_bf16": ("gdn", "_gdn_forward_kernel",
                         {"out_ptr": "bf16", "q_ptr": "bf16", "k_ptr": "bf16", "v_ptr": "bf16",
                          "g_ptr": "fp32", "beta_ptr": "bf16", "state_ptr": "fp32",
                          "ring_k_ptr": "fp32", "ring_v_ptr": "fp32", "ring_g_ptr": "fp32",
                          "ring_beta_ptr": "fp32", **_LAYOUT},
                         {**_GDN_SHAPE, "L2NORM": True, "PAD_ROWS": 16,
                          "CHANNEL_GATES": False}),
    # the block form: weight and stream programs in one launch (long requests walk in it)
    "gdn_block_stream_bf16": ("gdn", "_gdn_block_kernel", _GDN_BLOCK_PTRS,
                              {**_GDN_BLOCK_CONSTS, "WEIGHTS": True}),
    # the weight programs in a launch of their own, and the stream launch after it
    "gdn_block_weights_bf16": ("gdn", "_gdn_block_weights_kernel",
                               {"q_ptr": "bf16", "k_ptr": "bf16", "v_ptr": "bf16",
                                "g_ptr": "fp32", "beta_ptr": "bf16", "w_ptr": "fp32",
                                "c_ptr": "fp32", "ready_ptr": "i32", "ring_k_ptr": "fp32",
                                "ring_g_ptr": "fp32", "ring_beta_ptr": "fp32",
                                "query_start_loc_ptr": "i32"},
                               {"HK": 16, "HV": 32, "KD": 128, "VD": 128, "K_PAD": 128,
                                "V_PAD": 128, "T": 8, "KC": 16, "L2NORM": True}),
    "gdn_block_streams_bf16": ("gdn", "_gdn_block_kernel", _GDN_BLOCK_PTRS,
                               {**_GDN_BLOCK_CONSTS, "WEIGHTS": False}),
    "gdn_commit": ("gdn", "_gdn_commit_kernel",
                   {"state_ptr": "fp32", "ring_k_ptr": "fp32", "ring_v_ptr": "fp32",
                    "ring_g_ptr": "fp32", "ring_beta_ptr": "fp32", "accept_lens_ptr": "i32",
                    **_LAYOUT},
                   {**_GDN_SHAPE, "CHANNEL_GATES": False}),
    # Kimi Linear's KDA: one gate a key channel, 32 heads of K = V = 128
    "kda_forward_bf16": ("gdn", "_gdn_forward_kernel",
                         {"out_ptr": "bf16", "q_ptr": "bf16", "k_ptr": "bf16", "v_ptr": "bf16",
                          "g_ptr": "fp32", "beta_ptr": "bf16", "state_ptr": "fp32",
                          "ring_k_ptr": "fp32", "ring_v_ptr": "fp32", "ring_g_ptr": "fp32",
                          "ring_beta_ptr": "fp32", **_LAYOUT},
                         {**_GDN_SHAPE, "HK": 32, "L2NORM": True, "PAD_ROWS": 16,
                          "CHANNEL_GATES": True}),
    "kda_commit": ("gdn", "_gdn_commit_kernel",
                   {"state_ptr": "fp32", "ring_k_ptr": "fp32", "ring_v_ptr": "fp32",
                    "ring_g_ptr": "fp32", "ring_beta_ptr": "fp32", "accept_lens_ptr": "i32",
                    **_LAYOUT},
                   {**_GDN_SHAPE, "HK": 32, "CHANNEL_GATES": True}),
}


def _compile_all() -> dict:
    """Compile every case for every target; return ``{case: {target: [artifact kinds]}}``."""
    import importlib

    result: dict = {}
    for case, (module, attr, pointers, constexprs) in CASES.items():
        kernel = getattr(importlib.import_module(f"dspark_compile.kernels.{module}"), attr)
        missing = (set(pointers) | set(constexprs)) - set(kernel.arg_names)
        assert not missing, f"{case}: {attr} has no arguments {sorted(missing)}"
        # the warps the launches use: the GDN plan's default, 4 for the conv kernels
        warps = importlib.import_module("dspark_compile.kernels.gdn")._NUM_WARPS \
            if module == "gdn" else 4
        for name in TARGET_NAMES:
            result.setdefault(case, {})[name] = compile_kernel(
                kernel, pointers, constexprs, name, {"num_warps": warps},
                scalars={"scale": "fp32"})
    return result


compiled, test_linear_kernel_compiles_ahead_of_time = aot_tests(__file__, CASES)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") != "1", "AOT compile needs TRITON_INTERPRET unset"
    print(json.dumps(_compile_all()))
