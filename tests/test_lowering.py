"""Lowering choices: op selection per device, and the token-wise rest under Inductor (CPU)."""

import random

import pytest
import torch

from dspark_compile import DSparkConfig, dspark_compile
from dspark_compile.lowering.select import resolve_lowering
from helpers import PlainDecoder, Session


def test_auto_takes_the_reference_on_cpu_and_triton_on_gpu():
    assert resolve_lowering("auto", torch.device("cpu")) == "reference"
    assert resolve_lowering("auto", torch.device("cuda", 0)) == "triton"
    assert resolve_lowering("reference", torch.device("cuda", 0)) == "reference"


def test_triton_on_cpu_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="lowering='reference'"):
        resolve_lowering("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="needs a CUDA or ROCm device"):
        dspark_compile(PlainDecoder(), lowering="triton")


def test_bad_config_values_are_refused():
    with pytest.raises(ValueError, match="lowering='cuda'"):
        DSparkConfig(lowering="cuda")
    with pytest.raises(ValueError, match="page_size=0"):
        DSparkConfig(page_size=0)
    with pytest.raises(TypeError, match="no field"):
        DSparkConfig().with_overrides(pagesize=16)


def test_inductor_rest_matches_own_forward():
    """One compile (dynamic in N) serves batches of every size."""
    model = PlainDecoder(seed=7)
    verifier = dspark_compile(model, inductor=True)
    session = Session(model, verifier, [2, 0, 1])
    session.vocab = 61
    session.step([6, 3, 9], accept=[6, 3, 9])
    rng = random.Random(1)
    for _ in range(3):
        session.step([rng.randint(1, 8) for _ in range(3)])
    assert session.max_err < 1e-5
