"""Lightning loggers beside a run's own files: ``--trainer.logger mlflow|tensorboard|csv|wandb`` (also in a
``--config`` file) or a class path, in the run directory, the checkpoints where they were, a resume going on in the
same MLflow run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from coretune.cli import main
from coretune.engine import read_metrics
from coretune.runs.layout import RunDir
from fit_flags import QUIET, TINY_FIT

UNKNOWN_LOGGER = (
    "coretune fit: error: unknown logger 'mlfow' (--trainer.logger): choose one of csv, mlflow, tensorboard, wandb, a "
    "Logger class path (e.g. lightning.pytorch.loggers.MLFlowLogger, its settings as --trainer.logger.<name>), or false"
)


LOGGED = [*TINY_FIT, *QUIET, "--trainer.log_every_n_steps=1"]
"""A tiny fit's flags with a logger (Lightning warns about a logging interval longer than the epoch)."""


def _mlflow_client(store: Path) -> object:
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"file:{store}")


def _assert_run_files(run: Path) -> None:
    """The run directory's own files, where they always are, whatever the logger."""
    files = RunDir(run)
    assert files.last_checkpoint.is_file() and files.best_checkpoint.is_file()
    assert files.config.is_file() and files.metrics.is_file() and files.learning_curve.is_file()
    assert "test" in json.loads(files.results.read_text())
    assert sorted(p.name for p in run.rglob("*.ckpt")) == ["best.ckpt", "last.ckpt"]  # no checkpoint elsewhere


