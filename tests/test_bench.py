"""``coretune bench``: the spec, resumable sweeps of real fit subprocesses, and the mean ± std tables."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from rich.console import Console

import coretune.bench as bench_module
from coretune.bench import (
    BenchSpec,
    BenchSpecError,
    Cell,
    EpochBars,
    collect_cells,
    compare,
    curves_metric,
    export_records,
    final_val_top1,
    fit_command,
    format_duration,
    is_finished,
    launch_fit,
    run_sweep,
    sweep_time_left,
    table_layout,
    training_time_left,
    visible_gpus,
    worker_envs,
    write_summary,
)
from coretune.cli import FitArgsError, main, resolved_fit_config
from coretune.runclaim import RunClaim, claim_run

TINY_FIT = [
    "--model.backbone=small_cnn",
    "--data.image_size=16",
    "--data.batch_size=8",
    "--trainer.max_epochs=1",
    "--trainer.enable_model_summary=false",
]


def data_root(tmp_path: Path) -> Path:
    """An image-folder root with empty train/ and test/: enough for the sweep's up-front path check (fits are faked)."""
    for split in ("train", "test"):
        (tmp_path / "data" / split).mkdir(parents=True, exist_ok=True)
    return tmp_path / "data"


def spec_of(tmp_path: Path, **entries: object) -> BenchSpec:
    datasets = {"tiny": [f"--data.root={data_root(tmp_path)}"]}
    raw = {"output": str(tmp_path / "out"), "datasets": datasets, "objectives": ["ce", "core"]}
    return BenchSpec.from_dict({**raw, **entries})


def fabricate(spec: BenchSpec, top1: dict[tuple[str, str, float], list[float | None]]) -> None:
    """Finished runs with the given test top-1 (fractions) per (objective, dataset, fraction), by seed order."""
    for run in spec.runs():
        value = top1[(run.objective, run.dataset, run.label_fraction)][spec.seeds.index(run.seed)]
        if value is None:
            continue
        run.run_dir.mkdir(parents=True)
        (run.run_dir / "results.json").write_text(json.dumps({"test": {"top1": value, "top5": 1.0}, "epochs": 3}))


def test_runs_of_the_grid_and_their_fit_arguments(tmp_path: Path) -> None:
    spec = spec_of(
        tmp_path,
        base_args=["--trainer.max_epochs=2"],
        objectives=["ce", {"name": "core_eta1", "objective": "core", "args": ["--objective.eta=1"]}],
        label_fractions=[0.1, 1.0],
        seeds=[0, 1],
    )
    runs = spec.runs()
    assert len(runs) == 2 * 2 * 2
    run = runs[-1]
    assert run.run_dir == tmp_path / "out" / "tiny" / "core_eta1" / "frac1" / "seed1"
    assert run.args == (
        "--trainer.max_epochs=2",
        f"--data.root={tmp_path / 'data'}",
        "--objective",
        "core",
        "--objective.eta=1",
        "--data.label_fraction=1.0",
        "--seed=1",
    )
    assert runs[0].run_dir.parent.name == "frac0.1"
    cmd = fit_command(run.args, run.run_dir)
    assert cmd[1:4] == ["-m", "coretune.cli", "fit"] and cmd[-1] == f"--run_dir={run.run_dir}"
    (run.run_dir / "checkpoints").mkdir(parents=True)
    (run.run_dir / "checkpoints" / "last.ckpt").touch()
    assert fit_command(run.args, run.run_dir)[-1] == "--ckpt_path=last"  # a started run resumes
    subset = spec.subset(objectives=["core_eta1"], seeds=[1])
    assert [r.run_dir for r in subset.runs()] == [r.run_dir for r in runs if r.objective == "core_eta1" and r.seed == 1]
    assert [r.args for r in subset.runs()] == [r.args for r in runs if r.objective == "core_eta1" and r.seed == 1]


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ({"epochs": 3}, "unknown key(s) epochs"),
        ({"objectives": ["ce", "nope"]}, "unknown objective 'nope'"),
        ({"objectives": ["ce", "ce"]}, "objective names must be unique"),
        ({"label_fractions": [0.0, 1.0]}, "label_fractions must lie in (0, 1]"),
        ({"seeds": [0, 0]}, "seeds lists a value twice"),
        ({"table": "table3"}, "table must be one of table1, table2, table4"),
        ({"table": "table2", "objectives": ["ce", "l2sp"]}, "table2 takes the Table 2 rows only"),
        ({"datasets": {"a/b": []}}, "dataset name 'a/b' must be a non-empty folder name"),
        ({"base_args": "--trainer.max_epochs=3"}, "base_args must be a list of command-line arguments"),
        ({"baseline": "l2sp"}, "baseline 'l2sp' is not one of the objectives"),
        ({"metric": "train"}, "metric must be one of test, val (got 'train')"),
    ],
)
def test_spec_errors_name_the_problem(tmp_path: Path, entries: dict, message: str) -> None:
    with pytest.raises(BenchSpecError, match=r"^bench spec: .*" + re.escape(message)):
        spec_of(tmp_path, **entries)


@pytest.mark.parametrize(("what", "name"), [("dataset", ".."), ("dataset", "."), ("objective", "..")])
def test_a_name_that_leads_out_of_the_output_folder_is_refused(tmp_path: Path, what: str, name: str) -> None:
    """`..` or `.` passed the letters-and-dots check, and `OUT/..` put the runs beside the output folder."""
    datasets = {name if what == "dataset" else "tiny": [f"--data.root={data_root(tmp_path)}"]}
    objectives = [{"name": name, "objective": "ce"}] if what == "objective" else ["ce"]
    config = tmp_path / "bench.yaml"
    config.write_text(yaml.safe_dump({"output": str(tmp_path / "out"), "datasets": datasets, "objectives": objectives}))
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as info:
        main(["bench", str(config)])
    assert str(info.value.code) == (
        f"coretune bench: error: {config}: {what} name {name!r} must be a non-empty folder name of "
        "letters, digits and _ . + - (not . or .., which would lead out of the output folder)"
    )
    assert sorted(tmp_path.rglob("*")) == before


def test_resuming_refuses_other_arguments(tmp_path: Path) -> None:
    spec = spec_of(tmp_path)
    run = spec.runs()[0]
    run.run_dir.mkdir(parents=True)
    (run.run_dir / "fit_args.json").write_text(json.dumps(["--trainer.max_epochs=9"]))
    with pytest.raises(ValueError, match="was started with other fit arguments"):
        run_sweep(spec, dry_run=True)
    with pytest.raises(ValueError, match="was started with other fit arguments"):
        launch_fit(run.args, run.run_dir)


