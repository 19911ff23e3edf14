"""Stopping a run on SIGTERM or SIGINT (Ctrl+C) with a resumable checkpoint, and resuming it exactly.

Lightning on its own stops at SIGTERM without saving anything, and turns Ctrl+C into ``sys.exit(1)``.
:class:`StopOnSignal` instead finishes the current batch, writes ``checkpoints/last.ckpt`` (atomically, through
the trainer's checkpoint IO) and raises :class:`TrainingInterrupted`, which ``coretune fit`` reports with the
command that resumes the run. A mid-epoch checkpoint resumes exactly: the training loader skips the batches
already seen (:class:`coretune.data.samplers.ResumableLoader`), each step's random draws depend on
``(seed, step)`` only, and this callback carries the partial epoch's logged sums and metric states across the
restart, so the epoch's ``train/*`` values are those of an uninterrupted run (single-process runs).

A sweep (``coretune bench``/``tune``) passes on a signal only it received through a stop file
(:mod:`coretune.runs.stopfile`), which this callback watches.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from ..distributed import rank
from ..runs.layout import RunDir
from ..runs.stopfile import STOP_FILE_ENV, requested_signal

__all__ = ["StopOnSignal", "TrainingInterrupted"]

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class TrainingInterrupted(Exception):
    """Training stopped on a signal after saving a resumable checkpoint.

    Attributes:
        signum: the signal received (``signal.SIGTERM`` or ``signal.SIGINT``).
        checkpoint: the checkpoint written (the run resumes from it with ``ckpt_path="last"``).
    """

    def __init__(self, signum: int, checkpoint: Path, where: str) -> None:
        self.signum, self.checkpoint = signum, checkpoint
        name = signal.Signals(signum).name
        run_dir = checkpoint.parent.parent
        super().__init__(
            f"stopped by {name} {where}; saved a resumable checkpoint to {checkpoint}. "
            f"Resume by running the same command with --run_dir {run_dir}: it continues from this checkpoint "
            "(Python: trainer.fit(..., ckpt_path='last'))"
        )


class StopOnSignal(L.Callback):
    """On SIGTERM or SIGINT during ``fit``: finish the batch, save ``last.ckpt``, raise :class:`TrainingInterrupted`.

    The signal only sets a flag (and says so on stderr); the checkpoint is written at the next batch end (mid-epoch
    checkpoint), or, when the signal comes during an epoch's last batch or its validation, once the epoch is
    complete and saved as usual. A second SIGTERM or SIGINT while waiting ends the process at once, by the
    signal's default action, even when the batch never ends (a data loader blocked on a file): the previous
    checkpoint survives, since checkpoint writes are atomic. Under data parallelism the processes agree on
    stopping at the same batch. The stop file named by :data:`coretune.runs.stopfile.STOP_FILE_ENV`, when set, is
    checked at every batch end and counts as a first signal.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._stop_file: Path | None = None
        self._trainer: L.Trainer | None = None
        self._carry: dict[str, Any] | None = None  # the partial epoch's logged values, from a mid-epoch checkpoint

    # -- signal handling ------------------------------------------------------------------------------------
    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum
        for each in _SIGNALS:  # a second signal is not deferred (Lightning's SIGTERM handler would only set a flag)
            signal.signal(each, _stop_at_once)
        if rank() == 0:
            _say(
                f"coretune: {signal.Signals(signum).name} received: stopping at the next batch end with a resumable "
                "checkpoint (send SIGTERM or SIGINT again to stop at once)"
            )

    def _install_handlers(self) -> None:
        """Install the handlers over Lightning's (which it registers after ``on_fit_start``, records every
        handler before, and puts back when ``fit`` ends, normally or not: nothing is left installed)."""
        if threading.current_thread() is not threading.main_thread() or self.signum is not None:
            return
        for signum in _SIGNALS:
            signal.signal(signum, self._handle)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._trainer = trainer

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.signum = None
        self._stop_file = Path(path) if (path := os.environ.get(STOP_FILE_ENV)) else None

    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install_handlers()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install_handlers()
        # Lightning hands a resumed run's saved loader positions to the loaders in `setup_data`, but
        # `estimated_stepping_batches` (the LR schedule's length) runs that before the checkpoint is restored, so
        # they would be dropped: hand them over now (a no-op when there are none or they were already loaded).
        trainer.fit_loop._load_combined_loader_states()

    def _stop_requested(self, trainer: L.Trainer) -> bool:
        if self.signum is None and self._stop_file is not None:
            self.signum = requested_signal(self._stop_file)  # handlers stay: a later signal is still the first
        return trainer.strategy.reduce_boolean_decision(self.signum is not None, all=False)

    # -- stopping -------------------------------------------------------------------------------------------
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._carry is not None:
            self._merge_carried(trainer)
        if batch_idx + 1 >= trainer.num_training_batches or not self._stop_requested(trainer):
            return  # the epoch's last batch: stop at the epoch end instead, after its validation and checkpoint
        path = _last_checkpoint_path(trainer)
        trainer.save_checkpoint(path, weights_only=False)  # a full, resumable checkpoint (says so: no log line)
        self._raise(path, f"at epoch {trainer.current_epoch}, step {trainer.global_step}")

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._carry = None
        last_epoch = trainer.max_epochs is not None and trainer.current_epoch + 1 >= trainer.max_epochs
        if not last_epoch and self._stop_requested(trainer):
            trainer.should_stop = True  # Lightning finishes the epoch: validation, checkpoints, metrics row

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.should_stop and self._stop_requested(trainer):
            where = f"after epoch {trainer.current_epoch - 1} (step {trainer.global_step})"
            self._raise(_last_checkpoint_path(trainer), where)

    def _raise(self, path: Path, where: str) -> None:
        signum = self.signum if self.signum is not None else signal.SIGTERM  # another process got the signal
        raise TrainingInterrupted(signum, path, where)

    # -- the partial epoch across a mid-epoch checkpoint ----------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        # Under data parallelism only rank 0's sums would be saved: not carried (the epoch's train/* values then
        # cover the batches after the restart; weights, validation and later epochs stay exact).
        if trainer is None or not trainer.training or trainer.world_size > 1:
            return {}
        logged, metrics = {}, {}
        for key, result in _epoch_results(trainer).items():
            if not result.meta.on_epoch:
                continue
            if result.is_tensor:
                logged[key] = {name: getattr(result, name).clone() for name in result._defaults}
            else:  # a torchmetrics Metric logged as an object: its accumulated state
                metrics[key] = {name: _clone(getattr(result.value, name)) for name in result.value._defaults}
        return {"epoch": trainer.current_epoch, "logged": logged, "metrics": metrics}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._carry = state_dict or None

    def _merge_carried(self, trainer: L.Trainer) -> None:
        """Add the sums saved in the checkpoint to those of the first batch after the restart (same epoch only)."""
        carry, self._carry = self._carry, None
        if carry is None or carry["epoch"] != trainer.current_epoch:
            return
        results = _epoch_results(trainer)
        for key, state in carry["logged"].items():
            if (result := results.get(key)) is None:
                continue
            if result.meta.is_max_reduction or result.meta.is_min_reduction:
                result.value = result.meta.reduce_fx(result.value, state["value"].to(result.value.device))
            else:  # mean (value = Σ batch_size · value, and Σ batch_size) or sum
                for name, value in state.items():
                    setattr(result, name, getattr(result, name) + value.to(getattr(result, name).device))
        for key, state in carry["metrics"].items():
            if (result := results.get(key)) is not None:
                result.value.merge_state({k: _to(v, result.value.device) for k, v in state.items()})


