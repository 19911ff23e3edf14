"""A callback for the interruption tests, passed with ``--trainer.callbacks+=signal_helper.SendSignal``: it sends a
real signal to its own process after a fixed optimizer step, so the interruption point is deterministic and the
process has to handle an actual OS signal arriving in the middle of a batch."""

from __future__ import annotations

import os
from typing import Any

import lightning as L


class SendSignal(L.Callback):
    """Sends ``signum`` to this process once optimizer step ``step`` is done."""

    def __init__(self, signum: int = 15, step: int = 1) -> None:
        self.signum, self.step = signum, step

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)