def test_sweep_runs_fits_then_skips_finished_runs(image_tree: Path, tmp_path: Path) -> None:
    config = tmp_path / "bench.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "name": "tiny",
                "output": str(tmp_path / "out"),
                "base_args": TINY_FIT,
                "datasets": {"tiny": [f"--data.root={image_tree}"]},
                "objectives": ["ce", "core"],
                "seeds": [0, 1],
                "workers": 2,
            }
        )
    )
    spec = BenchSpec.from_yaml(config)
    assert run_sweep(spec, dry_run=True).skipped == [] and not spec.output.exists()  # a dry run runs nothing

    first = run_sweep(spec)
    assert first.failed == [] and len(first.finished) == 4
    for run in spec.runs():
        results = json.loads((run.run_dir / "results.json").read_text())
        assert 0 <= results["test"]["top1"] <= 1
        assert yaml.safe_load((run.run_dir / "config.yaml").read_text())["seed_everything"] == run.seed
        assert "epoch 1 of 1 (step " in (run.run_dir / "log.txt").read_text()  # fits without a bar log each epoch
    mtimes = {run.run_dir: (run.run_dir / "results.json").stat().st_mtime_ns for run in spec.runs()}

    main(["bench", str(config)])  # re-run: everything is finished, nothing is launched
    second = run_sweep(spec)
    assert len(second.skipped) == 4 and second.finished == second.failed == []
    assert {d: (d / "results.json").stat().st_mtime_ns for d in mtimes} == mtimes
    assert all((d / "log.txt").read_text().count("\n# ") == 1 for d in mtimes)  # one launch per run
    rows = list(csv.DictReader((spec.output / "runs.csv").open()))
    assert [r["status"] for r in rows] == ["finished"] * 4
    assert (spec.output / "summary.md").is_file() and (spec.output / "bars.png").is_file()


def test_metric_val_tabulates_the_final_epoch_on_the_validation_split(image_tree: Path, tmp_path: Path) -> None:
    from rich.console import Console

    spec = BenchSpec.from_dict(
        {
            "output": str(tmp_path / "out"),
            "base_args": [*TINY_FIT, "--trainer.max_epochs=2", "--data.val_fraction=0.5"],
            "datasets": {"tiny": [f"--data.root={image_tree}"]},
            "objectives": ["ce"],
            "metric": "val",
        }
    )
    console = Console(record=True, width=200)
    assert len(run_sweep(spec, console=console).finished) == 1
    run_dir = spec.runs()[0].run_dir
    val = 100 * final_val_top1(run_dir / "metrics.csv")
    assert f"✓ tiny/ce/frac1/seed0: final-epoch validation top-1 {val:.2f}%" in console.export_text()
    markdown, _ = write_summary(spec)
    assert markdown.splitlines()[2].startswith("final-epoch validation top-1 (%) of each fine-tuning method")
    summary = next(csv.DictReader((spec.output / "summary.csv").open()))
    assert float(summary["tiny mean (%)"]) == pytest.approx(val, abs=1e-4)
    (row,) = csv.DictReader((spec.output / "runs.csv").open())
    assert float(row["val_top1_pct"]) == pytest.approx(val, abs=1e-4)
    test = json.loads((run_dir / "results.json").read_text())["test"]["top1"]
    assert float(row["test_top1_pct"]) == pytest.approx(100 * test, abs=1e-4)  # still recorded, not tabulated


def test_metric_val_refuses_runs_that_validated_on_the_test_split(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, metric="val", objectives=["ce"])
    fabricate(spec, {("ce", "tiny", 1.0): [0.5]})
    run_dir = spec.runs()[0].run_dir
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"data": {"root": "DATA", "val_fraction": 0.0}}))
    (run_dir / "metrics.csv").write_text("epoch,val/top1\n0,0.5\n")
    with pytest.raises(BenchSpecError, match=r"metric 'val' needs a validation split .* add --data.val_fraction=0.2"):
        write_summary(spec)
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"data": {"root": "DATA", "val_fraction": 0.2}}))
    (run_dir / "metrics.csv").write_text("epoch,val/top1\n0,0.9\n1,0.7\n")
    assert "| ce | **70.00 (n=1)** |" in write_summary(spec)[0]  # the last validated epoch, not the test's 50


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--trainer.max_epochs=2"], r"run tiny/ce/frac1/seed0 has none .* add --data.val_fraction=0.2"),
        (
            ["--data.val_fraction=0.5", "--trainer.max_epochs=3", "--trainer.check_val_every_n_epoch=2"],
            r"trains 3 epochs and validates every 2: make --trainer.max_epochs a multiple",
        ),
    ],
)
def test_metric_val_refuses_a_spec_before_any_run_starts(
    image_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: list[str], message: str
) -> None:
    """The resolved fit configuration is checked up front: no hour-long run is wasted on an unusable spec."""
    launched: list[object] = []
    monkeypatch.setattr(bench_module, "launch_fit", lambda *a, **k: launched.append(a) or 0)
    spec = spec_of(
        tmp_path,
        metric="val",
        objectives=["ce"],
        base_args=[*TINY_FIT, *extra],
        datasets={"tiny": [f"--data.root={image_tree}"]},
    )
    with pytest.raises(BenchSpecError, match=message):
        run_sweep(spec)
    assert launched == [] and not spec.output.exists()


def test_resolved_fit_config_applies_configs_and_presets(tmp_path: Path) -> None:
    config = tmp_path / "fit.yaml"
    config.write_text(yaml.safe_dump({"data": {"val_fraction": 0.25}, "trainer": {"max_epochs": 7}}))
    root = f"--data.root={data_root(tmp_path)}"
    resolved = resolved_fit_config([f"--config={config}", root, "--objective", "core", "--trainer.max_epochs=8"])
    assert resolved["data"]["val_fraction"] == 0.25 and resolved["trainer"]["max_epochs"] == 8
    assert resolved["objective"]["class_path"].endswith("CoreTuning")
    with pytest.raises(FitArgsError, match="no_such_method"):
        resolved_fit_config(["--objective", "no_such_method"])
    with pytest.raises(FitArgsError, match=r"^Parser key \"trainer.max_epochs\".*many"):
        resolved_fit_config(["--trainer.max_epochs=many"])
    with pytest.raises(FitArgsError, match=r"^unrecognized arguments: --trainer.max_epochz=3$"):
        resolved_fit_config(["--trainer.max_epochz=3"])
    with pytest.raises(FitArgsError, match=r"Option 'etaa' is not accepted"):
        resolved_fit_config(["--objective", "core", "--objective.etaa=1"])
    with pytest.raises(FitArgsError, match=r"missing\.yaml"):
        resolved_fit_config([f"--config={tmp_path / 'missing.yaml'}"])


