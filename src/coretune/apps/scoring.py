"""``coretune test`` and ``coretune validate``: score a fine-tuned checkpoint on a data split.

The data options are those of the checkpoint's task (``--data.*`` of its data module: an image folder for
classification). The image size and normalisation default to those the model was fine-tuned with (its
checkpoint), the classes must be those it was fine-tuned on; ``--data.*`` (or a run's ``config.yaml`` through
``--config``) overrides the first two. The results go to a JSON file of their own in the checkpoint's run
directory (``test_results.json``, ``val_results.json``); the fit's ``results.json`` is left as it is.
``--posthoc_adjustment τ`` scores the classifier's post-hoc logit-adjusted predictions (:mod:`.posthoc`).

A classification checkpoint is also scored on one labelled folder without training data: ``--data.root DIR`` whose
class folders stand in ``DIR`` itself (or in ``DIR/test``, ``DIR/val``, with no ``DIR/train``), or
``--data.test_dir`` / ``--data.val_dir`` alone (the task's :meth:`~coretune.tasks.Task.scored_folder_options`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from operator import attrgetter
from pathlib import Path
from typing import Any, Literal

from ..arguments import ArgumentParser
from ..engine import FineTuner, atomic_write, default_precision
from ..runs.atomic import strict_json
from ..runs.config import add_config_argument, config_files, parse_with_config
from ..runs.layout import RunDir
from ..runs.outputs import check_file_output, data_paths, trained_data_paths
from ..tasks import DEFAULT_TASK, TASKS, Task
from .devices import add_trainer_arguments
from .posthoc import add_posthoc_argument, posthoc_shift
from .vocabulary import translate

__all__ = ["Split", "arg_value", "check_classes", "results_output", "score", "score_parser", "written_by"]

Split = Literal["test", "validate"]


def score_parser(command: Split, task: type[Task] | Task = TASKS[DEFAULT_TASK]) -> ArgumentParser:
    """The command line of ``coretune test`` or ``coretune validate`` for a checkpoint of ``task`` (its data
    module's options)."""
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
    parser.add_class_arguments(task.data_class, "data")
    parser.add_argument(
        "--output",
        type=str | None,
        default=None,
        help=f"JSON file to write the results to (default: {_results_name(command)} in the checkpoint's run "
        "directory, the folder holding its checkpoints/ folder, or beside the checkpoint).",
    )
    add_posthoc_argument(parser)
    add_trainer_arguments(parser, precision=default_precision(), what="the checkpoint is scored")
    return parser


def _results_name(command: Split) -> str:
    run = RunDir(Path())
    return (run.test_results if command == "test" else run.val_results).name


def score(command: Split, args: Sequence[str]) -> Path:
    """Run ``coretune test`` or ``coretune validate`` with ``args``; print and return the results file."""
    args = translate(command, args)
    ckpt_path = arg_value(args, "--ckpt_path")
    if ckpt_path is None:  # the parser's own error (or --help)
        parse_with_config(score_parser(command), args)
        raise ValueError("pass --ckpt_path, a .ckpt written by coretune fit")
    ckpt = Path(ckpt_path).resolve()
    results = attrgetter("test_results" if command == "test" else "val_results")
    reads = [("the checkpoint", ckpt_path), *(("a --config file", path) for path in config_files(args))]
    ours = written_by("checkpoint", "data", command)
    # before the checkpoint is loaded: the output as given (the data it reads is known once parsed)
    results_output(arg_value(args, "--output"), ckpt, results, command, reads=reads, ours=ours)
    model = FineTuner.from_checkpoint(ckpt_path)
    parser = score_parser(command, model.task)
    parser.set_defaults({f"data.{key}": value for key, value in model.trained_data.items()})
    # the checkpoint's settings as defaults: the command line still wins
    cfg = parse_with_config(parser, args, task=model.task.name, checkpoint=ckpt_path)
    data_read = [*data_paths(cfg.data.as_dict()), *trained_data_paths(ckpt)]
    output = results_output(cfg.output, ckpt, results, command, reads=reads, data=data_read, ours=ours)
    trainer = _trainer(cfg.trainer, output.parent)  # its settings checked before any image is read
    model.logit_shift = posthoc_shift(model, cfg.posthoc_adjustment, cfg.ckpt_path)  # as are the counts it needs
    options = cfg.data.as_dict()
    standalone = model.task.scored_folder_options(command, options)
    data = model.task.data_class(**(standalone or options))
    model.task.check_scored_data(model, data, cfg.ckpt_path)  # reads folder names only: before any image is read
    data.setup("test" if command == "test" else "validate")  # with cache_images: only the split it scores decoded
    check_classes(model, data, cfg.ckpt_path)
    results: dict[str, Any] = {"checkpoint": str(ckpt), "data": options}
    if standalone:
        results["scored_folder"] = standalone["train_dir"]
    if cfg.posthoc_adjustment:
        results["posthoc_adjustment"] = cfg.posthoc_adjustment
    if command == "test":
        trainer.test(model, datamodule=data)
        results["test"] = model.test_results
    else:
        (logged,) = trainer.validate(model, datamodule=data, verbose=False)
        results["validate"] = {key.removeprefix("val/"): value for key, value in logged.items()}
        results["validated_on_test_images"] = None if standalone else data.validates_on_test
    text = strict_json(results, indent=2, sort_keys=True) + "\n"
    with atomic_write(output) as f:
        f.write(text)
    if command == "validate":
        print(text, end="")
    print(f"{command} results: {output}")
    return output


def _trainer(settings: Any, root: Path) -> Any:
    """The Lightning ``Trainer`` that scores, on ``--trainer.accelerator/devices/precision`` (``settings``); a setting
    Lightning refuses is a one-line ``ValueError`` naming it, before the data is read."""
    import lightning as L
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    try:
        return L.Trainer(
            default_root_dir=str(root),
            accelerator=settings.accelerator,
            devices=settings.devices,
            precision=settings.precision,
            logger=False,
            enable_checkpointing=False,
        )
    except (MisconfigurationException, ValueError, ImportError) as err:  # ImportError: "tpu" without torch_xla
        raise ValueError(f"invalid trainer settings: {' '.join(str(err).split())}") from None


def arg_value(args: Sequence[str], option: str) -> str | None:
    """The value of the last ``option`` in ``args`` (``--ckpt_path``: the checkpoint, whose task decides the data
    options; ``--output``, checked before the checkpoint is read)."""
    found = None
    for arg, following in zip(args, [*args[1:], None], strict=True):
        key, eq, value = arg.partition("=")
        if key == option:
            found = value if eq else following
    return found


def written_by(*keys: str) -> Callable[[Path], bool]:
    """Whether a file is a JSON object holding ``keys``: how a command tells the results files it wrote (which it
    may replace) from anything else (:func:`coretune.runs.outputs.check_file_output`'s ``ours``)."""

    def ours(path: Path) -> bool:
        try:
            found = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError):
            return False
        return isinstance(found, dict) and all(key in found for key in keys)

    return ours


