"""``coretune test`` and ``coretune validate``: score a fine-tuned checkpoint on a data split.

The image size and normalisation default to those the model was fine-tuned with (its checkpoint), the classes must
be those it was fine-tuned on; ``--data.*`` (or a run's ``config.yaml`` through ``--config``) overrides the first
two. The results go to a JSON file of their own in the checkpoint's run directory (``test_results.json``,
``val_results.json``); the fit's ``results.json`` is left as it is.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from operator import attrgetter
from pathlib import Path
from typing import Any, Literal

from jsonargparse import ArgumentParser, Namespace

from .data import ImageClassificationData
from .engine import FineTuner, atomic_write, default_precision
from .runconfig import add_config_argument, parse_with_config
from .rundir import RunDir

__all__ = ["Split", "check_classes", "load_scored", "score", "score_parser"]

Split = Literal["test", "validate"]


def score_parser(command: Split) -> ArgumentParser:
    """The command line of ``coretune test`` or ``coretune validate``."""
    split = "test" if command == "test" else "validation"
    parser = ArgumentParser(
        allow_abbrev=False,
        prog=f"coretune {command}",
        description=f"Evaluate a fine-tuned checkpoint on the {split} split, at the image size and normalisation it "
        f"was fine-tuned with unless --data.* says otherwise; writes the results to {_results_name(command)} of "
        "their own (the run's results.json, the fit's, is left as it is).",
    )
    add_config_argument(parser)
    parser.add_argument("--ckpt_path", type=str, required=True, help="A .ckpt written by coretune fit.")
    parser.add_class_arguments(ImageClassificationData, "data")
    parser.add_argument(
        "--output",
        type=str | None,
        default=None,
        help=f"JSON file to write the results to (default: {_results_name(command)} in the checkpoint's run "
        "directory, the folder holding its checkpoints/ folder, or beside the checkpoint).",
    )
    parser.add_argument("--precision", type=str, default=default_precision())
    return parser


def _results_name(command: Split) -> str:
    run = RunDir(Path())
    return (run.test_results if command == "test" else run.val_results).name


def score(command: Split, args: Sequence[str]) -> Path:
    """Run ``coretune test`` or ``coretune validate`` with ``args``; print and return the results file."""
    import lightning as L

    results_file = attrgetter("test_results" if command == "test" else "val_results")
    cfg, model, output = load_scored(score_parser(command), args, command, results_file)
    ckpt = Path(cfg.ckpt_path).resolve()
    data = ImageClassificationData(**cfg.data.as_dict())
    check_classes(model, data, cfg.ckpt_path)
    trainer = L.Trainer(
        default_root_dir=str(output.parent), precision=cfg.precision, logger=False, enable_checkpointing=False
    )
    results: dict[str, Any] = {"checkpoint": str(ckpt), "data": cfg.data.as_dict()}
    if command == "test":
        trainer.test(model, datamodule=data)
        results["test"] = model.test_results
    else:
        (logged,) = trainer.validate(model, datamodule=data, verbose=False)
        results["validate"] = {key.removeprefix("val/"): value for key, value in logged.items()}
        results["validated_on_test_images"] = data.validates_on_test
    text = json.dumps(results, indent=2, sort_keys=True) + "\n"
    with atomic_write(output) as f:
        f.write(text)
    if command == "validate":
        print(text, end="")
    print(f"{command} results: {output}")
    return output


def load_scored(
    parser: ArgumentParser,
    args: Sequence[str],
    command: str,
    results_file: Callable[[RunDir], Path],
    check: Callable[[Namespace], None] | None = None,
) -> tuple[Namespace, FineTuner, Path]:
    """``(settings, model, output file)`` of a command that scores ``--ckpt_path`` (``test``, ``validate``,
    ``eval robust``): ``args`` parsed with the checkpoint's image size and normalisation as the ``data`` defaults (the
    command line still wins); the output is ``--output`` or ``results_file`` of the checkpoint's run directory, and
    never the fit's ``results.json``. That, and ``check`` of the settings, come before the checkpoint is read."""
    cfg = parse_with_config(parser, args)
    if check is not None:
        check(cfg)
    run = RunDir.of_checkpoint(Path(cfg.ckpt_path).resolve())
    output = Path(cfg.output) if cfg.output else results_file(run)
    if output.name == run.results.name and output.is_file():
        raise ValueError(
            f"--output {output} would overwrite a fit's results.json, which coretune {command} leaves as it is: "
            "give another file name"
        )
    model = FineTuner.from_checkpoint(cfg.ckpt_path)
    parser.set_defaults({f"data.{key}": value for key, value in model.trained_data.items()})
    return parse_with_config(parser, args), model, output


def check_classes(model: FineTuner, data: ImageClassificationData, ckpt_path: str) -> None:
    """Refuse data whose classes are named otherwise than those the checkpoint was fine-tuned on (or ordered
    otherwise): its scores would compare the wrong labels. (Another number of classes is the model's own error.)"""
    names = model.class_names
    if names is not None and len(names) == data.num_classes and list(data.class_names) != names:
        raise ValueError(
            f"the data's classes ({', '.join(data.class_names)}) are not those checkpoint {ckpt_path} was "
            f"fine-tuned on ({', '.join(model.class_names)}): score it on data with the same class folders"
        )
