"""``kernels.ir_check``: a scalar carried through a loop that only sets an inner loop's bounds is
what triton 3.5-3.7 compile wrong (their ``tritongpu-remove-layout-conversions`` drops the carry;
3.8 and 3.9 keep it). Every ahead-of-time compile of the tests refuses it (``aot.compile_kernel``)
and ``launch`` refuses a kernel that holds it under such a Triton. The IR below is triton's for
``for p in range(num_phases): for t in range(pid - d, n, nprog): store(out + t, pid); d += n``
and for variants of it that read ``d`` somewhere else."""

from __future__ import annotations

import types

import pytest
import torch
import triton
import triton.language as tl

from dspark_compile.kernels import ir_check, launch as launch_mod
from dspark_compile.kernels.ir_check import (bound_only_carries, check_compiled,
                                             triton_drops_bound_only_carries)

HEAD = """module {
  tt.func public @k(%out_ptr: !tt.ptr<i32> loc("out_ptr"(#loc)), %tab_ptr: !tt.ptr<i32>, %num_phases: i32) {
    %c1_i32 = arith.constant 1 : i32 loc(#loc1)
    %c0_i32 = arith.constant 0 : i32 loc(#loc2)
    %pid = tt.get_program_id x : i32 loc(#loc15)
    %nprog = tt.get_num_programs x : i32 loc(#loc16)
"""
LOOP = """    %d{count} = scf.for %p = %c0_i32 to %num_phases step %c1_i32 iter_args({args}) -> ({types})  : i32 {{
      %n = tt.addptr %tab_ptr, %p : !tt.ptr<i32>, i32 loc(#loc18)
      %n_1 = tt.load %n : !tt.ptr<i32> loc(#loc19)
      %0 = arith.subi %pid, %d_0 : i32 loc(#loc7)
{body}      %d_2 = arith.addi %d_0, %n_1 : i32 loc(#loc20)
      scf.yield {yields} loc(#loc1)
    }} loc(#loc17)
"""
INNER = """      scf.for %t = {lower} to {upper} step %nprog  : i32 {{
        %1 = tt.addptr %out_ptr, %t : !tt.ptr<i32>, i32 loc(#loc9)
        tt.store %1, %pid : !tt.ptr<i32> loc(#loc10)
      }} loc(#loc8)
"""
TAIL = """    tt.return loc(#loc)
  } loc(#loc)
} loc(#loc)
#loc7 = loc("d"(#loc3))
"""


def ir(body: str, after: str = "", args: str = "%d_0 = %c0_i32", types: str = "i32",
       yields: str = "%d_2 : i32", count: str = "") -> str:
    return HEAD + LOOP.format(body=body, args=args, types=types, yields=yields,
                              count=count) + after + TAIL


@pytest.mark.parametrize("lower, upper", [("%0", "%n_1"), ("%pid", "%0"), ("%d_0", "%n_1")])
def test_a_carry_that_only_bounds_an_inner_loop_is_found(lower: str, upper: str) -> None:
    found = bound_only_carries(ir(INNER.format(lower=lower, upper=upper)))
    assert len(found) == 1 and found[0].startswith("%d_0 of line 7")


@pytest.mark.parametrize("case, text", [
    ("stored", ir(INNER.format(lower="%pid", upper="%n_1")
                  + "      %2 = tt.addptr %out_ptr, %p : !tt.ptr<i32>, i32\n"
                  + "      tt.store %2, %0 : !tt.ptr<i32>\n")),
    ("an address", ir("      %3 = tt.addptr %out_ptr, %0 : !tt.ptr<i32>, i32\n"
                      + INNER.format(lower="%pid", upper="%n_1").replace(
                          "tt.addptr %out_ptr, %t", "tt.addptr %3, %t"))),
    ("a branch", ir("      %4 = arith.cmpi sgt, %0, %pid : i32\n      scf.if %4 {\n"
                    + INNER.format(lower="%0", upper="%n_1") + "      }\n")),
    ("read after the loop", ir(INNER.format(lower="%0", upper="%n_1"),
                               after="    tt.store %out_ptr, %d : !tt.ptr<i32>\n")),
    ("an inner loop's carry", ir(
        "      %5 = scf.for %u = %pid to %n_1 step %nprog iter_args(%e = %0) -> (i32)  : i32 {\n"
        "        %6 = arith.addi %e, %u : i32\n        scf.yield %6 : i32\n      }\n"
        + INNER.format(lower="%0", upper="%n_1"))),
    ("a tensor", ir(INNER.format(lower="%pid", upper="%n_1"),
                    args="%d_0 = %cst", types="tensor<16xi32>",
                    yields="%d_2 : tensor<16xi32>")),
])
def test_a_carry_read_elsewhere_is_not(case: str, text: str) -> None:
    assert bound_only_carries(text) == [], case