@pytest.mark.parametrize("metric", ["test", "val"])
def test_a_spec_whose_fit_arguments_fit_would_refuse_fails_before_any_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, metric: str
) -> None:
    """A typo in the last objective's args is found before the first run, not hours later when that run starts."""
    launched: list[object] = []
    monkeypatch.setattr(bench_module, "launch_fit", lambda *a, **k: launched.append(a) or 0)
    objectives = ["ce", {"name": "core", "args": ["--objective.etaa=0.1"]}]
    spec = spec_of(tmp_path, metric=metric, objectives=objectives, base_args=["--data.val_fraction=0.2"])
    message = r"coretune fit would refuse the arguments of run tiny/core/frac1/seed0: .*'etaa' is not accepted\. Fix"
    with pytest.raises(BenchSpecError, match=message):
        run_sweep(spec)
    with pytest.raises(BenchSpecError, match=message):
        run_sweep(spec, dry_run=True)
    assert launched == [] and not spec.output.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--data.root=MISSING"], r"data root MISSING does not exist: pass an existing folder"),
        (["--data.dataset=cifar10", "--data.root=ROOT"], r"cifar10 data not found under ROOT: expected ROOT/cifar-10"),
        (["--data.root=ROOT", "--model.weights=ROOT/w.pth"], r"checkpoint ROOT/w\.pth does not exist: check the path"),
        (["--data.root=ROOT", "--model.weights=ROOT"], r"checkpoint ROOT is a directory: pass the checkpoint file"),
    ],
)
def test_a_missing_data_folder_or_checkpoint_fails_before_any_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], message: str
) -> None:
    """No image or checkpoint is read up front, but a path that does not exist (a typo, data not unpacked on this
    machine) stops the sweep at once instead of failing every run in turn."""
    launched: list[object] = []
    monkeypatch.setattr(bench_module, "launch_fit", lambda *a, **k: launched.append(a) or 0)
    root = str(data_root(tmp_path))
    spec = spec_of(tmp_path, objectives=["ce"], datasets={"d": [a.replace("ROOT", root) for a in args]})
    pattern = r"coretune fit would refuse the arguments of run d/ce/frac1/seed0: " + message.replace("ROOT", root)
    with pytest.raises(BenchSpecError, match=pattern):
        run_sweep(spec, dry_run=True)
    assert launched == [] and not spec.output.exists()
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"not read up front")
    spec = spec_of(tmp_path, objectives=["ce"], datasets={"d": [f"--data.root={root}", f"--model.weights={weights}"]})
    assert run_sweep(spec, dry_run=True).skipped == []


def test_final_val_top1_is_the_last_validated_epoch(tmp_path: Path) -> None:
    (tmp_path / "metrics.csv").write_text("epoch,val/top1\n0,0.7\n1,0.9\n2,0.8\n3,\n")
    assert final_val_top1(tmp_path / "metrics.csv") == 0.8  # final (not best) validated epoch
    (tmp_path / "metrics.csv").write_text("epoch,val/top1\n0,\n")
    with pytest.raises(ValueError, match="has no val/top1: validation never ran"):
        final_val_top1(tmp_path / "metrics.csv")


def _fake_fits(monkeypatch: pytest.MonkeyPatch, outcome: dict[int, int]) -> list[int]:
    """Replace the fit subprocess: seed ``s`` exits with ``outcome.get(s, 0)``, writing results.json on 0; a negative
    outcome ``-N`` delivers signal N to this process (as Ctrl+C or a SIGTERM would) and exits ``128 + N``."""
    launched: list[int] = []

    def launch(args: list[str], run_dir: Path, env: object = None, stop: object = None) -> int:
        seed = int(next(a for a in args if a.startswith("--seed=")).split("=")[1])
        launched.append(seed)
        code = outcome.get(seed, 0)
        if code < 0:
            os.kill(os.getpid(), -code)
            time.sleep(0.5)  # the fit finishes its batch and saves last.ckpt
            return 128 - code
        if code == 0:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            (Path(run_dir) / "results.json").write_text(json.dumps({"test": {"top1": 0.5}}))
        return code

    monkeypatch.setattr("coretune.bench.launch_fit", launch)
    return launched


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_stops_the_sweep_and_reports_resumable_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], signum: int
) -> None:
    config = tmp_path / "bench.yaml"
    datasets = {"d": [f"--data.root={data_root(tmp_path)}"]}
    entries = {"output": str(tmp_path / "out"), "datasets": datasets, "objectives": ["ce"], "seeds": [0, 1, 2, 3]}
    config.write_text(yaml.safe_dump(entries))
    launched = _fake_fits(monkeypatch, {1: -signum})
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stop:
        main(["bench", str(config)])
    assert stop.value.code == 128 + signum  # the shell convention, as `coretune fit`
    assert launched == [0, 1]  # no run starts after the signal
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
    out, err = capsys.readouterr()
    assert "seed1 interrupted" in out and "failed" not in out
    name = signal.Signals(signum).name
    assert re.search(rf"stopped by {name}: 1 run\(s\) finished, 1 interrupted .*, 2 not started", err)
    assert "Re-run the same command to resume" in err

    launched = _fake_fits(monkeypatch, {})
    main(["bench", str(config)])  # the re-run skips seed 0 and runs the rest
    assert launched == [1, 2, 3]


def test_an_interrupted_fit_is_reported_as_resumable_not_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = spec_of(tmp_path, objectives=["ce"], seeds=[0, 1, 2])
    _fake_fits(monkeypatch, {0: 130, 1: 1})  # seed 0 killed on its own (kill -INT <fit pid>), seed 1 crashed
    report = run_sweep(spec)
    assert [r.seed for r in report.interrupted] == [0] and [r.seed for r in report.failed] == [1]
    assert [r.seed for r in report.finished] == [2] and report.signum is None and report.not_started == []
    config = tmp_path / "bench.yaml"
    datasets = {"d": [f"--data.root={data_root(tmp_path)}"]}
    config.write_text(yaml.safe_dump({"output": str(tmp_path / "out2"), "datasets": datasets, "objectives": ["ce"]}))
    _fake_fits(monkeypatch, {0: 130})
    with pytest.raises(SystemExit, match=r"of 1 runs, 1 were interrupted \(resumable\); re-run the same command"):
        main(["bench", str(config)])


