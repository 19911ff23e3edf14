"""LightningCLI's conventions in ``coretune``: ``--trainer.default_root_dir``, settings from the checkpoint,
``validate``, ``--config`` for the commands that read a fitted run."""

from __future__ import annotations

from pathlib import Path

import pytest

from coretune.cli import main
from fit_flags import QUIET, TINY_FIT


@pytest.fixture(scope="module")
def fitted16(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny image tree and a run fitted on it at 16 px."""
    from image_trees import make_image_tree

    base = tmp_path_factory.mktemp("fit16")
    tree = make_image_tree(base / "data")
    run = base / "run"
    main(["fit", *TINY_FIT, *QUIET, f"--data.root={tree}", f"--run_dir={run}"])
    return tree, run


def test_default_root_dir_is_the_parent_of_the_run_directory(image_tree: Path, tmp_path: Path) -> None:
    # it was accepted and ignored: the run went to runs/<objective>-<time>
    parent = tmp_path / "experiments"
    main(["fit", *TINY_FIT, *QUIET, f"--data.root={image_tree}", f"--trainer.default_root_dir={parent}"])
    (run,) = parent.iterdir()
    assert run.name.startswith("cetuning-")
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "results.json").is_file()
