"""``coretune bench --logger`` and ``coretune tune --logger``: a sweep's fits log into one place, one MLflow
experiment for the whole sweep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

import coretune.sweeps.tune as tune_module
from coretune.cli import main
from coretune.engine import read_metrics
from coretune.runs.layout import RunDir
from fit_flags import TINY_FIT
from inprocess_fits import fits_in_process


def test_two_runs_of_a_bench_spec_land_in_one_mlflow_experiment(
    image_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    fits_in_process(monkeypatch)  # what the fits log, not their processes (each would import MLflow again)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's opt-in to the file store, for the client below
    # MLflow exports the tracking URI a logger used (an earlier test's) to the environment, where it would win
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")
    out = tmp_path / "out"
    config = tmp_path / "bench.yaml"
    spec = {
        "name": "tiny-sweep",
        "output": str(out),
        "base_args": [*TINY_FIT, "--trainer.log_every_n_steps=1"],
        "datasets": {"tiny": [f"--data.root={image_tree}"]},
        "objectives": ["ce", "ce_con"],  # a Table 2 preset: its own name is logged, not its class's (core)
    }
    config.write_text(yaml.safe_dump(spec))
    main(["bench", str(config), "--logger", "mlflow", "--dry_run"])
    assert f"--trainer.logger.save_dir={out / 'mlruns'} --trainer.logger.run_name=tiny/ce_con/frac1/seed0" in " ".join(
        capsys.readouterr().out.split()
    )

    main(["bench", str(config), "--logger", "mlflow"])
    client = MlflowClient(f"file:{out / 'mlruns'}")
    experiment = client.get_experiment_by_name("tiny-sweep")
    runs = {run.info.run_name: run for run in client.search_runs([experiment.experiment_id])}
    assert sorted(runs) == ["tiny/ce/frac1/seed0", "tiny/ce_con/frac1/seed0"]
    for name, logged in runs.items():
        run_dir = out / "tiny" / name.split("/")[1] / "frac1" / "seed0"
        assert logged.data.params["objective"] == name.split("/")[1] and logged.data.params["seed"] == "0"
        assert logged.data.tags["coretune.run_dir"] == str(run_dir.resolve())
        (loss,) = client.get_metric_history(logged.info.run_id, "train/loss")
        assert loss.value == pytest.approx(float(read_metrics(RunDir(run_dir).metrics)[0]["train/loss"]))
        assert RunDir(run_dir).last_checkpoint.is_file() and not (run_dir / "mlruns").exists()
        ckpt = torch.load(RunDir(run_dir).last_checkpoint, weights_only=True)
        assert ckpt["coretune"]["objective"] == name.split("/")[1]
        assert json.loads(RunDir(run_dir).fit_args.read_text()) == [*spec["base_args"], *spec["datasets"]["tiny"],
            "--objective", name.split("/")[1], "--data.label_fraction=1.0", "--seed=0"]  # fmt: skip


def test_tune_passes_its_logger_to_every_trial(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("optuna")
    data = tmp_path / "data"
    (data / "train").mkdir(parents=True)
    out = tmp_path / "tune"
    launched: dict[str, list[str]] = {}

    def fake_fit(args: list[str], run_dir: Path, stop: object = None, log_args: object = ()) -> int:
        launched[run_dir.name] = list(log_args)
        run_dir.mkdir(parents=True)
        (run_dir / "metrics.csv").write_text("epoch,val/top1\n0,0.5\n")
        (run_dir / "results.json").write_text(json.dumps({"test": {"top1": 0.5}}))
        return 0

    monkeypatch.setattr(tune_module, "launch_fit", fake_fit)
    main(["tune", f"--output={out}", "--eta", "0.1", "1", "--alpha", "1", "--study_name=study", "--logger=mlflow",
          "--", f"--data.root={data}"])  # fmt: skip
    assert launched == {
        name: [
            "--trainer.logger=lightning.pytorch.loggers.mlflow.MLFlowLogger",
            "--trainer.logger.experiment_name=study",
            f"--trainer.logger.save_dir={out / 'mlruns'}",
            f"--trainer.logger.run_name={name}",
        ]
        for name in ("eta0.1_alpha1", "eta1_alpha1")
    }
    with pytest.raises(SystemExit) as exit_:
        main(["tune", f"--output={out}", "--logger=tensorbord", "--", f"--data.root={data}"])
    assert exit_.value.code == (
        "coretune tune: error: unknown logger 'tensorbord' (--logger): choose one of csv, mlflow, tensorboard, wandb"
    )
