"""Shared fixtures: tiny generated ImageFolder trees and VOC-layout sets (tests never read ../shared)."""

from __future__ import annotations

import os

# no test downloads: a hub name missing from the Hugging Face cache is an error, as under HF_HUB_OFFLINE=1 (the
# tests that download set --model.weights_options.download true with a fake hf_hub_download)
os.environ["HF_HUB_OFFLINE"] = "1"
# under pytest-xdist (make test) the worker processes share the cores: one torch thread each, and in the processes
# the tests start, as two threads per worker on 2 cores spent a third of the suite's time waiting on each other
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

from image_trees import make_image_tree
from segmentation_sets import make_voc_set


@pytest.fixture
def image_tree(tmp_path: Path) -> Path:
    return make_image_tree(tmp_path / "data")


@pytest.fixture
def voc_set(tmp_path: Path) -> Path:
    """A tiny PASCAL VOC-layout set: 8 train and 4 val images of 40×56 px, 4 classes, palette masks."""
    return make_voc_set(tmp_path / "voc")


@pytest.fixture
def other_process() -> Iterator[subprocess.Popen]:
    """Another live process (stands in for another sweep's or fit's process holding a run directory)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    """With ``CORETUNE_TEST_ORDER_DIR`` set, append each test's id to ``<dir>/<worker>.txt`` as it starts: the order
    each xdist worker ran its tests in, to find the earlier test whose leftover state tips a later one (a flaky
    failure seen only in the whole suite; ``main.txt``: the controller's, every test as reported). Unset (the
    default), nothing is written."""
    folder = os.environ.get("CORETUNE_TEST_ORDER_DIR")
    if folder:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        Path(folder).mkdir(parents=True, exist_ok=True)  # made by the first test to start (workers race: exist_ok)
        with open(Path(folder) / f"{worker}.txt", "a", encoding="utf-8") as order:
            order.write(nodeid + "\n")
