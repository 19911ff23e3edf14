"""Launching a sweep: resumable sweeps of real fit subprocesses, fit arguments checked before any run starts,
and the workers' CPU threads, GPUs and progress bars."""

from __future__ import annotations

import csv
import io
import json
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from rich.console import Console
from sweep_helpers import data_root, spec_of

from coretune.cli import main
from coretune.engine.fitcli import FitArgsError, resolved_fit_config
from coretune.sweeps import (
    BenchSpec,
    BenchSpecError,
    EpochBars,
    final_val_top1,
    launch_fit,
    run_sweep,
    visible_gpus,
    worker_envs,
    write_summary,
)
from fit_flags import TINY_FIT
from inprocess_fits import fits_in_process


def test_resuming_refuses_other_arguments(tmp_path: Path) -> None:
    spec = spec_of(tmp_path)
    run = spec.runs()[0]
    run.run_dir.mkdir(parents=True)
    (run.run_dir / "fit_args.json").write_text(json.dumps(["--trainer.max_epochs=9"]))
    with pytest.raises(ValueError, match="was started with other fit arguments"):
        run_sweep(spec, dry_run=True)
    with pytest.raises(ValueError, match="was started with other fit arguments"):
        launch_fit(run.args, run.run_dir)


def test_tables_and_exports_refuse_a_finished_run_of_other_arguments(tmp_path: Path) -> None:
    # the spec was edited (20 → 50 epochs) and only core was re-run (--only_objectives core): the table paired CE at
    # 20 epochs with Core-tuning at 50, and --export copied both, without a word
    from sweep_helpers import fabricate

    from coretune.sweeps import collect_cells, export_records

    spec = spec_of(tmp_path, seeds=[0])
    fabricate(spec, {("ce", "tiny", 1.0): [0.5], ("core", "tiny", 1.0): [0.6]})
    for run in spec.runs():
        args = ["--trainer.max_epochs=20"] if run.objective == "ce" else list(run.args)
        (run.run_dir / "fit_args.json").write_text(json.dumps(args))
    ce = spec.runs()[0].run_dir
    message = f"run directory {ce} was started with other fit arguments (recorded in {ce / 'fit_args.json'}): "
    with pytest.raises(ValueError) as info:
        collect_cells(spec)
    assert str(info.value).startswith(message)
    with pytest.raises(ValueError) as info:
        export_records(spec, tmp_path / "records")
    assert str(info.value).startswith(message) and not (tmp_path / "records").exists()
    config = tmp_path / "bench.yaml"
    config.write_text(yaml.safe_dump({"output": str(spec.output), "datasets": {"tiny": list(spec.datasets["tiny"])},
                                      "objectives": ["ce", "core"], "seeds": [0]}))  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", str(config), "--aggregate_only"])
    assert str(exit_info.value.code).startswith(f"coretune bench: error: {message}")


def test_status_lists_a_run_of_other_arguments_beside_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # one stale folder no longer hides the whole sweep's progress: --status shows it and what to do, and goes on
    from sweep_helpers import fabricate

    from coretune.runs.claim import claim_run
    from coretune.sweeps import collect_cells

    monkeypatch.setenv("COLUMNS", "200")
    spec = spec_of(tmp_path, seeds=[0])
    fabricate(spec, {("ce", "tiny", 1.0): [0.5], ("core", "tiny", 1.0): [0.6]})
    ce = spec.runs()[0].run_dir
    (ce / "fit_args.json").write_text(json.dumps(["--trainer.max_epochs=20"]))
    rows = collect_cells(spec, other_args="list")[1]
    states = [(r.objective, r.status, r.test_top1_pct) for r in rows]
    assert states == [("ce", "other_args", None), ("core", "finished", 60.0)]
    config = tmp_path / "bench.yaml"
    config.write_text(yaml.safe_dump({"output": str(spec.output), "datasets": {"tiny": list(spec.datasets["tiny"])},
                                      "objectives": ["ce", "core"], "seeds": [0]}))  # fmt: skip
    main(["bench", str(config), "--status"])
    out = " ".join(capsys.readouterr().out.split())
    assert "other fit arguments: delete the folder to redo it" in out and "60.00" in out
    assert "1 of 2 runs finished, 1 started with other fit arguments (refused by runs and tables until their" in out
    assert "fitting left" not in out and "time left unknown" not in out  # nothing a sweep would fit
    claim_run(ce)  # an older spec's sweep fits it right now: not a folder to delete
    assert collect_cells(spec, other_args="list")[1][0].progress == "other fit arguments, running now (another sweep's)"


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
                "seeds": [0],
                "workers": 2,
            }
        )
    )
    spec = BenchSpec.from_yaml(config)
    assert run_sweep(spec, dry_run=True).skipped == [] and not spec.output.exists()  # a dry run runs nothing

    first = run_sweep(spec)
    assert first.failed == [] and len(first.finished) == 2
    for run in spec.runs():
        results = json.loads((run.run_dir / "results.json").read_text())
        assert 0 <= results["test"]["top1"] <= 1
        assert yaml.safe_load((run.run_dir / "config.yaml").read_text())["seed_everything"] == run.seed
        assert "epoch 1 of 1 (step " in (run.run_dir / "log.txt").read_text()  # fits without a bar log each epoch
    mtimes = {run.run_dir: (run.run_dir / "results.json").stat().st_mtime_ns for run in spec.runs()}

    main(["bench", str(config)])  # re-run: everything is finished, nothing is launched
    second = run_sweep(spec)
    assert len(second.skipped) == 2 and second.finished == second.failed == []
    assert {d: (d / "results.json").stat().st_mtime_ns for d in mtimes} == mtimes
    assert all((d / "log.txt").read_text().count("\n# ") == 1 for d in mtimes)  # one launch per run
    rows = list(csv.DictReader((spec.output / "runs.csv").open()))
    assert [r["status"] for r in rows] == ["finished"] * 2
    assert (spec.output / "summary.md").is_file() and (spec.output / "bars.png").is_file()


