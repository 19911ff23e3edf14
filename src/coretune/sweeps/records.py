"""A run's record, read back from its run directory: finished or not, its top-1, how far it got and how long it
has left."""

from __future__ import annotations

import json
import math
import shlex
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from ..runs.config import recorded_task
from ..runs.layout import RunDir
from ..tasks import DEFAULT_TASK, TASKS
from .job import FitJob, current_spelling
from .spec import Metric, check_val_split

__all__ = [
    "OtherFitArgs",
    "RunRecord",
    "RunStatus",
    "check_run_args",
    "final_val_top1",
    "format_duration",
    "percent",
    "run_progress",
    "run_top1",
    "training_time_left",
]


RunStatus = Literal["finished", "running", "diverged", "unfinished", "missing", "other_args"]
"""A run's state: test results (or why the fit skipped the test) written, claimed by a live process, diverged or
collapsed (``results.json`` says so: a result, not run again), started, no run directory yet, or its directory was
started with other fit arguments than the spec's (:func:`check_run_args`: neither a result nor run again until it is
deleted; only ``--status`` lists it)."""


@dataclass(frozen=True)
class RunRecord:
    """One run of a sweep as its files record it (:func:`~.collect.collect_cells`): top-1 and top-5 in percent,
    ``None`` where a value is missing (unfinished, or not recorded); ``reconstructed`` for a record rebuilt from
    numbers written down when a lost run finished; a row of ``runs.csv`` once written (:meth:`csv_row`)."""

    dataset: str
    objective: str
    label_fraction: float
    seed: int
    status: RunStatus
    progress: str
    test_top1_pct: float | None
    test_top5_pct: float | None
    val_top1_pct: float | None
    epochs: int | None
    wall_time_s: float | None
    train_images_per_s: float | None
    run_dir: Path
    cpu_time_s: float | None = None  # the fitting process's CPU seconds (results.json; newer records only)
    reconstructed: bool = False  # results.json has a "reconstructed" entry (docs/records/README.md)
    selection: str | None = None  # domain generalization: the model-selection rule, "ORACLE: …" for the oracle

    def top1_pct(self, metric: Metric) -> float | None:
        """The top-1 (%) the spec's ``metric`` tabulates."""
        return self.val_top1_pct if metric == "val" else self.test_top1_pct

    def csv_row(self, metric: Metric, selection: bool = False) -> dict[str, Any]:
        """The ``runs.csv`` row: blank where a value is missing, ``val_top1_pct`` only with ``metric: val``,
        ``selection`` only with ``selection`` (runs that choose their checkpoint by a rule: domain generalization)."""
        skip = (
            {"run_dir"} | ({"val_top1_pct"} if metric != "val" else set()) | ({"selection"} if not selection else set())
        )
        names = [f.name for f in fields(self) if f.name not in skip]
        row = {name: "" if (value := getattr(self, name)) is None else value for name in names}
        return {**row, "run_dir": str(self.run_dir)}


def run_score_name(run_dir: str | Path) -> str:
    """The value a run is scored by: its task's monitored value (``top1`` for classification, ``miou`` for
    segmentation), the task being the one its ``config.yaml`` records."""
    task = recorded_task(RunDir(run_dir).read_config()) or DEFAULT_TASK
    return TASKS[task].monitor if task in TASKS else TASKS[DEFAULT_TASK].monitor


def percent(value: Any) -> float | None:
    """A score of a run's files (a fraction) in %, or ``None`` when it is undefined: ``null`` in its JSON (the
    MIoU of a split whose masks are all ignored), or ``NaN``/infinite (``metrics.csv``, the JSON of older runs).
    An undefined score is missing: never averaged or compared; a value that is no number raises ``ValueError``."""
    if value is None:
        return None
    number = float(value)
    return 100 * number if math.isfinite(number) else None


def final_val_top1(metrics_csv: str | Path, score: str | None = None) -> float:
    """``val/<score>`` (default: ``val/`` + the run's :func:`run_score_name`, ``val/top1`` for classification) of
    the last validated epoch in a run's ``metrics.csv`` (a fraction in [0, 1]; NaN where it is undefined, e.g. the
    MIoU of a validation split whose masks are all ignored: :func:`percent` makes that ``None``)."""
    from ..engine import read_metrics

    key = f"val/{score or run_score_name(Path(metrics_csv).parent)}"
    values = [float(r[key]) for r in read_metrics(metrics_csv) if r.get(key) not in (None, "")]
    if not values:
        raise ValueError(
            f"{metrics_csv} has no {key}: validation never ran. Make --trainer.max_epochs a multiple of "
            "--trainer.check_val_every_n_epoch so the last epoch is validated"
        )
    return values[-1]


