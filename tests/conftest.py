"""Test set-up shared by every test module.

TRITON_INTERPRET is read when @triton.jit decorates, so it is set here, before any kernel
module can be imported, whenever no GPU is present (``make test`` also sets it).
"""

import os
import shutil

if shutil.which("nvidia-smi") is None and shutil.which("rocm-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


HEAVY_FIRST = ("frontend/test_deepseek_v4.py", "zoo/test_zoo.py", "passes/test_fuse_linear.py",
               "passes/test_concat_linear.py", "frontend/test_decoder_families.py",
               "zoo/test_tiny.py", "session/test_protocol_machine_hybrid.py",
               "frontend/test_mrope.py", "frontend/test_mamba_hybrids.py")
"""Modules of a minute or more of CPU on the 2-core CI machine (``--durations=0``), sent to the
workers first so that the run does not end on one of them while the other worker idles."""


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """GPU tests skip cleanly without a GPU (and are deselected by default: -m 'not gpu').

    Under ``--dist loadgroup`` every test without an ``xdist_group`` of its own joins its
    module's group: a module runs in one worker, so its module fixtures and cached compiles
    are built once a run, not once per worker. The heavy modules go first."""
    if getattr(config.option, "loadgroup", False):  # xdist sets it for --dist loadgroup
        heavy = {f"tests/{name}": i for i, name in enumerate(HEAVY_FIRST)}
        rank = {}
        for item in items:
            module = item.nodeid.split("::")[0]
            rank[id(item)] = heavy.get(module, len(heavy))
            if item.get_closest_marker("xdist_group") is None:
                item.add_marker(pytest.mark.xdist_group(module))
        items.sort(key=lambda item: rank[id(item)])  # stable: collection order otherwise
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA or ROCm device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fixed_draws(monkeypatch):
    """Makes a derandomized hypothesis run draw the same in every process.

    Hypothesis mixes literals found in every local module imported so far into its draws, and
    caches the mix process-wide, so one seed drew differently after other tests had run in the
    same worker (a state machine's call mix moved by a third). Under this fixture it draws
    from its own built-in constants only. The names patched are hypothesis internals: if they
    move, ``monkeypatch`` raises here rather than letting the draws drift again.
    """
    from hypothesis.internal.conjecture import providers
    from hypothesis.internal.constants_ast import Constants

    monkeypatch.setattr(providers, "_get_local_constants", Constants)
    monkeypatch.setattr(providers, "CONSTANTS_CACHE", type(providers.CONSTANTS_CACHE)(1024))
