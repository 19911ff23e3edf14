"""``coretune fit``: a LightningCLI over :class:`~coretune.engine.FineTuner` and the data module of its task
(``--task NAME``: :class:`~coretune.data.ImageClassificationData` for ``classification``, the default), and the
wiring that resolves its arguments without running it.

``--objective NAME`` takes a registered objective name (``coretune objectives`` lists them) and
``--objective.<param>`` its hyper-parameters; ``--task NAME`` is ``--model.task NAME`` (recorded there in
``config.yaml`` and in the checkpoint's hyper-parameters); :func:`translate_args` rewrites those aliases (and
``--seed``) for LightningCLI, and :func:`task_of_args` finds the task, whose data module the CLI is built
with. ``--test false`` ends the fit without scoring the test split (:data:`TEST_SKIPPED`; ``coretune compare``'s
runs). :func:`resolved_fit_config` is the configuration a fit would run with (what ``--print_config`` prints),
parsed by fit's own parser without running it, for sweeps that check every run's arguments before the first starts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, cast

import yaml

from .. import objectives
from ..arguments import one_line
from ..data import TaskData, require_task_data
from ..models import check_weights
from ..robust.training import AdversarialTraining
from ..runs.config import recorded_task
from ..runs.layout import RunDir
from ..tasks import DEFAULT_TASK, TASKS, Task
from .averaging import Averaging
from .callbacks import update_results
from .checkpoint_io import with_atomic_io
from .fitargs import current_objective_args, task_of_args, translate_args
from .loggers import LOGGER_ALIAS, place_loggers
from .module import FineTuner
from .preflight import check_validates_before_max_steps
from .runcli import RunDirCLI
from .switches import check_switched_options, given_options
from .trainer import (
    BestCheckpoint,
    check_trainer_options,
    default_callbacks,
    default_precision,
    own_guard,
    quiet_lightning,
)

__all__ = [
    "TEST_SKIPPED",
    "FitArgsError",
    "FitCLI",
    "current_objective_args",
    "fit",
    "resolved_fit_config",
    "task_of_args",
    "translate_args",
]


class FitCLI(RunDirCLI):
    """``coretune fit``: a LightningCLI over :class:`FineTuner` and its task's data module."""

    command = "fit"
    aliases: ClassVar[Mapping[str, str]] = {
        "--objective NAME": "a registered objective or Table 2 preset and its settings (coretune objectives)",
        "--model.drop_path R": "--model.backbone_args.drop_path_rate R: a timm model's stochastic depth (ViTs: 0.1)",
        "--objective.help NAME": "the hyper-parameters of objective NAME",
        "--seed N": "--seed_everything N (also seeds the data split, --data.seed)",
        "--task NAME": f"--model.task NAME: {', '.join(TASKS)} (default {DEFAULT_TASK}); the --data.* options are its",
        "--task.SETTING V": "a task setting (segmentation: --task.output_stride 8, --task.image_labels multilabel)",
        LOGGER_ALIAS[0]: LOGGER_ALIAS[1],
    }

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_subclass_arguments(
            objectives.Objective,
            "objective",
            default={"class_path": "coretune.objectives.CETuning"},
            help="Fine-tuning method: a registered name (" + ", ".join(objectives.available()) + ") or class path.",
        )
        parser.link_arguments("objective", "model.objective", apply_on="instantiate")
        parser.add_class_arguments(
            AdversarialTraining,
            "adversarial",
            help="Adversarial training (classification): train on each batch and its PGD examples against the "
            "current model (--adversarial.enable true; eps in [0, 1] pixel units, a number or a fraction, e.g. "
            "--adversarial.eps 8/255).",
        )
        parser.link_arguments("adversarial", "model.adversarial", apply_on="instantiate")
        parser.add_class_arguments(
            Averaging,
            "averaging",
            help="Weight averaging: validate, checkpoint and end with an average of the weights, an EMA "
            "(--averaging.ema_decay 0.999) or SWA over the last epochs (--averaging.swa_start 0.75, BatchNorm "
            "statistics recomputed; --averaging.swa_lr a constant lr from there) or the equal average of every "
            "step's weights from a step on (--averaging.sma_start_step 600, ERM++'s) (docs/usage.md, Weight "
            "averaging).",
        )
        parser.link_arguments("seed_everything", "data.seed")
        parser.add_argument(
            "--run_dir",
            type=str | None,
            default=None,
            help="Run directory (default: <--trainer.default_root_dir, or runs>/<objective>-<date>-<time>; it wins "
            "over --trainer.default_root_dir). Reuse it to resume from its checkpoints/last.ckpt (a finished run is "
            "only tested again), with the settings it was trained with (--config RUN/config.yaml; only max_epochs, "
            "hardware, precision, progress and loader options may change). Refused while another fit or sweep runs it "
            "(its claim, fit.pid).",
        )
        parser.add_argument(
            "--test",
            type=bool,
            default=True,
            help="End by scoring the test split (results.json's test entry). false: the fit ends after training "
            "(results.json records test: null and test_skipped, why; no test split needed), as coretune compare's "
            "runs do; score a checkpoint later with coretune test --ckpt_path RUN/checkpoints/last.ckpt.",
        )

    def parse_arguments(self, parser: Any, args: Any) -> None:
        self.given = given_options(args if isinstance(args, list) else [])  # the options the command line names
        super().parse_arguments(parser, args)

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand]
        check_trainer_options(config["trainer"], _schedule(config))
        check_switched_options(config, self.given)
        self.settle_run_dir(str(config["objective"]["class_path"]).rsplit(".", 1)[-1].lower())
        place_loggers(config, resuming=config.get("ckpt_path") is not None)

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        """The Trainer, once the data module is known to be a :class:`~coretune.data.TaskData` and its folders to
        exist (a wrong path is then the only line a user sees, not after Lightning's accelerator report)."""
        require_task_data(self.datamodule).check_folders()
        trainer = self._get(self.config_init, "trainer", default={})
        show_progress = trainer.get("enable_progress_bar") is not False
        own = trainer.get("callbacks") or []  # --trainer.callbacks: a ChanceLevelGuard there replaces the default
        trainer["callbacks"], guard = own_guard(own if isinstance(own, list) else [own])
        averaging = self._get(self.config_init, "averaging")
        if isinstance(averaging, Averaging) and (averaged := averaging.callback()) is not None:
            trainer["callbacks"].append(averaged)
        self.trainer_defaults["callbacks"] = default_callbacks(trainer["default_root_dir"], show_progress, guard)
        kwargs["plugins"] = with_atomic_io(trainer.get("plugins"))
        return super().instantiate_trainer(**kwargs)

    def before_fit(self) -> None:
        """The task's check of the data settings, before any data is read (the model checks again once it is), and
        that the test the fit ends with has images (else it failed after the last epoch); ``--test false``: none of
        the test's checks."""
        self.model.task.check_data(self.datamodule, "fit")
        if not self._get(self.config, "test", default=True):
            return
        run = RunDir(self.trainer.default_root_dir)
        hint = self.model.task.selection_hint(self.datamodule)
        tests_best = self.model.task.test_checkpoint(run.path) == str(run.best_checkpoint)
        every, epochs = self.trainer.check_val_every_n_epoch, self.trainer.max_epochs
        never = f"--trainer.check_val_every_n_epoch {every} beyond --trainer.max_epochs {epochs}"
        if tests_best and self.trainer.limit_val_batches == 0:
            never = "--trainer.limit_val_batches 0"
        elif not (tests_best and self._get(self.config, "ckpt_path") is None and every and 0 < (epochs or 0) < every):
            never = ""
        if never:
            raise ValueError(
                f"{never} runs no validation, but this fit ends by testing the {_BEST} that validation chooses "
                f"({hint}): let it validate, or test the last weights (--data.selection "
                "last_checkpoint)"
            )
        if tests_best and self._get(self.config, "ckpt_path") is None:
            check_validates_before_max_steps(self.trainer, self.datamodule, hint, _BEST)
        cast(TaskData, self.datamodule).require_test_split(  # a TaskData: instantiate_trainer checked it
            "no images to test on: --data.val_fraction holds out part of train/ for validation, and coretune "
            "fit ends by scoring a test split (unless --test false),"
        )

    def after_fit(self) -> None:
        if self.trainer.interrupted:
            return
        if self.trainer.global_step == 0:  # stopped before its first step (a callback's stop): nothing trained
            raise ValueError(
                "this fit ran no optimiser step, so there is no trained model to test (the untrained one would be "
                "recorded as its result): let it train, e.g. --trainer.max_epochs 1 or more"
            )
        run = RunDir(self.trainer.default_root_dir)
        if not self._get(self.config, "test", default=True):
            if self.trainer.is_global_zero:
                update_results(run.path, test=None, test_skipped=TEST_SKIPPED)
                _print_run_summary(run.path, self.model.task)
            return
        tested = self.model.task.test_checkpoint(run.path)
        if tested == str(run.best_checkpoint) and not _chose_best(self.trainer, run):
            found = "the file there is an earlier run's" if run.best_checkpoint.is_file() else "there is none"
            resumed = self.trainer.ckpt_path
            weights = run.last_checkpoint if run.last_checkpoint.is_file() or not resumed else Path(resumed)
            # the best.ckpt a BestCheckpoint restored from the checkpoint this fit resumed from (not last.ckpt, which
            # a ModelCheckpoint without a monitor also calls its best_model_path)
            bests = [c for c in self.trainer.checkpoint_callbacks if isinstance(c, BestCheckpoint)]
            chosen = [c.best_model_path for c in bests if c.best_model_path] if resumed else []
            other = f" (the best checkpoint the resumed run chose is {chosen[0]}: test that one)" if chosen else ""
            hint = self.model.task.selection_hint(self.datamodule)
            raise ValueError(
                f"no validation of this run chose its {_BEST} ({found}), and this fit ends by testing it "
                f"({hint}): the trained weights are in {weights}; test them with "
                f"coretune test --ckpt_path {weights}{other}, or fit again into a new --run_dir with "
                "--trainer.check_val_every_n_epoch at most --trainer.max_epochs"
            )
        self.trainer.test(self.model, datamodule=self.datamodule, ckpt_path=tested, verbose=False)
        if self.trainer.is_global_zero:
            _print_run_summary(Path(self.trainer.default_root_dir), self.model.task)


