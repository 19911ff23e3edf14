"""A run directory's layout: :class:`RunDir`, the one object that names its files.

``coretune fit`` (and ``coretune pretrain``) write a run into one directory, ``--run_dir``; the engine writes it and
``coretune bench`` / ``coretune tune`` read it back through this object, never by file names of their own::

    config.yaml          the resolved configuration of the fit (LightningCLI)
    metrics.csv          one row per finished epoch
    results.json         test results, timings …; holds "test" once the fit has ended (null, with "test_skipped"
                         saying why, for a fit run with --test false), "diverged" (the message) when it stopped
                         with a NaN loss, collapsed or exploding logits or at chance level
    test_results.json    what ``coretune test`` found (the fit's results.json is left as it is)
    val_results.json     what ``coretune validate`` found
    robust_results.json  what ``coretune eval robust`` found (clean and robust accuracy; robust_results_*.json
                         for other --output names given there, e.g. AutoAttack's)
    learning_curve.png
    checkpoints/         best.ckpt, last.ckpt (what a re-run resumes from)
    fit.pid              the claim of the process running it (:mod:`coretune.runs.claim`)
    log.txt, fit_args.json, stop_request
                         a sweep's log of the fit, its fit arguments and its stop file (:mod:`coretune.runs.stopfile`)
    job.json             the cluster job a sweep submitted the run as (``coretune bench --launcher submitit``)
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .claim import CLAIM_FILE, RunClaim, live_claim

__all__ = ["RunDir"]


@dataclass(frozen=True)
class RunDir:
    """The files of the run in ``path`` (a ``str`` is taken as a path), and what they say about the run."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @classmethod
    def of_checkpoint(cls, checkpoint: str | Path) -> RunDir:
        """The run directory a checkpoint belongs to: the folder holding its ``checkpoints/`` folder, else (a
        checkpoint copied elsewhere) the checkpoint's own folder."""
        checkpoint = Path(checkpoint)
        run = cls(checkpoint.parent.parent)
        return run if run.checkpoints == checkpoint.parent else cls(checkpoint.parent)

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.csv"

    @property
    def results(self) -> Path:
        return self.path / "results.json"

    @property
    def test_results(self) -> Path:
        return self.path / "test_results.json"

    @property
    def val_results(self) -> Path:
        return self.path / "val_results.json"

    @property
    def robust_results(self) -> Path:
        return self.path / "robust_results.json"

    @property
    def learning_curve(self) -> Path:
        return self.path / "learning_curve.png"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def last_checkpoint(self) -> Path:
        return self.checkpoints / "last.ckpt"

    @property
    def best_checkpoint(self) -> Path:
        return self.checkpoints / "best.ckpt"

    @property
    def claim(self) -> Path:
        return self.path / CLAIM_FILE

    @property
    def log(self) -> Path:
        return self.path / "log.txt"

    @property
    def fit_args(self) -> Path:
        return self.path / "fit_args.json"

    @property
    def stop_file(self) -> Path:
        return self.path / "stop_request"

    @property
    def job(self) -> Path:
        """The cluster job the run was submitted as (:mod:`coretune.sweeps.cluster`)."""
        return self.path / "job.json"

    @property
    def wandb_id(self) -> Path:
        """The run's W&B run id, kept so that a resumed run logs into the same W&B run."""
        return self.path / "wandb_id"

    def records(self) -> tuple[Path, ...]:
        """The small files of a run that its tables, curves and resume checks read, and the robustness its
        checkpoint was measured with (``coretune eval robust``'s ``robust_results*.json`` there); no checkpoints or
        logs."""
        return self.config, self.fit_args, self.metrics, self.results, *sorted(self.path.glob("robust_results*.json"))

    def read_results(self) -> dict[str, Any]:
        """``results.json`` (empty before the fit has written it).

        Raises:
            ValueError: the file is not a JSON object (a truncated copy, a hand edit), naming it and the fix.
        """
        if not self.results.is_file():
            return {}
        try:
            results = json.loads(self.results.read_text())
        except json.JSONDecodeError as err:
            problem = f"is not valid JSON ({err})"
        else:
            if isinstance(results, dict):
                return results
            problem = "is not a JSON object"
        raise ValueError(
            f"{self.results} {problem}: restore it from a copy (such as a record of `coretune bench --export`), "
            "or delete it and run the run's command again to resume and test it"
        )

    def divergence(self) -> str | None:
        """The message ``results.json`` records when the fit diverged or collapsed (``diverged``; a fit from before
        that key: the chance-level guard's ``collapsed``), else None (also while another process writes the file
        in place, as :meth:`is_finished` reads it)."""
        try:
            results = self.read_results()
        except ValueError:
            return None
        return results.get("diverged") or results.get("collapsed")

    def read_config(self) -> dict[str, Any]:
        """``config.yaml`` (empty before the fit has written it)."""
        return (yaml.safe_load(self.config.read_text()) if self.config.is_file() else None) or {}

    def is_finished(self) -> bool:
        """A run is finished once its ``results.json`` holds the test results (written after training ends; an
        empty ``test`` entry is none, as ``coretune bench``'s tables count it), or says why the fit did not test
        (``test_skipped``: ``coretune fit --test false``, :meth:`test_skipped`)."""
        try:
            results = self.read_results()
        except (ValueError, FileNotFoundError):  # damaged (a sweep runs it again, and its fit names the file), gone
            return False
        return bool(results.get("test")) or (results.get("test") is None and bool(results.get("test_skipped")))

    def test_skipped(self) -> str | None:
        """Why a finished fit did not score the test split (``results.json``'s ``test_skipped``: it ran with
        ``--test false``; its ``test`` is null), else None."""
        try:
            results = self.read_results()
        except (ValueError, FileNotFoundError):
            return None
        return results.get("test_skipped") if results.get("test") is None else None

    def epochs_done(self) -> tuple[int, int | None]:
        """The run's finished epochs (rows of its ``metrics.csv``) and its length (``trainer.max_epochs`` of its
        ``config.yaml``; None until the fit has written it)."""
        done = 0
        if self.metrics.is_file():
            with self.metrics.open(newline="") as f:
                done = sum(1 for _ in csv.DictReader(f))
        return done, (self.read_config().get("trainer") or {}).get("max_epochs")

    def live_claim(self) -> RunClaim | None:
        """The claim of the live process running the run (:func:`coretune.runs.claim.live_claim`), if any."""
        return live_claim(self.path)
