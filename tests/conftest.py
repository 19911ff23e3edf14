"""Shared fixtures: tiny generated ImageFolder trees (tests never read ../shared)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from image_trees import make_image_tree


@pytest.fixture
def image_tree(tmp_path: Path) -> Path:
    return make_image_tree(tmp_path / "data")


@pytest.fixture
def other_process() -> Iterator[subprocess.Popen]:
    """Another live process (stands in for another sweep's or fit's process holding a run directory)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()
