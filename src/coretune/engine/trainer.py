"""A Lightning ``Trainer`` set up as coretune runs expect: precision, progress bar, checkpoints, run outputs."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, RichProgressBar
from lightning.pytorch.strategies import StrategyRegistry

from ..runs.layout import RunDir
from ..tasks import DEFAULT_TASK, TASKS
from .callbacks import ChanceLevelGuard, RunArtifacts, task_of
from .checkpoint_io import AtomicCheckpointIO
from .interrupts import StopOnSignal
from .loggers import LogRunSettings
from .optim import SCHEDULE_OPTION
from .preflight import training_length_problems

__all__ = [
    "LIGHTNING_PYTREE_DEPRECATION",
    "check_trainer_options",
    "default_callbacks",
    "default_precision",
    "make_trainer",
    "quiet_lightning",
]

#: A deprecation warning raised inside Lightning 2.6's own pytree code on every fit; nothing a user can change.
LIGHTNING_PYTREE_DEPRECATION = r".*isinstance\(treespec, LeafSpec\)"


class _DropCloudLoggingTip(logging.Filter):
    """Drops Lightning's "try litlogger" advertisement (an online service; coretune runs log to local files)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in record.getMessage()


def quiet_lightning() -> None:
    """Silence Lightning output no coretune user can act on: the cloud-logging tip, the pytree deprecation inside
    Lightning, LightningCLI's note that ``args`` is given (coretune's commands rewrite ``sys.argv`` on purpose) and
    the model summary's note that it sizes a bf16-mixed model in fp32 (every fit on bf16 hardware printed it).
    Idempotent; every other warning and message stays."""
    log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropCloudLoggingTip) for f in log.filters):
        log.addFilter(_DropCloudLoggingTip())
    warnings.filterwarnings("ignore", message=LIGHTNING_PYTREE_DEPRECATION)
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended", category=UserWarning)
    warnings.filterwarnings(
        "ignore", message=r"Precision \S+ is not supported by the model summary", category=UserWarning
    )


def default_precision() -> str:
    """``bf16-mixed`` where the hardware runs it natively (CUDA with bf16, or a CPU with AVX-512-BF16/AMX);
    ``16-mixed`` on a CUDA GPU without bf16; else ``32-true``."""
    if torch.cuda.is_available():
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    cpu = torch.backends.cpu.get_cpu_capability()
    return "bf16-mixed" if torch.cpu._is_avx512_bf16_supported() or "AMX" in cpu else "32-true"


def _accelerator_available(name: str) -> bool:
    """Whether Lightning's accelerator ``name`` (``gpu`` = CUDA or MPS) can run on this machine."""
    names = ("cuda", "mps") if name == "gpu" else (name,)
    return any(n in AcceleratorRegistry and AcceleratorRegistry[n]["accelerator"].is_available() for n in names)


def _start_method(strategy: Any) -> str | None:
    """How a ``--trainer.strategy`` (a registered name, or a ``class_path`` with ``init_args``) starts its
    processes: ``popen`` (a script per process), ``spawn``, ``fork``, or None when it does not say."""
    if isinstance(strategy, str):
        return StrategyRegistry[strategy]["init_params"].get("start_method") if strategy in StrategyRegistry else None
    init_args = strategy.get("init_args") if hasattr(strategy, "get") else None  # a dict or jsonargparse Namespace
    return init_args.get("start_method") if hasattr(init_args, "get") else None


def check_trainer_options(
    trainer: Mapping[str, Any], schedule: str | None = None, schedule_option: str = SCHEDULE_OPTION
) -> None:
    """Refuse, before anything is built or written, the ``--trainer.*`` options of a CLI run that cannot run here:
    an accelerator this machine lacks, SyncBatchNorm on CPU (torch synchronises CUDA tensors only), a gradient
    accumulation below 1 batch, a strategy whose processes Lightning starts with multiprocessing (``ddp_spawn``
    cannot pickle the run; errors in ``ddp_fork``'s and ``ddp_notebook``'s processes reach the command only as a
    traceback, and a diverged run is not recorded), and a training length of nothing or, under the learning-rate
    ``schedule`` (default cosine; set by ``schedule_option``), of no end
    (:func:`~coretune.engine.preflight.training_length_problems`). One ``ValueError`` lists every problem with its
    fix."""
    problems = training_length_problems(trainer, schedule, schedule_option)
    strategy = trainer.get("strategy", "auto")
    if (method := _start_method(strategy)) in ("spawn", "fork", "forkserver"):
        name = strategy if isinstance(strategy, str) else f"with start_method {method}"
        problems.append(
            f"--trainer.strategy {name} starts its processes with multiprocessing ({method}), which coretune's "
            "commands do not support (their errors would not reach the run directory): use --trainer.strategy ddp, "
            "the same data-parallel training with one script per process"
        )
    accelerator = trainer.get("accelerator", "auto")
    if isinstance(accelerator, str) and accelerator not in ("auto", "cpu") and not _accelerator_available(accelerator):
        available = [n for n in sorted(AcceleratorRegistry) if _accelerator_available(n)]
        problems.append(
            f"--trainer.accelerator {accelerator} is not available on this machine (available: "
            f"{', '.join(available)}): pass --trainer.accelerator auto to use the best one there is"
        )
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    if trainer.get("sync_batchnorm") and on_cpu:
        problems.append(
            "--trainer.sync_batchnorm true needs GPUs (torch synchronises batch-norm statistics of CUDA tensors "
            "only): drop it when training on CPU"
        )
    accumulate = trainer.get("accumulate_grad_batches", 1)
    if not isinstance(accumulate, int) or accumulate < 1:
        problems.append(
            f"--trainer.accumulate_grad_batches must be a whole number >= 1 (got {accumulate}): the number of "
            "batches whose gradients one optimiser step sums (1: step after every batch)"
        )
    if problems:
        raise ValueError("; ".join(problems))


