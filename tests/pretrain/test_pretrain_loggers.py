"""``coretune pretrain --trainer.logger NAME`` (also ``trainer: {logger: NAME}`` in a ``--config`` file): Lightning
loggers beside the pre-training run's own files, its checkpoints where they were, a re-run resuming."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from coretune.cli import main
from coretune.engine import read_metrics
from coretune.pretrain import PRETRAINED_FILENAME
from fit_flags import pretrain_args
from image_trees import make_image_folder

LOGGED = "--trainer.log_every_n_steps=1"
"""Lightning warns about a logging interval longer than the epoch (3 steps)."""


@pytest.fixture
def images(tmp_path: Path) -> Path:
    return make_image_folder(tmp_path / "images")


def _checkpoints(run: Path) -> list[str]:
    """Every checkpoint file under the run directory, relative to it."""
    return sorted(p.relative_to(run).as_posix() for p in run.rglob("*.ckpt"))


def _losses(run: Path) -> list[float]:
    return [float(r["train/loss"]) for r in read_metrics(run / "metrics.csv")]


def test_mlflow_records_the_pretraining_and_a_rerun_resumes_in_its_run(
    images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's opt-in to the file store, for the client below
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")  # exported by an earlier in-process logger, it would win
    run = tmp_path / "run"
    args = pretrain_args(images, run, "--trainer.logger", "mlflow", LOGGED, "--seed", "2")
    main(args)
    assert _checkpoints(run) == ["checkpoints/last.ckpt"] and (run / PRETRAINED_FILENAME).is_file()
    client = MlflowClient(f"file:{run / 'mlruns'}")
    experiment = client.get_experiment_by_name("coretune")
    (logged,) = client.search_runs([experiment.experiment_id])
    params = logged.data.params
    assert (params["method"], params["seed"], params["model.backbone"], params["model.temperature"]) == (
        "simclr",
        "2",
        "small_cnn",
        "0.2",
    )
    assert params["data.image_size"] == "16" and "data.num_workers" not in params  # it may change on a resume
    assert logged.info.run_name == "run" and logged.data.tags["coretune.run_dir"] == str(run.resolve())

    main([*args, "--trainer.max_epochs=2"])  # the same command, extended: resumes from checkpoints/last.ckpt
    (resumed,) = client.search_runs([experiment.experiment_id])
    assert resumed.info.run_id == logged.info.run_id and resumed.info.status == "FINISHED"
    history = sorted(client.get_metric_history(logged.info.run_id, "train/loss"), key=lambda m: m.step)
    assert [m.value for m in history] == pytest.approx(_losses(run)) and len(history) == 2
    assert _checkpoints(run) == ["checkpoints/last.ckpt"]
    assert torch.load(run / PRETRAINED_FILENAME, weights_only=True)["epoch"] == 2


def test_a_config_files_loggers_write_beside_the_run_and_its_config_yaml_resumes(images: Path, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, config = tmp_path / "run", tmp_path / "pretrain.yaml"
    # two loggers: a short name, and one with a setting of its own (which wins over the short name's)
    loggers = ["csv", {"class_path": "tensorboard", "init_args": {"name": "tb"}}]
    config.write_text(yaml.safe_dump({"trainer": {"logger": loggers}}))
    main(pretrain_args(images, run, f"--config={config}", LOGGED))
    assert _checkpoints(run) == ["checkpoints/last.ckpt"]
    hparams = yaml.safe_load((run / "csv" / "version_0" / "hparams.yaml").read_text())
    assert (hparams["method"], hparams["model.backbone"], hparams["seed"]) == ("simclr", "small_cnn", 0)
    assert [p.name for p in (run / "tb").iterdir()] == ["version_0"]

    main(["pretrain", f"--config={run / 'config.yaml'}", "--trainer.max_epochs=2"])  # the run's own config: resumes
    assert _checkpoints(run) == ["checkpoints/last.ckpt"] and len(_losses(run)) == 2
    assert torch.load(run / PRETRAINED_FILENAME, weights_only=True)["epoch"] == 2
    resumed = read_metrics(run / "csv" / "version_1" / "metrics.csv")  # Lightning's CSV logger would empty version_0
    assert [r["epoch"] for r in resumed if r["train/loss"]] == ["1"]
    events = EventAccumulator(str(run / "tb" / "version_0"))  # TensorBoard appends to its folder
    events.Reload()
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(_losses(run))


@pytest.mark.parametrize("in_config", [False, True], ids=["option", "config"])
def test_an_unknown_logger_is_one_line(images: Path, tmp_path: Path, in_config: bool) -> None:
    run, config = tmp_path / "run", tmp_path / "pretrain.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"logger": "tensorbord"}}))
    extra = [f"--config={config}"] if in_config else ["--trainer.logger", "tensorbord"]
    with pytest.raises(SystemExit) as exit_:
        main(pretrain_args(images, run, *extra))
    where = f"trainer.logger in {config}" if in_config else "--trainer.logger"
    settings = "init_args" if in_config else "--trainer.logger.<name>"
    assert exit_.value.code == (
        f"coretune pretrain: error: unknown logger 'tensorbord' ({where}): choose one of csv, mlflow, tensorboard, "
        f"wandb, a Logger class path (e.g. lightning.pytorch.loggers.MLFlowLogger, its settings as {settings}), "
        "or false"
    )
    assert not run.exists()
