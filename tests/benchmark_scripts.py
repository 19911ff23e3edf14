"""Loading a script of ``benchmarks/`` (not a package: run as ``python benchmarks/<name>.py``) as a module in a test."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
"""The repository's ``benchmarks/`` folder."""


def load_benchmark(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``benchmarks/<name>.py`` as the module ``name``, for one test: in ``sys.modules`` (its dataclasses resolve
    their annotations through it), with ``benchmarks/`` on ``sys.path`` (the packages a script imports beside it, as
    ``gpu_check.py``'s ``gpucheck``); ``monkeypatch`` undoes both when the test ends."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None, f"no script benchmarks/{name}.py"
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module
