"""One vocabulary for the commands that load a model: ``--ckpt_path`` (a fine-tuned checkpoint) or
``--model.weights`` (a pre-trained one), ``--data.*`` for the data, ``--trainer.*`` for the device and precision,
``-c/--config`` for a file.

Each command's older spellings (:data:`DEPRECATED`) still work for one release: :func:`translate` rewrites them
before the command's parser sees them, with one line on stderr per option (``coretune eval: --ckpt is deprecated and
will be removed in the next release: use --ckpt_path``), so ``--help`` lists the new names alone. docs/cli.md
tabulates them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

__all__ = ["DEPRECATED", "device_args", "translate"]


def device_args(device: str) -> list[str]:
    """``--device VALUE`` of ``coretune eval`` (``cpu``, ``cuda``, ``cuda:1``, ``mps``) as ``--trainer.*`` options."""
    kind, _, index = device.partition(":")
    accelerator = "gpu" if kind == "cuda" else kind
    return [f"--trainer.accelerator={accelerator}", *([f"--trainer.devices=[{index}]"] if index else [])]


Rewrite = str | Callable[[str], list[str]]
"""The new option of an old one (its value kept), or a function of the old option's value giving the new options."""

_EVAL: dict[str, Rewrite] = {
    "--backbone": "--model.backbone",
    "--weights": "--model.weights",
    "--weights_format": "--model.weights_options.format",
    "--weights_allow_cast": "--model.weights_options.allow_cast",
    "--device": device_args,
}

DEPRECATED: dict[str, dict[str, Rewrite]] = {
    "test": {"--precision": "--trainer.precision"},
    "validate": {"--precision": "--trainer.precision"},
    "predict": {
        "--image_size": "--data.image_size",
        "--batch_size": "--data.batch_size",
        "--num_workers": "--data.num_workers",
        "--on_bad_image": "--data.on_bad_image",
    },
    "eval": _EVAL,
    "eval robust": {"--ckpt": "--ckpt_path", "--device": device_args},
}
"""Each command's older options and their new spelling (one release more, then removed)."""


def translate(command: str, args: Sequence[str], *, prog: str | None = None) -> list[str]:
    """``args`` of ``coretune <command>`` with its deprecated options (:data:`DEPRECATED`) in their new spelling,
    and one line on stderr for each option given (once however often it is given). ``prog``: the command as the
    line names it (default ``coretune <first word of command>``)."""
    table = DEPRECATED.get(command, {})
    prog = prog or f"coretune {command.split()[0]}"
    out: list[str] = []
    warned: set[str] = set()
    it = iter(args)
    for arg in it:
        key, eq, value = arg.partition("=")
        rewrite = table.get(key)
        if rewrite is None:
            out.append(arg)
            if arg == "--":
                out.extend(it)
            continue
        if not eq:
            value = next(it, None)  # type: ignore[assignment]
            if value is None:  # the parser's own "expected one argument", under the new name
                out.append(rewrite if isinstance(rewrite, str) else key)
                continue
        new_args = [f"{rewrite}={value}"] if isinstance(rewrite, str) else rewrite(value)
        if key not in warned:
            new = rewrite if isinstance(rewrite, str) else " ".join(a.replace("=", " ", 1) for a in new_args)
            warned.add(key)
            print(f"{prog}: {key} is deprecated and will be removed in the next release: use {new}", file=sys.stderr)
        out.extend(new_args)
    return out
