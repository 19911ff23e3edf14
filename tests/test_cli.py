"""The ``coretune`` dispatcher imports each command's code only when that command runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from coretune.cli import main


def test_importing_the_cli_loads_no_command() -> None:
    code = "import sys, coretune.cli; print(sorted(m for m in sys.modules if m.startswith('coretune.')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for package in ("engine", "data", "sweeps", "pretrain", "tasks", "models"):
        assert f"'coretune.{package}" not in loaded, loaded


@pytest.mark.parametrize(
    "command",
    [
        ["fit"],
        ["test"],
        ["validate"],
        ["predict"],
        ["export"],
        ["objectives"],
        ["pretrain"],
        ["eval", "knn"],
        ["eval", "linear"],
        ["demo"],
        ["bench"],
        ["tune"],
        ["compare"],
    ],
)
def test_every_command_help_names_itself(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    usage = capsys.readouterr().out.split()
    assert usage[:2] == ["usage:", "coretune"] and usage[2] == command[0], usage[:4]


@pytest.mark.parametrize(
    ("command", "aliases"),
    [
        (
            "fit",
            [
                "--objective NAME ",
                "--model.drop_path R ",
                "--objective.help NAME ",
                "--seed N ",
                "--task NAME ",
                "--task.SETTING V ",
                "--trainer.logger NAME ",
            ],
        ),
        ("pretrain", ["--method NAME ", "--seed N ", "--trainer.logger NAME "]),
    ],
)
def test_help_lists_the_aliases(command: str, aliases: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    listed = capsys.readouterr().out.partition("\naliases (rewritten to the options above):\n")[2].splitlines()
    assert [line.split("  ")[1].strip() + " " for line in listed] == aliases  # one line each, with what it does
    assert all(len(line.split()) > 3 for line in listed), listed
