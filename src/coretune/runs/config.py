"""``--config`` for the commands that read a fitted run (``test``, ``validate``, ``predict``, ``export``, ``eval``):
a run's ``config.yaml`` works as it is.

The sections and keys a command does not take (a fit's ``trainer``, ``model``, ``objective``, ``run_dir`` …) are left
out; those it takes apply, and a ``data`` section's keys fill the options of the same name of a command that has no
``--data`` group (``predict --image_size``). A fit's ``ckpt_path`` (in a file with a fit's ``trainer``, ``run_dir`` or
``seed_everything``) is left out whatever its value: it names the checkpoint that fit resumed from (``last`` after a
resume, ``null`` when it was not resumed), never the one a reading command scores, which its own ``--ckpt_path`` names
wherever it stands; the user's own YAML may name it. Other null values are left out too. Inside a section the command
takes, an unknown key is still the parser's error: the ``data`` of another task is refused, not half applied: a config
that records its task (``model.task``) given for a checkpoint of another task is refused in one line
(:func:`parse_with_config`'s ``task``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser, Namespace

__all__ = ["add_config_argument", "check_config_task", "config_files", "parse_with_config", "recorded_task"]


def add_config_argument(parser: ArgumentParser) -> None:
    """Give ``parser`` a ``--config`` option that takes another command's YAML config (see the module)."""
    parser.add_argument(
        "--config",
        action=ActionConfigFile,
        help="A YAML config, such as a run's config.yaml: the keys this command takes apply (the data section), "
        "the others (trainer, model, objective …) are ignored. Options after it override it.",
    )


def recorded_task(config: Any) -> str | None:
    """The task a YAML configuration (a run's ``config.yaml``, a ``--config`` file) names as ``model.task`` (or a
    top-level ``task``), or None."""
    if not isinstance(config, dict):
        return None
    model = config.get("model")
    task = model.get("task") if isinstance(model, dict) else None
    task = config.get("task", task)
    return task if isinstance(task, str) else None


def parse_with_config(
    parser: ArgumentParser, args: Sequence[str], task: str | None = None, checkpoint: str | None = None
) -> Namespace:
    """``parser.parse_args(args)``, each ``--config FILE`` narrowed to what ``parser`` takes (see the module).

    Raises:
        ValueError: a ``--config`` file records another task than ``task`` (that of ``checkpoint``).
    """
    taken = set(vars(parser.get_defaults())) - {"config"}
    out: list[str] = []
    it = iter(args)
    for arg in it:
        key, eq, value = arg.partition("=")
        if key in ("--config", "-c"):
            path = value if eq else next(it, "")
            check_config_task(path, task, checkpoint)
            out.append(f"--config={_narrowed(path, taken)}")
        else:
            out.append(arg)
    return parser.parse_args(out)


def _read_mapping(path: str) -> dict[str, Any] | None:
    """The YAML mapping in file ``path``, or None (no such file, not YAML, not a mapping)."""
    file = Path(path)
    try:
        config = yaml.safe_load(file.read_text()) if file.is_file() else None
    except yaml.YAMLError:
        return None
    return config if isinstance(config, dict) else None


def config_files(args: Sequence[str]) -> list[str]:
    """The ``--config`` files named in ``args``."""
    it = iter(args)
    return [
        value if eq else next(it, "")
        for key, eq, value in (arg.partition("=") for arg in it)
        if key in ("--config", "-c")
    ]


def check_config_task(path: str, task: str | None, checkpoint: str | None = None) -> None:
    """Refuse (``ValueError``, one line) the config file ``path`` when it records another task than ``task``, that
    of ``checkpoint``."""
    recorded = recorded_task(_read_mapping(path))
    if task is not None and recorded is not None and recorded != task:
        model = f"checkpoint {checkpoint}" if checkpoint else "the model"
        raise ValueError(
            f"--config {path} is the configuration of a {recorded} run (model.task: {recorded}) but {model} is a "
            f"{task} model: pass the config.yaml of a {task} run, or the --data.* options alone"
        )


_FIT_ONLY = frozenset({"ckpt_path"})
"""Top-level keys of a fit's ``config.yaml`` that a reading command has under the same name with another meaning."""


def _narrowed(path: str, taken: set[str]) -> str:
    """The YAML text of the config file ``path`` with only the keys in ``taken``; ``path`` itself when it is no
    readable mapping (the parser then gives its own error)."""
    config = _read_mapping(path)
    if config is None:
        return path
    fits = {"trainer", "run_dir", "seed_everything"} & set(config)  # a fit's config.yaml, not the user's own YAML
    dropped = _FIT_ONLY if fits else frozenset()
    kept: dict[str, Any] = {k: v for k, v in config.items() if k in taken and k not in dropped and v is not None}
    if "data" not in taken and isinstance(data := config.get("data"), dict):
        kept |= {k: v for k, v in data.items() if k in taken and v is not None and k not in kept}
    return yaml.safe_dump(kept, sort_keys=False) if kept else "{}"
