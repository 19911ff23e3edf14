"""A callback for the interruption tests, passed with ``--trainer.callbacks+=signal_helper.SendSignal``: it sends a
real signal to its own process after a fixed optimizer step, so the interruption point is deterministic and the
process has to handle an actual OS signal arriving in the middle of a batch."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import lightning as L


class SendSignal(L.Callback):
    """Sends ``signum`` to this process once optimizer step ``step`` is done; with ``stop_file``, writes it into the
    stop file named by ``CORETUNE_STOP_FILE`` instead, as ``coretune bench`` does when only it got the signal. With
    ``hang_file``, the process then creates that file and hangs, as a loader blocked on a file would: the batch
    never ends."""

    def __init__(self, signum: int = 15, step: int = 1, stop_file: bool = False, hang_file: str | None = None) -> None:
        self.signum, self.step, self.stop_file, self.hang_file = signum, step, stop_file, hang_file

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        from coretune.runs.stopfile import STOP_FILE_ENV, request_stop

        if trainer.global_step != self.step:
            return
        if self.stop_file:
            request_stop(os.environ[STOP_FILE_ENV], self.signum)
        else:
            os.kill(os.getpid(), self.signum)
        if self.hang_file is not None:
            Path(self.hang_file).touch()
            while True:
                time.sleep(1)
