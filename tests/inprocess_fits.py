"""Sweeps whose fits run inside the test's process: for the tests of what a sweep does with its runs (tables,
configurations, loggers, selection), not of the ``coretune fit`` process itself (tests/sweeps/test_sweeps_launch.py
and test_sweeps_signals.py keep real subprocesses). A fit subprocess spends ~7 s of CPU importing torch and
Lightning before a tiny fit's ~1 s; in process, the test's imports serve every fit.

:func:`fits_in_process` replaces only the ``subprocess.Popen`` that :func:`coretune.sweeps.launch.launch_fit` starts
(its claim, ``fit_args.json``, ``log.txt`` and stop file stay the real ones): the command's ``coretune fit`` runs
through :func:`coretune.cli.main` with the command's environment, its output appended to the run's log.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import traceback
from types import SimpleNamespace
from typing import Any

import pytest

import coretune.sweeps.launch as launch_module
from coretune.cli import main

_ONE_AT_A_TIME = threading.Lock()


class InProcessFit:
    """A finished "process": the fit ran to its end in ``__init__`` (``returncode`` as ``coretune fit``'s exit)."""

    def __init__(self, cmd: list[str], *, stdout: Any, env: dict[str, str], **_: Any) -> None:
        assert cmd[1:4] == ["-m", "coretune.cli", "fit"], cmd
        if not _ONE_AT_A_TIME.acquire(blocking=False):  # one interpreter: no concurrent fits (workers: 1)
            raise AssertionError("fits_in_process runs one fit at a time: give the spec workers: 1")
        saved = dict(os.environ)
        try:
            os.environ.clear()
            os.environ.update(env)
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stdout):
                try:
                    main(cmd[3:])
                    self.returncode = 0
                except SystemExit as done:
                    self.returncode = done.code if isinstance(done.code, int) else 0 if done.code is None else 1
                    if not isinstance(done.code, int) and done.code is not None:
                        print(done.code, file=sys.stderr)
                except Exception:
                    traceback.print_exc()
                    self.returncode = 1
        finally:
            os.environ.clear()
            os.environ.update(saved)
            stdout.flush()
            _ONE_AT_A_TIME.release()
        self.pid = os.getpid()  # the claim points at this live process while the sweep records the run

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode

    def poll(self) -> int:
        return self.returncode

    def __enter__(self) -> InProcessFit:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def fits_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the fits that sweeps (``bench``, ``tune``) launch from here on inside this process."""
    fake = SimpleNamespace(**{name: getattr(subprocess, name) for name in dir(subprocess) if not name.startswith("_")})
    fake.Popen = InProcessFit
    monkeypatch.setattr(launch_module, "subprocess", fake)
