"""``--config`` for the commands that read a fitted run (``test``, ``validate``, ``predict``, ``export``, ``eval``): a
run's ``config.yaml`` works as it is.

The sections and keys a command does not take (a fit's ``objective``, ``run_dir`` …) are left out; those it takes
apply, and a ``data`` section's keys fill the options of the same name of a command that has no ``--data`` group. A
section a command takes in part (``predict``'s ``--data.image_size``, ``--data.batch_size`` …: its ``loose``
sections) takes the keys it has and leaves the others out. A fit's ``ckpt_path``, ``model`` and ``trainer`` (in a
file with a fit's ``trainer``, ``run_dir`` or ``seed_everything``) are left out whatever their value: ``ckpt_path``
names the checkpoint that fit resumed from (``last`` after a resume, ``null`` when it was not resumed), never the one
a reading command scores, which its own ``--ckpt_path`` names wherever it stands; ``model`` the pre-trained weights
it started from, not those ``coretune eval`` scores; ``trainer`` the hardware it ran on (a reading command runs where
its own ``--trainer.*`` options say). The user's own YAML may name them. Other null values are left out too. Inside a
section the command takes, an unknown key is still the parser's error: the ``data`` of another task is refused, not
half applied: a config that records its task (``model.task``) given for a checkpoint of another task is refused in
one line (:func:`parse_with_config`'s ``task``).
"""

from __future__ import annotations

import sys
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser, Namespace

__all__ = ["add_config_argument", "check_config_task", "config_files", "parse_with_config", "recorded_task"]


def add_config_argument(parser: ArgumentParser) -> None:
    """Give ``parser`` a ``--config`` option that takes another command's YAML config (see the module)."""
    parser.add_argument(
        "-c",
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
    parser: ArgumentParser,
    args: Sequence[str],
    task: str | None = None,
    checkpoint: str | None = None,
    loose: Collection[str] = (),
) -> Namespace:
    """``parser.parse_args(args)``, each ``--config FILE`` narrowed to what ``parser`` takes (see the module; the
    ``loose`` sections to the keys ``parser`` has in them).

    Raises:
        ValueError: a ``--config`` file records another task than ``task`` (that of ``checkpoint``).
    """
    defaults = parser.get_defaults()
    taken = set(vars(defaults)) - {"config"}
    keys = set(defaults.keys())
    out: list[str] = []
    it = iter(args)
    for arg in it:
        key, eq, value = arg.partition("=")
        if key in ("--config", "-c"):
            path = value if eq else next(it, "")
            check_config_task(path, task, checkpoint)
            out.append(f"--config={_narrowed(path, taken, {s: keys for s in loose}, parser.prog)}")
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


_FIT_ONLY = frozenset({"ckpt_path", "model", "trainer"})
"""Top-level keys of a fit's ``config.yaml`` that a reading command has under the same name with another meaning."""


def _narrowed(path: str, taken: set[str], loose: dict[str, set[str]] | None = None, prog: str = "coretune") -> str:
    """The YAML text of the config file ``path`` with only the keys in ``taken`` (of each ``loose`` section, only
    the dotted keys of its set; a top-level key that is one of them, as ``predict``'s own YAML spelled its options
    before they moved into ``data``, moved there with one deprecation line of ``prog`` on stderr); ``path`` itself when
    it is no readable mapping (the parser then gives its own error)."""
    config = _read_mapping(path)
    if config is None:
        return path
    fits = {"trainer", "run_dir", "seed_everything"} & set(config)  # a fit's config.yaml, not the user's own YAML
    dropped = _FIT_ONLY if fits else frozenset()
    kept: dict[str, Any] = {k: v for k, v in config.items() if k in taken and k not in dropped and v is not None}
    if "data" not in taken and isinstance(data := config.get("data"), dict):
        kept |= {k: v for k, v in data.items() if k in taken and v is not None and k not in kept}
    for section, keys in (loose or {}).items():
        if isinstance(kept.get(section), dict):
            kept[section] = {k: v for k, v in kept[section].items() if f"{section}.{k}" in keys and v is not None}
        moved = {k: v for k, v in config.items() if k not in taken and f"{section}.{k}" in keys and v is not None}
        if moved and isinstance(kept.setdefault(section, {}), dict):
            kept[section] = {**moved, **kept[section]}
            print(
                f"{prog}: --config {path} sets {', '.join(moved)}, which is deprecated and will be removed in the next "
                f"release: use {section}: {{{', '.join(f'{k}: …' for k in moved)}}}",
                file=sys.stderr,
            )
    return yaml.safe_dump(kept, sort_keys=False) if kept else "{}"
