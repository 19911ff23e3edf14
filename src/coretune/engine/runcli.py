"""A CLI run's directory: where it writes (``--run_dir``), resuming from it, and holding it while it runs."""

from __future__ import annotations

import contextlib
import importlib
import shutil
import time
import warnings
from argparse import RawDescriptionHelpFormatter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Union, get_args, get_origin

import yaml
from jsonargparse import DefaultHelpFormatter
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from ..arguments import OneLineErrors
from ..data.loading import AUTO, hardware_of_settings, is_auto, resolve_loading
from ..distributed import is_launching_process
from ..models import CheckpointError, UnreadableCheckpointError, load_checkpoint_file, weights_digest
from ..objectives import upgrade_objective_config
from ..runs.atomic import atomic_write
from ..runs.claim import fit_claim
from ..runs.layout import RunDir
from ..runs.outputs import check_folder_output, data_paths, mark_folder
from ..tasks import DEFAULT_TASK, TASKS, moved_task_settings
from .modelsettings import grouped_model_settings

__all__ = [
    "RESUMABLE_CHANGES",
    "RunDirCLI",
    "check_resume",
    "check_run_dir",
    "resolve_auto_loading",
    "resolve_run_dir",
    "setting_changes",
]

_WHERE = frozenset({"ckpt_path", "weights_only", "run_dir", "trainer.default_root_dir", "trainer.logger"})
"""Where a run resumes from and writes to, and logs to (``trainer.logger`` and its settings, which may be added,
changed or dropped on a resume): not settings of the run, never compared."""

RESUMABLE_CHANGES = frozenset(
    {
        "trainer.max_epochs",
        "trainer.max_steps",
        "trainer.max_time",
        "trainer.min_epochs",
        "trainer.min_steps",
        "trainer.accelerator",
        "trainer.devices",
        "trainer.precision",
        "trainer.enable_progress_bar",
        "trainer.enable_model_summary",
        "trainer.log_every_n_steps",
        "trainer.num_sanity_val_steps",
        "trainer.profiler",
        "trainer.detect_anomaly",
        "trainer.enable_autolog_hparams",
        "trainer.callbacks",
        "data.num_workers",
        "data.pin_memory",
        "data.cache_images",
        "data.eval_batch_size",
        "model.channels_last",
        "model.compile",
        "model.weights_options.download",
        "test",
    }
)
"""Settings a run may be resumed with after a change (a class's ``init_args.x`` named as its ``x``): how long it trains
(``trainer.max_epochs`` extends a run, its learning-rate schedule stretched to the new length), the hardware and numeric
precision it runs on (``trainer.devices`` only with the same number of devices), what it prints (added callbacks, such
as a monitor; its loggers are where it logs, never compared), how images are loaded, whether named weights may be
downloaded (the same file either way), and whether the fit ends by testing (``--test``). Every other setting changes the
model, the objective, the data or the optimisation, so a resume with another value is refused; but ``model.weights`` may
name another path to the very file the run started from (its SHA-256, which the checkpoint records), and another file at
the same path is refused."""


