"""Compile packed_weights.py's stream kernel with CLOCKS for sm_90 (run as a script by
test_packed_weights_smoke.py, without TRITON_INTERPRET); prints one JSON line: whether its PTX
reads the global timer and the SM id. compile_kernel also checks each build's loops (the rotated
dealing once compiled wrong under triton 3.6, ``aot.bound_only_carries``)."""

import json
import sys

from aot import REPO, compile_kernel

sys.path.insert(0, str(REPO / "benchmarks"))

from packed_weights import _stream_kernel  # noqa: E402

asm: dict = {}
for record in (True, False):  # the dealing check's build, then the clocks' (kept)
    compile_kernel(_stream_kernel, {"w_ptr": "bf16", "act_ptr": "bf16", "tab_ptr": "i64",
                                    "cols_ptr": "i64", "owner_ptr": "i32", "clock_ptr": "i64"},
                   {"BLOCK_N": 64, "BLOCK_K": 128, "PACKED": 0, "X_LOAD": True, "ROTATE": True,
                    "RECORD": record, "CLOCKS": not record}, "sm_90",
                   {"num_warps": 4, "num_stages": 5}, asm=asm)
print(json.dumps({"globaltimer": "%globaltimer" in asm["ptx"], "smid": "%smid" in asm["ptx"]}))
