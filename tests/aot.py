"""Shared harness of the ahead-of-time compile tests (``test_*aot*.py``).

``triton.compile(ASTSource(...), target=GPUTarget(...))`` needs no device, but it cannot run
under ``TRITON_INTERPRET=1`` (the interpreter swaps ``@triton.jit`` functions for Python ones
when a kernel module is imported, and ``make test`` sets it). So each AOT test file runs itself
as a script in a subprocess with TRITON_INTERPRET removed; the script prints one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_NAMES = ("sm_90", "gfx942", "gfx950")
ARTIFACTS = {"cuda": ("ptx", "cubin"), "hip": ("amdgcn", "hsaco")}
"""Artifacts a successful compile leaves, per backend."""


def compile_kernel(kernel, pointers: dict, constexprs: dict, target: str, options: dict,
                   scalars: dict | None = None, asm: dict | None = None) -> list[str]:
    """Compile one ``@triton.jit`` kernel for ``target``; returns the artifact kinds made.

    ``pointers``: argument -> element type (``"bf16"``, ``"i32"``, ...), or a tensor
    descriptor's type (``"tensordesc<bf16[64,64]>"``: element type and block); ``scalars``: argument ->
    type for non-i32 scalars (``"fp32"``); every other argument is an i32 scalar. Pointers and
    strides are declared 16-aligned, as the JIT specialises them at real shapes. A kernel's
    ``PDL`` constexpr, unless given, is the target's ``pdl``. ``asm``, if given, receives the
    compiled text and binaries by kind (``ptx``, ``amdgcn``, ...).
    """
    import triton
    from triton.compiler import ASTSource

    from dspark_compile.kernels.targets import gpu_target

    from dspark_compile.kernels.targets import TARGETS

    scalars = scalars or {}
    if "PDL" in kernel.arg_names:  # launched with PDL where the target uses it, as at run time
        constexprs = {"PDL": TARGETS[target].pdl, **constexprs}
    def pointer(kind: str) -> str:  # "tensordesc<bf16[64,64]>": a tensor descriptor argument
        return kind if kind.startswith("tensordesc") else "*" + kind

    signature = {a: "constexpr" if a in constexprs else pointer(pointers[a]) if a in pointers
                 else scalars.get(a, "i32") for a in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(kernel.arg_names)
             if (a in pointers and not pointers[a].startswith("tensordesc"))
             or a.startswith("stride_")}
    src = ASTSource(fn=kernel, signature=signature, constexprs=dict(constexprs), attrs=attrs)
    compiled = triton.compile(src, target=gpu_target(target), options=options)
    from dspark_compile.kernels.ir_check import bound_only_carries

    hazards = bound_only_carries(compiled.asm["ttir"])
    assert not hazards, (f"{kernel.__name__} for {target}: a loop-carried scalar reaches nothing "
                         f"but an inner loop's bounds, which triton 3.5-3.7 drop: {hazards}")
    if asm is not None:
        asm.update(compiled.asm)
    return sorted(kind for kind, blob in compiled.asm.items() if blob)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"),
                                         env.get("PYTHONPATH", "")])
    return env


def run_script(path: str, *args: str) -> dict:
    """Run an AOT test file as a script without the interpreter; its last line of JSON."""
    proc = subprocess.run([sys.executable, path, *args], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"AOT compile failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_scripts(path: str, arg_sets: list[tuple[str, ...]]) -> list[dict]:
    """Like :func:`run_script`, one subprocess per argument set, side by side."""
    procs = [subprocess.Popen([sys.executable, path, *args], cwd=REPO, env=_env(), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for args in arg_sets]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"AOT compile failed:\n{stdout}\n{stderr[-6000:]}"
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def missing_artifacts(kinds: list[str], target: str) -> list[str]:
    """Artifacts ``target``'s backend should have made that ``kinds`` lacks."""
    from dspark_compile.kernels.targets import TARGETS

    return [a for a in ARTIFACTS[TARGETS[target].backend] if a not in kinds]


def aot_tests(path: str, cases) -> tuple:
    """``(compiled, test)`` for an AOT test file to bind at module level: the module fixture
    that runs ``path`` as a script once, and the test that every case (a key of the script's
    JSON) compiled for every target in :data:`TARGET_NAMES` with its artifacts."""
    import pytest

    @pytest.fixture(scope="module")
    def compiled() -> dict:
        return run_script(path)

    @pytest.mark.parametrize("target", TARGET_NAMES)
    @pytest.mark.parametrize("case", sorted(cases))
    def test(compiled: dict, case: str, target: str) -> None:
        kinds = compiled[case][target]
        assert not missing_artifacts(kinds, target), f"{case} for {target}: only {kinds}"

    return compiled, test


