"""benchmarks/profile_step.py's exposed-time attribution: under programmatic dependent launch a
kernel starts while the one before it runs, so plain durations double-count the overlap; the
exposed shares must add up to the profiled span and credit each kernel only with how far it
moves the timeline's end."""

import pytest

from helpers import load_benchmark


@pytest.fixture(scope="module")
def prof():
    return load_benchmark("profile_step")


def test_serial_kernels_get_their_durations_and_gaps_are_idle(prof):
    got = prof.exposed_ms([("_ragged_attention_kernel", 0.0, 10.0), ("nvjet_gemm", 12.0, 20.0),
                           ("triton_poi_fused", 20.0, 23.0)], steps=1)
    assert got == pytest.approx({"attention": 0.010, "idle": 0.002, "gemm": 0.008,
                                 "inductor_fused": 0.003})


def test_an_early_started_kernel_is_credited_only_past_the_one_before(prof):
    # B starts at 4 (PDL) and waits for A (ends at 10): B's exposed time is 10..15
    kernels = [("_skinny_kernel", 0.0, 10.0), ("_ragged_attention_kernel", 4.0, 15.0),
               ("_skinny_kernel", 14.0, 20.0)]
    got = prof.exposed_ms(kernels, steps=2)
    assert got == pytest.approx({"skinny_matmul": 0.015 / 2, "attention": 0.005 / 2})
    assert sum(got.values()) == pytest.approx(0.020 / 2)  # the span, per step
    plain = sum(end - start for _, start, end in kernels) / 2 / 1e3
    assert plain > sum(got.values())  # what the plain sums report under overlap


def test_a_kernel_inside_another_adds_nothing_and_order_of_input_does_not_matter(prof):
    kernels = [("nvjet_gemm", 5.0, 6.0), ("_ragged_attention_kernel", 0.0, 10.0)]
    assert prof.exposed_ms(kernels, steps=1) == pytest.approx({"attention": 0.010})
    assert prof.exposed_ms(list(reversed(kernels)), steps=1) == pytest.approx(
        {"attention": 0.010})
