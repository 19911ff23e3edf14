"""The command line's friendly aliases: registry names for --objective (also in YAML configs), --seed."""

from pathlib import Path

import pytest
import yaml

from coretune.cli import main
from coretune.engine.fitcli import translate_args


def test_objective_names_become_class_paths_with_presets() -> None:
    assert translate_args(["--objective", "core"]) == ["--objective=coretune.objectives.core.CoreTuning"]
    assert translate_args(["--objective=ce"]) == ["--objective=coretune.objectives.ce.CETuning"]
    assert translate_args(["--objective", "ce_con", "--objective.eta", "1"]) == [
        "--objective=coretune.objectives.core.CoreTuning",
        "--objective.focal=false",
        "--objective.mixing=none",
        "--objective.eta",
        "1",
    ]
    # class paths and names jsonargparse resolves itself pass through unchanged
    assert translate_args(["--objective", "CoreTuning"]) == ["--objective=CoreTuning"]


def test_seed_alias() -> None:
    assert translate_args(["--seed", "3", "--data.root", "x"]) == ["--seed_everything=3", "--data.root", "x"]


def test_registry_names_work_inside_yaml_configs(tmp_path: Path) -> None:
    config = tmp_path / "x.yaml"
    config.write_text("objective:\n  class_path: ce_con\n  init_args:\n    eta: 1.0\ntrainer:\n  max_epochs: 3\n")
    (arg,) = translate_args(["--config", str(config)])
    rewritten = yaml.safe_load(arg.removeprefix("--config="))
    assert rewritten["objective"] == {
        "class_path": "coretune.objectives.core.CoreTuning",
        "init_args": {"focal": False, "mixing": "none", "eta": 1.0},  # the preset, then the file's own values
    }
    assert rewritten["trainer"] == {"max_epochs": 3}
    config.write_text("objective: core\n")
    (arg,) = translate_args([f"--config={config}"])
    assert yaml.safe_load(arg.removeprefix("--config="))["objective"]["class_path"].endswith("CoreTuning")
    plain = tmp_path / "plain.yaml"
    plain.write_text("objective:\n  class_path: coretune.objectives.CETuning\n")
    assert translate_args(["--config", str(plain)]) == [f"--config={plain}"]


CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize(
    "path",
    sorted([*CONFIGS.glob("*.yaml"), *CONFIGS.glob("cpu/*.yaml")]),
    ids=lambda p: str(p.relative_to(CONFIGS)),
)
def test_shipped_fit_configs_parse(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every shipped config is a valid `coretune fit --config` (class paths, option names and types)."""
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", str(path), "--print_config"])
    assert done.value.code in (None, 0)
    config = yaml.safe_load(capsys.readouterr().out)
    written = yaml.safe_load(path.read_text())
    assert config["objective"]["class_path"].startswith("coretune.objectives.")
    assert config["model"]["backbone"] == written["model"]["backbone"]
    assert config["trainer"]["max_epochs"] == written["trainer"]["max_epochs"]


@pytest.mark.parametrize(
    "args",
    [
        ["fit", "--trainer.max_epoch=1"],
        ["pretrain", "--trainer.max_epoch=1"],
        ["test", "--ckpt_pat=x.ckpt"],
        ["predict", "--ckpt_path=x.ckpt", "--input=x", "--outp=y.csv"],
        ["export", "--ckpt_path=x.ckpt", "--out=y"],
        ["eval", "knn", "--temp=0.1"],
        ["demo", "--seed=1"],
        ["bench", "spec.yaml", "--dry"],
        ["tune", "--out=x", "--", "--trainer.max_epochs=1"],
    ],
    ids=lambda a: a[0],
)
def test_no_command_takes_an_abbreviated_option(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """A prefix of an option (`--trainer.max_epoch` for `--trainer.max_epochs`) is an error, not silently the option."""
    with pytest.raises(SystemExit) as done:
        main(args)
    assert done.value.code not in (None, 0)
    assert "unrecognized arguments" in capsys.readouterr().err
