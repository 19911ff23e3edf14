"""The ``coretune`` dispatcher imports each command's code only when that command runs."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_cli_loads_no_command() -> None:
    code = "import sys, coretune.cli; print(sorted(m for m in sys.modules if m.startswith('coretune.')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for package in ("engine", "data", "sweeps", "pretrain", "tasks", "models"):
        assert f"'coretune.{package}" not in loaded, loaded
