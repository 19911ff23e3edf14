"""``--config`` for the commands that read a fitted run (``test``, ``validate``, ``predict``, ``export``, ``eval``):
a run's ``config.yaml`` works as it is.

The sections and keys a command does not take (a fit's ``trainer``, ``model``, ``objective``, ``run_dir`` …) are
left out; those it takes apply, and a ``data`` section's keys fill the options of the same name of a command that has
no ``--data`` group (``predict --image_size``). Null values are left out too (a fit's ``ckpt_path: null`` means "not
resumed", not "no checkpoint"). Inside a section the command takes, an unknown key is still the parser's error: the
``data`` of another task is refused, not half applied.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser, Namespace

__all__ = ["add_config_argument", "parse_with_config"]


def add_config_argument(parser: ArgumentParser) -> None:
    """Give ``parser`` a ``--config`` option that takes another command's YAML config (see the module)."""
    parser.add_argument(
        "--config",
        action=ActionConfigFile,
        help="A YAML config, such as a run's config.yaml: the keys this command takes apply (the data section), "
        "the others (trainer, model, objective …) are ignored. Options after it override it.",
    )


def parse_with_config(parser: ArgumentParser, args: Sequence[str]) -> Namespace:
    """``parser.parse_args(args)``, each ``--config FILE`` narrowed to what ``parser`` takes (see the module)."""
    taken = set(vars(parser.get_defaults())) - {"config"}
    out: list[str] = []
    it = iter(args)
    for arg in it:
        key, eq, value = arg.partition("=")
        if key in ("--config", "-c"):
            out.append(f"--config={_narrowed(value if eq else next(it, ''), taken)}")
        else:
            out.append(arg)
    return parser.parse_args(out)


def _narrowed(path: str, taken: set[str]) -> str:
    """The YAML text of the config file ``path`` with only the keys in ``taken``; ``path`` itself when it is no
    readable mapping (the parser then gives its own error)."""
    file = Path(path)
    try:
        config = yaml.safe_load(file.read_text()) if file.is_file() else None
    except yaml.YAMLError:
        return path
    if not isinstance(config, dict):
        return path
    kept: dict[str, Any] = {k: v for k, v in config.items() if k in taken and v is not None}
    if "data" not in taken and isinstance(data := config.get("data"), dict):
        kept |= {k: v for k, v in data.items() if k in taken and v is not None and k not in kept}
    return yaml.safe_dump(kept, sort_keys=False) if kept else "{}"