def test_mlflow_records_the_settings_and_every_epoch_and_a_resume_goes_on_in_its_run(
    image_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's opt-in to the file store, for the client below
    # MLflow exports the tracking URI a logger used (an earlier test's) to the environment, where it would win
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")
    run = tmp_path / "run"
    args = ["fit", *LOGGED, f"--data.root={image_tree}", f"--run_dir={run}", "--trainer.logger", "mlflow",
            "--objective", "core", "--objective.eta=0.5", "--objective.alpha=2", "--seed", "3",
            "--data.label_fraction=0.5"]  # fmt: skip
    main([*args, "--trainer.max_epochs=2"])
    _assert_run_files(run)
    client = _mlflow_client(run / "mlruns")
    experiment = client.get_experiment_by_name("coretune")
    (logged,) = client.search_runs([experiment.experiment_id])
    params = logged.data.params
    assert (params["objective"], params["objective.eta"], params["objective.alpha"]) == ("core", "0.5", "2.0")
    assert (params["seed"], params["data.label_fraction"], params["model.backbone"]) == ("3", "0.5", "small_cnn")
    assert "data.num_workers" not in params and "model._instantiator" not in params  # may change on resume; private
    assert logged.info.run_name == "run" and logged.data.tags["coretune.run_dir"] == str(run.resolve())
    rows = read_metrics(RunDir(run).metrics)

    def history(key: str) -> list[float]:
        return [m.value for m in sorted(client.get_metric_history(logged.info.run_id, key), key=lambda m: m.step)]

    assert history("train/loss") == pytest.approx([float(r["train/loss"]) for r in rows])  # one value per epoch
    assert history("val/top1") == pytest.approx([float(r["val/top1"]) for r in rows])
    assert len(rows) == 2 and history("test/top1") == [json.loads(RunDir(run).results.read_text())["test"]["top1"]]

    main([*args, "--trainer.max_epochs=3"])  # the same command, extended: resumes the run
    (resumed,) = client.search_runs([experiment.experiment_id])
    assert resumed.info.run_id == logged.info.run_id and resumed.info.status == "FINISHED"
    rows = read_metrics(RunDir(run).metrics)
    assert len(rows) == 3 and history("train/loss") == pytest.approx([float(r["train/loss"]) for r in rows])
    assert yaml.safe_load(RunDir(run).config.read_text())["trainer"]["logger"]["init_args"]["run_id"] == (
        logged.info.run_id
    )


def test_a_config_files_logger_short_name_is_expanded_and_the_runs_config_yaml_resumes(
    image_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")
    run, config = tmp_path / "run", tmp_path / "fit.yaml"
    # a logger's short name beside a registered objective's: both expanded as on the command line
    config.write_text(yaml.safe_dump({"objective": "core", "trainer": {"logger": "mlflow"}, "run_dir": str(run)}))
    main(["fit", f"--config={config}", *LOGGED, f"--data.root={image_tree}"])
    _assert_run_files(run)
    logger = yaml.safe_load(RunDir(run).config.read_text())["trainer"]["logger"]
    assert logger["class_path"].rpartition(".")[2] == "MLFlowLogger"
    assert (logger["init_args"]["experiment_name"], logger["init_args"]["save_dir"]) == ("coretune", f"{run}/mlruns")
    client = _mlflow_client(run / "mlruns")
    experiment = client.get_experiment_by_name("coretune")
    (logged,) = client.search_runs([experiment.experiment_id])
    assert logged.data.params["objective"] == "core" and logged.data.params["objective.eta"] == "0.1"

    main(["fit", f"--config={RunDir(run).config}", "--trainer.max_epochs=2"])  # the run's own config.yaml: resumes
    _assert_run_files(run)
    (resumed,) = client.search_runs([experiment.experiment_id])
    assert resumed.info.run_id == logged.info.run_id and resumed.info.status == "FINISHED"
    history = sorted(client.get_metric_history(logged.info.run_id, "train/loss"), key=lambda m: m.step)
    losses = [m.value for m in history]
    assert losses == pytest.approx([float(r["train/loss"]) for r in read_metrics(RunDir(run).metrics)])
    assert len(losses) == 2


def test_tensorboard_and_csv_write_beside_the_runs_files_and_a_resume_keeps_its_folders(
    image_tree: Path, tmp_path: Path
) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    args = ["fit", *LOGGED, f"--data.root={image_tree}", f"--run_dir={run}", "--trainer.logger=tensorboard"]
    main(args)
    main([*args, "--trainer.max_epochs=2"])  # resumed: TensorBoard appends to the same folder
    _assert_run_files(run)
    assert [p.name for p in (run / "tensorboard").iterdir()] == ["version_0"]
    events = EventAccumulator(str(run / "tensorboard" / "version_0"))
    events.Reload()
    losses = [float(r["train/loss"]) for r in read_metrics(RunDir(run).metrics)]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(losses)
    assert len(losses) == 2

    # a class path with a save_dir of its own, as LightningCLI takes it: the logger goes there, the checkpoints stay
    other, own = tmp_path / "other", tmp_path / "own-logs"
    main(["fit", *LOGGED, f"--data.root={image_tree}", f"--run_dir={other}",
          "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.save_dir={own}"])  # fmt: skip
    _assert_run_files(other)
    logged = read_metrics(own / "lightning_logs" / "version_0" / "metrics.csv")
    assert [float(r["train/loss"]) for r in logged if r["train/loss"]] == pytest.approx(
        [float(r["train/loss"]) for r in read_metrics(RunDir(other).metrics)]
    )
    assert not (other / "lightning_logs").exists()


def test_csv_shorthand_writes_into_the_run_directory_and_a_resume_into_a_new_version(
    image_tree: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    args = ["fit", *LOGGED, f"--data.root={image_tree}", f"--run_dir={run}", "--trainer.logger", "csv"]
    main(args)
    _assert_run_files(run)
    first = (run / "csv" / "version_0" / "metrics.csv").read_text()
    assert {"train/loss", "val/top1", "test/top1", "epoch", "step"} <= set(first.splitlines()[0].split(","))
    hparams = yaml.safe_load((run / "csv" / "version_0" / "hparams.yaml").read_text())
    assert hparams["objective"] == "ce" and hparams["seed"] == 0 and hparams["data.label_fraction"] == 1.0
    main([*args, "--trainer.max_epochs=2"])  # resumed: Lightning's CSV logger would empty version_0; it is kept
    assert (run / "csv" / "version_0" / "metrics.csv").read_text() == first
    assert [r["epoch"] for r in read_metrics(run / "csv" / "version_1" / "metrics.csv") if r["train/loss"]] == ["1"]


@pytest.mark.skipif(
    importlib.util.find_spec("wandb") is None, reason="wandb is not installed (pip install 'coretune[wandb]')"
)
def test_wandb_runs_offline_into_the_run_directory(
    image_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import wandb

    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    args = ["fit", *LOGGED, f"--data.root={image_tree}", f"--run_dir={run}", "--trainer.logger", "wandb"]
    main(args)
    _assert_run_files(run)
    (offline,) = (run / "wandb").glob("offline-run-*")  # offline: nothing was sent, the run waits for `wandb sync`
    assert list(offline.glob("*.wandb"))
    logger = yaml.safe_load(RunDir(run).config.read_text())["trainer"]["logger"]["init_args"]
    assert logger["offline"] is True and logger["project"] == "coretune" and logger["save_dir"] == str(run)
    run_id = RunDir(run).wandb_id.read_text().strip()
    assert logger["id"] == run_id and offline.name.endswith(f"-{run_id}")
    wandb.finish()  # as the end of the `coretune fit` process would
    main([*args, "--trainer.max_epochs=2"])  # resumed: the same W&B run id (it used to start another run)
    assert sorted(p.name.rsplit("-", 1)[1] for p in (run / "wandb").glob("offline-run-*")) == [run_id, run_id]
    wandb.finish()
    other = tmp_path / "other"  # another run gets another id
    main(["fit", *LOGGED, f"--data.root={image_tree}", f"--run_dir={other}", "--trainer.logger", "wandb"])
    assert RunDir(other).wandb_id.read_text().strip() != run_id


def test_an_unknown_or_missing_logger_is_one_line(
    image_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    base = ["fit", *LOGGED, f"--data.root={image_tree}", f"--run_dir={run}"]
    with pytest.raises(SystemExit) as exit_:
        main([*base, "--trainer.logger", "mlfow"])
    assert exit_.value.code == UNKNOWN_LOGGER and not run.exists()
    config = tmp_path / "fit.yaml"  # the same name in a --config file: that file is named
    config.write_text(yaml.safe_dump({"trainer": {"logger": {"class_path": "mlfow", "init_args": {"save_dir": "x"}}}}))
    with pytest.raises(SystemExit) as exit_:
        main([*base, f"--config={config}"])
    assert exit_.value.code == UNKNOWN_LOGGER.replace("(--trainer.logger)", f"(trainer.logger in {config})").replace(
        "--trainer.logger.<name>", "init_args"
    )
    assert not run.exists()

    spec = tmp_path / "bench.yaml"
    datasets = {"tiny": [f"--data.root={image_tree}"]}
    spec.write_text(yaml.safe_dump({"output": str(tmp_path / "out"), "datasets": datasets, "objectives": ["ce"]}))
    with pytest.raises(SystemExit) as exit_:
        main(["bench", str(spec), "--logger", "mlfow"])
    assert exit_.value.code == (
        "coretune bench: error: unknown logger 'mlfow' (--logger): choose one of csv, mlflow, tensorboard, wandb"
    )
    assert not (tmp_path / "out").exists()

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else find_spec(name, *a))
    with pytest.raises(SystemExit) as exit_:
        main([*base, "--trainer.logger", "mlflow"])
    assert exit_.value.code == (
        "coretune fit: error: --trainer.logger MLFlowLogger needs the mlflow package, which is not installed: "
        "pip install 'coretune[mlflow]'"
    )
    assert not (run / "config.yaml").exists() and not (run / "checkpoints").exists()