def _stand_in_fit(signum: int) -> str:
    """A stand-in ``coretune fit``: it sends ``signum`` to its parent only (``kill <bench pid>``), ignores signals
    itself, and once its stop file appears "saves" and exits ``128 +`` the signal the file names."""
    return (
        "import os, signal, sys, time; from pathlib import Path; "
        "[signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)]; "
        f"os.kill(os.getppid(), {int(signum)}); stop = Path(os.environ['CORETUNE_STOP_FILE']); "
        "deadline = time.monotonic() + 60\n"
        "while not stop.exists() and time.monotonic() < deadline: time.sleep(0.05)\n"
        "name = stop.read_text().strip() if stop.exists() else 'never asked'; print('saved, stopped by', name); "
        "sys.exit(128 + signal.Signals[name] if stop.exists() else 1)"
    )


def test_launch_fit_asks_an_interrupted_fit_to_save_instead_of_killing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ctrl+C (here: SIGINT to this process only) while launch_fit waits, without a sweep's handlers (the Python API):
    # the fit is asked through its stop file to save, and is awaited; subprocess.run would SIGKILL it 0.25 s later.
    monkeypatch.setattr("coretune.bench.fit_command", lambda args, run_dir: [sys.executable, "-c", _stand_in_fit(2)])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "stop_request").write_text("SIGTERM\n")  # an earlier sweep's request is not this one's
    # Python's own Ctrl+C handler: a shell starts background jobs (`make test &`, nohup) with SIGINT ignored
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            launch_fit([], tmp_path / "run")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert "saved, stopped by SIGINT" in (tmp_path / "run" / "log.txt").read_text()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["kill-int", "sigterm"])
def test_a_signal_to_the_sweep_alone_reaches_the_running_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], signum: int
) -> None:
    # `kill <bench pid>` or a container's SIGTERM to its main process: the fit gets no signal of its own, the sweep
    # passes it on, so the fit stops within a moment instead of running to its end.
    spec = spec_of(tmp_path, objectives=["ce"], seeds=[0, 1, 2])
    script = _stand_in_fit(signum)
    monkeypatch.setattr("coretune.bench.fit_command", lambda args, run_dir: [sys.executable, "-c", script])
    start = time.monotonic()
    report = run_sweep(spec)
    assert time.monotonic() - start < 30
    assert report.signum == signum and [r.seed for r in report.interrupted] == [0]
    assert [r.seed for r in report.not_started] == [1, 2] and report.failed == []
    name = signal.Signals(signum).name
    assert f"saved, stopped by {name}" in (report.interrupted[0].run_dir / "log.txt").read_text()
    assert f"{name}: no further run starts" in capsys.readouterr().out


def test_sigterm_to_a_real_bench_process_alone_stops_its_real_fit_resumably(image_tree: Path, tmp_path: Path) -> None:
    # The real thing: `coretune bench` in its own process, a real `coretune fit` that would train for 1,000 epochs,
    # and SIGTERM to the bench's pid only (as a container or `kill` sends it): the fit gets no signal of its own.
    config = tmp_path / "bench.yaml"
    run_dir = tmp_path / "out" / "tiny" / "ce" / "frac1" / "seed0"
    entries = {
        "output": str(tmp_path / "out"),
        "base_args": [*TINY_FIT, "--trainer.max_epochs=1000", "--trainer.enable_progress_bar=false"],
        "datasets": {"tiny": [f"--data.root={image_tree}"]},
        "objectives": ["ce"],
    }
    config.write_text(yaml.safe_dump(entries))
    cmd = [sys.executable, "-m", "coretune.cli", "bench", str(config)]
    bench = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.csv").is_file() and time.monotonic() < deadline:  # the fit is training
            time.sleep(0.2)
        os.kill(bench.pid, signal.SIGTERM)
        _, err = bench.communicate(timeout=120)
    finally:  # whatever happened, leave no fit training for 1,000 epochs
        with contextlib.suppress(ProcessLookupError):
            os.killpg(bench.pid, signal.SIGKILL)
    assert bench.returncode == 128 + signal.SIGTERM, err
    assert "sweep stopped by SIGTERM: 0 run(s) finished, 1 interrupted with a resumable checkpoint" in err
    assert "coretune fit: stopped by SIGTERM" in (run_dir / "log.txt").read_text()
    assert (run_dir / "checkpoints" / "last.ckpt").is_file() and not is_finished(run_dir)  # no test results


def test_aggregation_is_mean_and_sample_std(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, seeds=[0, 1, 2], datasets={"a": [], "b": []})
    values = {
        ("ce", "a", 1.0): [0.80, 0.82, 0.87],
        ("core", "a", 1.0): [0.90, 0.91, 0.95],
        ("ce", "b", 1.0): [0.50, 0.60, None],  # one seed unfinished
        ("core", "b", 1.0): [0.70, None, None],
    }
    fabricate(spec, values)
    markdown, paths = write_summary(spec)
    assert {p.name for p in paths} == {"runs.csv", "summary.csv", "summary.md", "bars.png"}
    # Δ = 92 − 83; s_p² = (2·13 + 2·7) / 4; paired 10, 9, 8 → t = 9 / (1 / √3); cell b pairs seed 0 only
    assert "| a | core | +9.00 | 6.32 | yes | +10.00 / +9.00 / +8.00 | 15.6 (0.0041) |" in markdown
    assert "| b | core | +15.00 | – | n/a | +20.00 | – |" in markdown
    summary = {r["objective"]: r for r in csv.DictReader((spec.output / "summary.csv").open())}
    for (objective, dataset, _), seeds in values.items():
        done = 100 * np.array([v for v in seeds if v is not None])
        row = summary[objective]
        assert float(row[f"{dataset} mean (%)"]) == pytest.approx(done.mean(), abs=1e-4)
        assert int(row[f"{dataset} n"]) == len(done)
        if len(done) > 1:
            assert float(row[f"{dataset} std (%)"]) == pytest.approx(done.std(ddof=1), abs=1e-4)
        else:
            assert row[f"{dataset} std (%)"] == ""
    # Table 1 layout: methods × data sets + the average of the cell means; best mean in bold
    assert "| Method | a | b | Avg. |" in markdown
    assert "| ce | 83.00 ± 3.61 (n=3) | 55.00 ± 7.07 (n=2) | 69.00 |" in markdown
    assert "| core | **92.00 ± 2.65 (n=3)** | **70.00 (n=1)** | 81.00 |" in markdown
    # core − ce on a: Δ = 9, s_p = sqrt((2·13 + 2·7)/4) = sqrt(10), 2 s_p = 6.32 → beyond 2σ; b has n = 1
    assert "| a | core | +9.00 | 6.32 | yes |" in markdown
    assert "| b | core | +15.00 | – | n/a |" in markdown
    runs = list(csv.DictReader((spec.output / "runs.csv").open()))
    assert [r["status"] for r in runs if r["dataset"] == "b" and r["objective"] == "core"] == ["finished"] + [
        "missing"
    ] * 2