def test_metric_val_tabulates_the_final_epoch_on_the_validation_split(
    image_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rich.console import Console

    fits_in_process(monkeypatch)  # the table of the fit's metrics, not its process

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


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--trainer.max_epochs=2"],
            r"run tiny/ce/frac1/seed0 validates on its test split .* add --data.val_fraction=0.2",
        ),
        (
            ["--data.val_fraction=0.5", "--trainer.max_epochs=3", "--trainer.check_val_every_n_epoch=2"],
            r"trains 3 epochs and validates every 2: make --trainer.max_epochs a multiple",
        ),
    ],
)
def test_metric_val_refuses_a_spec_before_any_run_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: list[str], message: str
) -> None:
    """The resolved fit configuration is checked up front: no hour-long run is wasted on an unusable spec."""
    from image_trees import make_image_tree

    image_tree = make_image_tree(tmp_path / "tree")  # train/ and val/: validation is the test split
    launched: list[object] = []
    monkeypatch.setattr("coretune.sweeps.launch.launch_fit", lambda *a, **k: launched.append(a) or 0)
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
    with pytest.raises(FitArgsError, match=r"^--trainer\.max_epochs: expected int or null, got many$"):
        resolved_fit_config(["--trainer.max_epochs=many"])
    with pytest.raises(FitArgsError, match=r"^unrecognized arguments: --trainer.max_epochz=3$"):
        resolved_fit_config(["--trainer.max_epochz=3"])
    with pytest.raises(FitArgsError, match=r"^--trainer\.strategy ddp_spawn starts its processes with multiprocessing"):
        resolved_fit_config([root, "--trainer.strategy=ddp_spawn", "--trainer.accelerator=cpu"])
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
    monkeypatch.setattr("coretune.sweeps.launch.launch_fit", lambda *a, **k: launched.append(a) or 0)
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
    monkeypatch.setattr("coretune.sweeps.launch.launch_fit", lambda *a, **k: launched.append(a) or 0)
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
    monkeypatch.setattr("coretune.sweeps.launch.visible_gpus", lambda: ["0", "1", "2", "3"])
    lock, busy, used = threading.Lock(), set(), []

    def launch(
        args: list[str], run_dir: Path, env: dict[str, str] | None = None, stop: object = None, log_args: object = ()
    ) -> int:
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

    monkeypatch.setattr("coretune.sweeps.launch.launch_fit", launch)
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


