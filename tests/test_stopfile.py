"""The stop file through which a sweep passes a signal on to its fits."""

from __future__ import annotations

import signal
from pathlib import Path

from coretune.runs.stopfile import request_stop, requested_signal


def test_a_stop_request_names_its_signal(tmp_path: Path) -> None:
    path = tmp_path / "stop_request"
    assert requested_signal(path) is None  # no file: no request
    request_stop(path, signal.SIGINT)
    assert requested_signal(path) == signal.SIGINT
    request_stop(path, signal.SIGTERM)  # replaced atomically, no temporary file left
    assert requested_signal(path) == signal.SIGTERM and [p.name for p in tmp_path.iterdir()] == ["stop_request"]
    path.write_text("")  # touched by hand: stop as on SIGTERM
    assert requested_signal(path) == signal.SIGTERM
