"""The training engine: Lightning module (:mod:`.module`, the training loop), what its checkpoints record
(:mod:`.checkpoint`), its output health checks (:mod:`.health`) and data module checks (:mod:`.datachecks`), its speed
options (:mod:`.speed`: channels-last by architecture, ``torch.compile`` with an eager fallback), trainer
set-up, run outputs, optimisers and schedules (:class:`~.optim.OptimSettings`; :mod:`.modelsettings`: the
settings older versions spelled flat), and ``coretune fit`` (:mod:`.fitcli`; its arguments' aliases and older
spellings: :mod:`.fitargs`)."""

from .callbacks import (
    ChanceLevelGuard,
    RunArtifacts,
    epoch_summary,
    plot_learning_curves,
    read_metrics,
    update_results,
)
from .checkpoint import CheckpointMeta
from .checkpoint_io import AtomicCheckpointIO, atomic_torch_save, atomic_write, with_atomic_io
from .fitcli import FitArgsError, FitCLI, resolved_fit_config, translate_args
from .health import GradScalerWatch, NonFiniteLossError, OutputHealth
from .interrupts import StopOnSignal, TrainingInterrupted
from .module import FineTuner
from .optim import OptimSettings, build_optimizer, lr_factor
from .runcli import RESUMABLE_CHANGES, RunDirCLI, check_resume, resolve_run_dir, setting_changes
from .trainer import (
    LIGHTNING_PYTREE_DEPRECATION,
    check_trainer_options,
    default_callbacks,
    default_precision,
    make_trainer,
    quiet_lightning,
)

__all__ = [
    "LIGHTNING_PYTREE_DEPRECATION",
    "RESUMABLE_CHANGES",
    "AtomicCheckpointIO",
    "ChanceLevelGuard",
    "CheckpointMeta",
    "FineTuner",
    "FitArgsError",
    "FitCLI",
    "GradScalerWatch",
    "NonFiniteLossError",
    "OptimSettings",
    "OutputHealth",
    "RunArtifacts",
    "RunDirCLI",
    "StopOnSignal",
    "TrainingInterrupted",
    "atomic_torch_save",
    "atomic_write",
    "build_optimizer",
    "check_resume",
    "check_trainer_options",
    "default_callbacks",
    "default_precision",
    "epoch_summary",
    "lr_factor",
    "make_trainer",
    "plot_learning_curves",
    "quiet_lightning",
    "read_metrics",
    "resolve_run_dir",
    "resolved_fit_config",
    "setting_changes",
    "translate_args",
    "update_results",
    "with_atomic_io",
]