def test_curves_are_the_per_epoch_mean_and_std_over_finished_seeds(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, seeds=[0, 1, 2], label_fractions=[0.1, 1.0])
    rng = np.random.default_rng(0)
    curves: dict[tuple[str, float, int], list[float | None]] = {}  # per run: val/top1 per epoch (None: not validated)
    for run in spec.runs():
        curve = [float(v) for v in rng.uniform(0.3, 0.9, size=4)]
        if run.seed == 2:
            curve[1] = None  # this seed validated every other epoch only
        curves[(run.objective, run.label_fraction, run.seed)] = curve
        run.run_dir.mkdir(parents=True)
        rows = "".join(f"{e},{'' if v is None else v}\n" for e, v in enumerate(curve))
        (run.run_dir / "metrics.csv").write_text("epoch,val/top1\n" + rows)
        if (run.objective, run.label_fraction, run.seed) != ("core", 0.1, 1):  # one unfinished run: left out
            # no validation split (seed 1: a record from before results.json said so)
            on_test = {"validated_on_test_images": True} if run.seed != 1 else {}
            (run.run_dir / "results.json").write_text(json.dumps({"test": {"top1": 0.5}, **on_test}))
    _, paths = write_summary(spec)
    assert (spec.output / "curves.png") in paths and (spec.output / "curves.csv") in paths
    width, height = Image.open(spec.output / "curves.png").size
    assert height > 0.75 * width  # two columns (10%, 100%), two rows of panels: the curves, then the paired Δ
    got = list(csv.DictReader((spec.output / "curves.csv").open()))
    expected = []  # reference: loop over cells and epochs, statistics of the finished seeds that validated
    for objective in ("ce", "core"):
        for fraction in (0.1, 1.0):
            for epoch in range(4):
                seeds = [s for s in (0, 1, 2) if (objective, fraction, s) != ("core", 0.1, 1)]
                values = [100 * v for s in seeds if (v := curves[(objective, fraction, s)][epoch]) is not None]
                deltas = []  # paired with the baseline (ce) on the seeds both finished and validated this epoch
                for s in seeds if objective != "ce" else ():
                    v, b = curves[(objective, fraction, s)][epoch], curves[("ce", fraction, s)][epoch]
                    if v is not None and b is not None:
                        deltas.append(100 * v - 100 * b)
                expected.append((objective, fraction, epoch + 1, len(values), statistics.mean(values), values, deltas))
    assert len(got) == len(expected)
    for row, (objective, fraction, epoch, n, mean, values, deltas) in zip(got, expected, strict=True):
        assert row["baseline"] == "ce"
        if deltas:
            assert int(row["delta_n"]) == len(deltas)
            assert float(row["delta_mean_pp"]) == pytest.approx(statistics.mean(deltas), abs=1e-3)
            if len(deltas) > 1:
                assert float(row["delta_std_pp"]) == pytest.approx(statistics.stdev(deltas), abs=1e-3)
            else:
                assert row["delta_std_pp"] == ""
        else:
            assert row["delta_n"] == row["delta_mean_pp"] == row["delta_std_pp"] == ""
        assert (row["objective"], float(row["label_fraction"]), int(row["epoch"]), int(row["n"])) == (
            objective,
            fraction,
            epoch,
            n,
        )
        assert row["validated_on"] == "test"
        assert float(row["val_top1_mean_pct"]) == pytest.approx(mean, abs=1e-3)
        if n > 1:
            assert float(row["val_top1_std_pct"]) == pytest.approx(statistics.stdev(values), abs=1e-3)
        else:
            assert row["val_top1_std_pct"] == ""
    assert curves_metric(got) == "test top-1 (no validation split)"
    # no row to pair with the baseline (a spec of one objective): no Δ columns filled, one row of panels
    solo = spec_of(tmp_path / "solo", objectives=["ce"], label_fractions=[0.1, 1.0], seeds=[0, 1])
    for run in solo.runs():  # 10%: a validation split; 100%: seed 0 on a split, seed 1 on the test images
        on_test = run.label_fraction == 1.0 and run.seed == 1
        run.run_dir.mkdir(parents=True)
        (run.run_dir / "metrics.csv").write_text("epoch,val/top1\n0,0.5\n1,0.6\n")
        results = {"test": {"top1": 0.6}, "validated_on_test_images": on_test}
        (run.run_dir / "results.json").write_text(json.dumps(results))
    write_summary(solo)
    solo_curves = list(csv.DictReader((solo.output / "curves.csv").open()))
    assert {r["delta_n"] for r in solo_curves} == {""}
    assert {(r["label_fraction"], r["validated_on"]) for r in solo_curves} == {("0.1", "val"), ("1.0", "mixed")}
    assert curves_metric(solo_curves) == "validated top-1 (validation split or test images)"
    assert curves_metric([r for r in solo_curves if r["label_fraction"] == "0.1"]) == "validation top-1"
    assert curves_metric([{**r, "validated_on": ""} for r in solo_curves]).startswith("validated top-1")
    width, height = Image.open(solo.output / "curves.png").size
    assert height < 0.6 * width


def test_compare_pooled_std_reference() -> None:
    a = Cell("x", "d", 1.0, (1.0, 2.0, 3.0, 4.0))  # s² = 5/3
    b = Cell("y", "d", 1.0, (10.0, 12.0))  # s² = 2
    c = compare(b, a)
    assert c.diff == pytest.approx(11 - 2.5)
    assert c.pooled_std == pytest.approx(math.sqrt((3 * 5 / 3 + 1 * 2) / 4))
    assert c.beyond_two_std is True
    assert compare(a, a).beyond_two_std is False
    assert compare(Cell("z", "d", 1.0, (5.0,)), a).beyond_two_std is None


