"""``coretune fit``: a LightningCLI over :class:`~coretune.engine.FineTuner` and the data module of its task
(``--task NAME``: :class:`~coretune.data.ImageClassificationData` for ``classification``, the default), and the
wiring that resolves its arguments without running it.

``--objective NAME`` takes a registered objective name (``coretune objectives`` lists them) and
``--objective.<param>`` its hyper-parameters; ``--task NAME`` is ``--model.task NAME`` (recorded there in
``config.yaml`` and in the checkpoint's hyper-parameters); :func:`translate_args` rewrites those aliases (and
``--seed``) for LightningCLI, and :func:`task_of_args` finds the task, whose data module the CLI is built
with. :func:`resolved_fit_config` is the configuration a fit would run with (what ``--print_config`` prints),
parsed by fit's own parser without running it, for sweeps that check every run's arguments before the first starts.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, cast

import yaml

from .. import objectives
from ..arguments import one_line
from ..data import TaskData, require_task_data
from ..models import HUB_PREFIXES, resolve_weights
from ..robust.training import AdversarialTraining
from ..runs.config import recorded_task
from ..runs.layout import RunDir
from ..tasks import DEFAULT_TASK, TASKS, Task, moved_task_settings
from .checkpoint_io import with_atomic_io
from .loggers import LOGGER_ALIAS, expand_config_loggers, logger_args, place_loggers
from .modelsettings import MOVED_SETTINGS, deprecated_option_line, grouped_model_settings, moved_option
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
    "FitArgsError",
    "FitCLI",
    "current_objective_args",
    "fit",
    "resolved_fit_config",
    "task_of_args",
    "translate_args",
]


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _defaults(cls: type) -> dict[str, Any]:
    """The constructor arguments of ``cls`` that have a default, with it."""
    return {k: p.default for k, p in inspect.signature(cls).parameters.items() if p.default is not p.empty}


def _sibling_relics(cls: type, preset: dict[str, Any], current_args: Mapping[str, Any]) -> dict[str, Any]:
    """The settings another preset of ``cls`` left in ``current_args`` (a config's or an earlier ``--objective``'s
    ``init_args``) that the preset ``preset`` of the same class does not set, with the class defaults that replace
    them: ``ce_mix``'s ``eta: 0.0``, ``miner: null`` and ``manifold_mixup: true`` when ``--objective core`` follows a
    ``ce_mix`` run's config. A value no sibling preset sets (a tuned ``eta: 0.5``) is the user's and stays."""
    defaults = _defaults(cls)
    sibling_values: dict[str, list[Any]] = {}
    for other in objectives.available():
        other_cls, other_preset = objectives.get(other)
        if other_cls is cls:
            for key, value in other_preset.items():
                sibling_values.setdefault(key, []).append(value)
    return {
        key: defaults[key]
        for key, values in sibling_values.items()
        if key not in preset and key in current_args and key in defaults
        and current_args[key] in values and current_args[key] != defaults[key]
    }  # fmt: skip


def _objective_class_path(
    name: str, current: str | None = None, current_args: Mapping[str, Any] | None = None
) -> tuple[str, list[str], dict[str, Any]]:
    """Class path of a registered objective name (class paths pass through), the ``--objective`` arguments that
    set it and its preset, and the hyper-parameters those arguments set.

    When it names another class than ``current`` (the objective a ``--config`` or an earlier ``--objective`` set),
    every hyper-parameter is its new class's default or preset: jsonargparse would keep the ``init_args`` the new
    class also accepts (Core-tuning's ``eta: 0.1`` as BSS's ``eta``, 100 x its 0.001). When it names another preset
    of the same class, the settings the earlier preset set in ``current_args`` are reset too
    (:func:`_sibling_relics`); the other settings (a config's tuned η) stay."""
    preset: dict[str, Any] = {}
    if name in objectives.available():
        cls, preset = objectives.get(name)
    elif (cls := objectives.registered_class(name)) is None:
        if "." not in name:
            objectives.get(name)  # neither a name nor a class (path): "unknown objective 'x'; choose one of: ..."
        return name, [f"--objective={name}"], {}
    class_path = _class_path(cls)
    if current is not None and class_path != current:
        init_args = {
            k: list(v) if isinstance(v, tuple) else objectives.plain_setting(v)
            for k, v in {**_defaults(cls), **preset}.items()
        }
        return class_path, [f"--objective={json.dumps({'class_path': class_path, 'init_args': init_args})}"], init_args
    given = class_path if name in objectives.available() else name  # a class (path) jsonargparse resolves itself
    settings = {**_sibling_relics(cls, preset, current_args or {}), **preset} if current is not None else preset
    args = [f"--objective={given}", *(f"--objective.{k}={_cli_value(v)}" for k, v in settings.items())]
    return class_path, args, settings


def _cli_value(value: Any) -> str:
    value = objectives.plain_setting(value)  # a component (Core-tuning's miner) as the dict of its settings
    if value is None or isinstance(value, dict):
        return json.dumps(value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def _moved_objective_setting(objective: str | None, key: str) -> tuple[type[objectives.Objective], str] | None:
    """The objective class (``objective``: the class path set so far) and setting of an ``--objective.<old>`` key
    that an older version spelled so (:attr:`~coretune.objectives.Objective.moved_settings`), or None."""
    old = key.removeprefix("--objective.")
    cls = objectives.registered_class(objective) if objective is not None and key != old else None
    return (cls, old) if cls is not None and old in cls.moved_settings else None


def _moved_objective_args(
    cls: type[objectives.Objective], old: str, value: str, settings: dict[str, Any], held: dict[str, list[str]]
) -> list[str]:
    """``--objective.<old> value``, an older version's spelling, as its current arguments, with one line on stderr
    (``--objective.lambda_n 0.5``: ``--objective.miner.lambda_n=0.5``). ``settings`` are the objective's known so
    far (by dotted key; updated). A renamed setting of a component that is off (``ce_con``'s miner, a memory
    before its size) had no effect in the old spelling and would turn it on in the new: it is ``held`` until a
    setting turns the component on (a move by value, as ``--objective.mixing hard`` or ``--objective.memory_size
    64``, says exactly what the old value meant), else dropped."""
    new = cls.moved_setting(old, yaml.safe_load(value))
    renamed = isinstance(cls.moved_settings[old], str)
    print(
        f"coretune fit: --objective.{old} is deprecated and will be removed in the next release: use "
        f"{' '.join(f'--objective.{path} {_cli_value(v)}' for path, v in new.items())}",
        file=sys.stderr,
    )
    args: list[str] = []
    for path, setting in new.items():
        head, dot, _ = path.partition(".")
        arg = f"--objective.{path}={_cli_value(setting)}"
        if dot and renamed and not _component_on(cls, settings, head):
            held.setdefault(head, []).append(arg)
            continue
        _record_setting(settings, path, setting)
        args.append(arg)
        if setting is not None and _component_on(cls, settings, head):
            args.extend(held.pop(head, []))
    return args


def current_objective_args(args: Sequence[str]) -> list[str]:
    """``args`` with each ``--objective.<old> V`` that an older version spelled so (after ``--objective NAME``) in
    its current spelling (``--objective.memory_size=4096``: ``--objective.memory.size=4096``), silently, and
    nothing else changed: how a sweep compares the fit arguments a run recorded with its spec's."""
    out: list[str] = []
    objective: str | None = None
    it = iter(args)
    for arg in it:
        key, eq, value = arg.partition("=")
        if key == "--objective":
            value = value if eq else next(it, "")
            out.extend([arg] if eq else [arg, value])
            cls = objectives.registered_class(value)
            objective = None if cls is None else _class_path(cls)
        elif moved := _moved_objective_setting(objective, key):
            new = moved[0].moved_setting(moved[1], yaml.safe_load(value if eq else next(it, "")))
            out.extend(f"--objective.{path}={_cli_value(setting)}" for path, setting in new.items())
        else:
            out.append(arg)
    return out


def _component_on(cls: type, settings: Mapping[str, Any], name: str) -> bool:
    """Whether the component setting ``name`` of ``cls`` is on (not None) with the ``settings`` known so far."""
    return any(k.startswith(f"{name}.") for k in settings) or settings.get(name, _defaults(cls).get(name)) is not None


def _record_setting(settings: dict[str, Any], key: str, value: Any) -> None:
    """``settings[key] = value``; a component turned off (``miner: null``) forgets the settings beneath it."""
    if value is None:
        for beneath in [k for k in settings if k.startswith(f"{key}.")]:
            del settings[beneath]
    settings[key] = value


def _upgraded_objective(spec: dict[str, Any], path: str) -> list[str]:
    """Rewrite a ``--config`` file's ``objective`` entry (``spec``, its class path resolved) whose ``init_args``
    spell settings as an older version did, with one line on stderr; the old names."""
    upgraded, old = objectives.upgrade_objective_config(spec)
    if old:
        cls = objectives.registered_class(str(spec["class_path"]))
        assert cls is not None  # upgrade_objective_config found it
        new = {k: v for key in old for k, v in cls.moved_setting(key, spec["init_args"][key]).items()}
        print(
            f"coretune fit: {path}: objective settings {', '.join(old)} are deprecated and will be removed in the "
            f"next release: use {', '.join(f'{k}: {_cli_value(v)}' for k, v in new.items())} (nested under init_args)",
            file=sys.stderr,
        )
        spec.update(upgraded)
    return old


def _translate_config(path: str) -> tuple[str, str | None, dict[str, Any]]:
    """A ``--config`` value whose ``objective`` names a registered objective (``objective: core`` or
    ``objective: {class_path: ce_con, init_args: {...}}``), rewritten as the YAML text of the same config with the
    class path and the preset's settings (the file's own ``init_args`` win), and so is one whose ``trainer.logger``
    is a short name (:func:`~coretune.engine.loggers.expand_config_loggers`) or that records a task's setting among
    the model's as older versions did (``model: {output_stride: 8}``, moved into ``task_settings``:
    :func:`~coretune.tasks.moved_task_settings`), and so is one that spells the optimiser's or the weights' settings
    flat as older versions did (``model: {lr: 0.01}``, moved into ``model: {optim: {lr: 0.01}}``, with one
    deprecation line on stderr: :func:`~coretune.engine.modelsettings.grouped_model_settings`); other configs pass
    through. Also returns the class path of the objective it sets (None: it sets none, or is not a readable file)
    and its ``init_args``."""
    file = Path(path)
    if not file.is_file():
        return path, None, {}
    config = yaml.safe_load(file.read_text())
    logged = expand_config_loggers(config, path)
    if isinstance(config, dict) and isinstance(model := config.get("model"), dict):  # model: {output_stride: 8}
        moved = grouped_model_settings(moved_task_settings(model))
        logged |= moved != model
        config["model"] = moved
        if flat := [key for key in model if key in MOVED_SETTINGS]:
            _warn_deprecated_config(path, flat)
    spec = config.get("objective") if isinstance(config, dict) else None
    name = spec if isinstance(spec, str) else spec.get("class_path") if isinstance(spec, dict) else None
    text = yaml.safe_dump(config, sort_keys=False) if logged else path
    if not isinstance(name, str):
        return text, None, {}
    if isinstance(spec, dict) and _upgraded_objective(spec, path):  # an older version's settings (lambda_n: 0.5)
        text = yaml.safe_dump(config, sort_keys=False)
    own = (spec.get("init_args") or {}) if isinstance(spec, dict) else {}
    own = own if isinstance(own, dict) else {}
    if name not in objectives.available():
        return text, _class_path(cls) if (cls := objectives.registered_class(name)) else name, own
    cls, preset = objectives.get(name)
    init_args = {**preset, **own}
    config["objective"] = {"class_path": _class_path(cls), "init_args": init_args}
    return yaml.safe_dump(config, sort_keys=False), _class_path(cls), init_args


def task_of_args(args: Sequence[str]) -> str:
    """The task ``coretune fit ARGS`` runs: the last ``--task``/``--model.task`` given, else the one its
    ``--config`` file records, else :data:`~coretune.tasks.DEFAULT_TASK`.

    Raises:
        ValueError: ``--task`` names another task than the ``--config`` file it follows records (that file's
            data and model settings are another task's).
    """
    task, config_task, config_file = None, None, None
    it = iter(args)
    for arg in it:
        key, eq, value = arg.partition("=")
        value = value if eq else next(it, "") if key in ("--config", "-c", "--task", "--model.task") else value
        if key in ("--config", "-c") and Path(value).is_file():
            with contextlib.suppress(yaml.YAMLError):
                if (recorded := recorded_task(yaml.safe_load(Path(value).read_text()))) is not None:
                    config_task, config_file = recorded, value
        elif key in ("--task", "--model.task"):
            task = value
    if task is not None and config_task is not None and task != config_task:
        raise ValueError(
            f"--config {config_file} is the configuration of a {config_task} run (model.task: {config_task}) but "
            f"--task {task} was given: drop --task to run it as {config_task}, or pass a {task} configuration"
        )
    return task or config_task or DEFAULT_TASK


def _task_settings() -> dict[str, str]:
    """The settings a task of :data:`~coretune.tasks.TASKS` owns (:attr:`~coretune.tasks.Task.own_settings`), with
    the task's name: ``--task.<setting>``."""
    return {key: task.name for task in TASKS.values() for key in task.own_settings}


def _warn_deprecated_setting(key: str) -> None:
    """One line on stderr: ``--model.<key>`` (a task's setting) is deprecated for ``--task.<key>``."""
    print(
        f"coretune fit: --model.{key} is deprecated and will be removed in the next release: use --task.{key} "
        f"(a setting of the {_task_settings()[key]} task)",
        file=sys.stderr,
    )


def _warn_deprecated_config(path: str, keys: Sequence[str]) -> None:
    """One line on stderr: the ``--config`` file ``path`` spells the model settings ``keys`` flat, as older versions
    did (``model: {lr: 0.01}``)."""
    old = ", ".join(f"model.{key}" for key in keys)
    new = ", ".join(f"model.{moved_option(key)}" for key in keys)
    print(
        f"coretune fit: --config {path} sets {old}, which are deprecated and will be removed in the next release: "
        f"use {new} (model: {{optim: {{lr: …}}}}, model: {{weights_options: {{format: …}}}})",
        file=sys.stderr,
    )


def translate_args(args: list[str]) -> list[str]:
    """Rewrite the friendly aliases: ``--objective NAME`` (registry names and Table 2 presets, also inside
    ``--config`` files), ``--task NAME``, ``--task.<setting> V`` (a task's own setting, e.g. segmentation's
    ``--task.output_stride 8``: ``--model.task_settings.<setting>``; its older spelling ``--model.<setting>`` still
    works, with a deprecation line on stderr, and so does a ``--config`` file's ``model: {output_stride: 8}``),
    ``--seed N``, ``--trainer.logger NAME``, and the optimiser's and weights' settings as older versions spelled
    them (``--model.lr``: ``--model.optim.lr``; ``--model.weights_format``: ``--model.weights_options.format``;
    :data:`~coretune.engine.modelsettings.MOVED_SETTINGS`), each with a deprecation line on stderr
    (:func:`~coretune.engine.loggers.logger_args`; also ``trainer: {logger: NAME}`` inside ``--config`` files)."""
    out: list[str] = []
    objective: str | None = None  # the class path of the objective set so far (a config's, an --objective's)
    settings: dict[str, Any] = {}  # its init_args known so far
    held: dict[str, list[str]] = {}  # an older version's settings of a component that is off so far
    it = iter(args)
    for arg in it:
        key, eq, value = arg.partition("=")
        if key in ("--config", "-c"):
            config, config_objective, config_settings = _translate_config(value if eq else next(it, ""))
            out.append(f"--config={config}")
            if config_objective is not None:
                objective, settings = config_objective, config_settings
        elif key == "--objective":
            previous = objective
            objective, objective_args, given = _objective_class_path(value if eq else next(it, ""), objective, settings)
            out.extend(objective_args)
            settings = {**(settings if objective == previous else {}), **given}
        elif moved := _moved_objective_setting(objective, key):  # an older version's --objective.lambda_n
            out.extend(_moved_objective_args(*moved, value if eq else next(it, ""), settings, held))
        elif key.startswith("--objective.") and key != "--objective.help" and eq:
            _record_setting(settings, key[len("--objective.") :], yaml.safe_load(value))
            out.append(arg)
        elif key == "--objective.help":
            out.append(f"{key}={_objective_class_path(value if eq else next(it, ''))[0]}")
        elif key == "--seed":
            out.append(f"--seed_everything={value if eq else next(it, '')}")
        elif key == "--task":
            out.append(f"--model.task={value if eq else next(it, '')}")
        elif key.startswith("--task.") and key[len("--task.") :] in _task_settings():
            out.append(f"--model.task_settings.{key[len('--task.') :]}={value if eq else next(it, '')}")
        elif key.startswith("--model.") and (new := moved_option(key[len("--model.") :])) is not None:
            print(deprecated_option_line("fit", key, f"--model.{new}"), file=sys.stderr)
            out.append(f"--model.{new}={value if eq else next(it, '')}")
        elif key.startswith("--model.") and key[len("--model.") :] in _task_settings():
            _warn_deprecated_setting(key[len("--model.") :])
            out.append(f"--model.task_settings.{key[len('--model.') :]}={value if eq else next(it, '')}")
        elif key == "--trainer.logger":
            out.extend(logger_args(value if eq else next(it, "")))
        else:
            out.append(arg)
    return out


class FitCLI(RunDirCLI):
    """``coretune fit``: a LightningCLI over :class:`FineTuner` and its task's data module."""

    command = "fit"
    aliases: ClassVar[Mapping[str, str]] = {
        "--objective NAME": "a registered objective or Table 2 preset and its settings (coretune objectives)",
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
        self.trainer_defaults["callbacks"] = default_callbacks(trainer["default_root_dir"], show_progress, guard)
        kwargs["plugins"] = with_atomic_io(trainer.get("plugins"))
        return super().instantiate_trainer(**kwargs)

    def before_fit(self) -> None:
        """The task's check of the data settings, before any data is read (the model checks again once it is), and
        that the test the fit ends with has images (else it failed after the last epoch)."""
        self.model.task.check_data(self.datamodule, "fit")
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
            "fit ends by scoring a test split,"
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
    """The end of ``coretune fit``: where the run is and its test results (``task``: default, the run's own, as its
    ``config.yaml`` records it)."""
    import json

    from rich.console import Console

    if task is None:
        task = TASKS.get(recorded_task(RunDir(run_dir).read_config()) or DEFAULT_TASK, TASKS[DEFAULT_TASK])()
    results = json.loads(RunDir(run_dir).results.read_text())
    test = results.get("test", {})
    console = Console()
    console.print(f"[bold]run directory[/bold]: {run_dir}")
    if test:
        console.print(
            f"{task.summary_line(test)}  "
            f"({results.get('train_images_per_s')} train images/s, {results.get('wall_time_s')} s)"
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
    if (weights := model.get("weights")) and not (download and weights.startswith(HUB_PREFIXES)):
        resolve_weights(weights)  # a file that exists, or a hub name in the local cache (no network)