def _stop_at_once(signum: int, frame: FrameType | None) -> None:
    """A second SIGTERM or SIGINT: end the process now by the signal's default action (exit status 128 + signum)."""
    _say(
        f"coretune: second signal ({signal.Signals(signum).name}): stopping at once; the last complete checkpoint "
        "is intact"
    )
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _say(line: str) -> None:
    """Write ``line`` to stderr from a signal handler (``os.write``: ``print`` may be in the middle of a write)."""
    os.write(2, f"{line}\n".encode())


def _epoch_results(trainer: L.Trainer) -> dict[str, Any]:
    """The training epoch's logged values (Lightning keeps them in the loop's ``_results`` collection)."""
    return trainer.fit_loop.epoch_loop._results


def _clone(value: Any) -> Any:
    return [v.clone() for v in value] if isinstance(value, list) else value.clone()


def _to(value: Any, device: torch.device) -> Any:
    return [v.to(device) for v in value] if isinstance(value, list) else value.to(device)


def _last_checkpoint_path(trainer: L.Trainer) -> Path:
    """``last.ckpt`` in the run's checkpoint folder (``<run dir>/checkpoints`` without a ModelCheckpoint)."""
    callback = trainer.checkpoint_callback
    if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
        return Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"
    return RunDir(trainer.default_root_dir).last_checkpoint
