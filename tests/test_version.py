"""`coretune --version` / `-V`: the installed distribution's version."""

from __future__ import annotations

from importlib.metadata import version

import pytest

import coretune
from coretune.cli import main


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_flag_prints_the_distribution_version(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    main([flag])
    assert capsys.readouterr().out == f"coretune {version('coretune')}\n"
    assert coretune.__version__ == version("coretune")


def test_help_names_the_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--help"])
    assert "-V, --version  print coretune's version" in capsys.readouterr().out
