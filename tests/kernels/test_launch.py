"""``kernels/launch.py``: launches, and the compile-only pass that builds kernels ahead (its
GPU side, every tier's kernels compiled before the captures, is in test_gpu.py)."""

import pytest
import torch

from dspark_compile.kernels import launch as L


class FakeKernel:
    """Records how it was launched or warmed up."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(("run", grid, args, kwargs))

    def warmup(self, *args, grid, **kwargs):
        self.calls.append(("warmup", grid, args, kwargs))


def test_launch_runs_the_kernel_outside_compile_ahead():
    k = FakeKernel()
    L.launch(k, (3, 2), 1, "x", BLOCK=16, num_warps=4)
    assert k.calls == [("run", (3, 2), (1, "x"), {"BLOCK": 16, "num_warps": 4})]
    assert not L.warming()


@pytest.mark.skipif(not L.can_compile_ahead(), reason="this Triton has no AsyncCompileMode")
def test_compile_ahead_turns_launches_into_warmups_with_the_same_arguments():
    k = FakeKernel()
    with L.compile_ahead(workers=2):
        assert L.warming()
        L.launch(k, (5,), 7, BLOCK=32, launch_pdl=True)
    assert not L.warming()
    assert k.calls == [("warmup", (5,), (7,), {"BLOCK": 32, "launch_pdl": True})]
    L.launch(k, (5,), 7)
    assert k.calls[-1][0] == "run"


@pytest.mark.skipif(not L.can_compile_ahead(), reason="this Triton has no AsyncCompileMode")
def test_compile_ahead_warms_each_specialisation_once():
    """A launch repeated (every layer makes it) is warmed up once; one that differs in
    anything Triton specialises on (an int's value, a tensor's dtype or 16-byte alignment, an
    option) again; an argument of an unknown kind every time."""
    k = FakeKernel()
    buf = torch.zeros(64)
    a, b = buf[0:16], buf[1:17]  # 16-byte aligned, and not
    with L.compile_ahead(workers=1):
        for _ in range(3):
            L.launch(k, (1,), a, 8, 0.5, BLOCK=16)
        L.launch(k, (9,), buf[16:32], 8, 0.5, BLOCK=16)  # other data, same key; other grid
        L.launch(k, (1,), b, 8, 0.5, BLOCK=16)  # misaligned
        L.launch(k, (1,), a.half(), 8, 0.5, BLOCK=16)  # dtype
        L.launch(k, (1,), a, 9, 0.5, BLOCK=16)  # int value
        L.launch(k, (1,), a, 8, 0.5, BLOCK=32)  # constexpr
        L.launch(k, (1,), a, 8, 0.5, BLOCK=16, num_warps=8)  # option
        L.launch(k, (1,), a, 8, 0.5, BLOCK=16, F=object())
        L.launch(k, (1,), a, 8, 0.5, BLOCK=16, F=object())  # unknown kind: always
    assert [c[0] for c in k.calls] == ["warmup"] * 8
    assert k.calls[1][2][0].data_ptr() == b.data_ptr()
    with L.compile_ahead(workers=1):  # a new pass starts with nothing warmed
        L.launch(k, (1,), a, 8, 0.5, BLOCK=16)
    assert len(k.calls) == 9


@pytest.mark.skipif(not L.can_compile_ahead(), reason="this Triton has no AsyncCompileMode")
def test_compile_ahead_ends_warming_when_the_body_raises_and_refuses_nesting():
    with pytest.raises(KeyError):
        with L.compile_ahead(workers=1):
            raise KeyError("x")
    assert not L.warming()
    with L.compile_ahead(workers=1):
        with pytest.raises(RuntimeError, match="already inside"):
            with L.compile_ahead(workers=1):
                pass
        assert L.warming()
    with pytest.raises(ValueError, match="workers is -2"):
        with L.compile_ahead(workers=-2):
            pass
    assert not L.warming()


@pytest.mark.skipif(not L.can_compile_ahead(), reason="this Triton has no AsyncCompileMode")
def test_zeros_when_warming_zeroes_outputs_only_inside_compile_ahead():
    a, b, c = torch.ones(3), torch.full((2, 2), 5.0), torch.ones(4)
    assert L.zeros_when_warming(a) is a and a.sum() == 3  # outside: untouched
    with L.compile_ahead(workers=1):
        assert L.zeros_when_warming(a) is a
        out = L.zeros_when_warming([b, None])
        d = L.zeros_when_warming({"x": c, "n": 3})
    assert a.abs().sum() == 0 and b.abs().sum() == 0 and c.abs().sum() == 0
    assert out[1] is None and d["n"] == 3


def test_compile_ahead_without_async_mode_is_refused(monkeypatch):
    monkeypatch.setattr(L, "_async_mode", lambda: None)
    assert not L.can_compile_ahead()
    with pytest.raises(RuntimeError, match="AsyncCompileMode"):
        with L.compile_ahead():
            pass


def test_every_lowering_kernel_launch_goes_through_launch():
    """A launch written as ``kernel[grid](...)`` would run (not just compile) inside
    compile_ahead, on outputs nobody zeroes."""
    import re
    from pathlib import Path

    import dspark_compile.kernels as pkg

    raw = []
    for path in sorted(Path(pkg.__file__).parent.glob("*.py")):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\b_\w*kernel\s*\[", line):
                raw.append(f"{path.name}:{i}: {line.strip()}")
    assert raw == []


def test_capture_without_async_mode_says_so_once_and_runs_nothing(monkeypatch, caplog):
    import logging

    from dspark_compile.session import graphs as runner
    from dspark_compile.session.tiers import Tier

    calls = []
    graphs = runner.TierGraphs(lambda *a: calls.append(a), (Tier(4, 2),), vocab=5,
                               dtype=torch.float32, device=torch.device("cpu"))
    monkeypatch.setattr(L, "_async_mode", lambda: None)
    monkeypatch.setattr(runner, "_warned_no_ahead", False)
    with caplog.at_level(logging.WARNING, logger="dspark_compile"):
        graphs._compile_ahead(list(graphs.tiers))
        graphs._compile_ahead(list(graphs.tiers))
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "AsyncCompileMode" in caplog.records[0].message and len(caplog.records) == 1
    assert calls == [] and graphs.ahead_seconds == 0.0


def test_every_triton_op_with_outputs_zeroes_them_when_warming():
    """Inside compile_ahead a ``*_triton`` op's launches do not run; an output it returns
    unwritten would feed uninitialised values (indices among them) to the graph's kernels."""
    import inspect

    from dspark_compile.kernels import ops

    checked, missing = [], []
    for mod in (ops,):
        for name, fn in vars(mod).items():
            op = getattr(torch.ops.dspark, name, None) if name.endswith("_triton") else None
            if op is None or not callable(fn):
                continue
            src = inspect.getsource(getattr(fn, "_init_fn", None) or fn)
            if "-> None" in src.split(":\n", 1)[0]:
                continue  # a commit: mutates state only
            checked.append(name)
            if "zeros_when_warming(" not in src:
                missing.append(name)
    assert len(checked) >= 6 and missing == [], (checked, missing)


