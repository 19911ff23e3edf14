"""Lightning loggers beside a run's own files (``metrics.csv``, ``results.json``, the learning curve).

``--trainer.logger tensorboard|csv|mlflow|wandb`` names a logger briefly (:func:`logger_args`), and so does
``trainer: {logger: NAME}`` in a ``--config`` file (:func:`expand_config_loggers`); a Logger class path with
``--trainer.logger.<init arg>`` works as in LightningCLI. A logger not given a place of its own writes into the
run directory (:func:`place_loggers`), a resumed run goes on in its MLflow run, and :class:`LogRunSettings` tells
every logger the run's settings. The checkpoints stay in ``RUN/checkpoints`` whatever the logger.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import secrets
import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import yaml
from lightning.pytorch import loggers

from ..runs.layout import RunDir
from .modelsettings import GROUPS
from .runcli import RESUMABLE_CHANGES
from .seeds import run_seed

__all__ = [
    "LOGGERS",
    "LOGGER_ALIAS",
    "RUN_DIR",
    "RUN_DIR_TAG",
    "LogRunSettings",
    "check_logger_installed",
    "check_sweep_logger",
    "expand_config_loggers",
    "logger_args",
    "place_loggers",
    "run_settings",
    "sweep_logger_args",
    "translate_logger_config",
]

RUN_DIR = "<run_dir>"
"""In a logger's ``save_dir``, the run's directory (:func:`place_loggers` puts it in)."""

LOGGERS: dict[str, tuple[type[loggers.Logger], dict[str, Any]]] = {
    "csv": (loggers.CSVLogger, {"save_dir": RUN_DIR, "name": "csv"}),
    "mlflow": (loggers.MLFlowLogger, {"experiment_name": "coretune"}),
    "tensorboard": (loggers.TensorBoardLogger, {"save_dir": RUN_DIR, "name": "tensorboard", "version": 0}),
    "wandb": (loggers.WandbLogger, {"project": "coretune", "offline": True}),
}
"""The short names of ``--trainer.logger`` and the settings they add: CSV into ``RUN/csv/version_N`` (a new version
after each resume: Lightning's CSV logger would empty a folder it reuses), TensorBoard into ``RUN/tensorboard/
version_0`` (a resume appends to it), MLflow into the file store ``RUN/mlruns``, experiment ``coretune``, W&B offline
into ``RUN/wandb``, project ``coretune``."""

LOGGER_ALIAS = (
    "--trainer.logger NAME",
    "tensorboard, csv, mlflow or wandb (offline), in the run directory (docs/loggers.md)",
)
"""The alias line ``coretune fit --help`` and ``coretune pretrain --help`` print for ``--trainer.logger NAME``."""

_PACKAGES: dict[type[loggers.Logger], tuple[tuple[str, ...], str]] = {
    loggers.TensorBoardLogger: (("tensorboard", "tensorboardX"), "tensorboard"),
    loggers.MLFlowLogger: (("mlflow",), "mlflow"),
    loggers.WandbLogger: (("wandb",), "wandb"),
}
"""The modules each logger needs (any one of them) and the ``coretune`` extra that installs them."""

RUN_DIR_TAG = "coretune.run_dir"
"""The MLflow tag naming a run's directory (absolute): a resumed run finds its MLflow run by it."""

_LITERALS = {"true", "false", "null", "none"}


def logger_args(value: str, **settings: Any) -> list[str]:
    """The ``--trainer.logger`` arguments for ``value``: a short name of :data:`LOGGERS` as its class path and
    settings, updated with ``settings`` (later ``--trainer.logger.<arg>`` options override them); a class path or
    name, a boolean, ``null`` or a YAML/JSON value as it is.

    Raises:
        ValueError: ``value`` is none of these (one line naming the choices).
    """
    if value.lower() in LOGGERS:
        cls, preset = LOGGERS[value.lower()]
        options = [f"--trainer.logger.{key}={v}" for key, v in {**preset, **settings}.items()]
        return [f"--trainer.logger={_class_path(cls)}", *options]
    structured = value.lower() in _LITERALS or value.startswith(("{", "[")) or "." in value
    if not structured:
        _check_logger_name(value, "--trainer.logger", "--trainer.logger.<name>")
    return [f"--trainer.logger={value}"]


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _check_logger_name(name: str, option: str, settings: str) -> None:
    """Raise a ``ValueError`` naming the choices unless ``name`` is a class name of Lightning's loggers."""
    if not isinstance(getattr(loggers, name, None), type):
        raise ValueError(
            f"unknown logger {name!r} ({option}): choose one of {', '.join(LOGGERS)}, a Logger class path "
            f"(e.g. lightning.pytorch.loggers.MLFlowLogger, its settings as {settings}), or false"
        )


def _config_logger(spec: Any, source: str) -> Any:
    """One ``trainer.logger`` entry of config file ``source``: a short name of :data:`LOGGERS` (``mlflow``, or
    ``{class_path: mlflow, init_args: {...}}``) as its class path and settings (the entry's own ``init_args``
    win), a class path, class name, boolean or null as it is (``ValueError`` for another name)."""
    name = spec.get("class_path") if isinstance(spec, Mapping) else spec
    if not isinstance(name, str) or "." in name:
        return spec
    if name.lower() not in LOGGERS:
        _check_logger_name(name, f"trainer.logger in {source}", "init_args")
        return spec
    cls, preset = LOGGERS[name.lower()]
    init_args = {**preset, **((spec.get("init_args") or {}) if isinstance(spec, Mapping) else {})}
    return {"class_path": _class_path(cls), "init_args": init_args}


def expand_config_loggers(config: Any, source: str) -> bool:
    """Rewrite in place the short names of :data:`LOGGERS` in the ``trainer.logger`` of a ``--config`` file's
    content ``config`` (from file ``source``; one entry or a list), as ``--trainer.logger NAME`` expands them
    (:func:`logger_args`); whether any was.

    Raises:
        ValueError: an entry names no logger (one line naming the file and the choices).
    """
    trainer = config.get("trainer") if isinstance(config, Mapping) else None
    if not isinstance(trainer, dict) or "logger" not in trainer:
        return False
    chosen = trainer["logger"]
    if isinstance(chosen, list):
        trainer["logger"] = [_config_logger(spec, source) for spec in chosen]
    else:
        trainer["logger"] = _config_logger(chosen, source)
    return trainer["logger"] != chosen


def translate_logger_config(path: str) -> str:
    """A ``--config`` value whose ``trainer.logger`` holds a short name (:func:`expand_config_loggers`), rewritten
    as the YAML text of the same config; other configs (and values that are not files) pass through."""
    file = Path(path)
    if not file.is_file():
        return path
    config = yaml.safe_load(file.read_text())
    return yaml.safe_dump(config, sort_keys=False) if expand_config_loggers(config, path) else path


def sweep_logger_args(name: str, output: str | Path, experiment: str, run: str) -> list[str]:
    """The fit arguments that put run ``run`` of a sweep (``coretune bench``, ``tune``) in the sweep's logger
    ``name`` (a key of :data:`LOGGERS`): one MLflow experiment or W&B project ``experiment`` in ``output``
    (``output/mlruns``, ``output/wandb``), or one TensorBoard or CSV folder per run under ``output/tensorboard``,
    ``output/csv``."""
    output = Path(output)
    where = {
        "csv": {"save_dir": output / "csv", "name": run},
        "mlflow": {"save_dir": output / "mlruns", "experiment_name": experiment, "run_name": run},
        "tensorboard": {"save_dir": output / "tensorboard", "name": run},
        "wandb": {"save_dir": output, "project": experiment, "name": run},
    }[name]
    return logger_args(name, **where)


def check_sweep_logger(name: str) -> None:
    """Refuse, before a sweep starts, a ``--logger`` that is not a short name of :data:`LOGGERS` or whose package is
    missing (one ``ValueError`` line naming the choices, or the ``pip install``)."""
    if name not in LOGGERS:
        raise ValueError(f"unknown logger {name!r} (--logger): choose one of {', '.join(LOGGERS)}")
    check_logger_installed(LOGGERS[name][0])


def check_logger_installed(cls: type) -> None:
    """Raise a ``ValueError`` naming the ``pip install`` when the package logger ``cls`` needs is missing."""
    for logger_cls, (modules, extra) in _PACKAGES.items():
        if issubclass(cls, logger_cls) and not any(importlib.util.find_spec(m) for m in modules):
            raise ValueError(
                f"--trainer.logger {cls.__name__} needs the {modules[0]} package, which is not installed: "
                f"pip install 'coretune[{extra}]'"
            )


def _class(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def place_loggers(config: Any, resuming: bool) -> None:
    """Settle the loggers of a CLI run's parsed ``config`` (``trainer.logger``, ``run_dir``): each needs its
    package (``ValueError`` with the ``pip install`` otherwise); :data:`RUN_DIR` in a ``save_dir`` is the run
    directory, and an MLflow or W&B logger left at its default folder (``./mlruns``, ``.``; no ``tracking_uri`` or
    ``dir``) writes into the run directory (TensorBoard and CSV loggers need a ``save_dir``: the short names give
    :data:`RUN_DIR`). An MLflow run is named after the run directory and tagged with it (:data:`RUN_DIR_TAG`); a
    ``resuming`` run goes on in the MLflow run so tagged. A file store needs MLflow 3's opt-in
    (``MLFLOW_ALLOW_FILE_STORE``), set here unless set already."""
    run_dir = Path(config["run_dir"])
    chosen = config["trainer"].get("logger")
    for spec in chosen if isinstance(chosen, list) else [chosen]:
        if not isinstance(spec, Mapping) and not hasattr(spec, "class_path"):
            continue  # true, false or none: Lightning's default logger (into the run directory), or none
        cls, args = _class(spec["class_path"]), spec["init_args"]
        check_logger_installed(cls)
        if isinstance(args.get("save_dir"), str) and RUN_DIR in args["save_dir"]:
            args["save_dir"] = args["save_dir"].replace(RUN_DIR, str(run_dir))
        if issubclass(cls, loggers.MLFlowLogger):
            _place_mlflow(args, run_dir, resuming)
        elif issubclass(cls, loggers.WandbLogger):
            _place_wandb(args, run_dir, resuming)


def _place_wandb(args: Any, run_dir: Path, resuming: bool) -> None:
    """Into the run directory unless told otherwise; the W&B run id kept in ``RUN/wandb_id``, so that a resumed run
    goes on in the same W&B run (online; offline, each start writes its own folder of that id, which ``wandb
    sync RUN/wandb/offline-run-*`` uploads into the one run, in order)."""
    if args["save_dir"] == _default(loggers.WandbLogger, "save_dir") and not args["dir"]:
        args["save_dir"] = str(run_dir)
    if args.get("id") or args.get("version"):
        return
    id_file = RunDir(run_dir).wandb_id
    if resuming and id_file.is_file():
        args["id"] = id_file.read_text().strip()
        return
    args["id"] = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    id_file.write_text(args["id"] + "\n")


def _default(cls: type, name: str) -> Any:
    """The default value of ``cls``'s constructor argument ``name``."""
    return inspect.signature(cls).parameters[name].default


def _place_mlflow(args: Any, run_dir: Path, resuming: bool) -> None:
    if not args.get("tracking_uri") and args.get("save_dir") == _default(loggers.MLFlowLogger, "save_dir"):
        args["save_dir"] = str(run_dir / "mlruns")
    uri = args.get("tracking_uri") or f"file:{args['save_dir']}"
    if uri.startswith("file:") or "://" not in uri:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    if args.get("run_name") is None:
        args["run_name"] = run_dir.name
    args["tags"] = {**(args.get("tags") or {}), RUN_DIR_TAG: str(run_dir.resolve())}
    if resuming and args.get("run_id") is None:
        args["run_id"] = _mlflow_run(uri, args["experiment_name"], str(run_dir.resolve()))


def _mlflow_run(uri: str, experiment_name: str, run_dir: str) -> str | None:
    """The id of the latest run of the MLflow experiment tagged with ``run_dir``, or None."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(experiment_name)
    if experiment is None:
        return None
    quoted = run_dir.replace("\\", "\\\\").replace("'", "\\'")
    runs = client.search_runs(
        [experiment.experiment_id],
        filter_string=f"tags.`{RUN_DIR_TAG}` = '{quoted}'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    return runs[0].info.run_id if runs else None


def run_settings(model: L.LightningModule, datamodule: L.LightningDataModule | None = None) -> dict[str, Any]:
    """What a run's loggers record as its parameters: ``objective`` (its registered name) and ``objective.<x>``
    (η, α, …) or a pre-training run's ``method``, ``seed``, ``model.<x>`` (a group's as ``model.optim.lr``) and
    ``data.<x>`` (label fraction, image size, …), without the settings a resume may change
    (:data:`~coretune.engine.RESUMABLE_CHANGES`), so a resumed run logs the same values, and without private
    entries (LightningCLI's ``_instantiator``)."""
    settings: dict[str, Any] = {"seed": run_seed()}
    if method := getattr(model, "method", ""):
        settings["method"] = method  # a pre-training method (coretune pretrain)
    if (objective := getattr(model, "objective", None)) is not None:
        settings["objective"] = objective.registered_name
        for key, value in objective.hparams().items():  # a component's settings (Core-tuning's miner) one by one
            nested = isinstance(value, dict) and value
            settings |= {f"objective.{key}.{k}": v for k, v in value.items()} if nested else {f"objective.{key}": value}
    for key, value in model.hparams.items():  # a group's settings one by one: model.optim.lr
        group = key in GROUPS and isinstance(value, Mapping)
        settings |= {f"model.{key}.{k}": v for k, v in value.items()} if group else {f"model.{key}": value}
    settings |= {f"data.{k}": v for k, v in (datamodule.hparams if datamodule is not None else {}).items()}
    return {k: v for k, v in settings.items() if k not in RESUMABLE_CHANGES and not k.split(".")[-1].startswith("_")}


class LogRunSettings(L.Callback):
    """Logs :func:`run_settings` to every logger of the run when the fit starts (in place of Lightning's own
    hyper-parameters, which hold no objective or seed and settings a resume may change)."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.loggers:
            settings = run_settings(pl_module, trainer.datamodule)
            for logger in trainer.loggers:
                logger.log_hyperparams(settings)
