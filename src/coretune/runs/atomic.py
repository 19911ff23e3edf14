"""Files written whole: a reader (another process, a sweep, a person) sees the old content or the new one, never
a part, even after a crash or a full disk; and the strict JSON text every JSON file of the project holds
(:func:`strict_json`)."""

from __future__ import annotations

import json
import math
import os
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_write", "finite_or_none", "new_file_mode", "strict_json"]


_UMASK_LOCK = threading.Lock()


@contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", **kwargs: Any) -> Iterator[IO[Any]]:
    """Open a temporary file beside ``path`` for writing (``mode`` ``"w"`` or ``"wb"``, ``kwargs`` as for
    ``open``); when the block ends without an error, ``fsync`` it and ``os.replace`` it onto ``path``, else remove it.
    ``path`` thus holds either its old content or the complete new one, never a part. The file gets the mode a
    plain ``open`` would give it (``0o666`` less the umask; an existing ``path``'s own mode), not ``mkstemp``'s
    owner-only ``0o600``, so that runs stay readable by the group that shares them (where the file system allows
    it: a failed ``chmod`` keeps ``0o600``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a name of its own: processes on other hosts sharing the folder may have this pid
    handle, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    tmp = Path(name)
    try:
        with open(tmp, mode, **kwargs) as f:  # owner-writable until written: its final mode is set below
            yield f
            f.flush()
            with suppress(OSError):  # after writing: a read-only old file's mode must not stop the write
                try:
                    os.fchmod(f.fileno(), path.stat().st_mode & 0o7777)
                except FileNotFoundError:
                    os.fchmod(f.fileno(), new_file_mode())
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def new_file_mode() -> int:
    """The mode ``open`` gives a new file: ``0o666`` less the process's umask (Linux: read from
    ``/proc/self/status``; elsewhere set and restored under a lock, the umask being the whole process's)."""
    with suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask


def finite_or_none(value: Any) -> Any:
    """``value`` with every non-finite float in it (NaN, ±infinity; also inside dicts, lists and tuples) replaced by
    ``None``: an undefined score (the MIoU of a split without a scored pixel) is missing, not a number."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_none(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_none(item) for item in value]
    return value


def strict_json(value: Any, **kwargs: Any) -> str:
    """``json.dumps(value, **kwargs)`` as strict JSON, which any parser reads: non-finite floats as ``null``
    (:func:`finite_or_none`), never the ``NaN``/``Infinity`` tokens Python's ``json`` writes by default."""
    return json.dumps(finite_or_none(value), allow_nan=False, **kwargs)
