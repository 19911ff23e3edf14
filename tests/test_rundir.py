"""RunDir: the one object that names a run directory's files, and what they say about the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from coretune.engine import update_results
from coretune.runs.layout import RunDir


def test_the_layout_of_a_run_directory(tmp_path: Path) -> None:
    run = RunDir(str(tmp_path))
    assert run.path == tmp_path and run == RunDir(tmp_path)
    names = [run.config, run.metrics, run.results, run.learning_curve, run.last_checkpoint, run.claim, run.log]
    assert [p.relative_to(tmp_path).as_posix() for p in names] == [
        "config.yaml",
        "metrics.csv",
        "results.json",
        "learning_curve.png",
        "checkpoints/last.ckpt",
        "fit.pid",
        "log.txt",
    ]
    assert [p.name for p in run.records()] == ["config.yaml", "fit_args.json", "metrics.csv", "results.json"]
    (tmp_path / "robust_results_autoattack.json").write_text("{}")  # coretune eval robust --output …, found
    run.robust_results.write_text("{}")
    assert [p.name for p in run.records()][4:] == ["robust_results.json", "robust_results_autoattack.json"]


def test_a_run_is_finished_once_results_hold_the_test_results(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    assert not run.is_finished() and run.read_results() == {} and run.epochs_done() == (0, None)
    run.results.write_text("{truncated")
    assert not run.is_finished()
    run.results.write_text(json.dumps({"best_val_top1": 0.5}))
    assert not run.is_finished()
    run.results.write_text(json.dumps({"test": {}}))  # no test result: unfinished for the tables too
    assert not run.is_finished()
    run.results.write_text(json.dumps({"test": {"top1": 0.5}}))
    assert run.is_finished() and run.read_results()["test"] == {"top1": 0.5}


def test_epochs_done_counts_metrics_rows_against_the_configured_length(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    run.metrics.write_text("epoch,val/top1\n0,0.5\n1,\n")
    assert run.epochs_done() == (2, None)
    run.config.write_text(yaml.safe_dump({"trainer": {"max_epochs": 20}}))
    assert run.epochs_done() == (2, 20) and run.read_config()["trainer"] == {"max_epochs": 20}


def test_the_run_directory_of_a_checkpoint(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    assert RunDir.of_checkpoint(run.last_checkpoint) == run and run.best_checkpoint.parent == run.checkpoints
    assert RunDir.of_checkpoint(tmp_path / "copies" / "model.ckpt") == RunDir(tmp_path / "copies")
    assert run.test_results.name == "test_results.json"


@pytest.mark.parametrize(
    ("text", "problem"),
    [('{"test": {"top1": 0.5', "is not valid JSON (Expecting ',' delimiter: line 1 column 22 (char 21))"),
     ("", "is not valid JSON (Expecting value: line 1 column 1 (char 0))"), ("[1, 2]", "is not a JSON object")],
)  # fmt: skip
def test_a_damaged_results_file_is_named_with_the_fix(tmp_path: Path, text: str, problem: str) -> None:
    # was json's bare "Expecting value: line 1 column 1 (char 0)" from every table, and a fit that failed on it
    run = RunDir(tmp_path)
    run.results.write_text(text)
    expected = (
        f"{run.results} {problem}: restore it from a copy (such as a record of `coretune bench --export`), or "
        "delete it and run the run's command again to resume and test it"
    )
    with pytest.raises(ValueError) as info:
        run.read_results()
    assert str(info.value) == expected
    with pytest.raises(ValueError) as info:
        update_results(tmp_path, epochs=3)
    assert str(info.value) == expected and run.results.read_text() == text  # left as it was
    assert run.divergence() is None and not run.is_finished()  # a sweep runs it again, and its fit says the above


def test_atomic_write_leaves_the_old_content_when_the_writer_fails(tmp_path: Path) -> None:
    # results.json, config.yaml, fit_args.json, the bench summaries and tune's best.yaml are written this way
    from coretune.runs.atomic import atomic_write

    path = tmp_path / "summary.md"
    with atomic_write(path) as f:
        f.write("old\n")
    with pytest.raises(OSError), atomic_write(path) as f:
        f.write("half of the new")
        raise OSError(28, "No space left on device")
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["summary.md"]
