"""Compile flow_chain.py's kernel for sm_90, with and without the L2 prefetch and the waits (run
as a script by test_flow_chain_smoke.py, without TRITON_INTERPRET); prints one JSON line: the
prefetch instruction's count in each build's PTX and each build's shared memory. compile_kernel
also checks each build's loops (``kernels.ir_check``)."""

import json
import sys

from aot import REPO, compile_kernel

sys.path.insert(0, str(REPO / "benchmarks"))

from flow_chain import _flow_kernel  # noqa: E402

out = {}
for dep, l2 in ((True, False), (True, True), (False, False)):
    asm: dict = {}
    compile_kernel(_flow_kernel, {"w_ptr": "bf16", "act_ptr": "bf16", "tab_ptr": "i64",
                                  "unit_ptr": "i32", "ready_ptr": "i32", "part_ptr": "fp32",
                                  "count_ptr": "i32", "err_ptr": "i32"},
                   {"BLOCK_N": 64, "BLOCK_K": 128, "DEP": dep, "L2": l2, "SPIN": 1 << 18,
                    "ROWS": 3},
                   "sm_90", {"num_warps": 4, "num_stages": 4}, asm=asm)
    out[f"dep{int(dep)}_l2{int(l2)}"] = asm["ptx"].count("cp.async.bulk.prefetch.L2")
print(json.dumps(out))
