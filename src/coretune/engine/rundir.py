"""A CLI run's directory: where it writes (``--run_dir``), resuming from it, and holding it while it runs."""

from __future__ import annotations

import contextlib
import time
import warnings
from pathlib import Path
from typing import Any

from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from ..distributed import is_launching_process
from ..runclaim import fit_claim

__all__ = ["RunDirCLI", "resolve_run_dir"]


def resolve_run_dir(config: Any, default_name: str) -> None:
    """Settle a CLI run's directory in its parsed ``config`` (``run_dir``, ``trainer``, ``ckpt_path``).

    ``run_dir`` defaults to ``runs/<default_name>-<date>-<time>`` and becomes the trainer's ``default_root_dir``.
    Without ``--ckpt_path``, a run directory that holds ``checkpoints/last.ckpt`` is resumed from it: re-running
    a command continues its run (a finished run is only tested again) instead of starting over and overwriting its
    checkpoints and metrics. Lightning's "checkpoint directory exists and is not empty" warning is then expected
    and silenced.
    """
    if config.get("run_dir") is None:
        config["run_dir"] = str(Path("runs") / f"{default_name}-{time.strftime('%Y%m%d-%H%M%S')}")
    config["trainer"]["default_root_dir"] = config["run_dir"]
    last = Path(config["run_dir"]) / "checkpoints" / "last.ckpt"
    if config.get("ckpt_path") is None and last.is_file():
        config["ckpt_path"] = str(last)
        rank_zero_info(
            f"resuming the run in {config['run_dir']} from {last} (re-running a command continues its run; to start "
            "over, pass another --run_dir or delete that folder)"
        )
    if config.get("ckpt_path") is not None:
        warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")


class RunDirCLI(LightningCLI):
    """A LightningCLI whose run writes into ``--run_dir`` (added by the subclass), held while it runs.

    Start it with :meth:`run`: :meth:`settle_run_dir` (called by the subclass once the configuration is parsed)
    resolves the directory (:func:`resolve_run_dir`) and claims it (:func:`coretune.runclaim.fit_claim`; only in
    the process a user or a sweep started, not in those a DDP launcher adds) until the run ends, so that a second
    run into the same directory is refused instead of overwriting its checkpoints.
    """

    def __init__(self, *args: Any, hold: contextlib.ExitStack, **kwargs: Any) -> None:
        self._hold = hold
        super().__init__(*args, **kwargs)

    @classmethod
    def run(cls, *args: Any, **kwargs: Any) -> None:
        """Parse, run the subcommand, and release the run directory afterwards (also on errors)."""
        with contextlib.ExitStack() as hold:
            cls(*args, hold=hold, **kwargs)

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        """The trainer; a setting Lightning refuses (``MisconfigurationException``, e.g. ``--trainer.devices 0``)
        is a ``ValueError`` with Lightning's message on one line."""
        try:
            return super().instantiate_trainer(**kwargs)
        except MisconfigurationException as err:
            raise ValueError(f"invalid trainer settings: {' '.join(str(err).split())}") from None

    def settle_run_dir(self, default_name: str) -> None:
        config = self.config[self.subcommand]
        resolve_run_dir(config, default_name)
        if is_launching_process():
            self._hold.enter_context(fit_claim(config["run_dir"]))