_BEST = "checkpoints/best.ckpt"

#: ``results.json``'s ``test_skipped`` of a fit run with ``--test false`` (its ``test`` is null).
TEST_SKIPPED = (
    "--test false: the fit did not score the test split; score a checkpoint with coretune test --ckpt_path "
    "RUN/checkpoints/last.ckpt (test_results.json)"
)


def _chose_best(trainer: Any, run: RunDir) -> bool:
    """Whether this run's validation chose ``run``'s ``best.ckpt``: a :class:`BestCheckpoint` of ``trainer`` saved it
    in this fit or, resumed from this run's own checkpoints, in an earlier one (the run may have moved since). A
    best checkpoint restored from another run's checkpoint (``--ckpt_path`` of another folder) is that run's. True
    when no :class:`BestCheckpoint` keeps one (the caller's own callbacks)."""
    bests = [c for c in trainer.checkpoint_callbacks if isinstance(c, BestCheckpoint)]
    if not bests:
        return True
    resumed = trainer.ckpt_path is not None and Path(trainer.ckpt_path).resolve().parent == run.checkpoints.resolve()
    for best in (Path(c.best_model_path) for c in bests if c.best_model_path):
        if best.resolve() == run.best_checkpoint.resolve() or (resumed and best.name == run.best_checkpoint.name):
            return True
    return False


