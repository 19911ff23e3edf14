"""Command-line flags shared by the tests that run ``coretune fit`` and ``coretune pretrain``, and the one-line error
of a command."""

from pathlib import Path

import lightning as L
import pytest

from coretune.cli import main

QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
"""No progress bar or model summary in the tests' output."""

TINY_FIT = [
    "--model.backbone=small_cnn",
    "--data.image_size=16",
    "--data.batch_size=8",
    "--trainer.max_epochs=1",
    "--trainer.enable_model_summary=false",
]
"""A fit of one epoch of a small CNN on 16 px images: seconds on a CPU (add ``--data.root``)."""


def pretrain_args(root: Path, run_dir: Path, *extra: str) -> list[str]:
    """``coretune pretrain`` of one epoch of a small CNN on 16 px images of ``root``, into ``run_dir``."""
    return [
        "pretrain",
        f"--data.root={root}",
        "--model.backbone=small_cnn",
        "--model.proj_dim=16",
        "--data.image_size=16",
        "--data.batch_size=4",  # 12 images: 3 steps per epoch
        "--trainer.max_epochs=1",
        f"--run_dir={run_dir}",
        *QUIET,
        *extra,
    ]


def error(args: list[str]) -> str:
    """The message ``coretune ARGS`` exits with, asserted to be a one-line user error (no traceback), without its
    ``coretune <command>: error:`` prefix."""
    with pytest.raises(SystemExit) as info:
        main(args)
    message = str(info.value.code)
    prefix = f"coretune {args[0]}: error: "
    assert message.startswith(prefix), message
    assert "\n" not in message and "Traceback" not in message, message
    return message[len(prefix) :]


class StopBeforeTraining(L.Callback):
    """Stops a fit at its start, before its first optimiser step: a run that trained nothing
    (``--trainer.callbacks+=fit_flags.StopBeforeTraining``)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.should_stop = True


class StopAfterEpoch(L.Callback):
    """Stops a fit at the end of epoch ``epoch`` (0-based): an interrupted run that a resume continues."""

    def __init__(self, epoch: int = 0) -> None:
        self.epoch = epoch

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            trainer.should_stop = True


class PauseForStopRequest(L.Callback):
    """Pauses a sweep's fit after the first batch of its second epoch, once, when its run folder holds a file
    ``pause_here`` (renamed ``paused`` then): until the sweep asks it to stop (its stop file), at most 120 s. A test
    then interrupts it mid-epoch at a known point (``--trainer.callbacks+=fit_flags.PauseForStopRequest``); without
    the file it changes nothing."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
        import os
        import time

        from coretune.runs.stopfile import STOP_FILE_ENV

        stop_file = Path(os.environ.get(STOP_FILE_ENV, "/nonexistent/stop_request"))
        marker = stop_file.with_name("pause_here")
        if trainer.current_epoch != 1 or not marker.exists():
            return
        marker.rename(marker.with_name("paused"))
        deadline = time.monotonic() + 120
        while not stop_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
