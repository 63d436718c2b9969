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
