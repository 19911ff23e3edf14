"""Every distribution the package imports is declared in pyproject.toml: required imports in ``dependencies``,
optional ones (inside a function, or guarded by ``except ImportError``) in ``dependencies`` or an extra."""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "coretune"


def _normalise(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(pyproject: dict) -> tuple[set[str], set[str]]:
    """The distributions of ``dependencies`` and of every optional extra (names only, normalised)."""
    project = pyproject["project"]

    def names(requirements: list[str]) -> set[str]:
        return {_normalise(re.match(r"[A-Za-z0-9._-]+", r.strip())[0]) for r in requirements}

    extras = set().union(*map(names, project.get("optional-dependencies", {}).values()))
    return names(project.get("dependencies", [])), extras


def _guards_import_error(node: ast.Try) -> bool:
    def catches(handler: ast.ExceptHandler) -> bool:
        kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        return any(isinstance(k, ast.Name) and k.id in {"ImportError", "ModuleNotFoundError"} for k in kinds)

    return any(catches(h) for h in node.handlers)


def imports(tree: ast.AST, optional: bool = False) -> Iterator[tuple[str, int, bool]]:
    """``(top-level module, line, optional)`` of every absolute import; optional means it runs only when a function
    is called, or an ``ImportError`` is caught around it."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.partition(".")[0], node.lineno, optional
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.partition(".")[0], node.lineno, optional
        else:
            guarded = isinstance(node, ast.Try) and _guards_import_error(node)
            lazy = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from imports(node, optional or guarded or lazy)


def undeclared(package: Path, required: set[str], extras: set[str], distributions: dict[str, list[str]]) -> list[str]:
    """One line per import of ``package`` (a folder of modules) whose distribution is not declared where it must be."""
    problems = []
    for path in sorted(package.rglob("*.py")):
        for module, line, optional in imports(ast.parse(path.read_text(), str(path))):
            if module in sys.stdlib_module_names or module in {package.name, "__future__"}:
                continue
            where = f"{path.relative_to(package.parent)}:{line}: import {module}"
            dists = {_normalise(d) for d in distributions.get(module, [])}
            if not dists:
                problems.append(f"{where}: no installed distribution provides it")
            elif not dists & (required | extras if optional else required):
                wanted = "dependencies or an extra" if optional else "dependencies"
                problems.append(f"{where}: {' or '.join(sorted(dists))} is not in pyproject.toml's {wanted}")
    return problems


def test_every_import_of_the_package_is_a_declared_dependency() -> None:
    required, extras = declared(tomllib.loads((ROOT / "pyproject.toml").read_text()))
    assert undeclared(PACKAGE, required, extras, packages_distributions()) == []


def test_an_undeclared_import_is_found(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("import os\nimport yaml\nfrom . import sub\nfrom pkg.sub import x\n")
    (package / "sub" / "__init__.py").write_text(
        "try:\n    import optuna\nexcept ImportError:\n    optuna = None\n\n"
        "def f():\n    from onnx import helper\n    import sklearn.svm\n"
    )
    distributions = {"yaml": ["PyYAML"], "optuna": ["optuna"], "onnx": ["onnx"], "sklearn": ["scikit-learn"]}
    pyproject = {"project": {"dependencies": ["pyyaml>=6"], "optional-dependencies": {"tune": ["Optuna >=3"]}}}
    assert undeclared(package, *declared(pyproject), distributions) == [
        "pkg/sub/__init__.py:7: import onnx: onnx is not in pyproject.toml's dependencies or an extra",
        "pkg/sub/__init__.py:8: import sklearn: scikit-learn is not in pyproject.toml's dependencies or an extra",
    ]
    pyproject["project"]["dependencies"] = ["scikit-learn"]
    assert undeclared(package, *declared(pyproject), distributions)[0] == (
        "pkg/__init__.py:2: import yaml: pyyaml is not in pyproject.toml's dependencies"
    )
    del distributions["yaml"]
    assert "pkg/__init__.py:2: import yaml: no installed distribution provides it" in undeclared(
        package, *declared(pyproject), distributions
    )
