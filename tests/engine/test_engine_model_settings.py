"""The FineTuner's grouped settings (issue 61): ``--model.optim.<x>`` (:class:`OptimSettings`) and
``--model.weights_options.<x>`` (:class:`WeightsOptions`); the flat spellings of older versions (flags, ``--config``
files, checkpoints' hyper-parameters, a run's ``config.yaml``) still work for one release, with a deprecation line."""

from __future__ import annotations

import inspect
import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from coretune import objectives
from coretune.cli import main
from coretune.engine import FineTuner, OptimSettings, read_metrics, resolved_fit_config, translate_args
from coretune.engine.modelsettings import MOVED_SETTINGS, grouped_model_settings
from coretune.models import WeightsOptions
from coretune.sweeps.job import current_spelling
from fit_flags import QUIET, error

NEW_FLAGS = ("--model.optim.lr=0.02", "--model.optim.schedule=constant")
"""The run's optimiser settings, in the current spelling (a constant lr: metrics.csv shows it)."""


def fit_args(root: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "fit", f"--data.root={root}", "--data.image_size=32", "--data.batch_size=8", "--model.backbone=small_cnn",
        f"--run_dir={run_dir}", "--trainer.max_epochs=1", "--trainer.limit_train_batches=2",
        "--trainer.limit_val_batches=1", *QUIET, *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from image_trees import make_image_tree

    return make_image_tree(tmp_path_factory.mktemp("model_settings") / "data")


@pytest.fixture(scope="module")
def run(tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 1-epoch run trained with the current spelling (copy it before changing it)."""
    run = tmp_path_factory.mktemp("grouped") / "run"
    main(fit_args(tree, run, *NEW_FLAGS))
    return run


def flat(model: dict[str, Any]) -> dict[str, Any]:
    """A FineTuner's settings as older versions recorded them: the groups' settings among the model's own (those
    added to the groups since, LP-FT's, FTP's …, did not exist then: left out)."""
    old = {where: name for name, where in MOVED_SETTINGS.items()}  # (optim, lr) → lr
    out: dict[str, Any] = {}
    for key, value in model.items():
        if key in ("optim", "weights_options"):
            out |= {old[(key, k)]: v for k, v in value.items() if (key, k) in old}  # layer_decay, lora …: none then
        else:
            out[key] = value
    return out


def as_older_version(run: Path, tmp_path: Path) -> Path:
    """A copy of ``run`` as an older version would have left it: flat settings in config.yaml and in every
    checkpoint's hyper-parameters."""
    old = Path(shutil.copytree(run, tmp_path / "old"))
    config = yaml.safe_load((old / "config.yaml").read_text())
    config["model"] = flat(config["model"])
    (old / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    for path in (old / "checkpoints").glob("*.ckpt"):
        ckpt = torch.load(path, weights_only=True)
        ckpt["hyper_parameters"] = flat(ckpt["hyper_parameters"])
        torch.save(ckpt, path)
    return old


# -- the constructor ----------------------------------------------------------------------------------------
def test_the_fine_tuner_takes_at_most_12_settings() -> None:
    """Issue 61: the training loop's constructor stays small (12 at most: the 12th is issue 62's compile)."""
    assert len(inspect.signature(FineTuner).parameters) <= 12


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        ({"lr": 0.0}, "lr must be > 0 (got 0.0)"),
        ({"backbone_lr": -0.1}, "backbone_lr must be >= 0 (got -0.1)"),
        ({"momentum": 1.0}, "momentum must lie in [0, 1) (got 1.0)"),
        ({"weight_decay": -1e-4}, "weight_decay must be >= 0 (got -0.0001)"),
        ({"warmup_epochs": -1.0}, "warmup_epochs must be >= 0 (got -1.0)"),
        ({"optimizer": "rmsprop"}, "optimizer must be one of sgd, adam, adamw (got 'rmsprop')"),
        ({"schedule": "step"}, "schedule must be one of cosine, linear, poly, constant, exponential (got 'step')"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else "",
)
def test_optim_settings_name_each_bad_value(settings: dict[str, Any], problem: str) -> None:
    assert OptimSettings(**settings).problems() == [problem]
    with pytest.raises(ValueError) as info:
        FineTuner(backbone="small_cnn", optim=OptimSettings(**settings))
    assert str(info.value) == f"invalid model settings: optim.{problem}"


def test_valid_optim_settings_have_no_problem() -> None:
    assert OptimSettings().problems() == []
    assert OptimSettings(optimizer="adam", lr=5e-5, backbone_lr=0.0, momentum=0.0, schedule="poly").problems() == []


@pytest.mark.parametrize(
    ("flag", "problem"),
    [("--model.optim.backbone_lr=-1", "backbone_lr must be >= 0 (got -1.0)"),
     ("--model.optim.momentum=1", "momentum must lie in [0, 1) (got 1.0)")],
)  # fmt: skip
def test_bad_optim_settings_are_one_line_from_the_cli(flag: str, problem: str, tree: Path, tmp_path: Path) -> None:
    assert error(fit_args(tree, tmp_path / "run", flag)) == f"invalid model settings: optim.{problem}"
    assert not (tmp_path / "run").exists()


# -- the current spelling -----------------------------------------------------------------------------------
def test_the_grouped_settings_train_and_are_recorded_as_plain_values(run: Path) -> None:
    assert [float(r["lr"]) for r in read_metrics(run / "metrics.csv")] == [0.02]  # the constant schedule's lr
    config = yaml.safe_load((run / "config.yaml").read_text())["model"]
    assert config["optim"] == {**asdict(OptimSettings()), "lr": 0.02, "schedule": "constant"}
    assert config["weights_options"] == asdict(WeightsOptions())
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)  # no dataclass to unpickle
    assert ckpt["hyper_parameters"]["optim"] == config["optim"]
    model = FineTuner.from_checkpoint(run / "checkpoints" / "last.ckpt")
    assert model.optim == OptimSettings(lr=0.02, schedule="constant") and model.weights_options == WeightsOptions()


def test_the_new_flags_parse_into_their_groups(tree: Path) -> None:
    config = resolved_fit_config(
        [f"--data.root={tree}", "--model.optim.optimizer=adam", "--model.optim.weight_decay=5e-4",
         "--model.weights_options.allow_cast=true", "--model.weights=resnet18", "--model.backbone=resnet18",
         "--model.weights_options.download=true"]
    )["model"]  # fmt: skip
    optim = config["optim"]
    assert (optim["optimizer"], optim["weight_decay"], optim["lr"]) == ("adam", 5e-4, 0.01)
    assert config["weights_options"] == {"download": True, "format": "auto", "allow_cast": True}


# -- the deprecated spellings -------------------------------------------------------------------------------
OLD_FLAGS = {
    "lr": ("0.05", 0.05),
    "optimizer": ("adamw", "adamw"),
    "backbone_lr": ("0.001", 0.001),
    "momentum": ("0.8", 0.8),
    "nesterov": ("false", False),
    "weight_decay": ("0", 0.0),
    "schedule": ("linear", "linear"),
    "warmup_epochs": ("0.5", 0.5),
    "weights_download": ("true", True),
    "weights_format": ("moco", "moco"),
    "weights_allow_cast": ("true", True),
}


def test_every_moved_setting_has_a_deprecated_flag_test() -> None:
    assert sorted(OLD_FLAGS) == sorted(MOVED_SETTINGS)


@pytest.mark.parametrize("name", sorted(OLD_FLAGS))
def test_a_deprecated_flag_works_and_warns_once(name: str, tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    group, new = MOVED_SETTINGS[name]
    given, value = OLD_FLAGS[name]
    assert translate_args([f"--model.{name}", given]) == [f"--model.{group}.{new}={given}"]
    assert capsys.readouterr().err == (
        f"coretune fit: --model.{name} is deprecated and will be removed in the next release: use "
        f"--model.{group}.{new}\n"
    )
    weights = ["--model.backbone=resnet18", "--model.weights=resnet18"] if group == "weights_options" else []
    # the hub name is not in the cache: only a download lets resolved_fit_config pass it
    download = ["--model.weights_options.download=true"] if weights else []
    optimizer = ["--model.optim.optimizer=sgd"] if name in ("momentum", "nesterov") else []
    config = resolved_fit_config([f"--data.root={tree}", *weights, *download, *optimizer, f"--model.{name}={given}"])
    assert config["model"][group][new] == value
    assert capsys.readouterr().err.count("is deprecated") == 1


def test_a_config_file_of_an_older_version_works_with_one_line(
    tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump({"model": {"backbone": "small_cnn", "lr": 0.05, "schedule": "poly",
                                             "weights_format": "auto", "optim": {"momentum": 0.5}}}))  # fmt: skip
    config = resolved_fit_config([f"--config={old}", f"--data.root={tree}"])["model"]
    assert config["optim"] == {**asdict(OptimSettings()), "lr": 0.05, "schedule": "poly", "momentum": 0.5}
    assert config["weights_options"]["format"] == "auto"
    err = capsys.readouterr().err
    assert err == (
        f"coretune fit: --config {old} sets model.lr, model.schedule, model.weights_format, which are deprecated and "
        "will be removed in the next release: use model.optim.lr, model.optim.schedule, model.weights_options.format "
        "(model: {optim: {lr: …}}, model: {weights_options: {format: …}})\n"
    )


def test_grouped_model_settings_moves_flat_settings_and_lets_the_groups_win() -> None:
    assert grouped_model_settings({"backbone": "x", "lr": 0.1, "task": "t", "optim": {"lr": 0.2}}) == {
        "backbone": "x", "optim": {"lr": 0.2}, "task": "t",
    }  # fmt: skip
    assert grouped_model_settings({"weights_allow_cast": True, "channels_last": False}) == {
        "weights_options": {"allow_cast": True}, "channels_last": False,
    }  # fmt: skip
    current = {"backbone": "x", "optim": {"lr": 0.2}}
    assert grouped_model_settings(current) == current


def test_sweeps_compare_fit_arguments_in_the_current_spelling() -> None:
    assert current_spelling(["--model.lr=0.1", "--model.weights_format", "moco", "--data.root=x"]) == [
        "--model.optim.lr=0.1", "--model.weights_options.format", "moco", "--data.root=x",
    ]  # fmt: skip
    assert current_spelling(["--model.optim.lr=0.1"]) == ["--model.optim.lr=0.1"]


# -- records of an older version ----------------------------------------------------------------------------
def test_a_checkpoint_of_an_older_version_loads_tests_predicts_and_exports(
    run: Path, tree: Path, tmp_path: Path
) -> None:
    old = as_older_version(run, tmp_path)
    ckpt = old / "checkpoints" / "last.ckpt"
    assert "lr" in torch.load(ckpt, weights_only=True)["hyper_parameters"]  # flat, as older versions saved it
    model = FineTuner.from_checkpoint(ckpt)
    assert model.optim == OptimSettings(lr=0.02, schedule="constant")
    main(["test", f"--ckpt_path={ckpt}", f"--data.root={tree}", f"--output={tmp_path / 'test.json'}"])
    assert "top1" in json.loads((tmp_path / "test.json").read_text())["test"]
    main(["predict", f"--ckpt_path={ckpt}", f"--input={tree / 'val'}", f"--output={tmp_path / 'p.csv'}"])
    assert len((tmp_path / "p.csv").read_text().splitlines()) == 1 + 12
    main(["export", f"--ckpt_path={ckpt}", f"--output={tmp_path / 'export'}"])
    assert (tmp_path / "export").is_dir()


def test_a_run_of_an_older_version_resumes_with_its_config_and_refuses_another_lr(
    run: Path, tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = as_older_version(run, tmp_path)
    message = error(fit_args(tree, old, "--model.optim.lr=0.5", "--model.optim.schedule=constant",
                             "--trainer.max_epochs=2"))  # fmt: skip
    assert "was trained with other settings than these: model.optim.lr 0.02 → 0.5." in message, message
    # its own settings, flat (config.yaml names the original run_dir): resumes
    main(["fit", f"--config={old / 'config.yaml'}", f"--run_dir={old}", "--trainer.max_epochs=2"])
    assert [int(r["epoch"]) for r in read_metrics(old / "metrics.csv")] == [0, 1]
    assert [float(r["lr"]) for r in read_metrics(old / "metrics.csv")] == [0.02, 0.02]
    assert "model.optimizer, model.lr, model.backbone_lr" in capsys.readouterr().err  # the old config.yaml's line
    assert yaml.safe_load((old / "config.yaml").read_text())["model"]["optim"]["lr"] == 0.02  # now grouped


def test_a_fresh_checkpoint_with_flattened_settings_builds_the_same_model(tmp_path: Path) -> None:
    model = FineTuner(objectives.create("ce"), backbone="small_cnn", optim=OptimSettings(lr=0.3, nesterov=False))
    model.build(3, ["a", "b", "c"])
    checkpoint = {"state_dict": model.state_dict(), "hyper_parameters": flat(dict(model.hparams))}
    model.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, tmp_path / "old.ckpt")
    assert FineTuner.from_checkpoint(tmp_path / "old.ckpt").optim == OptimSettings(lr=0.3, nesterov=False)
