"""The one-launch device metadata (``kernels/metadata.py``) against the torch-op
version in ``VerifierState.device_metadata``: random padded layouts (padding rows, empty padded
requests, more requests than one search chunk, more rows than one row block), mRoPE deltas,
and the input checks. Runs under the interpreter on the CPU and as is on a GPU."""

from __future__ import annotations

import random

import pytest
import torch
from aot import TARGET_NAMES, aot_tests, compile_kernel

from dspark_compile.kernels import metadata as triton_metadata
from dspark_compile.kernels.metadata import device_metadata_triton
from dspark_compile.specs import AttentionSpec
from dspark_compile.state import VerifierState

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _state(max_requests: int, max_context: int, page: int) -> VerifierState:
    return VerifierState.allocate([AttentionSpec(1, 8)], max_requests, max_context, page,
                             torch.float16, torch.device(DEVICE))


def _padded_batch(rng: random.Random, reqs: int, slots_total: int, pad_reqs: int,
                  pad_rows: int, max_len: int, max_context: int):
    lens = [rng.randint(1, max_len) for _ in range(reqs)]
    ctx = [rng.randint(0, max_context - max_len) for _ in range(reqs)]
    slots = rng.sample(range(slots_total), reqs)
    n = sum(lens)
    qsl = [0]
    for ln in lens:
        qsl.append(qsl[-1] + ln)
    qsl += [n] * pad_reqs  # empty padded requests, as a tier pads them
    ctx += [0] * pad_reqs
    slots += [0] * pad_reqs
    deltas = [rng.randint(-5, 50) for _ in range(reqs)] + [0] * pad_reqs

    def dev(v):
        return torch.tensor(v, dtype=torch.int32, device=DEVICE)

    return dev(qsl), dev(ctx), dev(slots), dev(deltas), n + pad_rows


@pytest.mark.parametrize("reqs,pad_reqs,pad_rows,page", [
    (1, 0, 0, 16), (3, 2, 5, 16), (8, 0, 0, 4), (150, 30, 9, 16), (5, 3, 200, 8)])
def test_one_launch_equals_the_torch_ops(reqs, pad_reqs, pad_rows, page) -> None:
    rng = random.Random(reqs * 100 + pad_rows)
    slots_total = reqs + 7
    state = _state(slots_total, 96, page)
    qsl, ctx, slots, deltas, n = _padded_batch(rng, reqs, slots_total, pad_reqs, pad_rows,
                                               8, 96)
    for mrope in (None, deltas):
        want = state.device_metadata(qsl, ctx, slots, n, mrope)
        got = state.device_metadata(qsl, ctx, slots, n, mrope, triton=True)
        assert set(got) == set(want)
        for key in want:
            assert got[key].dtype == want[key].dtype, key
            assert got[key].shape == want[key].shape, key
            assert torch.equal(got[key], want[key]), key
        if mrope is not None:
            assert got["mrope_positions"].stride() == want["mrope_positions"].stride()
    assert triton_metadata.CHUNK < 180 and triton_metadata.BLOCK_ROWS < 205  # cases cover both


def test_inputs_are_checked_before_launch() -> None:
    state = _state(4, 32, 16)
    qsl = torch.tensor([0, 2, 3], dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor([1, 4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="slots is torch.int64"):
        device_metadata_triton(qsl, ctx, ctx.long(), state.block_table, 16, 3)
    with pytest.raises(ValueError, match=r"query_start_loc is torch.int32 \(2,\)"):
        device_metadata_triton(qsl[:2], ctx, ctx, state.block_table, 16, 3)
    with pytest.raises(ValueError, match="0 requests"):
        device_metadata_triton(qsl[:1], ctx[:0], ctx[:0], state.block_table, 16, 0)


# --------------------------------------------------------------------------- ahead of time
def _compile_all() -> dict:
    pointers = {a: "i32" for a in triton_metadata._metadata_kernel.arg_names if a.endswith("_ptr")}
    pointers.update(pos_ptr="i64", slot_map_ptr="i64", mpos_ptr="i64")
    return {f"mrope_{mrope}": {target: compile_kernel(
        triton_metadata._metadata_kernel, pointers,
        dict(BLOCK_ROWS=triton_metadata.BLOCK_ROWS, BLOCK_REQS=triton_metadata.BLOCK_REQS,
             CHUNK=triton_metadata.CHUNK, PAGES_PAD=128, MROPE=mrope), target,
        {"num_warps": 4}) for target in TARGET_NAMES} for mrope in (False, True)}


compiled, test_kernel_compiles_ahead_of_time = aot_tests(__file__, ["mrope_False", "mrope_True"])


if __name__ == "__main__":
    import json
    import os

    assert os.environ.get("TRITON_INTERPRET") != "1", "AOT compile needs TRITON_INTERPRET unset"
    print(json.dumps(_compile_all()))


def test_inside_compile_ahead_the_metadata_is_the_all_padding_batchs(monkeypatch) -> None:
    """Inside ``launch.compile_ahead`` the launch does not run; the outputs must still be what
    the torch ops give the all-padding batch the pass runs on (slot mapping -1: no KV write)."""
    state = _state(4, 64, 16)
    r, n = 3, 10
    qsl = torch.zeros(r + 1, dtype=torch.int32, device=DEVICE)
    zeros = torch.zeros(r, dtype=torch.int32, device=DEVICE)
    want = state.device_metadata(qsl, zeros, zeros, n, zeros)
    monkeypatch.setattr(triton_metadata, "launch", lambda *a, **k: None)
    monkeypatch.setattr(triton_metadata, "warming", lambda: True)
    got = device_metadata_triton(qsl, zeros, zeros, state.block_table, 16, n, zeros)
    for key in ("positions", "slot_mapping", "seq_lens", "mrope_positions"):
        assert torch.equal(got[key], want[key]), key
    assert (got["slot_mapping"] == -1).all()