def test_the_second_of_two_carries_is_named() -> None:
    # d is read only by %0, which nothing reads; e only sets the inner loop's start
    body = "      %7 = arith.addi %e_0, %pid : i32\n" + INNER.format(lower="%7", upper="%n_1")
    found = bound_only_carries(ir(body, args="%d_0 = %c0_i32, %e_0 = %c0_i32", types="i32, i32",
                                  yields="%d_2, %e_0 : i32, i32", count=":2"))
    assert [f.split(" of ")[0] for f in found] == ["%e_0"], found


@pytest.mark.parametrize("version, drops", [("3.5.1", True), ("3.6.0", True), ("3.7.1", True),
                                            ("3.6.0+git1234abcd", True), ("3.8.0", False),
                                            ("3.9.0", False), ("3.10.1", False), ("4.0.0", False),
                                            ("2.3.1", True)])
def test_which_tritons_are_checked_at_run_time(version: str, drops: bool) -> None:
    assert triton_drops_bound_only_carries(version) is drops


def _compiled(ttir: str, name: str = "_probe_kernel"):
    return types.SimpleNamespace(asm={"ttir": ttir}, metadata=types.SimpleNamespace(name=name))


def test_check_compiled_refuses_the_kernel_by_name_and_passes_a_clean_one() -> None:
    bad = _compiled(ir(INNER.format(lower="%0", upper="%n_1")))
    with pytest.raises(RuntimeError, match=r"_probe_kernel: triton .* compiles it wrong.*%d_0"):
        check_compiled(bad)
    with pytest.raises(RuntimeError):  # refused every time, not only the first
        check_compiled(bad)
    good = _compiled(ir(INNER.format(lower="%pid", upper="%n_1")
                        + "      %2 = tt.addptr %out_ptr, %p : !tt.ptr<i32>, i32\n"
                        + "      tt.store %2, %0 : !tt.ptr<i32>\n"))
    check_compiled(good)
    assert ir_check._checked[id(good)] is good
    check_compiled(types.SimpleNamespace())  # no IR (the interpreter): nothing to check


class _Kernel:
    """Stands in for a JIT function: ``kernel[grid](...)`` runs and returns ``compiled``."""

    def __init__(self, compiled) -> None:
        self.compiled, self.calls = compiled, 0

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls += 1
            return self.compiled
        return run


def test_launch_refuses_a_kernel_this_triton_compiles_wrong(monkeypatch) -> None:
    kernel = _Kernel(_compiled(ir(INNER.format(lower="%0", upper="%n_1")), "_chain_kernel"))
    monkeypatch.setattr(launch_mod, "_CHECK_IR", True)
    with pytest.raises(RuntimeError, match="_chain_kernel"):
        launch_mod.launch(kernel, (1,), torch.zeros(1))
    monkeypatch.setattr(launch_mod, "_CHECK_IR", False)  # a Triton that compiles it right
    launch_mod.launch(kernel, (1,), torch.zeros(1))
    assert kernel.calls == 2


@triton.jit
def _dealt_kernel(out_ptr, sizes_ptr, num_phases):
    """Program ``pid`` writes its id at every tile ``base + t`` of every phase with ``t`` equal
    to ``pid - d`` modulo the programs, ``d`` the tiles of the phases before (carried, and read
    only in the inner loop's start, as the stream probe's dealing was)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    d = 0
    for p in range(num_phases):
        n = tl.load(sizes_ptr + p)
        for t in range((pid - d % nprog + nprog) % nprog, n, nprog):
            tl.store(out_ptr + 64 * p + t, pid)
        d += n


@pytest.mark.gpu
def test_launch_never_returns_what_triton_compiled_wrong() -> None:
    """On the GPU: the kernel above runs right, or ``launch`` refuses it; and a Triton that runs
    it wrong is one the run-time check covers."""
    sizes = torch.tensor([5, 7, 3, 6], dtype=torch.int32, device="cuda")
    programs = 4
    want = torch.full((4, 64), -1, dtype=torch.int32)
    d = 0
    for p, n in enumerate(sizes.tolist()):
        for t in range(n):
            want[p, t] = (t + d) % programs
        d += n
    direct = torch.full((4, 64), -1, dtype=torch.int32, device="cuda")
    _dealt_kernel[(programs,)](direct, sizes, 4)
    if not torch.equal(direct.cpu(), want):
        assert triton_drops_bound_only_carries(), (
            f"triton {triton.__version__} ran the kernel wrong but is not checked at run time")
    got = torch.full((4, 64), -1, dtype=torch.int32, device="cuda")
    try:
        launch_mod.launch(_dealt_kernel, (programs,), got, sizes, 4)
    except RuntimeError as err:
        assert "_dealt_kernel" in str(err) and triton_drops_bound_only_carries()
    else:
        assert torch.equal(got.cpu(), want)
