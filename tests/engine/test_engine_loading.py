"""``coretune fit`` with ``--data.num_workers auto`` / ``--data.pin_memory auto`` (the defaults): the values chosen
for the accelerator are named at the start and recorded in ``config.yaml``; a resume chooses them again; explicit
values win; bad values are refused in one line. CUDA is faked where the CLI decides it (no GPU needed)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from coretune.cli import main
from coretune.engine import runcli
from fit_flags import QUIET, TINY_FIT, error


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from image_trees import make_image_tree

    return make_image_tree(tmp_path_factory.mktemp("loading") / "data", per_class=4, val_per_class=2, size=16)


def fit(tree: Path, run: Path, *extra: str) -> None:
    main(["fit", f"--data.root={tree}", f"--run_dir={run}", *TINY_FIT, *QUIET, *extra])


def recorded(run: Path) -> tuple[object, object]:
    data = yaml.safe_load((run / "config.yaml").read_text())["data"]
    return data["num_workers"], data["pin_memory"]


def loading_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("data loading:")]


@pytest.mark.filterwarnings("ignore:The dirpath has changed")  # --config of the run: resumed from its checkpoint
def test_auto_on_cpu_is_recorded_and_a_resume_with_auto_goes_on(
    tree: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runcli, "hardware_of_settings", lambda trainer: (False, 1))
    run = tmp_path / "run"
    with caplog.at_level(logging.INFO):
        fit(tree, run)
    assert recorded(run) == (0, False)  # as before auto: loading in the main process, unpinned
    assert loading_lines(caplog) == [
        "data loading: num_workers=0, pin_memory=false, persistent_workers=false (auto without CUDA; "
        "--data.num_workers and --data.pin_memory set them)"
    ]  # once: the data module got the chosen values
    caplog.clear()
    with caplog.at_level(logging.INFO):
        fit(tree, run, "--trainer.max_epochs=2")  # resumed with auto again: the same values, no change to report
    resumed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resuming")]
    assert len(resumed) == 1 and "trainer.max_epochs 1 → 2 (" in resumed[0] and "num_workers" not in resumed[0]
    assert recorded(run) == (0, False)
    fit(tree, tmp_path / "again", f"--config={run / 'config.yaml'}", f"--run_dir={tmp_path / 'again'}")
    assert recorded(tmp_path / "again") == (0, False)  # its config.yaml (explicit values) runs again


def test_auto_on_cuda_is_recorded(
    tree: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the trainer settings on a node of 2 CUDA devices with 2 cores (the fit itself runs on the CPU)
    monkeypatch.setattr(runcli, "hardware_of_settings", lambda trainer: (True, 2))
    monkeypatch.setattr("coretune.data.loading.cpu_cores", lambda: 2)
    run = tmp_path / "run"
    with caplog.at_level(logging.INFO):
        fit(tree, run, "--data.pin_memory=false")  # pinning needs a GPU: given, it wins
    assert recorded(run) == (1, False)
    assert loading_lines(caplog) == [
        "data loading: num_workers=1, pin_memory=false, persistent_workers=true, prefetch_factor=4 (auto for CUDA, "
        "1 CPU core(s) per process of 2; --data.num_workers and --data.pin_memory set them)"
    ]


def test_explicit_values_are_recorded_as_given(tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runcli, "hardware_of_settings", lambda trainer: (True, 1))
    fit(tree, tmp_path / "run", "--data.num_workers=0", "--data.pin_memory=false")
    assert recorded(tmp_path / "run") == (0, False)


def test_bad_values_are_refused_in_one_line(tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["fit", f"--data.root={tree}", f"--run_dir={tmp_path / 'run'}", *TINY_FIT]
    assert "invalid data option(s): num_workers must be >= 0 or auto, got -1 — set valid values" in error(
        [*args, "--data.num_workers=-1"]
    )
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--data.num_workers=many"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1:] == [
        "coretune fit: error: --data.num_workers: expected one of int, 'auto', got many (coretune fit --help lists "
        "the options)"
    ]
    assert not (tmp_path / "run").exists()
