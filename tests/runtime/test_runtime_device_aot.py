"""The runtime's device kernels compile ahead of time for cuda:90, hip:gfx942 and hip:gfx950.

Same pattern as ``tests/test_aot_compile.py``: ``triton.compile(ASTSource(...),
target=GPUTarget(...))`` needs no device but cannot run under ``TRITON_INTERPRET=1`` (set before
the kernel modules are imported), so the compile runs in a subprocess without it: this file run
as a script, printing one JSON line. Pads and warps come from the modules' own launch helpers
at R 32 x gamma 7 (the planner's build time grows with its sort: ~5 s here, ~25 s at R 256 x
gamma 15 on this CPU, so the test stays small) and a 152k vocabulary for the estimator.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared AOT harness
from aot import TARGET_NAMES, compile_kernel, missing_artifacts, run_scripts  # noqa: E402

R_AOT, G_AOT = 32, 7

_PLAN_PTRS = {"conf_ptr": "bf16", "budget_ptr": "bf16", "sps_ptr": "fp64", "tiers_ptr": "i32",
              "lens_ptr": "i32", "k_ptr": "i32"}
_STATE_PTRS = {name: "fp64" for name in ("slope_ptr", "bias_ptr", "count_ptr", "grad_ptr",
                                         "h_xx_ptr", "h_x1_ptr", "h_11_ptr")}
_FEATURE_PTRS = {"logits_ptr": "bf16", "temperature_ptr": "fp32", "x_ptr": "fp32",
                 "out_ptr": "fp32", **_STATE_PTRS}
_OBSERVE_PTRS = {"x_ptr": "fp32", "accepted_ptr": "i64", "verified_ptr": "i64",
                 "calls_ptr": "i64", **_STATE_PTRS}
_I64_ARGS = {"ridge_bits", "damping_bits", "max_step_bits"}  # float64 constants as bits
# case: (module, kernel attribute, pointer dtypes, constexprs beyond the launch helper's)
CASES = {
    # bf16 confidence, lagged budget (two sorts), rate mode, tier alignment: every branch but
    # the threshold count (a sum) is in this one build
    "plan": ("planner_device", "_plan_kernel", _PLAN_PTRS,
             dict(HAS_RATE=True, THRESHOLD=False, LAGGED=True, TIERS_PAD=4)),
    "estimator_feature_predict": ("estimator_triton", "_feature_predict_kernel", _FEATURE_PTRS,
                                  {}),
    "estimator_observe": ("estimator_triton", "_observe_kernel", _OBSERVE_PTRS, {}),
}


def _constexprs(module, kernel_name: str, consts: dict, cfg) -> tuple[dict, int]:
    """Constexprs and warps of one case, from the module's launch helper (what runs)."""
    if module.__name__.endswith("planner_device"):
        r_pad, rb_pad, g_pad, warps = module.planner_launch(R_AOT, G_AOT, R_AOT, cfg)
        return dict(consts, R_PAD=r_pad, RB_PAD=rb_pad, G_PAD=g_pad), warps
    return module.estimator_launch(kernel_name, G_AOT, cfg, vocab=152064)


def _compile_all(targets: tuple[str, ...]) -> dict:
    """Compile every case for ``targets``; return ``{case: {target: [artifact kinds]}}``."""
    import importlib

    from dspark_compile.kernels.targets import TARGETS

    result: dict = {}
    for case, (mod_name, attr, pointers, consts) in CASES.items():
        module = importlib.import_module(f"dspark_compile.runtime.{mod_name}")
        kernel = getattr(module, attr)
        for name in targets:
            constexprs, warps = _constexprs(module, attr, consts, TARGETS[name])
            # no FMA contraction: the kernels round each add and multiply as torch does
            options = {"num_warps": warps, "enable_fp_fusion": False}
            result.setdefault(case, {})[name] = compile_kernel(
                kernel, pointers, constexprs, name, options,
                scalars={a: "i64" for a in _I64_ARGS})
    return result


@pytest.fixture(scope="module")
def compiled() -> dict:
    """One subprocess per target, run side by side (the builds are single-threaded)."""
    result: dict = {}
    for part in run_scripts(__file__, [(name,) for name in TARGET_NAMES]):
        for case, kinds in part.items():
            result.setdefault(case, {}).update(kinds)
    return result


@pytest.mark.parametrize("target", TARGET_NAMES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_runtime_kernel_compiles_ahead_of_time(compiled: dict, case: str, target: str) -> None:
    kinds = compiled[case][target]
    assert not missing_artifacts(kinds, target), f"{case} for {target}: only {kinds}"


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") != "1", "AOT compile needs TRITON_INTERPRET unset"
    print(json.dumps(_compile_all(tuple(sys.argv[1:]) or TARGET_NAMES)))
