"""The accept kernels compile ahead of time for cuda:90, hip:gfx942 and hip:gfx950 on the CPU.

Same pattern as ``test_aot_compile.py``: ``triton.compile(ASTSource(...), target=GPUTarget(...))``
needs no device but cannot run under ``TRITON_INTERPRET=1`` (set by ``make test`` before the
kernel module is imported), so the compile runs in a subprocess without it: this file run as a
script, printing one JSON line. Tiles and warps come from ``accept_tiles`` of each target.
"""

from __future__ import annotations

import json
import os

from aot import TARGET_NAMES, aot_tests, compile_kernel

_ROW_PTRS = {"logits_ptr": "bf16", "input_ids_ptr": "i64", "qsl_ptr": "i32",
             "temperature_ptr": "fp32", "top_k_ptr": "i32", "top_p_ptr": "fp32",
             "draft_probs_ptr": "fp32", "uniforms_ptr": "fp32", "gumbel_ptr": "fp32",
             "seeds_ptr": "i64", "steps_ptr": "i64", "stop_ptr": "i8", "token_ptr": "i64"}
CASES = {  # case: (kernel attribute, pointer dtypes by argument, constexprs; other args are i32)
    # bf16 logits, the drafter's q, pre-drawn noise (the bitwise-testable path)
    "row_bf16_draft_probs": ("_row_kernel", _ROW_PTRS,
                             {"HAS_DRAFT_PROBS": True, "PHILOX": False, "SEARCH": 256}),
    # float32 logits, one-hot drafts, Philox noise drawn in the kernel
    "row_fp32_philox": ("_row_kernel", {**_ROW_PTRS, "logits_ptr": "fp32", "qsl_ptr": "i64"},
                        {"HAS_DRAFT_PROBS": False, "PHILOX": True, "SEARCH": 1024}),
    "select": ("_select_kernel", {"qsl_ptr": "i32", "stop_ptr": "i8", "token_ptr": "i64",
                                  "num_accepted_ptr": "i32", "accept_lens_ptr": "i32",
                                  "next_tokens_ptr": "i64"}, {}),
}


def _compile_all() -> dict:
    """Compile every case for every target; return ``{case: {target: [artifact kinds]}}``."""
    from dspark_compile.engine import accept_triton
    from dspark_compile.kernels.targets import TARGETS

    result: dict = {}
    for case, (attr, pointers, constexprs) in CASES.items():
        kernel = getattr(accept_triton, attr)
        for name in TARGET_NAMES:
            block_v, block_s, warps = accept_triton.accept_tiles(TARGETS[name])
            consts = dict(constexprs)
            if "BLOCK_V" in kernel.arg_names:
                consts.update(BLOCK_V=block_v, BLOCK_S=block_s, FANOUT=accept_triton.FANOUT)
            else:
                warps = 1
            result.setdefault(case, {})[name] = compile_kernel(kernel, pointers, consts, name,
                                                               {"num_warps": warps})
    return result


compiled, test_accept_kernel_compiles_ahead_of_time = aot_tests(__file__, CASES)


def test_tiles_follow_the_target_table() -> None:
    from dspark_compile.engine.accept_triton import FANOUT, accept_tiles
    from dspark_compile.kernels.targets import TARGETS

    assert accept_tiles(TARGETS["sm_90"]) == (1024, 512, 4)
    assert accept_tiles(TARGETS["gfx942"]) == (2048, 1024, 4)
    assert FANOUT & (FANOUT - 1) == 0, "tl.arange needs a power of two"


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") != "1", "AOT compile needs TRITON_INTERPRET unset"
    print(json.dumps(_compile_all()))
