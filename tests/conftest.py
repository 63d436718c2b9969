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


def pytest_collection_modifyitems(config, items):
    """GPU tests skip cleanly without a GPU (and are deselected by default: -m 'not gpu')."""
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
