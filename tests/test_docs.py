"""The API reference of the docs site: every public name of the documented modules has a docstring, and each
module has its page (the site itself is built by `make docs`, ``mkdocs build --strict``)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

griffe = pytest.importorskip("griffe")

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTED = {
    "coretune": "api/coretune.md",
    "coretune.objectives": "api/objectives.md",
    "coretune.losses": "api/losses.md",
    "coretune.mining": "api/mining.md",
}


@pytest.fixture(scope="module")
def package() -> object:
    """The package as mkdocstrings reads it (griffe, from the source files)."""
    return griffe.load("coretune", search_paths=[str(ROOT / "src")])


@pytest.mark.parametrize("module", DOCUMENTED)
def test_every_public_name_has_a_docstring(module: str, package: object) -> None:
    names = importlib.import_module(module).__all__
    static = package if module == "coretune" else package[module.partition(".")[2]]
    undocumented = [name for name in names if not static[name].docstring]
    assert undocumented == [], f"{module}: public names without a docstring"


@pytest.mark.parametrize("module", DOCUMENTED)
def test_every_documented_module_has_its_api_page(module: str) -> None:
    page = ROOT / "docs" / DOCUMENTED[module]
    assert f"::: {module}\n" in page.read_text()
    assert f"- {module}: {DOCUMENTED[module]}\n" in (ROOT / "mkdocs.yml").read_text()