WS_PTX = {"tma_loads": r"cp\.async\.bulk\.tensor", "cp_async": r"cp\.async\.cg",
          "ring_waits": r"mbarrier\.try_wait", "acquire": r"\.acquire\.",
          "release": r"\.release\.", "setmaxnreg": r"setmaxnreg",
          "proxy_fences": r"fence\.proxy\.async"}
"""What the warp-specialized benchmark kernels' PTX is counted for (``ws_ptx``)."""


def unfenced_releases(ptx: str) -> int:
    """Ring slots handed back without a proxy fence: plain ``mbarrier.arrive`` (the consumers'
    release; the producer's arrive carries ``expect_tx``) with no ``fence.proxy.async`` since the
    last ``mbarrier.try_wait`` before it. A slot read by shared-memory loads and refilled by TMA
    needs the fence in between (``ws_chain.release_slot``)."""
    import re

    fenced, count = True, 0
    for line in ptx.splitlines():
        if "mbarrier.try_wait" in line:
            fenced = False
        elif re.search(r"fence\.proxy\.async", line):
            fenced = True
        elif re.search(r"mbarrier\.arrive\.shared", line) and "expect_tx" not in line:
            count += not fenced
    return count


def warp_slot_barriers(ptx: str) -> tuple[int, int]:
    """In a build whose consumer warps take and hand back ring slots on their own
    (``ws_chain.take_slot`` / ``give_slot`` with ``WREL``): how many slot loops (a thread's poll,
    ``take_wait``, to its warp's arrive) there are, and how many partition barriers
    (``bar.sync``) stand inside them, which would put the warps back in lock step."""
    loops, barriers, inside = 0, 0, False
    for line in ptx.splitlines():
        if line.strip() == "take_wait:":
            loops += 1
            inside = True
        elif inside and "bar.sync" in line:
            barriers += 1
        elif inside and "mbarrier.arrive" in line:
            inside = False
    return loops, barriers


def ws_ptx(compiled, **patterns: str) -> dict:
    """A Gluon build's shared memory, the counts in its PTX of :data:`WS_PTX`'s patterns and
    ``patterns`` (name -> regex), its :func:`unfenced_releases` and its
    :func:`warp_slot_barriers`."""
    import re

    ptx = compiled.asm["ptx"]
    loops, barriers = warp_slot_barriers(ptx)
    return {"shared": compiled.metadata.shared, "unfenced_releases": unfenced_releases(ptx),
            "warp_slot_loops": loops, "warp_slot_barriers": barriers,
            **{k: len(re.findall(v, ptx)) for k, v in {**WS_PTX, **patterns}.items()}}


def ring_build(build, stages: int, warps: int, wrel: bool):
    """``build(consts)`` -> a compiled ring kernel, with the constexprs of its slot hand-over:
    with ``wrel``, the barrier offsets from a first build, checked in the second (as
    ``ws_chain.launch_ring`` does at run time)."""
    import ws_chain

    if not wrel:
        return build(dict(WREL=False, FULL0=0, EMPTY0=0))
    bars = ws_chain.ring_barriers(build(dict(WREL=True, FULL0=0, EMPTY0=0)).asm["ptx"], stages,
                                  warps)
    compiled = build(dict(WREL=True, FULL0=bars[0], EMPTY0=bars[1]))
    assert ws_chain.ring_barriers(compiled.asm["ptx"], stages, warps) == bars
    return compiled


def check_ws_builds(out: dict) -> None:
    """Every build of a warp-specialized benchmark kernel (``ws_ptx`` counts by name): within
    the H200's opt-in 227 KB of shared memory, two partitions (register budgets set per
    partition), weight tiles by TMA into the ring, the phase's rows by ``cp.async``, slots
    handed over by mbarrier waits, each phase's count released."""
    for name, build in out.items():
        assert build["shared"] <= 232448, (name, build)
        assert build["setmaxnreg"] > 0 and build["tma_loads"] > 0, (name, build)
        assert build["cp_async"] > 0 and build["ring_waits"] > 0, (name, build)
        assert build["release"] > 0, (name, build)
        assert build["proxy_fences"] > 0 and build["unfenced_releases"] == 0, (name, build)