def test_compare_pairs_the_seeds_both_cells_finished() -> None:
    from scipy.stats import ttest_rel

    a = Cell("x", "d", 1.0, (1.0, 2.0, 3.0, 4.0), (0, 1, 2, 3))
    b = Cell("y", "d", 1.0, (0.5, 1.0, 2.9), (0, 1, 3))  # seed 2 unfinished: not paired
    c = compare(a, b)
    assert c.paired == pytest.approx((0.5, 1.0, 1.1))
    diffs = [0.5, 1.0, 1.1]
    mean = sum(diffs) / 3
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2)
    assert c.paired_t == pytest.approx(mean / (sd / math.sqrt(3)))
    reference = ttest_rel([1.0, 2.0, 4.0], [0.5, 1.0, 2.9])
    assert (c.paired_t, c.paired_p) == pytest.approx((reference.statistic, reference.pvalue))
    same_gap = compare(Cell("x", "d", 1.0, (2.0, 3.0), (0, 1)), Cell("y", "d", 1.0, (1.0, 2.0), (0, 1)))
    assert same_gap.paired == (1.0, 1.0) and math.isnan(same_gap.paired_t)  # no spread: no t
    assert compare(Cell("z", "d", 1.0, (5.0,)), a).paired == ()  # seeds unknown
    with pytest.raises(ValueError, match="2 values but 1 seeds"):
        Cell("x", "d", 1.0, (1.0, 2.0), (0,))


def test_table2_and_table4_layouts(tmp_path: Path) -> None:
    table2 = spec_of(tmp_path, table="table2", objectives=["core", "ce_mix", "ce", "ce_con_mixh", "ce_con"])
    assert table_layout(table2).rows == [
        ("ce", "CE"),
        ("ce_con", "CE + L_con"),
        ("ce_mix", "CE + mix"),
        ("ce_con_mixh", "CE + L_con + mix-H"),
        ("core", "CE + L^f_con + mix-H (Core-tuning)"),
    ]
    assert table2.baseline == "ce" and table_layout(table2).columns == [(("tiny", 1.0), "tiny")]
    plotted = [bench_module._plot_label(label) for _, label in table_layout(table2).rows]
    assert plotted[1] == r"CE + $\mathcal{L}_{con}$" and plotted[4].startswith(r"CE + $\mathcal{L}^f_{con}$ + mix-H")
    tuned = spec_of(tmp_path, table="table2", objectives=["ce", {"name": "core", "args": ["--objective.alpha=10"]}])
    assert tuned.runs()[1].args[-3:] == ("--objective.alpha=10", "--data.label_fraction=1.0", "--seed=0")
    with pytest.raises(BenchSpecError, match="table2 takes the Table 2 rows only"):
        spec_of(tmp_path, table="table2", objectives=[{"name": "core", "objective": "ce"}])

    table4 = spec_of(tmp_path, table="table4", label_fractions=[0.1, 0.25, 1.0], seeds=[0, 1])
    assert [label for _, label in table_layout(table4).columns] == ["10%", "25%", "100%"]
    fabricate(table4, {(o, "tiny", f): [0.5 + f / 4, 0.5 + f / 2] for o in ("ce", "core") for f in (0.1, 0.25, 1.0)})
    markdown, paths = write_summary(table4)
    assert "| Method | 10% | 25% | 100% | Avg. |" in markdown
    assert (table4.output / "label_fraction.png") in paths
    # a second data set joins the columns of Table 1 with several label fractions
    both = spec_of(tmp_path, datasets={"a": [], "b": []}, label_fractions=[0.1, 1.0])
    assert [label for _, label in table_layout(both).columns] == ["a 10%", "a 100%", "b 10%", "b 100%"]


def test_cli_dry_run_and_aggregate_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "bench.yaml"
    datasets = {"d": [f"--data.root={data_root(tmp_path)}"]}
    config.write_text(yaml.safe_dump({"output": str(tmp_path / "out"), "datasets": datasets, "objectives": ["ce"]}))
    main(["bench", str(config), "--dry_run"])
    out = capsys.readouterr().out
    assert "1 runs, 0 finished (skipped), 1 to run" in out
    assert re.search(r"coretune\.cli fit --trainer\.enable_progress_bar=false --data\.root=\S+ --objective ce", out)
    assert not (tmp_path / "out").exists()
    main(["bench", str(config), "--dry_run", "--only_objectives=[ce]", "--only_seeds=[0]"])
    assert "1 runs, 0 finished (skipped), 1 to run" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="core, 7 not in the spec"):
        main(["bench", str(config), "--dry_run", "--only_objectives=[core]", "--only_seeds=[7]"])
    main(["bench", str(config), "--aggregate_only"])
    assert "| ce | – |" in (tmp_path / "out" / "summary.md").read_text()
    with pytest.raises(SystemExit, match=r"^coretune bench: error: bench spec .*missing\.yaml does not exist$"):
        main(["bench", str(tmp_path / "missing.yaml")])


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
    statuses = [r["status"] for r in collect_cells(spec)[1]]
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


@pytest.mark.parametrize("running", [False, True])
@settings(max_examples=40, deadline=None)
@given(
    times=st.lists(st.floats(0.5, 5000), min_size=1, max_size=8),
    extra=st.integers(0, 30),
    since_last=st.floats(0, 20000),
)
def test_training_time_left_is_the_epochs_to_go_at_the_recent_pace(
    tmp_path_factory: pytest.TempPathFactory, running: bool, times: list[float], extra: int, since_last: float
) -> None:
    """Reference: the median of the last three epoch wall times per epoch to go; a running run's current epoch
    has already run for the time since metrics.csv was written, but the epochs after it still take their time."""
    run_dir = tmp_path_factory.mktemp("run")
    total = len(times) + extra
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"trainer": {"max_epochs": total}}))
    rows = "".join(f"{e},{t!r}\n" for e, t in enumerate(times))
    (run_dir / "metrics.csv").write_text("epoch,epoch_time_s\n" + rows)
    now = (run_dir / "metrics.csv").stat().st_mtime + since_last
    left = training_time_left(run_dir, running=running, now=now)
    if extra == 0:
        assert left is None  # the training is over (the test evaluation may still run)
        return
    recent = sorted(times[-3:])
    pace = recent[len(recent) // 2] if len(recent) % 2 else (recent[0] + recent[1]) / 2
    expected = extra * pace
    if running:
        current = max(pace - since_last, 0.0)  # what is left of the epoch in progress
        expected = current + (extra - 1) * pace
    assert left == pytest.approx(expected, rel=1e-9, abs=1e-6)


def test_training_time_left_needs_a_timed_epoch_and_a_length(tmp_path: Path) -> None:
    assert training_time_left(tmp_path, running=False) is None  # nothing written yet
    (tmp_path / "metrics.csv").write_text("epoch,val/top1\n0,0.5\n")  # written before epoch times were logged
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"trainer": {"max_epochs": 4}}))
    assert training_time_left(tmp_path, running=True) is None
    (tmp_path / "metrics.csv").write_text("epoch,val/top1,epoch_time_s\n0,0.5,90\n")
    assert training_time_left(tmp_path, running=False) == 270
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"trainer": {}}))
    assert training_time_left(tmp_path, running=False) is None


