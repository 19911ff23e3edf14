"""The command line's friendly aliases: registry names for --objective, --seed."""

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
