"""``coretune bench --status``: every run, how far it got, and the fitting left."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from rich.console import Console
from sweep_helpers import data_root, fabricate

from coretune.cli import main
from coretune.runs.claim import RunClaim, claim_run
from coretune.sweeps import BenchSpec, collect_cells, sweep_time_left
from coretune.sweeps.records import RunRecord, RunStatus
from coretune.sweeps.status import print_status


def test_status_lists_finished_started_and_missing_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "160")  # rich's table width: no wrapped cells
    config = tmp_path / "bench.yaml"
    datasets = {"d": [f"--data.root={data_root(tmp_path)}"]}
    entries = {"output": str(tmp_path / "out"), "datasets": datasets, "objectives": ["ce"], "seeds": [0, 1, 2, 3, 4]}
    config.write_text(yaml.safe_dump(entries))
    spec = BenchSpec.from_yaml(config)
    fabricate(spec.subset(seeds=[0]), {("ce", "d", 1.0): [0.7512]})
    results = spec.output / "d" / "ce" / "frac1" / "seed0" / "results.json"
    results.write_text(json.dumps({**json.loads(results.read_text()), "wall_time_s": 600.0}))
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    gone = RunClaim(ended.pid, socket.gethostname(), time.time())
    # seed 1 stopped after 3 of 20 epochs of a minute (its sweep was killed: a stale claim); seed 2 just launched;
    # seed 4 runs, 5 epochs of 2 minutes done, the last written a minute ago
    for seed, epochs, checkpoint, claim in ((1, 3, True, gone), (2, 0, False, None), (4, 5, True, "live")):
        run_dir = spec.output / "d" / "ce" / "frac1" / f"seed{seed}"
        (run_dir / "checkpoints").mkdir(parents=True)
        (run_dir / "log.txt").write_text("# launched\n")
        (run_dir / "config.yaml").write_text(yaml.safe_dump({"trainer": {"max_epochs": 20}}))
        rows = "".join(f"{e},,{60 * (1 + seed // 4)}\n" for e in range(epochs))
        (run_dir / "metrics.csv").write_text("epoch,val/top1,epoch_time_s\n" + rows)
        os.utime(run_dir / "metrics.csv", (time.time() - 60,) * 2)
        if checkpoint:
            (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"")
        if claim == "live":
            claim_run(run_dir)
        elif claim is not None:
            (run_dir / "fit.pid").write_text(json.dumps(dataclasses.asdict(claim)))
    main(["bench", str(config), "--status"])
    out = capsys.readouterr().out
    assert re.search(r"│ d +│ ce +│ 100% +│ 0 +│ 75\.12 +│ 3 epochs", out)
    assert re.search(r"│ 1 +│ +│ 3 of 20 epochs, resumable, ~17 min to go +│", out)
    assert re.search(r"│ 2 +│ +│ 0 of 20 epochs +│", out) and re.search(r"│ 3 +│ +│ not started", out)
    assert re.search(r"│ 4 +│ +│ running, 5 of 20 epochs done, ~29 min left +│", out)
    assert "1 of 5 runs finished, 3 started (1 running now), 1 not started" in out
    # 17 + 29 min for seeds 1 and 4, seed 0's 10 min for seeds 2 (no epoch yet) and 3
    assert "~1 h 06 min of fitting left for the 4 unfinished runs, one after another" in " ".join(out.split())
    statuses = [r.status for r in collect_cells(spec)[1]]
    assert statuses == ["finished", "unfinished", "unfinished", "missing", "running"]
    assert not (spec.output / "summary.md").exists()  # --status writes nothing
    main(["bench", str(config), "--status", "--only_seeds=[1, 3]"])  # the runs a restricted sweep command runs
    out = capsys.readouterr().out
    assert re.search(r"│ 1 +│ +│ 3 of 20 epochs", out) and re.search(r"│ 3 +│ +│ not started", out)
    assert "0 of 2 runs finished, 1 started (0 running now), 1 not started" in out
    # seed 3 not started: timed by seed 0, finished in the whole spec though not in the restricted table
    assert "~27 min of fitting left for the 2 unfinished runs" in " ".join(out.split())
    main(["bench", str(config), "--status", "--only_seeds=[3]"])
    out = " ".join(capsys.readouterr().out.split())
    assert "~10 min of fitting left for the 1 unfinished run, one after another (at its own pace, or its cell's" in out


def test_sweep_time_left_times_each_run_by_its_pace_or_its_cells_finished_seeds(tmp_path: Path) -> None:
    def row(name: str, status: RunStatus, cell: str = "a", wall: float | None = None, done: int = 0) -> RunRecord:
        run_dir = tmp_path / name
        if status != "missing":
            run_dir.mkdir()
            (run_dir / "config.yaml").write_text(yaml.safe_dump({"trainer": {"max_epochs": 4}}))
            (run_dir / "metrics.csv").write_text("epoch,epoch_time_s\n" + "".join(f"{e},50\n" for e in range(done)))
        none = dict.fromkeys(("test_top1_pct", "test_top5_pct", "val_top1_pct", "epochs", "train_images_per_s"))
        return RunRecord("d", cell, 1.0, 0, status, "", **none, wall_time_s=wall, run_dir=run_dir)

    finished = [row("f1", "finished", wall=100.0), row("f2", "finished", wall=300.0), row("f3", "finished")]
    assert sweep_time_left(finished) == (0.0, 0)
    rows = [
        *finished,
        row("missing_a", "missing"),  # the median of its cell's timed finished seeds: 200 s
        row("half", "unfinished", done=2),  # 2 epochs of 50 s to go
        row("testing", "running", done=4),  # trained; its test evaluation runs
        row("missing_b", "missing", cell="b"),  # no finished seed in its cell: left out
        row("launched_b", "unfinished", cell="b"),
    ]
    assert sweep_time_left(rows) == (300.0, 3)


def test_a_run_that_diverged_says_so(tmp_path: Path) -> None:
    from coretune.sweeps.records import run_progress

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "log.txt").write_text("# launched\n")
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"trainer": {"max_epochs": 20}}))
    (run_dir / "metrics.csv").write_text("epoch,epoch_time_s\n0,60\n1,60\n2,60\n")
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"")
    assert run_progress(run_dir) == "3 of 20 epochs, resumable, ~17 min to go"
    (run_dir / "results.json").write_text(json.dumps({"diverged": "the training loss is nan at epoch 3, step 9 …"}))
    assert run_progress(run_dir) == "3 of 20 epochs, diverged (its message: results.json)"


def test_runs_fitted_with_test_false_are_finished_without_a_test_score(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run whose fit skipped the test (``coretune fit --test false``: ``"test": null`` and ``test_skipped``) is
    finished, not run again, with no test score: tables leave it out of a ``metric: test`` cell, ``--status`` says
    so, and ``metric: val`` reads its final validation."""
    monkeypatch.setenv("COLUMNS", "160")
    datasets = {"d": [f"--data.root={data_root(tmp_path)}"]}
    for metric in ("test", "val"):
        spec = BenchSpec.from_dict(
            {
                "output": str(tmp_path / metric),
                "datasets": datasets,
                "objectives": ["ce"],
                "seeds": [0],
                "metric": metric,
            }
        )
        (run,) = spec.runs()
        run.run_dir.mkdir(parents=True)
        results = {"test": None, "test_skipped": "--test false: …", "epochs": 2, "validated_on_test_images": False}
        (run.run_dir / "results.json").write_text(json.dumps(results))
        (run.run_dir / "config.yaml").write_text(yaml.safe_dump({"data": {"val_fraction": 0.2}}))
        (run.run_dir / "metrics.csv").write_text("epoch,val/top1,epoch_time_s\n0,0.5,1\n1,0.625,1\n")
        cells, (row,) = collect_cells(spec)
        assert row.status == "finished" and row.progress == "2 epochs, not tested (--test false)"
        assert row.test_top1_pct is None and row.test_top5_pct is None
        assert cells[("ce", "d", 1.0)].values == (() if metric == "test" else (62.5,))
        print_status(spec, Console(width=160))
        out = " ".join(capsys.readouterr().out.split())
        assert "1 of 1 runs finished" in out and "not tested (--test false)" in out
        assert ("62.50" in out) == (metric == "val")
