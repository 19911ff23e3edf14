"""Shared fixtures: tiny generated ImageFolder trees (tests never read ../shared)."""

from __future__ import annotations

from pathlib import Path

import pytest

from image_trees import make_image_tree


@pytest.fixture
def image_tree(tmp_path: Path) -> Path:
    return make_image_tree(tmp_path / "data")
