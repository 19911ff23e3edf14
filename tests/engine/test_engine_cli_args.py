"""The command line's friendly aliases: registry names for --objective (also in YAML configs), --seed."""

from pathlib import Path

import yaml

from coretune.cli import translate_args


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