def _print_run_summary(run_dir: Path, task: Task | None = None) -> None:
    """The end of ``coretune fit``: where the run is and its test results, or how to score it when the fit skipped
    the test (``task``: default, the run's own, as its
    ``config.yaml`` records it)."""

    from rich.console import Console

    if task is None:
        task = TASKS.get(recorded_task(RunDir(run_dir).read_config()) or DEFAULT_TASK, TASKS[DEFAULT_TASK])()
    results = json.loads(RunDir(run_dir).results.read_text())
    test = results.get("test") or {}
    console = Console()
    console.print(f"[bold]run directory[/bold]: {run_dir}")
    if test:
        console.print(
            f"{task.summary_line(test)}  "
            f"({results.get('train_images_per_s')} train images/s, {results.get('wall_time_s')} s)"
        )
    elif results.get("test_skipped"):
        console.print(
            f"test split not scored (--test false): coretune test --ckpt_path {RunDir(run_dir).last_checkpoint}  "
            f"({results.get('train_images_per_s')} train images/s, {results.get('wall_time_s')} s)",
            highlight=False,
        )
    console.print(f"metrics: {RunDir(run_dir).metrics}   curves: {RunDir(run_dir).learning_curve}")
    if results.get("validated_on_test_images") and results.get("best_checkpoint"):
        console.print(
            f"[yellow]note[/yellow]: validation read the test images ({task.no_validation_split}), so best.ckpt and "
            f"best_val_{task.monitor} were chosen on the test set; the {task.monitor_label} above is the final "
            f"model's. To choose a checkpoint or setting, hold out a validation split: {task.validation_split_fix}",
            highlight=False,
        )