class BestCheckpoint(ModelCheckpoint):
    """``best.ckpt``: the model of the epoch with the highest ``val/<monitor>`` of the task being trained
    (:attr:`coretune.tasks.Task.monitor`: top-1 for classification), set once the trainer knows the model."""

    def __init__(self, dirpath: str | Path | None = None) -> None:
        super().__init__(
            dirpath=dirpath,
            filename="best",
            monitor=f"val/{TASKS[DEFAULT_TASK].monitor}",
            mode="max",
            auto_insert_metric_name=False,
            # one best.ckpt: a run started over beside an earlier best.ckpt (killed between its best and last
            # checkpoints) replaces it, instead of writing best-v1.ckpt while domain generalization tests best.ckpt
            enable_version_counter=False,
        )

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.monitor = f"val/{task_of(pl_module).monitor}"
        super().setup(trainer, pl_module, stage)


def default_callbacks(
    run_dir: str | Path | None = None, progress: bool = True, guard: ChanceLevelGuard | None = None
) -> list[Callback]:
    """Best and last checkpoints (best by the task's ``val/<monitor>``, :class:`BestCheckpoint`) in
    ``run_dir/checkpoints`` (without ``run_dir``: the trainer's ``default_root_dir/checkpoints`` while it has no
    logger, else the first logger's folder), run outputs, the run's settings for its loggers, a stop for runs
    collapsed to chance (``guard``, default a :class:`ChanceLevelGuard` with its default thresholds; after the run
    outputs, so the epoch that stops a run is in ``metrics.csv``), a resumable checkpoint on SIGTERM/SIGINT, and a
    rich progress bar with ETA."""
    checkpoint_dir = RunDir(run_dir).checkpoints if run_dir is not None else None
    callbacks: list[Callback] = [
        BestCheckpoint(checkpoint_dir),
        # Every training epoch's end (after that epoch's validation, if any), overwritten: Lightning 2.6's
        # save_last=True writes last.ckpt only when `best` improves, and a plain ModelCheckpoint only at validated
        # epochs when check_val_every_n_epoch > 1.
        ModelCheckpoint(
            dirpath=checkpoint_dir, filename="last", enable_version_counter=False, save_on_train_epoch_end=True
        ),
        RunArtifacts(run_dir),
        LogRunSettings(),
        ChanceLevelGuard(run_dir) if guard is None else guard,
        StopOnSignal(),
    ]
    if progress:
        callbacks.append(RichProgressBar())
    return callbacks


def own_guard(callbacks: Sequence[Callback]) -> tuple[list[Callback], ChanceLevelGuard | None]:
    """A caller's ``callbacks`` without their :class:`ChanceLevelGuard`, and the guard, which replaces the default
    one in :func:`default_callbacks` (the last one given, when there are several: an option given again wins)."""
    guards = [callback for callback in callbacks if isinstance(callback, ChanceLevelGuard)]
    return [callback for callback in callbacks if callback not in guards], (guards[-1] if guards else None)


def make_trainer(run_dir: str | Path, progress: bool = True, **kwargs: Any) -> L.Trainer:
    """A ``Trainer`` writing into ``run_dir`` (``kwargs`` are passed on to ``lightning.Trainer``; a ``logger`` is
    told the run's settings by :class:`~coretune.engine.loggers.LogRunSettings`)."""
    kwargs.setdefault("precision", default_precision())
    kwargs.setdefault("logger", False)
    kwargs.setdefault("enable_autolog_hparams", False)
    kwargs.setdefault("plugins", [AtomicCheckpointIO()])
    progress = progress and kwargs.get("enable_progress_bar", True)
    own, guard = own_guard(list(kwargs.get("callbacks") or []))
    kwargs["callbacks"] = default_callbacks(run_dir, progress, guard) + own
    return L.Trainer(default_root_dir=str(run_dir), **kwargs)
