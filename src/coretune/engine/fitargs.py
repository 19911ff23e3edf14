"""The arguments of ``coretune fit`` as a user may write them, rewritten for LightningCLI: the friendly aliases
(``--objective NAME``, ``--task NAME``, ``--task.<setting>``, ``--seed``, ``--trainer.logger NAME``) and the spellings
of earlier versions (``--model.lr``, ``--model.output_stride``, Core-tuning's ``--objective.lambda_n``, in flags and in
``--config`` files), each with one deprecation line (:func:`translate_args`); the task a command line runs
(:func:`task_of_args`); and recorded arguments in the current spelling (:func:`current_objective_args`)."""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from .. import objectives
from ..models import current_backbone_name, current_weights_name
from ..models.backbones import DROP_PATH_OPTION
from ..runs.config import recorded_task
from ..tasks import DEFAULT_TASK, TASKS, moved_task_settings
from .loggers import expand_config_loggers, logger_args
from .modelsettings import MOVED_SETTINGS, deprecated_option_line, grouped_model_settings, moved_option

__all__ = ["DROP_PATH_ALIAS", "current_objective_args", "drop_path_value", "task_of_args", "translate_args"]

DROP_PATH_ALIAS = "--model.drop_path"
"""``coretune fit --model.drop_path R``: the stochastic depth rate of a timm backbone, ``R`` in [0, 1), written
``--model.backbone_args.drop_path_rate R`` (what config.yaml records); ``model: {drop_path: R}`` in a ``--config``
file too. A backbone without drop path refuses it in one line."""


def drop_path_value(value: Any) -> float:
    """A ``--model.drop_path`` value (text or number) as the rate, checked: a number in [0, 1)."""
    try:
        rate = float(yaml.safe_load(value) if isinstance(value, str) else value)
    except (TypeError, ValueError, yaml.YAMLError):
        rate = math.nan
    if not 0 <= rate < 1:
        raise ValueError(f"--model.drop_path must be a rate in [0, 1) (got {value!r}; DINO's and MAE's ViTs use 0.1)")
    return rate


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


SHARED_OBJECTIVE_SETTINGS = ("label_smoothing",)
"""Settings every built-in objective takes with one meaning (the recipe's, not the method's): ``--objective NAME``
of another class keeps them, where the class's own settings reset (:func:`_objective_class_path`)."""


def _objective_class_path(
    name: str, current: str | None = None, current_args: Mapping[str, Any] | None = None
) -> tuple[str, list[str], dict[str, Any]]:
    """Class path of a registered objective name (class paths pass through), the ``--objective`` arguments that
    set it and its preset, and the hyper-parameters those arguments set.

    When it names another class than ``current`` (the objective a ``--config`` or an earlier ``--objective`` set),
    every hyper-parameter is its new class's default or preset: jsonargparse would keep the ``init_args`` the new
    class also accepts (Core-tuning's ``eta: 0.1`` as BSS's ``eta``, 100 x its 0.001). When it names another preset
    of the same class, the settings the earlier preset set in ``current_args`` are reset too
    (:func:`_sibling_relics`); the other settings (a config's tuned η) stay. A setting every objective shares
    (:data:`SHARED_OBJECTIVE_SETTINGS`: a ViT recipe's label smoothing) stays across classes too, as it does when
    jsonargparse switches the class itself (no ``--config`` before)."""
    preset: dict[str, Any] = {}
    if name in objectives.available():
        cls, preset = objectives.get(name)
    elif (cls := objectives.registered_class(name)) is None:
        if "." not in name:
            objectives.get(name)  # neither a name nor a class (path): "unknown objective 'x'; choose one of: ..."
        return name, [f"--objective={name}"], {}
    class_path = _class_path(cls)
    if current is not None and class_path != current:
        defaults = _defaults(cls)
        shared = {k: v for k, v in (current_args or {}).items() if k in SHARED_OBJECTIVE_SETTINGS and k in defaults}
        init_args = {
            k: list(v) if isinstance(v, tuple) else objectives.plain_setting(v)
            for k, v in {**defaults, **shared, **preset}.items()
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
        if "drop_path" in moved:  # the alias of backbone_args' drop_path_rate
            rate = drop_path_value(moved.pop("drop_path"))
            moved["backbone_args"] = {**(moved.get("backbone_args") or {}), DROP_PATH_OPTION: rate}
            logged = True
        if flat := [key for key in model if key in MOVED_SETTINGS]:
            _warn_deprecated_config(path, flat)
        for key, spell in (("backbone", current_backbone_name), ("weights", current_weights_name)):
            if isinstance(model.get(key), str):
                spell(model[key])  # an older spelling (timm/<model>, timm:<model>): one deprecation line
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
        elif key == DROP_PATH_ALIAS:
            out.append(f"--model.backbone_args.{DROP_PATH_OPTION}={drop_path_value(value if eq else next(it, ''))}")
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