def test_a_spec_objective_other_than_its_base_configs_runs_with_its_own_defaults(
    image_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fits_in_process(monkeypatch)  # the configurations the fits record, not their processes
    # the base config is Core-tuning's (eta 0.3): BSS's run took that eta (jsonargparse keeps the init_args the
    # new class also accepts); the spec's own objective args still win
    core = tmp_path / "core.yaml"
    core.write_text(yaml.safe_dump({"objective": {"class_path": "CoreTuning", "init_args": {"eta": 0.3}}}))
    config = tmp_path / "bench.yaml"
    one_step = [*TINY_FIT, "--trainer.limit_train_batches=1", "--trainer.limit_val_batches=1"]
    config.write_text(
        yaml.safe_dump(
            {
                "output": str(tmp_path / "out"),
                "base_args": [f"--config={core}", *one_step],
                "datasets": {"tiny": [f"--data.root={image_tree}"]},
                "objectives": ["bss", {"name": "bss_k2", "objective": "bss", "args": ["--objective.k=2"]}, "core"],
            }
        )
    )
    spec = BenchSpec.from_yaml(config)
    assert [resolved_fit_config(run.args)["objective"]["init_args"]["eta"] for run in spec.runs()] == [
        0.001,
        0.001,
        0.3,
    ]
    main(["bench", str(config), "--only_objectives=[bss, bss_k2]"])
    recorded = [yaml.safe_load((run.run_dir / "config.yaml").read_text())["objective"] for run in spec.runs()[:2]]
    # label smoothing is shared by every objective (kept across a class switch: engine/fitargs.py), 0 here
    assert [r["init_args"].pop("label_smoothing", 0.0) for r in recorded] == [0.0, 0.0]
    assert [r["init_args"] for r in recorded] == [{"eta": 0.001, "k": 1}, {"eta": 0.001, "k": 2}]


def test_a_diverged_run_is_a_result_listed_under_the_tables_and_not_run_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # seed 1's fit diverges (coretune fit records `diverged` in results.json and exits 1): a seeded re-run would
    # diverge again, so bench used to train it again on every invocation
    message = "the training loss is nan at epoch 2, step 7 (batch 3; ce=nan). Check the images for NaN/Inf, …"
    launched: list[int] = []

    def launch(args: list[str], run_dir: Path, env: object = None, stop: object = None, log_args: object = ()) -> int:
        seed = int(next(a for a in args if a.startswith("--seed=")).split("=")[1])
        launched.append(seed)
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        outcome = {"diverged": message} if seed == 1 else {"test": {"top1": 0.5 + seed / 100}}
        (Path(run_dir) / "results.json").write_text(json.dumps(outcome))
        return 1 if seed == 1 else 0

    monkeypatch.setattr("coretune.sweeps.launch.launch_fit", launch)
    config = tmp_path / "bench.yaml"
    datasets = {"d": [f"--data.root={data_root(tmp_path)}"]}
    config.write_text(
        yaml.safe_dump(
            {"output": str(tmp_path / "out"), "datasets": datasets, "objectives": ["ce"], "seeds": [0, 1, 2]}
        )
    )
    with pytest.raises(SystemExit, match="1 diverged") as failed:
        main(["bench", str(config)])
    out = " ".join(capsys.readouterr().out.split())  # rich wraps to the terminal's width
    assert f"✗ d/ce/frac1/seed1 diverged after 0 s: {message}" in out and "did not finish" not in out
    assert str(failed.value.code).endswith(
        "of 3 runs, 1 diverged (listed under the tables; each message is in its results.json); for the diverged "
        "runs: the same settings diverge again, so add a spec entry under a new name with a lower learning rate or "
        "gradient clipping (--trainer.gradient_clip_val 1.0); after a code change, --retry_diverged runs them again "
        "from the start"
    )  # not a success: exit status 1
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| ce | **51.00 ± 1.41 (n=2)** |" in summary
    assert "✗ 1 run(s) diverged or collapsed and are not in the table" in summary
    assert f"- d/ce/frac1/seed1: {message}" in summary

    launched.clear()
    with pytest.raises(SystemExit, match="of 3 runs, 1 diverged"):
        main(["bench", str(config)])  # a result: not run again, and still not a success
    assert launched == []
    out = " ".join(capsys.readouterr().out.split())
    assert "3 runs, 2 finished (skipped), 1 diverged (not run again), 0 to run" in out
    assert f"✗ d/ce/frac1/seed1 diverged in an earlier sweep: {message} (not run again; --retry_diverged" in out

    records = tmp_path / "records"  # its record is kept with the finished ones: a new machine skips it too
    main(["bench", str(config), "--export", str(records)])
    seed1 = tmp_path / "out" / "d" / "ce" / "frac1" / "seed1"
    assert json.loads((records / seed1.relative_to(tmp_path / "out") / "results.json").read_text()) == {
        "diverged": message
    }
    shutil.rmtree(tmp_path / "out")  # a new machine: the records copied back, without logs or checkpoints
    shutil.copytree(records, tmp_path / "out")
    monkeypatch.setenv("COLUMNS", "300")  # the status table's cells unwrapped
    main(["bench", str(config), "--status"])
    out = " ".join(capsys.readouterr().out.split())
    assert "diverged (its message: results.json)" in out and "│ not started" not in out
    assert "2 of 3 runs finished, 1 diverged (not run again), 0 started" in out

    (seed1 / "checkpoints").mkdir()
    (seed1 / "checkpoints" / "last.ckpt").write_bytes(b"the weights of the epoch before it diverged")
    main(["bench", str(config), "--retry_diverged", "--dry_run"])  # says what the retry runs: from the start
    out = capsys.readouterr().out
    assert "# d/ce/frac1/seed1: the run that diverged is moved aside, then" in out and "--ckpt_path" not in out
    assert launched == [] and (seed1 / "checkpoints" / "last.ckpt").is_file()
    with pytest.raises(SystemExit, match="of 3 runs, 1 diverged"):
        main(["bench", str(config), "--retry_diverged"])  # diverges again (the stand-in always does)
    assert launched == [1]
    (aside,) = seed1.parent.glob("seed1.diverged-*")  # the run that diverged, kept; the retry starts over
    assert (aside / "checkpoints" / "last.ckpt").is_file() and not (seed1 / "checkpoints").exists()
    assert "↻ d/ce/frac1/seed1: starts over; the run that diverged is kept in" in " ".join(
        capsys.readouterr().out.split()
    )


def test_a_run_another_process_saw_diverge_is_not_run_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a second sweep of the spec (another terminal or machine) recorded seed 1's divergence after this one listed it
    spec = spec_of(tmp_path, objectives=["ce"], seeds=[0, 1])
    launched: list[Path] = []

    def launch(args: list[str], run_dir: Path, env: object = None, stop: object = None, log_args: object = ()) -> int:
        launched.append(Path(run_dir))
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        (Path(run_dir) / "results.json").write_text(json.dumps({"test": {"top1": 0.5}}))
        other = spec.runs()[1].run_dir
        other.mkdir(parents=True, exist_ok=True)
        (other / "results.json").write_text(json.dumps({"diverged": "the training loss is nan …"}))
        return 0

    monkeypatch.setattr("coretune.sweeps.launch.launch_fit", launch)
    console = Console(record=True, width=300)
    report = run_sweep(spec, console=console)
    assert launched == [spec.runs()[0].run_dir] and [r.seed for r in report.diverged] == [1]
    assert "✗ tiny/ce/frac1/seed1 diverged in another process: the training loss is nan …" in console.export_text()


def test_an_error_of_one_run_fails_it_and_the_sweep_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # seed 0's fit arguments were rewritten by another sweep, seed 1's score cannot be read; the runs after them
    # ran, and each failure has its line. Was: the sweep's error, once every queued fit had run with no progress
    spec = spec_of(tmp_path, objectives=["ce"], seeds=[0, 1, 2])
    launched: list[int] = []

    def launch(args: list[str], run_dir: Path, env: object = None, stop: object = None, log_args: object = ()) -> int:
        seed = spec.runs()[[r.run_dir for r in spec.runs()].index(Path(run_dir))].seed
        launched.append(seed)
        if seed == 0:
            raise ValueError(f"the run in {run_dir} was started with other fit arguments")
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        (Path(run_dir) / "results.json").write_text(json.dumps({"test": {"top1": 0.5 if seed == 2 else "n/a"}}))
        return 0

    monkeypatch.setattr("coretune.sweeps.launch.launch_fit", launch)
    console = Console(record=True, width=300)
    report = run_sweep(spec, console=console)
    assert launched == [0, 1, 2]
    assert [r.seed for r in report.failed] == [0, 1] and [r.seed for r in report.finished] == [2]
    text = console.export_text()
    assert f"✗ tiny/ce/frac1/seed0 failed: the run in {spec.runs()[0].run_dir} was started with other" in text
    assert "✗ tiny/ce/frac1/seed1 failed: could not convert string to float: 'n/a'" in text
    assert "✓ tiny/ce/frac1/seed2: test top-1 50.00%" in text


def test_an_error_of_the_sweep_starts_no_further_run_and_stops_the_running_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the sweep's own loop fails while seed 0 runs: seed 0 is asked to save a resumable checkpoint, the others never
    # start, and the error follows. Was: every queued fit ran, with no progress and no signal handling, first
    spec = spec_of(tmp_path, objectives=["ce"], seeds=[0, 1, 2])
    launched: list[Path] = []
    stops: list[int | None] = []

    def launch(args: list[str], run_dir: Path, env: object = None, stop: Any = None, log_args: object = ()) -> int:
        launched.append(Path(run_dir))
        while stop.signum is None:  # a fit that runs until it is asked to stop
            time.sleep(0.05)
        stops.append(stop.signum)
        return 143

    def refresh(bars: EpochBars) -> None:
        if launched:
            raise RuntimeError("the progress display broke")

    monkeypatch.setattr("coretune.sweeps.launch.launch_fit", launch)
    monkeypatch.setattr(EpochBars, "refresh", refresh)
    with pytest.raises(RuntimeError, match="the progress display broke"):
        run_sweep(spec, console=Console(file=io.StringIO()), workers=1)
    assert launched == [spec.runs()[0].run_dir] and stops == [signal.SIGTERM]