def results_output(
    output: str | None,
    ckpt: Path,
    default: Callable[[RunDir], Path],
    command: str,
    *,
    reads: Sequence[tuple[str, str | None]] = (),
    data: Sequence[Path] = (),
    ours: Callable[[Path], bool] = lambda _: False,
) -> Path:
    """The file a command that scores checkpoint ``ckpt`` writes: ``output``, else ``default`` of the checkpoint's
    run directory (a name the command owns there), checked (:func:`coretune.runs.outputs.check_file_output`): never an
    input, data, a run's other files or a file the command did not write, and in a writable folder."""
    run = RunDir.of_checkpoint(ckpt)
    owned = default(run)
    path = Path(output) if output else owned
    return check_file_output(path, command, reads=reads, data=data, owns=[owned.name], ours=ours)


def check_classes(model: FineTuner, data: Any, ckpt_path: str) -> None:
    """Refuse data whose classes are named otherwise than those the checkpoint was fine-tuned on (or ordered
    otherwise): its scores would compare the wrong labels. (Another number of classes is the model's own error.)"""
    names = model.class_names
    if names is not None and len(names) == data.num_classes and list(data.class_names) != names:
        raise ValueError(
            f"the data's classes ({', '.join(data.class_names)}) are not those checkpoint {ckpt_path} was "
            f"fine-tuned on ({', '.join(model.class_names)}): score it on data with the same class folders"
        )