def fit(args: list[str]) -> None:
    _run_fit_cli(FitCLI, args)


def _run_fit_cli(cli: type[FitCLI], args: Sequence[str], **parser_kwargs: Any) -> None:
    """Run ``cli`` (:class:`FitCLI`, or :class:`_ParseOnly`) as ``coretune fit ARGS`` runs; ``parser_kwargs`` go to
    its parser and its ``fit`` subcommand's."""
    quiet_lightning()
    task = task_of_args(args)
    cli.run(
        FineTuner,
        TASKS[task].data_class if task in TASKS else TASKS[DEFAULT_TASK].data_class,  # else FineTuner refuses it
        args=["fit", *translate_args(list(args))],
        seed_everything_default=0,
        trainer_defaults={"precision": default_precision(), "logger": False, "enable_autolog_hparams": False},
        save_config_kwargs={"overwrite": True},
        parser_kwargs={
            "allow_abbrev": False,
            **parser_kwargs,
            "fit": {"default_env": False, "allow_abbrev": False, **parser_kwargs},
        },
        auto_configure_optimizers=False,
    )


class _Parsed(Exception):  # not an error: how the parsed configuration leaves the CLI constructor
    """The configuration :class:`_ParseOnly` parsed, as plain YAML types."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__("parsed")
        self.config = config


class _ParseOnly(FitCLI):
    """:class:`FitCLI` that stops once it has parsed its arguments (configs, presets and links applied, values
    validated), before anything is seeded, instantiated, claimed or written."""

    def parse_arguments(self, parser: Any, args: Any) -> None:
        config = parser.parse_args(args)
        fit_parser = self._subcommand_parsers["fit"]
        raise _Parsed(yaml.safe_load(fit_parser.dump(config["fit"], skip_unset=False)) or {})


class FitArgsError(ValueError):
    """``coretune fit`` would refuse these arguments at its start; the message is its error."""


def resolved_fit_config(args: Sequence[str]) -> dict[str, Any]:
    """The configuration ``coretune fit ARGS`` would run with (what its ``--print_config`` prints: configs and presets
    applied), without running it: parsed by fit's own parser, nothing instantiated. Raises :class:`FitArgsError`
    with fit's own message when it would refuse the arguments (an unknown option or objective, a value of the wrong
    type, an unreadable config file, a data folder or ``--model.weights`` file that does not exist or hub name
    missing from the local cache; no image or checkpoint is read)."""
    from jsonargparse import ArgumentError

    try:
        _run_fit_cli(_ParseOnly, args, exit_on_error=False)
        raise AssertionError("_ParseOnly returned without its configuration")  # pragma: no cover
    except _Parsed as parsed:
        config = parsed.config
    except ArgumentError as error:  # the parser's error, as coretune fit words it (without the --help hint)
        raise FitArgsError(one_line(str(error))) from None
    except (ValueError, OSError, yaml.YAMLError) as error:
        raise FitArgsError(" ".join(str(error).split())) from None
    try:
        # fit checks them after --print_config would exit
        check_trainer_options(config.get("trainer") or {}, _schedule(config))
        check_switched_options(config, given_options(args))
        _check_local_paths(config)
    except ValueError as error:
        raise FitArgsError(" ".join(str(error).split())) from None
    return config


def _schedule(config: Any) -> str | None:
    """The learning-rate schedule a parsed fit configuration (a dict or a jsonargparse ``Namespace``) sets."""
    optim = (config.get("model") or {}).get("optim") or {}
    return optim.get("schedule")


def _check_local_paths(config: dict[str, Any]) -> None:
    """The data folders and the pre-trained checkpoint file of a resolved fit config exist (DataError or
    CheckpointError, both ValueErrors, otherwise)."""
    if "data" in config:
        task = TASKS.get(recorded_task(config) or DEFAULT_TASK, TASKS[DEFAULT_TASK])
        task.data_class(**config["data"]).check_folders()
    model = config.get("model", {})
    download = (model.get("weights_options") or {}).get("download")
    if weights := model.get("weights"):  # a file that exists, or a hub name in the local cache or to download
        check_weights(weights, download, model.get("backbone"))  # no network call