def test_float32_dots_follow_torchs_matmul_precision():
    """IEEE float32 dots at torch's default ("highest"), as cuBLAS computes the model's own
    float32 matmuls; the target's TF32 only where torch allows TF32; never on AMD."""
    import torch

    from dspark_compile.kernels.device import fp32_dot_precision
    from dspark_compile.kernels.targets import TARGETS

    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert fp32_dot_precision(TARGETS["sm_90"]) == "ieee"
        for setting in ("high", "medium"):
            torch.set_float32_matmul_precision(setting)
            assert fp32_dot_precision(TARGETS["sm_90"]) == "tf32"
            assert fp32_dot_precision(TARGETS["gfx942"]) == "ieee"
    finally:
        torch.set_float32_matmul_precision(before)


def test_register_cap_only_on_nvidia_devices_and_only_when_set():
    """``maxnreg`` goes to an NVIDIA launch on a CUDA device; HIP rejects the option, the
    interpreter (CPU tensors) has no registers, and 0 / None leave the compiler's choice."""
    from dspark_compile.kernels.device import register_cap
    from dspark_compile.kernels.targets import TARGETS

    cuda = torch.device("cuda")
    assert register_cap(128, TARGETS["sm_90"], cuda) == {"maxnreg": 128}
    assert register_cap(128, TARGETS["gfx942"], cuda) == {}
    assert register_cap(128, TARGETS["sm_90"], torch.device("cpu")) == {}
    assert register_cap(0, TARGETS["sm_90"], cuda) == {}
    assert register_cap(None, TARGETS["sm_90"], cuda) == {}
