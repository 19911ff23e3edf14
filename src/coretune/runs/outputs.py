"""Where a command may write: every output path is checked before any model is loaded or any image read.

One rule for every command (``test``, ``validate``, ``predict``, ``eval``, ``export``, ``fit``, ``pretrain``,
``bench``, ``tune``, ``demo``): **an output never replaces what the command did not make.** An output is refused, with
one line naming the path and the fix and nothing written, when it

- is an input of the command (its checkpoint, a ``--config`` file, pre-trained weights) or lies inside a data folder
  it reads (a data root, an image or mask folder, a list file);
- is a file of a run (``checkpoints/*``, ``config.yaml``, ``metrics.csv``, ``results.json`` …) the command does not
  own (``coretune test`` owns ``test_results.json``);
- exists and was not written by the command (a file: :func:`check_file_output`'s ``ours`` tells its own files by
  their content; a folder to fill: it is new, empty, or holds the command's marker, :func:`mark_folder`, or a layout
  the command recognises);
- lies in a folder the command cannot write to (probed by creating a file there, so a read-only file system or an
  immutable folder counts for root too): a long evaluation fails up front, not after the work.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from .layout import RunDir

__all__ = [
    "check_file_output",
    "check_folder_output",
    "check_output_path",
    "check_writable",
    "data_paths",
    "is_marked",
    "mark_folder",
    "marked_by_another",
    "marker",
    "run_file_names",
    "trained_data_paths",
]

Inputs = Iterable[tuple[str, "str | os.PathLike[str] | None"]]
"""What a command reads, each as ``(what it is, its path)``: ``("the checkpoint", "run/checkpoints/best.ckpt")``."""

_PATH_KEYS = ("root", "dir", "file", "list", "path", "folder")


_PROBE = ".coretune-probe-"
"""The prefix of :func:`check_writable`'s probe file, there for an instant (a process checking the same folder at
once, as workers of one study do, sees it)."""


def marker(folder: str | os.PathLike[str], command: str) -> Path:
    """The file that tells that ``coretune <command>`` made ``folder`` (``.coretune-<command>``)."""
    return Path(folder) / f".coretune-{command.replace(' ', '-')}"


def mark_folder(folder: str | os.PathLike[str], command: str) -> None:
    """Create ``folder`` if need be and mark it as made by ``coretune <command>``: its next run may write into it."""
    path = marker(folder, command)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"made by coretune {command}; it writes into this folder again on its next run\n")


def is_marked(folder: str | os.PathLike[str], command: str) -> bool:
    return marker(folder, command).is_file()


def marked_by_another(folder: str | os.PathLike[str], command: str) -> bool:
    """Whether ``folder`` holds another command's marker (a pre-training run, a sweep's output, predictions …)."""
    own = marker(folder, command).name
    return any(m.name != own and not m.name.startswith(_PROBE) for m in Path(folder).glob(".coretune-*"))


def run_file_names() -> frozenset[str]:
    """The names of the files a run directory holds (:class:`~coretune.runs.layout.RunDir`), which only their own
    command writes."""
    run = RunDir(Path())
    files = (
        run.config, run.metrics, run.results, run.test_results, run.val_results, run.robust_results,
        run.learning_curve, run.claim, run.log, run.fit_args, run.stop_file, run.wandb_id,
    )  # fmt: skip
    return frozenset(path.name for path in files)


def data_paths(options: Mapping[str, Any] | None) -> list[Path]:
    """The existing files and folders among data options (``root``, ``train_dir``, ``mask_dir``, ``list_file`` …,
    searched through nested ``init_args``): what a command reads images, masks and lists from."""
    found: list[Path] = []
    for key, value in (options or {}).items():
        if isinstance(value, Mapping):
            found += data_paths(value)
        elif isinstance(value, str) and value and key.rsplit("_", 1)[-1] in _PATH_KEYS and os.path.exists(value):
            found.append(Path(value))
    return found


def trained_data_paths(checkpoint: str | os.PathLike[str]) -> list[Path]:
    """The data a checkpoint's run was trained on (:func:`data_paths` of its run's ``config.yaml``; none for a
    checkpoint without its run): an export or prediction from it never goes there."""
    try:
        config = RunDir.of_checkpoint(checkpoint).read_config()
    except (OSError, ValueError, yaml.YAMLError):  # unreadable or not YAML: nothing known
        return []
    return data_paths(config.get("data") if isinstance(config, Mapping) else None)


def _real(path: str | os.PathLike[str]) -> Path:
    return Path(os.path.realpath(path))


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _check_not_input(path: Path, option: str, given: str, reads: Inputs, data: Iterable[Path]) -> None:
    real = _real(path)
    for what, source in reads:
        if source is not None and os.path.exists(source) and real == _real(source):
            raise ValueError(f"{option} {given} is {what} this command reads: pass another {option}")
    for folder in data:
        if _inside(real, _real(folder)):
            raise ValueError(
                f"{option} {given} is inside {folder}, data this command reads (images, masks or lists there would "
                f"be replaced, or read as data next time): choose an output outside the data"
            )


def _in_run(folder: Path) -> RunDir | None:
    """The run whose directory ``folder`` is (a ``config.yaml``, ``results.json``, claim or ``checkpoints/``
    there), or None."""
    run = RunDir(folder)
    found = (run.config, run.results, run.claim, run.checkpoints, run.fit_args)
    return run if any(path.exists() for path in found) else None


def check_writable(path: str | os.PathLike[str], option: str, given: str) -> None:
    """Refuse ``path`` when the folder it would be written into (its nearest existing ancestor for a new path)
    cannot take a new file: a probe file is created and removed, so read-only file systems, immutable folders and
    permissions count as they would for the real write."""
    folder = Path(os.path.abspath(path)).parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(f"{option} {given}: {folder} is a file, not a folder: pass another {option}")
    try:
        handle, name = tempfile.mkstemp(prefix=_PROBE, dir=folder)
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise ValueError(
            f"{option} {given}: cannot write into {folder} ({reason}); nothing was run: choose an output in a "
            "writable folder"
        ) from None
    os.close(handle)
    os.unlink(name)


def check_output_path(
    path: str | os.PathLike[str] | None,
    command: str,
    *,
    option: str = "--output",
    reads: Inputs = (),
    data: Iterable[Path] = (),
) -> None:
    """What can be checked of an output before knowing whether it is a file or a folder (before a checkpoint is
    loaded): it is no input and not inside the data, and its folder is writable. Nothing for ``path`` None."""
    if path is None:
        return
    _check_not_input(Path(path), option, str(path), reads, data)
    check_writable(path, option, str(path))


def check_file_output(
    path: str | os.PathLike[str],
    command: str,
    *,
    option: str = "--output",
    reads: Inputs = (),
    data: Iterable[Path] = (),
    owns: Iterable[str] = (),
    ours: Callable[[Path], bool] = lambda _: False,
) -> Path:
    """Check the file ``coretune <command>`` is to write at ``path`` (see the module's rule); return it.

    ``reads``: the command's inputs; ``data``: the data it reads (:func:`data_paths`); ``owns``: the names of run
    files the command writes (``test_results.json``); ``ours``: whether an existing file is one the command wrote
    (by its content), and may be replaced.

    Raises:
        ValueError: one line naming ``path``, what it would replace and the fix.
    """
    given, target = str(path), Path(path)
    _check_not_input(target, option, given, reads, data)
    real = _real(target)
    if real.is_dir():
        raise ValueError(f"{option} {given} is a folder: coretune {command} writes one file there; give its path")
    run = _in_run(real.parent)
    if real.parent.name == "checkpoints" and _in_run(real.parent.parent) is not None:
        raise ValueError(
            f"{option} {given} is in a run's checkpoints/ folder, which only coretune fit writes: pass another {option}"
        )
    if run is not None and real.name in run_file_names() - set(owns):
        raise ValueError(
            f"{option} {given} is the run file {real.name} of {run.path}, which coretune {command} does not write: "
            f"pass another {option}"
        )
    if real.exists() and not ours(real):
        raise ValueError(
            f"{option} {given} exists and was not written by coretune {command}, which would replace it: pass "
            f"another {option} (or move that file away)"
        )
    check_writable(real, option, given)
    return target


def check_folder_output(
    path: str | os.PathLike[str],
    command: str,
    *,
    option: str = "--output",
    reads: Inputs = (),
    data: Iterable[Path] = (),
    ours: Callable[[Path], bool] = lambda _: False,
) -> Path:
    """Check the folder ``coretune <command>`` is to fill at ``path``: new, empty, or one it made before (its
    marker, :func:`mark_folder`, or ``ours``: a layout it recognises, in a folder no other command marked); never an
    input or inside data it reads, and writable. Return it.

    Raises:
        ValueError: one line naming ``path`` and the fix.
    """
    given, target = str(path), Path(path)
    _check_not_input(target, option, given, reads, data)
    real = _real(target)
    if real.exists() and not real.is_dir():
        raise ValueError(f"{option} {given} is a file: coretune {command} fills a folder; pass a folder's path")
    made = is_marked(real, command) or (not marked_by_another(real, command) and ours(real))
    if real.is_dir() and any(not p.name.startswith(_PROBE) for p in real.iterdir()) and not made:  # another's probe
        raise ValueError(
            f"{option} {given} holds files coretune {command} did not make (it has no {marker(real, command).name}), "
            f"which it could replace: pass a new or empty folder as {option}"
        )
    check_writable(real / "probe", option, given)
    return target
