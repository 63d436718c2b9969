"""``aot.bound_only_carries``, the check every ahead-of-time compile runs on its Triton IR: a
scalar carried through a loop that only sets an inner loop's bounds is what triton 3.5-3.7
compile wrong (their ``tritongpu-remove-layout-conversions`` drops the carry; 3.8 and 3.9 keep
it), so no kernel of ours may hold one. The IR below is triton's for
``for p in range(num_phases): for t in range(pid - d, n, nprog): store(out + t, pid); d += n``
and for variants of it that read ``d`` somewhere else."""

from __future__ import annotations

import pytest

from aot import bound_only_carries

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