def test_sweep_time_left_times_each_run_by_its_pace_or_its_cells_finished_seeds(tmp_path: Path) -> None:
    def row(name: str, status: str, cell: str = "a", wall: float | str = "", done: int = 0) -> dict[str, object]:
        run_dir = tmp_path / name
        if status != "missing":
            run_dir.mkdir()
            (run_dir / "config.yaml").write_text(yaml.safe_dump({"trainer": {"max_epochs": 4}}))
            (run_dir / "metrics.csv").write_text("epoch,epoch_time_s\n" + "".join(f"{e},50\n" for e in range(done)))
        return {"dataset": "d", "objective": cell, "label_fraction": 1.0, "status": status, "wall_time_s": wall,
                "run_dir": str(run_dir)}  # fmt: skip

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


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "<1 min"), (29, "<1 min"), (31, "1 min"), (38 * 60, "38 min"), (3569, "59 min"), (3571, "1 h 00 min"),
     (2 * 3600 + 5 * 60, "2 h 05 min"), (30 * 3600, "30 h 00 min")],
)  # fmt: skip
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_export_keeps_the_records_of_finished_runs_which_count_when_copied_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "bench.yaml"
    datasets = {"d": [f"--data.root={data_root(tmp_path)}"]}
    entries = {"output": str(tmp_path / "out"), "datasets": datasets, "objectives": ["ce"], "seeds": [0, 1, 2]}
    config.write_text(yaml.safe_dump(entries))
    spec = BenchSpec.from_yaml(config)
    fabricate(spec, {("ce", "d", 1.0): [0.70, 0.72, None]})
    for run in spec.runs()[:2]:
        (run.run_dir / "checkpoints").mkdir()
        (run.run_dir / "checkpoints" / "last.ckpt").write_bytes(b"weights")
        (run.run_dir / "metrics.csv").write_text("epoch,val/top1\n0,0.5\n1,0.7\n")
        (run.run_dir / "log.txt").write_text("log\n")
    unfinished = spec.runs()[2].run_dir
    unfinished.mkdir(parents=True)
    (unfinished / "metrics.csv").write_text("epoch,val/top1\n0,\n")
    records = tmp_path / "records"
    main(["bench", str(config), "--export", str(records)])
    assert "copied the records of 2 finished run(s)" in capsys.readouterr().out
    kept = sorted(str(p.relative_to(records)) for p in records.rglob("*") if p.is_file())
    assert kept == [f"d/ce/frac1/seed{s}/{f}" for s in (0, 1) for f in ("metrics.csv", "results.json")]
    main(["bench", str(config), "--export", str(records), "--only_seeds=[1]"])
    assert "copied the records of 1 finished run(s)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="is the spec's output folder"):
        export_records(spec, spec.output)
    shutil.rmtree(spec.output)  # the machine (and its runs/) is gone; the records are back
    shutil.copytree(records, spec.output)
    main(["bench", str(config), "--aggregate_only"])
    assert "| ce | **71.00 ± 1.41 (n=2)** |" in (spec.output / "summary.md").read_text()
    assert [r["status"] for r in collect_cells(spec)[1]] == ["finished", "finished", "missing"]


def test_worker_envs_split_cpu_threads_and_deal_out_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert worker_envs(1, ["0", "1"]) == [None]  # one fit: every GPU and thread, DDP if its arguments ask
    assert [e["OMP_NUM_THREADS"] for e in worker_envs(4)] == ["2"] * 4
    assert all("CUDA_VISIBLE_DEVICES" not in e for e in worker_envs(4))

    def gpus(workers: int, visible: list[str]) -> list[str]:
        return [e["CUDA_VISIBLE_DEVICES"] for e in worker_envs(workers, visible)]

    assert gpus(2, ["0", "1", "2", "3"]) == ["0,1", "2,3"]
    assert gpus(3, ["0", "1", "2", "3"]) == ["0", "1", "2"]  # an equal share each; GPU 3 idles
    assert gpus(4, ["4", "6"]) == ["4", "6", "4", "6"]  # fewer GPUs than workers: shared in turn
    assert gpus(2, ["GPU-a1", "GPU-b2"]) == ["GPU-a1", "GPU-b2"]  # UUIDs pass through
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert [e["OMP_NUM_THREADS"] for e in worker_envs(2)] == ["3", "3"]  # the user's choice stands


@pytest.mark.parametrize(("listed", "expected"), [("2,5", ["2", "5"]), ("", []), ("-1", []), (None, [])])
def test_visible_gpus_follow_cuda_visible_devices(
    monkeypatch: pytest.MonkeyPatch, listed: str | None, expected: list[str]
) -> None:
    if listed is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        monkeypatch.setattr("torch.cuda.device_count", lambda: 0)  # this CPU machine
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", listed)
    assert visible_gpus() == expected


def test_concurrent_fits_of_a_sweep_never_share_a_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = spec_of(tmp_path, seeds=[0, 1, 2])  # 6 runs on 2 workers
    monkeypatch.setattr("coretune.bench.visible_gpus", lambda: ["0", "1", "2", "3"])
    lock, busy, used = threading.Lock(), set(), []

    def launch(args: list[str], run_dir: Path, env: dict[str, str] | None = None, stop: object = None) -> int:
        assert env is not None
        with lock:
            group = env["CUDA_VISIBLE_DEVICES"]
            assert group not in busy  # no other running fit has these GPUs
            busy.add(group)
            used.append(group)
        time.sleep(0.1)
        (Path(run_dir) / "results.json").parent.mkdir(parents=True, exist_ok=True)
        (Path(run_dir) / "results.json").write_text(json.dumps({"test": {"top1": 0.5}}))
        with lock:
            busy.remove(group)
        return 0

    monkeypatch.setattr("coretune.bench.launch_fit", launch)
    report = run_sweep(spec, workers=2, console=Console(file=io.StringIO()))
    assert len(report.finished) == 6 and sorted(set(used)) == ["0,1", "2,3"]