def _flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"trainer": {"max_epochs": 2}}`` as ``{"trainer.max_epochs": 2}``; a class's ``init_args`` are its own
    (``model.init_args.backbone`` is ``model.backbone``, as a checkpoint's hyper-parameters name it), tuples are
    lists."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if key == "init_args" and isinstance(value, Mapping):
            flat |= _flat(value, prefix)
        elif isinstance(value, Mapping) and value:
            flat |= _flat(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = _class_of(value) if key == "class_path" else _plain(value)
    return flat


def _plain(value: Any) -> Any:
    """Tuples (in hyper-parameters) as the lists a YAML config holds."""
    return [_plain(v) for v in value] if isinstance(value, tuple | list) else value


def _class_of(path: Any) -> Any:
    """The full name of the class a ``class_path`` names (``coretune.objectives.CETuning`` is
    ``coretune.objectives.ce.CETuning``), or ``path`` itself if it names none."""
    module, _, name = str(path).rpartition(".")
    with contextlib.suppress(ImportError, ValueError):
        cls = getattr(importlib.import_module(module), name, None)
        if isinstance(cls, type):
            return f"{cls.__module__}.{cls.__qualname__}"
    return path


def _device_count(devices: Any) -> Any:
    """How many devices a ``--trainer.devices`` value asks for (``[1]`` and ``1`` are one), or the value itself."""
    if isinstance(devices, list):
        return len(devices)
    with contextlib.suppress(TypeError, ValueError):
        return len([d for d in devices.split(",") if d.strip()]) if "," in str(devices) else int(devices)
    return devices


def _is_where(key: str) -> bool:
    """Whether a flat setting (``trainer.logger.save_dir``) is, or belongs to, one of :data:`_WHERE`."""
    return key in _WHERE or any(key.startswith(f"{where}.") for where in _WHERE)


def setting_changes(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """The settings whose values differ between two run configurations (nested dicts, as in ``config.yaml``), as
    ``"key old → new"``, split into those a resume may change (:data:`RESUMABLE_CHANGES`) and the others. Settings
    only one side has (options added by a later version) are left out."""
    old, new = _flat(recorded), _flat(current)
    allowed, refused = [], []
    for key in [k for k in new if k in old and old[k] != new[k] and not _is_where(k)]:
        if key == "trainer.devices" and _device_count(old[key]) != _device_count(new[key]):
            resumable = False
        else:
            # a single --trainer.callbacks class is recorded as a mapping: its trainer.callbacks.<x> are callbacks too
            resumable = key in RESUMABLE_CHANGES or key.startswith("trainer.callbacks.")
        (allowed if resumable else refused).append(f"{key} {old[key]} → {new[key]}")
    return allowed, refused


def _resume_source(config: Mapping[str, Any]) -> Path | None:
    """The checkpoint file a run with this configuration resumes from (Lightning's ``ckpt_path="last"`` is the run
    directory's ``checkpoints/last.ckpt``), or None (a new run, or a ``ckpt_path`` Lightning resolves itself)."""
    ckpt = config.get("ckpt_path")
    if ckpt == "last":
        ckpt = RunDir(config["run_dir"]).last_checkpoint
    return Path(ckpt) if ckpt is not None and Path(ckpt).is_file() else None


def _recorded_settings(checkpoint: Any, config_file: Path | None) -> list[Mapping[str, Any]]:
    """What a run was trained with: its ``config.yaml`` (if any) and its checkpoint's model and data
    hyper-parameters (as ``{"model": …, "data": …}``)."""
    recorded: list[Mapping[str, Any]] = []
    if config_file is not None:
        try:
            settings = yaml.safe_load(config_file.read_text())
        except yaml.YAMLError as err:
            raise ValueError(
                f"{config_file}, the settings the run was trained with, is not valid YAML ({type(err).__name__}): "
                "restore it, or start a new run with another --run_dir"
            ) from None
        recorded.append(settings if isinstance(settings, Mapping) else {})
    if isinstance(checkpoint, Mapping):
        hparams = {"model": checkpoint.get("hyper_parameters"), "data": checkpoint.get("datamodule_hyper_parameters")}
        recorded.append({k: v for k, v in hparams.items() if isinstance(v, Mapping)})
    return recorded


def _with_task_settings(settings: Mapping[str, Any]) -> Mapping[str, Any]:
    """A run configuration (or a checkpoint's hyper-parameters as ``{"model": …}``) whose ``model`` holds its task
    settings as coretune records them now, the task's defaults filled in (``model.task_settings``), and its
    optimiser's and weights' settings in their groups: an older run's ``model.output_stride`` then compares with
    ``--task.output_stride``, its ``model.lr`` with ``--model.optim.lr``, and a setting left at its default with the
    default given (:func:`~coretune.tasks.moved_task_settings`, :meth:`~coretune.tasks.Task.resolved_settings`,
    :func:`~coretune.engine.modelsettings.grouped_model_settings`)."""
    model = settings.get("model")
    owned = {key for task in TASKS.values() for key in task.own_settings} | {"task", "task_settings"}
    if not isinstance(model, Mapping) or not owned & set(model):
        return settings  # not a FineTuner's
    model = grouped_model_settings(moved_task_settings(model))
    task, given = TASKS.get(str(model.get("task", DEFAULT_TASK))), model.get("task_settings")
    if task is not None and (given is None or isinstance(given, Mapping)):
        model["task_settings"] = task.resolved_settings(given)
    return {**settings, "model": model}


def _current_spelling(settings: Mapping[str, Any]) -> Mapping[str, Any]:
    """A run configuration with an older version's settings spelled as now: its task settings
    (:func:`_with_task_settings`) and its objective's (Core-tuning's ``lambda_n`` as ``miner.lambda_n``:
    :func:`~coretune.objectives.upgrade_objective_config`), so they compare with the current ones."""
    settings = _with_task_settings(settings)
    objective, moved = upgrade_objective_config(settings.get("objective"))
    return {**settings, "objective": objective} if moved else settings


def _weights_digests(checkpoint: Any, current: Mapping[str, Any]) -> tuple[str, str | None] | None:
    """The SHA-256 of the file the run started from (its checkpoint's ``coretune.weights_sha256``) and that of the
    file ``--model.weights`` names now (None: no such file), or None when the checkpoint records none."""
    recorded = (checkpoint.get("coretune") or {}).get("weights_sha256") if isinstance(checkpoint, Mapping) else None
    weights = _flat(current).get("model.weights")
    if recorded is None or weights is None:
        return None
    try:
        return recorded, weights_digest(weights, _flat(current).get("model.backbone"))
    except (CheckpointError, OSError):  # no such file: the fit names it
        return recorded, None


def check_resume(config: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Refuse, before anything is written, to resume a run whose checkpoint cannot be read or which was trained
    with other settings; return the settings that changed and may (:func:`setting_changes`).

    ``config`` is the parsed configuration (``run_dir``, ``ckpt_path``), ``current`` the same as ``config.yaml``
    would record it. The recorded settings are the run directory's ``config.yaml`` (else that of the checkpoint's
    run directory) and the checkpoint's hyper-parameters.

    Raises:
        ValueError: settings that change the maths or the data differ (each named, old → new).
        CheckpointError: the checkpoint is truncated or corrupt (the run's ``best.ckpt`` offered when it is the
            run's ``last.ckpt``), or a pickle that would run code.
    """
    ckpt = _resume_source(config)
    if ckpt is None:
        return []
    run = RunDir(config["run_dir"])
    try:
        checkpoint = load_checkpoint_file(ckpt)
    except UnreadableCheckpointError as err:
        if ckpt.resolve() != run.last_checkpoint.resolve():
            raise
        best = ckpt.with_name(run.best_checkpoint.name)
        instead = f"resume from its best checkpoint (perhaps an earlier epoch) with --ckpt_path {best}, or "
        raise CheckpointError(
            f"cannot resume the run in {run.path}: its checkpoint {ckpt} is truncated or corrupt ({err.reason}). "
            f"Nothing was changed: {instead if best.is_file() else ''}start a new run with another --run_dir"
        ) from None
    config_file = next((p for p in (run.config, RunDir(ckpt.parent.parent).config) if p.is_file()), None)
    allowed: dict[str, None] = {}
    refused: dict[str, None] = {}
    digests = _weights_digests(checkpoint, current)
    same_file = digests is not None and digests[0] == digests[1]  # the very file, perhaps moved: may be renamed
    for settings in _recorded_settings(checkpoint, config_file):
        may, may_not = setting_changes(_current_spelling(settings), _current_spelling(current))
        allowed |= dict.fromkeys(may + [c for c in may_not if c.startswith("model.weights ") and same_file])
        refused |= dict.fromkeys(c for c in may_not if not (c.startswith("model.weights ") and same_file))
    epochs = _flat(current).get("trainer.max_epochs")
    done = checkpoint.get("epoch") if isinstance(checkpoint, Mapping) else None
    if isinstance(epochs, int) and epochs >= 0 and isinstance(done, int) and epochs < done + 1:
        # the checkpoint was saved during (or at the end of) 0-based epoch `done`: that many epochs and more trained
        refused[
            f"trainer.max_epochs {epochs} is below the {done + 1} epoch(s) the checkpoint has reached (pass "
            f"--trainer.max_epochs {done + 1} or more)"
        ] = None
    if (
        digests is not None
        and digests[1] is not None
        and not same_file
        and not any(c.startswith("model.weights ") for c in refused)
    ):  # the same path, another file (re-made or replaced): L2-SP and DELTA would anchor to it
        weights = _flat(current)["model.weights"]
        refused[f"model.weights {weights} holds another file (SHA-256 {digests[0][:12]}… → {digests[1][:12]}…)"] = None
    if refused:
        fix = f" (--config {config_file} applies them)" if config_file is not None else ""
        raise ValueError(
            f"the run in {run.path} was trained with other settings than these: {'; '.join(refused)}. Resuming it "
            f"from {ckpt} would go on with settings it was not trained with: resume it with its own{fix}, or start "
            "a new run with another --run_dir"
        )
    return list(allowed)


def _held_results(run: RunDir) -> str:
    """What a finished run directory without ``last.ckpt`` holds that a new fit would overwrite (its test results,
    and any checkpoints), described; empty for an unfinished run: one that stopped before saving ``last.ckpt``
    (killed between its best and last checkpoints, or at a mid-epoch validation: ``coretune bench`` re-runs it from
    the start) or that diverged (re-fitted with a fix, its record is replaced)."""
    if not run.is_finished():
        return ""
    what = "results (the test skipped)" if run.test_skipped() else "test results"
    return ", ".join([what, *(f"checkpoints/{p.name}" for p in sorted(run.checkpoints.glob("*.ckpt")))])


def resolve_run_dir(config: Any, default_name: str) -> None:
    """Settle a CLI run's directory in its parsed ``config`` (``run_dir``, ``trainer``, ``ckpt_path``).

    ``run_dir`` defaults to ``<default_root_dir>/<default_name>-<date>-<time>`` (``--trainer.default_root_dir``,
    Lightning's convention, is the parent of run directories; ``runs`` without it) and becomes the trainer's
    ``default_root_dir``.
    Without ``--ckpt_path``, a run directory that holds ``checkpoints/last.ckpt`` is resumed from it: re-running
    a command continues its run (a finished run is only tested again) instead of starting over and overwriting its
    checkpoints and metrics; a finished one (test results) without ``last.ckpt`` (copied back without its
    checkpoints, say) is refused (``ValueError``). Lightning's "checkpoint directory exists and is not empty"
    warning is then expected and silenced.
    """
    if config.get("run_dir") is None:
        parent = config["trainer"].get("default_root_dir") or "runs"
        config["run_dir"] = str(Path(parent) / f"{default_name}-{time.strftime('%Y%m%d-%H%M%S')}")
    config["trainer"]["default_root_dir"] = config["run_dir"]
    run = RunDir(config["run_dir"])
    if "://" in str(config.get("ckpt_path") or ""):  # Lightning reads http(s) checkpoints with weights_only=False
        raise ValueError(
            f"--ckpt_path {config['ckpt_path']} is a remote file: coretune resumes only from local checkpoints, read "
            "weights-only (a remote one would be unpickled, which can run code): download it and pass its path"
        )
    if config.get("ckpt_path") is None and run.last_checkpoint.is_file():
        config["ckpt_path"] = str(run.last_checkpoint)
    if config.get("ckpt_path") is None and (held := _held_results(run)):
        raise ValueError(
            f"{run.path} holds a run ({held}) but no {run.last_checkpoint.name} to resume it from: a new fit there "
            "would overwrite its results and metrics. Pass another --run_dir, resume it from one of its checkpoints "
            "with --ckpt_path, or delete that folder to start over"
        )
    if config.get("ckpt_path") is not None:
        warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")


def resolve_auto_loading(config: Any) -> str | None:
    """Replace ``auto`` in a parsed run configuration's ``data.num_workers`` and ``data.pin_memory`` by the values
    chosen for its ``trainer`` settings' accelerator (:func:`~coretune.data.loading.resolve_loading`), in place, so
    that ``config.yaml``, the checkpoint and a resume's comparison hold them; the line naming them, or None when
    neither was ``auto`` (explicit values are left as they are, for the data module to check)."""
    data = config.get("data")
    if data is None:
        return None
    if "init_args" in data:  # a data class given by class path
        data = data["init_args"]
    workers, pin = data.get("num_workers", 0), data.get("pin_memory", AUTO)
    if not (is_auto(workers) or is_auto(pin)) or not (is_auto(workers) or _count(workers)):
        return None  # nothing to choose, or a number of workers the data module refuses
    cuda, processes = hardware_of_settings(config.get("trainer") or {})
    settings = resolve_loading(workers, pin, cuda=cuda, processes_per_node=processes)
    if is_auto(workers):
        data["num_workers"] = settings.num_workers
    if "pin_memory" in data and is_auto(pin):
        data["pin_memory"] = settings.pin_memory
    return settings.describe()


def _count(value: Any) -> bool:
    """Whether ``value`` is a count (an int >= 0)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _made_by_a_run(folder: Path) -> bool:
    """Whether a folder without the command's marker is a run all the same: made before runs were marked (its
    checkpoints, results, claim, or a sweep's fit arguments)."""
    run = RunDir(folder)
    return any(path.exists() for path in (run.checkpoints, run.results, run.claim, run.fit_args))


def check_run_dir(config: Mapping[str, Any], current: Mapping[str, Any], command: str) -> None:
    """Refuse, before anything is read or written, a ``--run_dir`` that ``coretune <command>`` would write into but
    did not make (:func:`coretune.runs.outputs.check_folder_output`): a folder of other files (a user's own
    ``config.yaml`` and ``metrics.csv``), the data it reads or a folder inside it, an input, another command's
    folder, or an unwritable one. ``current`` is the configuration as ``config.yaml`` records it."""
    flat = _flat(current)
    reads = [("a --config file", str(path)) for path in config.get("config") or []]
    reads += [("the pre-trained weights (--model.weights)", flat.get("model.weights"))]
    reads += [("the checkpoint (--ckpt_path)", config.get("ckpt_path"))]
    reads = [(what, path) for what, path in reads if isinstance(path, str)]
    data = data_paths(current.get("data") if isinstance(current.get("data"), Mapping) else None)
    check_folder_output(config["run_dir"], command, option="--run_dir", reads=reads, data=data,
                        ours=_made_by_a_run)  # fmt: skip


class SaveConfigOnFitStart(SaveConfigCallback):
    """LightningCLI's ``config.yaml``, written once the run's checkpoint is restored (``on_fit_start``) instead of at
    set-up: a resume refused while loading its checkpoint (the data gained a class) leaves the file as it was. It
    goes into the run directory (the trainer's ``default_root_dir``), not a logger's folder (LightningCLI's
    ``trainer.log_dir``), where a resume reads it."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Nothing yet: see :meth:`on_fit_start`."""

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.is_global_zero and not self.already_saved:
            path = RunDir(trainer.default_root_dir).config
            if path.exists() and not self.overwrite:  # save_config_kwargs={"overwrite": False} (coretune's: True)
                raise RuntimeError(f"{path} exists: pass another run directory, or save_config_kwargs overwrite=True")
            with atomic_write(path) as f:  # whole, for the sweeps that read it while the run goes on
                f.write(self.parser.dump(self.config, skip_unset=False))
        self.already_saved = True


class _KeepLinesHelpFormatter(RawDescriptionHelpFormatter, DefaultHelpFormatter):
    """jsonargparse's help, keeping the line breaks of descriptions and the epilog (one alias a line)."""


class _RemoveIfUntrained:
    """An exit handler for a run directory this process created: when the run fails before its first optimiser
    step (``steps()`` is 0; no checkpoint or ``metrics.csv``), remove the directory and what it holds (the claim,
    ``config.yaml``, a logger's empty run such as MLflow's), so that a mistyped data root leaves no empty run
    behind. A run that trained at all, or whose ``results.json`` records that it diverged (in its first
    validation: a finding, which ``coretune tune`` does not run again), keeps everything."""

    def __init__(self, run_dir: str | Path, steps: Callable[[], int]) -> None:
        self.run, self.steps = RunDir(Path(run_dir)), steps
        self.claimed = False  # set once this process holds the run's claim: a run another process claimed first
        # (both saw no directory) is that process's, however new

    def __call__(self, exc_type: type[BaseException] | None, *_: Any) -> bool:
        trained = self.steps() > 0 or self.run.metrics.is_file() or any(self.run.checkpoints.glob("*.ckpt"))
        failed = exc_type is not None and self.claimed and self.run.path.is_dir()
        if failed and not trained and self.run.divergence() is None:
            shutil.rmtree(self.run.path, ignore_errors=True)
        return False  # the error goes on


def int_before_float(function: Callable[..., Any]) -> None:
    """Give ``int`` before ``float`` in ``function``'s annotations that accept both (the Trainer's
    ``limit_val_batches``, ``val_check_interval``…: an int counts batches, a float is a fraction), in place.

    The parser tries a union's types in order, and Python caches ``Optional[Union[…]]`` by a union that compares
    equal whatever its order: once any module imported before Lightning (scikit-learn does) has built
    ``Optional[Union[float, int]]``, the Trainer's ``Optional[Union[int, float]]`` *is* that object, and
    ``--trainer.limit_val_batches=1`` would parse as 1.0 (every batch) instead of 1 (one batch).
    """
    for name, hint in function.__annotations__.items():
        types = get_args(hint)
        if get_origin(hint) is Union and int in types and float in types and types.index(float) < types.index(int):
            function.__annotations__[name] = Union[(int, *(t for t in types if t is not int))]  # uncached order


class _Parser(OneLineErrors, LightningArgumentParser):
    """LightningCLI's parser with one-line errors."""


class RunDirCLI(LightningCLI):
    """A LightningCLI whose run writes into ``--run_dir`` (added by the subclass), held while it runs.

    Start it with :meth:`run`: :meth:`settle_run_dir` (called by the subclass once the configuration is parsed)
    resolves the directory (:func:`resolve_run_dir`), claims it (:func:`coretune.runs.claim.fit_claim`; only in the
    process a user or a sweep started, not in those a DDP launcher adds) until the run ends, so that a second run
    into the same directory is refused instead of overwriting its checkpoints, and checks a resume
    (:func:`check_resume`: the checkpoint is readable and the run was trained with these settings). ``config.yaml``
    is written when the fit starts (:class:`SaveConfigOnFitStart`).
    """

    command: ClassVar[str]
    """The ``coretune`` command it runs (``fit``, ``pretrain``): what its ``--help`` and errors name."""
    aliases: ClassVar[Mapping[str, str]] = {}
    """The options the command rewrites before parsing (its ``translate_args``) and what each does: listed at the
    end of its ``--help``."""

    def __init__(self, *args: Any, hold: contextlib.ExitStack, **kwargs: Any) -> None:
        self._hold = hold
        int_before_float(kwargs.get("trainer_class", Trainer).__init__)
        super().__init__(*args, **kwargs)

    @classmethod
    def run(cls, *args: Any, **kwargs: Any) -> None:
        """Parse, run the subcommand, and release the run directory afterwards (also on errors)."""
        kwargs.setdefault("save_config_callback", SaveConfigOnFitStart)
        kwargs.setdefault("parser_class", _Parser)
        with contextlib.ExitStack() as hold:
            cls(*args, hold=hold, **kwargs)

    def _add_subcommands(self, parser: Any, **kwargs: Any) -> None:
        """LightningCLI's subcommand parsers, named ``coretune <command>`` (jsonargparse would name them
        ``<prog> [options] fit``, also for ``coretune pretrain``)."""
        super()._add_subcommands(parser, **kwargs)
        parser.prog = f"coretune {self.command}"  # not the script's name (cli.py under python -m)
        width = max(map(len, self.aliases), default=0) + 2
        lines = [f"  {option:<{width}}{meaning}" for option, meaning in self.aliases.items()]
        for subcommand_parser in self._subcommand_parsers.values():
            subcommand_parser.prog = f"coretune {self.command}"
            if lines:
                subcommand_parser.epilog = "\n".join(["aliases (rewritten to the options above):", *lines])
                subcommand_parser.formatter_class = _KeepLinesHelpFormatter

    def _parse_ckpt_path(self) -> None:
        """Nothing: LightningCLI would replace the command line's model settings by those of a ``--ckpt_path``
        checkpoint, silently (and read it with torch's multi-line errors); :func:`check_resume` refuses a
        difference instead."""

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        """The trainer; a setting Lightning refuses (``MisconfigurationException``, e.g. ``--trainer.devices 0``)
        is a ``ValueError`` with Lightning's message on one line."""
        try:
            return super().instantiate_trainer(**kwargs)
        except MisconfigurationException as err:
            raise ValueError(f"invalid trainer settings: {' '.join(str(err).split())}") from None

    def settle_run_dir(self, default_name: str) -> None:
        config = self.config[self.subcommand]
        if (loading := resolve_auto_loading(config)) is not None:
            rank_zero_info(loading)
        found = config.get("ckpt_path") is None
        resolve_run_dir(config, default_name)
        found = found and config.get("ckpt_path") is not None
        current = yaml.safe_load(self._parser(self.subcommand).dump(config, skip_unset=False))
        check_run_dir(config, current, self.command)
        if is_launching_process():
            remover = None
            if not Path(config["run_dir"]).exists():
                steps = lambda: int(getattr(getattr(self, "trainer", None), "global_step", 0))  # noqa: E731
                remover = _RemoveIfUntrained(config["run_dir"], steps)
                self._hold.push(remover)  # runs after the claim's release
            self._hold.enter_context(fit_claim(config["run_dir"]))
            if remover is not None:
                remover.claimed = True
            mark_folder(config["run_dir"], self.command)
        changes = check_resume(config, current)
        if found or changes:
            changed = f" with {'; '.join(changes)}" if changes else ""
            rank_zero_info(
                f"resuming the run in {config['run_dir']} from {config['ckpt_path']}{changed} (re-running a command "
                "continues its run; to start over, pass another --run_dir or delete that folder)"
            )
