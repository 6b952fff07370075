"""Every benchmark imports: a bench that stopped importing (a helper it used was removed) fails CI here, not
the next time someone runs it."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import bench

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted(info.name for info in pkgutil.iter_modules(bench.__path__, prefix="bench."))


def test_the_package_lists_its_benchmarks():
    assert {"bench.harness", "bench.pages", "bench.proxy_overhead", "bench.fleet_faults"} <= set(MODULES)
    documented = bench.__doc__ or ""
    for name in MODULES:
        if name not in ("bench.harness",):
            assert f"python -m {name} " in documented, f"{name} is not in bench/__init__.py's list"


@pytest.mark.parametrize("name", MODULES)
def test_each_module_imports(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__doc__, f"{name} says what it measures in its docstring"


@pytest.mark.parametrize("name", [name for name in MODULES if name != "bench.harness"])
def test_each_benchmark_answers_help_from_the_repository_root(name: str) -> None:
    """As the docs run it: ``python -m bench.NAME`` from the root, no path set up by hand."""
    run = subprocess.run([sys.executable, "-m", name, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "usage:" in run.stdout


def test_no_benchmark_edits_sys_path():
    """Benchmarks import each other as a package (``from bench.harness import ...``), never through sys.path."""
    offenders = [
        path.name
        for path in sorted((ROOT / "bench").glob("*.py"))
        if "sys.path" in path.read_text().replace("``sys.path``", "")
    ]
    assert offenders == []