def test_epoch_bars_follow_the_running_fits(tmp_path: Path) -> None:
    from rich.progress import Progress

    spec = spec_of(tmp_path, seeds=[0])
    ce, core = spec.runs()
    out = io.StringIO()
    progress = Progress(console=Console(file=out, width=300))
    bars = EpochBars(progress, every=0.0)

    def shown() -> dict[str, tuple[float, float | None]]:
        return {t.description.strip(): (t.completed, t.total) for t in progress.tasks}

    bars.started(ce)
    bars.refresh()  # launched: no files yet
    assert shown() == {"tiny/ce/frac1/seed0 (epochs)": (0, None)}
    ce.run_dir.mkdir(parents=True)
    (ce.run_dir / "config.yaml").write_text(yaml.safe_dump({"trainer": {"max_epochs": 20}}))
    (ce.run_dir / "metrics.csv").write_text("epoch,val/top1\n0,0.5\n1,\n2,\n")
    core.run_dir.mkdir(parents=True)
    (core.run_dir / "metrics.csv").write_text("epoch,val/top1\n0,0.5\n")  # an interrupted run, resumed
    bars.started(core)
    bars.refresh()
    assert shown() == {"tiny/ce/frac1/seed0 (epochs)": (3, 20), "tiny/core/frac1/seed0 (epochs)": (1, None)}
    # One line per launch, for output that is not a terminal (no bars there): the run and its per-epoch log.
    assert out.getvalue().splitlines() == [
        f"▶ tiny/ce/frac1/seed0 started (log: {ce.run_dir / 'log.txt'})",
        f"▶ tiny/core/frac1/seed0 resumes after epoch 1 (log: {core.run_dir / 'log.txt'})",
    ]
    bars.ended(ce)
    bars.refresh()
    assert shown() == {"tiny/core/frac1/seed0 (epochs)": (1, None)}
    slow = EpochBars(progress, every=3600.0)
    slow.refresh()
    slow.started(ce)  # a new fit shows at once, throttled or not
    slow.refresh()
    assert "tiny/ce/frac1/seed0 (epochs)" in shown()
    assert out.getvalue().splitlines()[-1] == (  # its length known from config.yaml
        f"▶ tiny/ce/frac1/seed0 resumes after epoch 3 of 20 (log: {ce.run_dir / 'log.txt'})"
    )


def test_launch_fit_claims_the_run_for_its_fit_until_it_exits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # --status tells a running fit from an interrupted one, and a second sweep skips it, by RUN/fit.pid: the fit's
    # claim while it runs, gone after.
    script = (
        "import json, os, sys, time; from pathlib import Path; claim = Path(sys.argv[1]) / 'fit.pid'\n"
        "deadline = time.monotonic() + 30\n"
        "while json.loads(claim.read_text())['pid'] != os.getpid() and time.monotonic() < deadline: time.sleep(0.02)\n"
        "print('claimed', json.loads(claim.read_text())['pid'] == os.getpid())"
    )
    command = [sys.executable, "-c", script]
    monkeypatch.setattr("coretune.bench.fit_command", lambda args, run_dir: [*command, str(run_dir)])
    assert launch_fit([], tmp_path / "run") == 0
    assert "claimed True" in (tmp_path / "run" / "log.txt").read_text()
    assert not (tmp_path / "run" / "fit.pid").exists()


def _finishing_fit(monkeypatch: pytest.MonkeyPatch, launches: Path, seconds: float = 0.0) -> None:
    """Stand in for the fit subprocess: it sleeps ``seconds``, appends its run directory to ``launches`` and writes
    finished results."""
    script = (
        "import json, sys, time; from pathlib import Path; run = Path(sys.argv[1]); time.sleep(float(sys.argv[2]))\n"
        "with open(sys.argv[3], 'a') as f: f.write(f'{run}\\n')\n"
        "(run / 'results.json').write_text(json.dumps({'test': {'top1': 0.5}}))"
    )
    monkeypatch.setattr(
        "coretune.bench.fit_command",
        lambda args, run_dir: [sys.executable, "-c", script, str(run_dir), str(seconds), str(launches)],
    )


def test_a_sweep_skips_the_runs_another_process_is_running(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    other_process: subprocess.Popen,
) -> None:
    # A second `coretune bench` of the same spec (another terminal, another machine) must not train a run twice.
    monkeypatch.setenv("COLUMNS", "200")
    config = tmp_path / "bench.yaml"
    datasets = {"d": [f"--data.root={data_root(tmp_path)}"]}
    config.write_text(
        yaml.safe_dump(
            {"output": str(tmp_path / "out"), "datasets": datasets, "objectives": ["ce"], "seeds": [0, 1, 2]}
        )
    )
    spec = BenchSpec.from_yaml(config)
    _finishing_fit(monkeypatch, tmp_path / "launches.txt")
    busy = spec.runs()[1].run_dir
    busy.mkdir(parents=True)
    claim_run(busy)
    bench_module.point_claim(busy, other_process.pid)
    main(["bench", str(config)])
    out = capsys.readouterr().out
    assert re.search(
        rf"↷ d/ce/frac1/seed1 skipped: .*seed1 is being run by another process \(pid {other_process.pid}\)", out
    )
    assert "1 run(s) skipped: another process is running them" in out
    assert sorted(os.listdir(busy)) == ["fit.pid"]  # nothing of the other process's run touched
    assert (tmp_path / "launches.txt").read_text().split() == [str(r.run_dir) for r in spec.subset(seeds=[0, 2]).runs()]
    main(["bench", str(config), "--status"])
    assert re.search(r"│ 1 +│ +│ running, 0 epochs done", capsys.readouterr().out)
    other_process.kill()  # the other process is gone: its claim is stale
    other_process.wait()
    main(["bench", str(config)])  # the other process is gone (killed: its claim is stale): this sweep runs seed 1
    assert (tmp_path / "launches.txt").read_text().split()[2:] == [str(busy)]
    assert is_finished(busy) and not (busy / "fit.pid").exists()


def test_two_sweeps_of_one_spec_share_its_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each run is trained once, by whichever sweep claims it first; the other skips it.
    spec = spec_of(tmp_path, objectives=["ce", "core"], seeds=[0, 1])
    _finishing_fit(monkeypatch, tmp_path / "launches.txt", seconds=0.3)
    with ThreadPoolExecutor(2) as pool:
        reports = list(pool.map(lambda _: run_sweep(spec, workers=2, console=Console(file=io.StringIO())), range(2)))
    launched = (tmp_path / "launches.txt").read_text().split()
    assert sorted(launched) == sorted(str(r.run_dir) for r in spec.runs())  # each run once
    assert all(not (r.failed or r.interrupted or r.not_started) for r in reports)
    assert all(is_finished(r.run_dir) and not (r.run_dir / "fit.pid").exists() for r in spec.runs())


@pytest.mark.parametrize("path", sorted(Path(__file__).parents[1].glob("configs/bench/*.yaml")), ids=lambda p: p.name)
def test_shipped_bench_specs_parse(path: Path) -> None:
    spec = BenchSpec.from_yaml(path)
    assert spec.runs() and all("--run_dir" not in " ".join(r.args) for r in spec.runs())
