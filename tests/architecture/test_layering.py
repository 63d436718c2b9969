"""The import contracts of ``pyproject.toml`` (``[tool.importlinter]``) hold, and would break
on a reintroduced upward import or cycle: ``lint-imports`` runs on a copy of the package with
one bad import added."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _lint(package_parent: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    return subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
         "sys.exit(lint_imports_command())", "--config", str(REPO / "pyproject.toml"),
         "--no-cache"], cwd=package_parent, env=env, capture_output=True, text=True, timeout=300)


def _copy_with(tmp_path: Path, module: str, line: str) -> Path:
    parent = tmp_path / "src"
    shutil.copytree(REPO / "dspark_compile", parent / "dspark_compile",
                    ignore=shutil.ignore_patterns("__pycache__"))
    path = parent / "dspark_compile" / module
    path.write_text(path.read_text() + f"\n{line}\n")
    return parent


def test_the_package_keeps_its_contracts():
    out = _lint(REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 kept, 0 broken" in out.stdout


@pytest.mark.parametrize("module, line, broken", [
    ("ops/attention.py", "from ..kernels import launch  # noqa", "pipeline layers"),
    ("kernels/targets.py", "from ..passes import base  # noqa", "pipeline layers"),
    ("layout.py", "from .state import pools  # noqa", "pipeline layers"),
    ("passes/lower.py", "from ..frontend import scope  # noqa", "pipeline layers"),
    ("frontend/scope.py", "from .. import nn  # noqa", "no import cycles"),
])
def test_an_upward_import_or_a_cycle_breaks_a_contract(tmp_path, module, line, broken):
    out = _lint(_copy_with(tmp_path, module, line))
    assert out.returncode != 0, out.stdout
    assert f"{broken}" in out.stdout and "BROKEN" in out.stdout, out.stdout
