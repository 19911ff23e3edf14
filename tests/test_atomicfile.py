"""``atomic_write``: whole files, with the mode a plain ``open`` would give them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from coretune.runs.atomic import atomic_write


def test_a_new_file_gets_the_umask_mode_and_an_existing_one_keeps_its_own(tmp_path: Path) -> None:
    """mkstemp's temporary file is owner-only (0o600): every checkpoint, results.json and config.yaml was unreadable
    by the group sharing a run folder on a cluster."""
    previous = os.umask(0o027)
    try:
        with atomic_write(tmp_path / "results.json") as f:
            f.write("{}")
        assert (tmp_path / "results.json").stat().st_mode & 0o777 == 0o640
        (tmp_path / "results.json").chmod(0o664)
        with atomic_write(tmp_path / "results.json") as f:
            f.write("{}\n")
        assert (tmp_path / "results.json").stat().st_mode & 0o777 == 0o664
        (tmp_path / "results.json").chmod(0o444)  # read-only: the new content is written before its mode is set
        with atomic_write(tmp_path / "results.json") as f:
            f.write("{}\n\n")
        assert (tmp_path / "results.json").stat().st_mode & 0o777 == 0o444
        assert (tmp_path / "results.json").read_text() == "{}\n\n"
    finally:
        os.umask(previous)


def test_an_error_leaves_the_old_content_and_no_temporary_file(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("old")
    with pytest.raises(RuntimeError), atomic_write(tmp_path / "a.txt") as f:
        f.write("new, half")
        raise RuntimeError("disk full")
    assert (tmp_path / "a.txt").read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["a.txt"]
