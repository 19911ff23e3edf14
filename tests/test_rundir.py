"""RunDir: the one object that names a run directory's files, and what they say about the run."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from coretune.rundir import RunDir


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