def run_progress(run_dir: str | Path) -> str:
    """How far an unfinished run got, from its files: ``"12 of 20 epochs, resumable"`` (``metrics.csv`` has a row
    per finished epoch, ``config.yaml`` the run's length; ``checkpoints/last.ckpt`` is what a re-run resumes from),
    or ``"12 of 20 epochs, diverged (…)"`` when its ``results.json`` records that it diverged."""
    run = RunDir(run_dir)
    claim = run.live_claim()
    diverged = claim is None and run.divergence() is not None  # also a record copied back, without its log
    if claim is None and not diverged and not run.log.is_file():
        return "not started"
    done, total = run.epochs_done()
    text = f"{done} of {total} epochs" if total else f"{done} epochs"
    left = training_time_left(run_dir, running=claim is not None)
    if claim is not None:
        return f"running{'' if claim.local else ' on ' + claim.host}, {text} done" + (
            f", ~{format_duration(left)} left" if left is not None else ""
        )
    if diverged:  # a re-run would diverge again
        return f"{text}, diverged (its message: {run.results.name})"
    resumable = ", resumable" if run.last_checkpoint.is_file() else ""
    return text + resumable + (f", ~{format_duration(left)} to go" if left is not None else "")


def training_time_left(run_dir: str | Path, running: bool, now: float | None = None) -> float | None:
    """Seconds of training an unfinished run has left: its epochs still to go times the median wall time of its
    last three epochs (``epoch_time_s`` in ``metrics.csv``); for a ``running`` one less what its current epoch has
    run since the last row was written (never below the epochs after it). None before an epoch has finished or
    when the run's length is unknown."""
    from statistics import median

    from ..engine import read_metrics

    run = RunDir(run_dir)
    done, total = run.epochs_done()
    times = [float(r["epoch_time_s"]) for r in read_metrics(run.metrics) if r.get("epoch_time_s")]
    if not times or total is None or done >= total:
        return None
    per_epoch, to_go = median(times[-3:]), total - done
    if not running:
        return to_go * per_epoch
    since_last = (time.time() if now is None else now) - run.metrics.stat().st_mtime
    return max(to_go * per_epoch - since_last, (to_go - 1) * per_epoch)


def format_duration(seconds: float) -> str:
    """``"<1 min"``, ``"38 min"``, ``"2 h 05 min"``."""
    minutes = round(seconds / 60)
    if minutes < 1:
        return "<1 min"
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


def run_top1(run_dir: str | Path, metric: Metric = "test") -> float | None:
    """The score (%) of a finished run (:func:`run_score_name`: top-1 for classification, MIoU for segmentation):
    its test result, or (``"val"``) its final epoch's ``val/<score>``, which must come from a validation split other
    than the test split (:func:`~coretune.sweeps.spec.check_val_split`); ``None`` where it is undefined
    (:func:`percent`: a split without a pixel to score) or was not measured (a fit run with ``--test false``), a
    missing value."""
    run = RunDir(run_dir)
    if metric == "test":  # null (--test false: the fit did not test) or absent: none
        return percent((run.read_results().get("test") or {}).get(run_score_name(run_dir)))
    check_val_split(run.read_config(), f"{run.path} ({run.config})", run.read_results())
    return percent(final_val_top1(run.metrics))


class OtherFitArgs(ValueError):
    """A run directory was started with other fit arguments than the spec's (:func:`check_run_args`)."""


def check_run_args(job: FitJob | Sequence[str], run_dir: str | Path | None = None) -> None:
    """Refuse to skip, resume or table a run directory (the ``job``'s, or ``run_dir``) that was started with other
    fit arguments than the job's :meth:`~.job.FitJob.argv` (or the argument list ``job``), which its
    ``fit_args.json`` records: a table must not put runs of other settings side by side. An option an older
    version spelled otherwise (``--model.lr``) is the same as its current spelling (:func:`~.job.current_spelling`).

    Raises:
        OtherFitArgs: naming the run, both argument lists and the fix.
    """
    if isinstance(job, FitJob):
        args, run_dir = job.argv(), job.run_dir if run_dir is None else run_dir
    else:
        args = list(job)
    if run_dir is None:
        raise TypeError("check_run_args: the run directory of an argument list is needed")
    path = RunDir(run_dir).fit_args
    if not path.is_file():
        return
    before = json.loads(path.read_text())
    if before != list(args) and current_spelling(before) != current_spelling(args):  # --model.lr: --model.optim.lr
        raise OtherFitArgs(
            f"run directory {run_dir} was started with other fit arguments (recorded in {path}): "
            f"{shlex.join(before)}  ≠  {shlex.join(args)}. Delete that directory to redo the run with the new "
            "arguments, or point the sweep at a new output folder"
        )
