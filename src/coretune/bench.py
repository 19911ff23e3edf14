"""``coretune bench``: a grid of ``coretune fit`` runs (objectives × data sets × label fractions × seeds) and its
tables of mean ± std top-1 in the layouts of the paper's Table 1 (methods × data sets), Table 2 (the ablation rows)
and its table of various numbers of labeled data (methods × label fractions; ``table4``, numbered Table 5 in the
NeurIPS version).

Every run is an ordinary ``coretune fit`` in its own subprocess (a crash ends that run only; ``workers`` runs go at
once), writing into ``<output>/<dataset>/<objective>/frac<f>/seed<s>``. The sweep is resumable: a run whose
``results.json`` holds test results is skipped, a started one resumes from its ``checkpoints/last.ckpt``.
With ``metric: val`` the tables hold each run's final-epoch top-1 on a validation split carved from the training
set (``--data.val_fraction``), for studies that must not look at the test split.
"""

from __future__ import annotations

import csv
import json
import math
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import yaml

from .runclaim import RunInUse, claimed, live_claim, point_claim
from .stopfile import STOP_FILE_ENV, request_stop

__all__ = [
    "BenchSpec",
    "Cell",
    "Comparison",
    "EpochBars",
    "ObjectiveEntry",
    "Run",
    "StopSignal",
    "SweepInterrupted",
    "SweepReport",
    "catch_stop_signals",
    "collect_cells",
    "collect_curves",
    "compare",
    "epochs_done",
    "final_val_top1",
    "fit_command",
    "format_duration",
    "is_finished",
    "launch_fit",
    "main",
    "run_sweep",
    "run_top1",
    "training_time_left",
    "visible_gpus",
    "worker_envs",
    "write_summary",
]

Layout = Literal["table1", "table2", "table4"]
Metric = Literal["test", "val"]
#: What the tables hold, per ``metric``.
_METRIC_TEXT = {"test": "test top-1", "val": "final-epoch validation top-1"}
_SPEC_KEYS = (
    "name",
    "output",
    "base_args",
    "datasets",
    "objectives",
    "label_fractions",
    "seeds",
    "workers",
    "table",
    "baseline",
    "metric",
)
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")
#: Arguments every bench/tune subprocess gets first (the user's arguments come after and may override them):
#: the per-batch progress bar would flood ``log.txt``.
SUBPROCESS_FIT_ARGS = ("--trainer.enable_progress_bar=false",)
_ARGS_FILE = "fit_args.json"
#: The files of a finished run that the tables, curves and resume checks read: what :func:`export_records` keeps.
RECORD_FILES = ("config.yaml", _ARGS_FILE, "metrics.csv", "results.json")
STOP_FILE = "stop_request"
"""A run directory's stop file: the sweep writes a signal's name into it to stop the fit (:mod:`coretune.stopfile`)."""


class BenchSpecError(ValueError):
    """A bench spec (YAML) with a missing, unknown or invalid entry."""


class SweepInterrupted(Exception):
    """A sweep (``bench``, ``tune``) stopped on SIGINT or SIGTERM: no further run started and the running fits saved
    a resumable ``last.ckpt``; re-running the same command resumes. ``signum``: the signal (exit ``128 + signum``)."""

    def __init__(self, signum: int, message: str) -> None:
        self.signum = signum
        super().__init__(message)


@dataclass
class StopSignal:
    """The first SIGINT or SIGTERM a sweep received (``signum``, ``None`` until then): no further fit starts and the
    running ones are asked to save a resumable checkpoint and exit (:func:`launch_fit`)."""

    signum: int | None = None


# -- one fit run in a subprocess (shared with ``coretune tune``) ---------------------------------------------------
def is_finished(run_dir: str | Path) -> bool:
    """A run is finished once its ``results.json`` holds the test results (written after training ends)."""
    path = Path(run_dir) / "results.json"
    try:
        return "test" in json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False


def final_val_top1(metrics_csv: str | Path) -> float:
    """``val/top1`` of the last validated epoch in a run's ``metrics.csv`` (a fraction in [0, 1])."""
    from .engine import read_metrics

    values = [float(r["val/top1"]) for r in read_metrics(metrics_csv) if r.get("val/top1") not in (None, "")]
    if not values:
        raise ValueError(
            f"{metrics_csv} has no val/top1: validation never ran. Make --trainer.max_epochs a multiple of "
            "--trainer.check_val_every_n_epoch so the last epoch is validated"
        )
    return values[-1]


def run_progress(run_dir: str | Path) -> str:
    """How far an unfinished run got, from its files: ``"12 of 20 epochs, resumable"`` (``metrics.csv`` has a row
    per finished epoch, ``config.yaml`` the run's length; ``checkpoints/last.ckpt`` is what a re-run resumes from)."""
    run_dir = Path(run_dir)
    claim = live_claim(run_dir)
    if claim is None and not (run_dir / "log.txt").is_file():
        return "not started"
    done, total = epochs_done(run_dir)
    text = f"{done} of {total} epochs" if total else f"{done} epochs"
    left = training_time_left(run_dir, running=claim is not None)
    if claim is not None:
        return f"running{'' if claim.local else ' on ' + claim.host}, {text} done" + (
            f", ~{format_duration(left)} left" if left is not None else ""
        )
    resumable = ", resumable" if (run_dir / "checkpoints" / "last.ckpt").is_file() else ""
    return text + resumable + (f", ~{format_duration(left)} to go" if left is not None else "")


def training_time_left(run_dir: str | Path, running: bool, now: float | None = None) -> float | None:
    """Seconds of training an unfinished run has left: its epochs still to go times the median wall time of its
    last three epochs (``epoch_time_s`` in ``metrics.csv``); for a ``running`` one less what its current epoch has
    run since the last row was written (never below the epochs after it). None before an epoch has finished or
    when the run's length is unknown."""
    from statistics import median

    from .engine import read_metrics

    run_dir = Path(run_dir)
    done, total = epochs_done(run_dir)
    times = [float(r["epoch_time_s"]) for r in read_metrics(run_dir / "metrics.csv") if r.get("epoch_time_s")]
    if not times or total is None or done >= total:
        return None
    per_epoch, to_go = median(times[-3:]), total - done
    if not running:
        return to_go * per_epoch
    since_last = (time.time() if now is None else now) - (run_dir / "metrics.csv").stat().st_mtime
    return max(to_go * per_epoch - since_last, (to_go - 1) * per_epoch)


def sweep_time_left(rows: list[dict[str, Any]], paces: list[dict[str, Any]] | None = None) -> tuple[float, int]:
    """Seconds of fitting the unfinished runs of :func:`collect_cells`' ``rows`` have left, one after another, and
    how many of them the sum covers: a run with a timed epoch at its own recent pace (:func:`training_time_left`;
    all epochs done: 0), one without at the median ``wall_time_s`` of its cell's finished seeds in ``paces``
    (default ``rows``; the whole spec's rows when ``rows`` are a subset's: the same fit but for the seed). A run
    with neither is left out. The paces are those of the machines that ran them."""
    from statistics import median

    def cell(row: dict[str, Any]) -> tuple[str, str, float]:
        return row["dataset"], row["objective"], row["label_fraction"]

    finished: dict[tuple[str, str, float], list[float]] = {}
    for row in rows if paces is None else paces:
        if row["status"] == "finished" and row["wall_time_s"] != "":
            finished.setdefault(cell(row), []).append(float(row["wall_time_s"]))
    total, covered = 0.0, 0
    for row in rows:
        if row["status"] == "finished":
            continue
        left = None
        if row["status"] != "missing":
            done, epochs = epochs_done(row["run_dir"])
            trained = epochs is not None and done >= epochs
            left = 0.0 if trained else training_time_left(row["run_dir"], running=row["status"] == "running")
        if left is None and cell(row) in finished:
            left = median(finished[cell(row)])
        if left is not None:
            total, covered = total + left, covered + 1
    return total, covered


def format_duration(seconds: float) -> str:
    """``"<1 min"``, ``"38 min"``, ``"2 h 05 min"``."""
    minutes = round(seconds / 60)
    if minutes < 1:
        return "<1 min"
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


def epochs_done(run_dir: str | Path) -> tuple[int, int | None]:
    """A run's finished epochs (rows of its ``metrics.csv``) and its length (``trainer.max_epochs`` of its
    ``config.yaml``; None until the fit has written it)."""
    run_dir = Path(run_dir)
    metrics, config = run_dir / "metrics.csv", run_dir / "config.yaml"
    done = 0
    if metrics.is_file():
        with metrics.open(newline="") as f:
            done = sum(1 for _ in csv.DictReader(f))
    resolved = (yaml.safe_load(config.read_text()) if config.is_file() else None) or {}
    return done, (resolved.get("trainer") or {}).get("max_epochs")


def check_val_split(config: dict[str, Any], run: str) -> None:
    """Refuse (``metric: val``) a run whose resolved fit ``config`` has no validation split carved from the training
    set (``data.val_fraction`` > 0): without one it validates on the test split."""
    if not float((config.get("data") or {}).get("val_fraction") or 0) > 0:
        raise BenchSpecError(
            f"metric 'val' needs a validation split carved from the training set, but {run} has none "
            "(data.val_fraction is not > 0, so it validates on the test split): add --data.val_fraction=0.2 to the "
            "spec's base_args (with a new output folder if runs finished without it), or use metric 'test'"
        )


def unvalidated_final_epoch(config: dict[str, Any]) -> str | None:
    """Why a resolved fit ``config`` would not validate its final epoch (``max_epochs`` not a multiple of
    ``check_val_every_n_epoch``: its last ``val/top1`` is an earlier epoch's), with the fix; None when it does."""
    trainer = config.get("trainer") or {}
    epochs, every = trainer.get("max_epochs"), trainer.get("check_val_every_n_epoch")
    if isinstance(epochs, int) and isinstance(every, int) and epochs > 0 and every > 0 and epochs % every:
        return (
            f"it trains {epochs} epochs and validates every {every}: make --trainer.max_epochs a multiple of "
            "--trainer.check_val_every_n_epoch"
        )
    return None


def check_fit_args(runs: Sequence[Run], metric: Metric = "test") -> None:
    """Before a sweep starts, resolve each run's fit configuration (``coretune fit --print_config``, in process) and
    refuse the spec when ``coretune fit`` would refuse a run's arguments or, for ``metric: val``, a run would not
    validate its final epoch on a split of the training set: a bad spec fails at once, not after the runs before it."""
    from .cli import FitArgsError, resolved_fit_config

    for run in runs:
        try:
            config = resolved_fit_config(run.args)
        except FitArgsError as error:
            raise BenchSpecError(
                f"coretune fit would refuse the arguments of run {run.label}: {error}. Fix them in the spec "
                "(base_args, the data set's or the objective's args)"
            ) from None
        if metric == "val":
            check_val_split(config, f"run {run.label}")
            if problem := unvalidated_final_epoch(config):
                raise BenchSpecError(
                    f"metric 'val' tabulates the final epoch's validation top-1, but run {run.label} would not "
                    f"validate its final epoch: {problem}"
                )


def run_top1(run_dir: str | Path, metric: Metric = "test") -> float:
    """Top-1 (%) of a finished run: its test result, or (``"val"``) its final epoch's ``val/top1``, which must come
    from a validation split carved from the training set (``data.val_fraction`` > 0 in the run's config.yaml)."""
    run_dir = Path(run_dir)
    if metric == "test":
        return 100 * float(json.loads((run_dir / "results.json").read_text())["test"]["top1"])
    config = run_dir / "config.yaml"
    check_val_split((yaml.safe_load(config.read_text()) if config.is_file() else None) or {}, f"{run_dir} ({config})")
    return 100 * final_val_top1(run_dir / "metrics.csv")


def fit_command(args: Sequence[str], run_dir: str | Path) -> list[str]:
    """The ``coretune fit`` subprocess command of a run; it resumes from ``checkpoints/last.ckpt`` when present."""
    run_dir = Path(run_dir)
    cmd = [sys.executable, "-m", "coretune.cli", "fit", *SUBPROCESS_FIT_ARGS, *args, f"--run_dir={run_dir}"]
    if (run_dir / "checkpoints" / "last.ckpt").is_file():
        cmd.append("--ckpt_path=last")
    return cmd


def check_run_args(args: Sequence[str], run_dir: str | Path) -> None:
    """Refuse to skip or resume a run directory that was started with other fit arguments."""
    path = Path(run_dir) / _ARGS_FILE
    if not path.is_file():
        return
    before = json.loads(path.read_text())
    if before != list(args):
        raise ValueError(
            f"run directory {run_dir} was started with other fit arguments (recorded in {path}): "
            f"{shlex.join(before)}  ≠  {shlex.join(args)}. Delete that directory to redo the run with the new "
            "arguments, or point the sweep at a new output folder"
        )


def launch_fit(
    args: Sequence[str], run_dir: str | Path, env: dict[str, str] | None = None, stop: StopSignal | None = None
) -> int:
    """Run one ``coretune fit`` subprocess into ``run_dir``, appending its stdout and stderr to ``log.txt``.

    Returns the exit code; whether the run finished is :func:`is_finished` (results.json holds test results). Once
    ``stop`` holds a signal, or on Ctrl+C (``KeyboardInterrupt``) while waiting, the fit is asked through its stop
    file (:mod:`coretune.stopfile`) to save a resumable checkpoint and exit, and is awaited.

    The run directory is claimed for the fit while it runs (:mod:`coretune.runclaim`): raises
    :class:`~coretune.runclaim.RunInUse`, touching nothing, when another live process is running it, and returns 0
    without starting a fit when another one finished it before the claim.
    """
    run_dir = Path(run_dir)
    check_run_args(args, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with claimed(run_dir):
        if is_finished(run_dir):
            return 0
        (run_dir / _ARGS_FILE).write_text(json.dumps(list(args), indent=1) + "\n")
        stop_file = run_dir / STOP_FILE
        stop_file.unlink(missing_ok=True)  # an earlier sweep's request must not stop this fit
        env = {**(os.environ if env is None else env), STOP_FILE_ENV: str(stop_file)}
        cmd = fit_command(args, run_dir)
        with (run_dir / "log.txt").open("a") as log:
            log.write(f"\n# {time.strftime('%Y-%m-%d %H:%M:%S')}  {shlex.join(cmd)}\n")
            log.flush()
            with subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env) as proc:
                point_claim(run_dir, proc.pid)  # a fit still running after a second Ctrl+C keeps the claim
                try:
                    while (code := _wait(proc, 0.2)) is None:
                        if stop is not None and stop.signum is not None and not stop_file.exists():
                            request_stop(stop_file, stop.signum)
                    return code
                except KeyboardInterrupt:
                    # Ctrl+C at a terminal reached the fit too, `kill -INT <our pid>` only us: ask it to stop either
                    # way (the request only repeats the signal's), then wait for its checkpoint instead of killing it
                    # as subprocess.run would. A second Ctrl+C at the terminal aborts both.
                    request_stop(stop_file, signal.SIGINT)
                    proc.wait()
                    raise


def _wait(proc: subprocess.Popen, seconds: float) -> int | None:
    """``proc``'s exit code, or ``None`` if it still runs after ``seconds``."""
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return None


# -- the spec ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ObjectiveEntry:
    """A table row: ``name`` (row label and folder name), the ``--objective`` value and extra fit ``args``."""

    name: str
    objective: str
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Run:
    """One cell × seed of the grid: its fit arguments (without ``--run_dir``) and its run directory."""

    dataset: str
    objective: str
    label_fraction: float
    seed: int
    run_dir: Path
    args: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"{self.dataset}/{self.objective}/frac{self.label_fraction:g}/seed{self.seed}"


@dataclass(frozen=True)
class BenchSpec:
    """A benchmark grid read from YAML (see ``configs/bench/``); :meth:`runs` lists its fit runs."""

    name: str
    output: Path
    datasets: dict[str, tuple[str, ...]]
    objectives: tuple[ObjectiveEntry, ...]
    base_args: tuple[str, ...] = ()
    label_fractions: tuple[float, ...] = (1.0,)
    seeds: tuple[int, ...] = (0,)
    workers: int = 1
    table: Layout = "table1"
    baseline: str = ""
    metric: Metric = "test"

    @classmethod
    def from_yaml(cls, path: str | Path) -> BenchSpec:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"bench spec {path} does not exist")
        try:
            raw = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            raise BenchSpecError(f"bench spec {path} is not valid YAML: {err}") from None
        return cls.from_dict(raw, default_name=path.stem, source=str(path))

    @classmethod
    def from_dict(cls, raw: Any, default_name: str = "bench", source: str = "bench spec") -> BenchSpec:
        def fail(msg: str) -> BenchSpecError:
            return BenchSpecError(f"{source}: {msg}")

        if not isinstance(raw, dict):
            raise fail("expected a YAML mapping with datasets, objectives, label_fractions, seeds, ...")
        unknown = sorted(set(raw) - set(_SPEC_KEYS))
        if unknown:
            raise fail(f"unknown key(s) {', '.join(unknown)}; the keys are {', '.join(_SPEC_KEYS)}")
        name = str(raw.get("name") or default_name)
        table = raw.get("table", "table1")
        if table not in get_args(Layout):
            raise fail(f"table must be one of {', '.join(get_args(Layout))} (got {table!r})")
        datasets = _parse_datasets(raw.get("datasets"), fail)
        entries = _parse_objectives(raw.get("objectives"), table, fail)
        fractions = _parse_numbers(raw.get("label_fractions", [1.0]), float, "label_fractions", fail)
        if any(not 0 < f <= 1 for f in fractions):
            raise fail(f"label_fractions must lie in (0, 1] (got {list(fractions)})")
        seeds = _parse_numbers(raw.get("seeds", [0]), int, "seeds", fail)
        workers = raw.get("workers", 1)
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise fail(f"workers must be an integer >= 1 (got {workers!r})")
        metric = raw.get("metric", "test")
        if metric not in get_args(Metric):
            raise fail(f"metric must be one of {', '.join(get_args(Metric))} (got {metric!r})")
        names = [e.name for e in entries]
        baseline = raw.get("baseline") or ("ce" if table == "table2" and "ce" in names else names[0])
        if baseline not in names:
            raise fail(f"baseline {baseline!r} is not one of the objectives ({', '.join(names)})")
        return cls(
            name=name,
            output=Path(raw.get("output") or Path("runs") / "bench" / name),
            datasets=datasets,
            objectives=entries,
            base_args=_parse_args(raw.get("base_args"), "base_args", fail),
            label_fractions=fractions,
            seeds=seeds,
            workers=workers,
            table=table,
            baseline=baseline,
            metric=metric,
        )

    def runs(self) -> list[Run]:
        """Every run of the grid, seed by seed (a partial sweep has every cell's first seeds), then data set, label
        fraction and objective."""
        runs = []
        for seed in self.seeds:
            for dataset, dataset_args in self.datasets.items():
                for fraction in self.label_fractions:
                    for entry in self.objectives:
                        args = (
                            *self.base_args,
                            *dataset_args,
                            "--objective",
                            entry.objective,
                            *entry.args,
                            f"--data.label_fraction={fraction}",
                            f"--seed={seed}",
                        )
                        run_dir = self.output / dataset / entry.name / f"frac{fraction:g}" / f"seed{seed}"
                        runs.append(Run(dataset, entry.name, fraction, seed, run_dir, args))
        return runs

    def subset(self, objectives: Sequence[str] | None = None, seeds: Sequence[int] | None = None) -> BenchSpec:
        """The same grid restricted to some objective names and seeds (e.g. the main comparison's seeds first)."""
        names = [e.name for e in self.objectives]
        unknown = sorted(set(objectives or ()) - set(names)) + sorted(set(seeds or ()) - set(self.seeds))
        if unknown:
            raise BenchSpecError(
                f"{', '.join(map(str, unknown))} not in the spec {self.name!r} (objectives: {', '.join(names)}; "
                f"seeds: {', '.join(map(str, self.seeds))})"
            )
        return replace(
            self,
            objectives=tuple(e for e in self.objectives if objectives is None or e.name in objectives),
            seeds=tuple(s for s in self.seeds if seeds is None or s in seeds),
        )


def _parse_args(value: Any, what: str, fail: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, list):
        raise fail(f"{what} must be a list of command-line arguments, e.g. [--trainer.max_epochs=30]")
    return tuple(str(v) for v in value)


def _parse_numbers(value: Any, kind: type, what: str, fail: Any) -> tuple[Any, ...]:
    values = value if isinstance(value, list) else [value]
    try:
        parsed = tuple(kind(v) for v in values if not isinstance(v, bool))
    except (TypeError, ValueError):
        raise fail(f"{what} must be a list of numbers (got {value!r})") from None
    if len(parsed) != len(values) or not parsed:
        raise fail(f"{what} must be a non-empty list of numbers (got {value!r})")
    if len(set(parsed)) != len(parsed):
        raise fail(f"{what} lists a value twice: {list(parsed)}")
    return parsed


def _check_name(name: Any, what: str, fail: Any) -> str:
    if not isinstance(name, str) or not _SAFE_NAME.match(name) or name in (".", ".."):
        raise fail(
            f"{what} name {name!r} must be a non-empty folder name of letters, digits and _ . + - (not . or .., "
            "which would lead out of the output folder)"
        )
    return name


def _parse_datasets(value: Any, fail: Any) -> dict[str, tuple[str, ...]]:
    if not isinstance(value, dict) or not value:
        raise fail("datasets must map each data-set name to its fit arguments, e.g. {cifar10: [--data.root=DIR]}")
    return {
        _check_name(name, "dataset", fail): _parse_args(args, f"datasets.{name}", fail) for name, args in value.items()
    }


def _parse_objectives(value: Any, table: str, fail: Any) -> tuple[ObjectiveEntry, ...]:
    from .objectives import TABLE2_ROWS, available

    registered = available()
    if not isinstance(value, list) or not value:
        raise fail("objectives must be a non-empty list of registered names or {name, objective, args} entries")
    entries = []
    for item in value:
        if isinstance(item, str):
            if item not in registered:
                raise fail(f"unknown objective {item!r}; registered: {', '.join(registered)}")
            entries.append(ObjectiveEntry(item, item))
        elif isinstance(item, dict):
            extra = sorted(set(item) - {"name", "objective", "args"})
            if extra or "name" not in item:
                raise fail(f"objective entry {item!r} needs 'name' and takes only name, objective and args")
            name = _check_name(item["name"], "objective", fail)
            objective = str(item.get("objective", name))
            if objective not in registered and "." not in objective:
                raise fail(f"objective {objective!r} of entry {name!r} is neither registered nor a class path")
            entries.append(ObjectiveEntry(name, objective, _parse_args(item.get("args"), f"{name}.args", fail)))
        else:
            raise fail(f"objective entry {item!r} must be a name or a {{name, objective, args}} mapping")
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise fail(f"objective names must be unique (got {names})")
    if table == "table2":
        order = [name for _, name in TABLE2_ROWS]
        bad = [e.name for e in entries if e.name not in order or e.objective != e.name]
        if bad:
            raise fail(
                f"table2 takes the Table 2 rows only ({', '.join(order)}; args such as a tuned "
                f"--objective.eta are allowed); not {', '.join(bad)}"
            )
        entries.sort(key=lambda e: order.index(e.name))
    return tuple(entries)


# -- running the grid ----------------------------------------------------------------------------------------------
@dataclass
class SweepReport:
    """What a sweep did: runs skipped as already finished, launched and finished, launched but failed, skipped
    because another process was running them (``in_use``: another sweep of the same spec); and after a signal
    (``signum``), the runs it interrupted (exit ``128 + SIGINT/SIGTERM``, resumable) and those never started.
    """

    skipped: list[Run] = field(default_factory=list)
    in_use: list[Run] = field(default_factory=list)
    finished: list[Run] = field(default_factory=list)
    failed: list[Run] = field(default_factory=list)
    interrupted: list[Run] = field(default_factory=list)
    not_started: list[Run] = field(default_factory=list)
    signum: int | None = None


def visible_gpus() -> list[str]:
    """The CUDA devices this process may use, as ``CUDA_VISIBLE_DEVICES`` names them (indices or UUIDs)."""
    if (listed := os.environ.get("CUDA_VISIBLE_DEVICES")) is not None:
        return [] if listed.strip() == "-1" else [d.strip() for d in listed.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def worker_envs(workers: int, gpus: Sequence[str] = ()) -> list[dict[str, str] | None]:
    """The environment of each of ``workers`` concurrent fits (``None``: this process's own).

    One worker: unchanged (the fit sees every GPU and CPU thread). Several: each fit gets ``cpu_count // workers``
    CPU threads (unless ``OMP_NUM_THREADS`` is set) and, through ``CUDA_VISIBLE_DEVICES``, its own
    ``len(gpus) // workers`` of the visible ``gpus`` (consecutive; a fit with several runs DDP over them if its
    arguments ask for it), or with fewer GPUs than workers one GPU, shared in turn (worker ``k`` gets GPU
    ``k mod len(gpus)``).
    """
    if workers == 1:
        return [None]
    base = dict(os.environ)
    base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    if not gpus:
        return [base] * workers
    per = len(gpus) // workers
    groups = [gpus[k * per : (k + 1) * per] if per else [gpus[k % len(gpus)]] for k in range(workers)]
    return [{**base, "CUDA_VISIBLE_DEVICES": ",".join(group)} for group in groups]


def run_sweep(spec: BenchSpec, workers: int | None = None, dry_run: bool = False, console: Any = None) -> SweepReport:
    """Run every unfinished run of ``spec`` as a ``coretune fit`` subprocess, ``workers`` at a time.

    On a 2-core CPU use ``workers=1``: one fit already keeps both cores busy, and concurrent runs only split them
    (each gets ``cpu_count // workers`` threads) while holding several data sets and models in memory. On a
    machine with GPUs, each of several workers gets its own share of them (:func:`worker_envs`).

    On SIGINT (Ctrl+C) or SIGTERM no further run starts and the running fits are asked (through their stop files,
    whoever sent the signal) to save a resumable ``last.ckpt`` and exit, and are awaited; the report's ``signum``,
    ``interrupted`` and ``not_started`` say so.

    A run that another live process is running (a second sweep of the same spec, in another terminal or on another
    machine sharing the output folder) is skipped when its turn comes (``in_use``), so several sweeps of one spec
    share out its runs instead of training one twice (:mod:`coretune.runclaim`).
    """
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    console = console or Console()
    workers = workers or spec.workers
    report = SweepReport()
    todo = []
    for run in spec.runs():
        check_run_args(run.args, run.run_dir)
        (report.skipped if is_finished(run.run_dir) else todo).append(run)
    check_fit_args(todo, spec.metric)
    console.print(
        f"[bold]{spec.name}[/bold]: {len(report.skipped) + len(todo)} runs, {len(report.skipped)} finished (skipped), "
        f"{len(todo)} to run with {workers} worker(s) → {spec.output}",
        soft_wrap=True,
    )
    if dry_run:
        for run in todo:
            console.print(escape(shlex.join(fit_command(run.args, run.run_dir))), soft_wrap=True, highlight=False)
    if dry_run or not todo:
        return report
    slots: queue.SimpleQueue[dict[str, str] | None] = queue.SimpleQueue()  # one environment per worker
    for env in worker_envs(workers, visible_gpus() if workers > 1 else ()):
        slots.put(env)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    with (
        Progress(*columns, console=console) as progress,
        ThreadPoolExecutor(max_workers=workers) as pool,
        catch_stop_signals() as stop,
    ):
        task = progress.add_task("runs", total=len(todo))
        bars = EpochBars(progress)
        started = {pool.submit(_timed_launch, run, slots, stop, bars): run for run in todo}
        pending = set(started)
        while pending:  # wake up often: a signal only sets `stop`
            done = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED).done
            pending -= done
            bars.refresh()
            if stop.signum is not None and report.signum is None:
                # Start no further run; the running fits are asked to save a resumable checkpoint (launch_fit).
                report.signum = stop.signum
                progress.console.print(
                    f"{signal.Signals(report.signum).name}: no further run starts; waiting for the running fits to "
                    "save a resumable checkpoint (a second signal aborts)…",
                    highlight=False,
                )
                cancelled = {f for f in pending if f.cancel()}
                report.not_started.extend(started[f] for f in cancelled)
                pending -= cancelled
            for future in sorted(done, key=lambda f: todo.index(started[f])):
                run = started[future]
                try:
                    outcome = future.result()
                except RunInUse as error:
                    report.in_use.append(run)
                    progress.console.print(f"↷ {run.label} skipped: {error}", highlight=False)
                    progress.advance(task)
                    continue
                if outcome is None and is_finished(run.run_dir):
                    report.skipped.append(run)
                    progress.console.print(f"↷ {run.label}: finished by another process", highlight=False)
                    progress.advance(task)
                elif outcome is None:  # queued behind the signal
                    report.not_started.append(run)
                else:
                    _report_run(run, *outcome, report, progress.console, spec.metric)
                    progress.advance(task)
    report.not_started.sort(key=todo.index)
    return report


@contextmanager
def catch_stop_signals() -> Iterator[StopSignal]:
    """Within the block, the first SIGINT or SIGTERM is recorded in the yielded :class:`StopSignal` instead of
    raising; a second one gets the previous behaviour. Outside the main thread (no handlers) nothing changes."""
    stop = StopSignal()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {}

    def handle(signum: int, frame: Any) -> None:
        stop.signum = signum
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    previous.update({sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)})
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _report_run(run: Run, code: int, seconds: float, report: SweepReport, console: Any, metric: Metric) -> None:
    if is_finished(run.run_dir):
        report.finished.append(run)
        top1 = run_top1(run.run_dir, metric)
        console.print(f"✓ {run.label}: {_METRIC_TEXT[metric]} {top1:.2f}% ({seconds:.0f} s)", highlight=False)
    elif code in _INTERRUPTED_CODES:
        report.interrupted.append(run)
        console.print(
            f"⏸ {run.label} interrupted after {seconds:.0f} s (exit code {code}); it resumes from "
            f"{run.run_dir / 'checkpoints' / 'last.ckpt'} when the sweep is re-run",
            highlight=False,
        )
    else:
        report.failed.append(run)
        console.print(
            f"✗ {run.label} did not finish (exit code {code}): see {run.run_dir / 'log.txt'}", highlight=False
        )


_INTERRUPTED_CODES = (128 + signal.SIGINT, 128 + signal.SIGTERM)
"""Exit codes of a ``coretune fit`` stopped by a signal after saving ``last.ckpt`` (``TrainingInterrupted``)."""


class EpochBars:
    """Beside a sweep's bar of runs, one bar per running fit: its epochs done of its length, read from its files
    (:func:`epochs_done`) at most every ``every`` seconds. Worker threads call :meth:`started` and :meth:`ended`,
    the sweep's thread :meth:`refresh`."""

    def __init__(self, progress: Any, every: float = 2.0) -> None:
        self.progress, self.every = progress, every
        self._running: set[Run] = set()
        self._bars: dict[Run, Any] = {}  # run → rich task id
        self._lock = threading.Lock()
        self._due = 0.0

    def started(self, run: Run) -> None:
        """Also prints one line, so that a sweep whose output is not a terminal (``nohup``, a batch job: no bars)
        still says which run it is on and where that run's per-epoch log is."""
        done, total = epochs_done(run.run_dir)
        where = f"(log: {run.run_dir / 'log.txt'})"
        if done:
            of = f" of {total}" if total else ""
            line = f"▶ {run.label} resumes after epoch {done}{of} {where}"
        else:
            line = f"▶ {run.label} started {where}"
        self.progress.console.print(line, highlight=False, markup=False, soft_wrap=True)
        with self._lock:
            self._running.add(run)
        self._due = 0.0  # show it at the next refresh

    def ended(self, run: Run) -> None:
        with self._lock:
            self._running.discard(run)
        self._due = 0.0

    def refresh(self) -> None:
        if time.monotonic() < self._due:
            return
        self._due = time.monotonic() + self.every
        with self._lock:
            running = set(self._running)
        for run in [r for r in self._bars if r not in running]:
            self.progress.remove_task(self._bars.pop(run))
        for run in sorted(running, key=lambda r: r.label):
            done, total = epochs_done(run.run_dir)
            if run in self._bars:
                self.progress.update(self._bars[run], completed=done, total=total)
            else:
                self._bars[run] = self.progress.add_task(f"  {run.label} (epochs)", completed=done, total=total)


def _timed_launch(run: Run, slots: queue.SimpleQueue, stop: StopSignal, bars: EpochBars) -> tuple[int, float] | None:
    """Exit code and seconds of the run's fit, in the environment of a free worker slot (taken from ``slots`` and
    put back); ``None`` when it did not start: ``stop`` held a signal, or another sweep finished the run since this
    one listed it."""
    if stop.signum is not None or is_finished(run.run_dir):
        return None
    env = slots.get()  # the pool has one thread per slot: never waits
    bars.started(run)
    try:
        start = time.perf_counter()
        code = launch_fit(run.args, run.run_dir, env, stop)
        return code, time.perf_counter() - start
    finally:
        bars.ended(run)
        slots.put(env)


# -- aggregation ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    """The finished seeds of one (objective, data set, label fraction): top-1 in percent (the spec's metric)."""

    objective: str
    dataset: str
    label_fraction: float
    values: tuple[float, ...]
    seeds: tuple[int, ...] = ()  # the seed of each value, when known (pairs runs across cells)

    def __post_init__(self) -> None:
        if self.seeds and len(self.seeds) != len(self.values):
            raise ValueError(f"{len(self.values)} values but {len(self.seeds)} seeds: give one seed per value or none")

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return float(np.mean(self.values)) if self.values else math.nan

    @property
    def std(self) -> float:
        """Sample standard deviation (ddof = 1); NaN below two seeds."""
        return float(np.std(self.values, ddof=1)) if self.n >= 2 else math.nan

    def text(self) -> str:
        if not self.values:
            return "–"
        spread = f" ± {self.std:.2f}" if self.n >= 2 else ""
        return f"{self.mean:.2f}{spread} (n={self.n})"


@dataclass(frozen=True)
class Comparison:
    """Difference of two cells' means against twice their pooled standard deviation, and the paired view.

    ``paired``: ``a − b`` for each seed both cells finished (seed order). Runs with one seed share the label
    subset, the new heads' initialisation, the batches and the augmentations, so the per-seed differences are
    free of that variation. ``paired_t`` = mean / (std / √n) of those differences (n − 1 degrees of freedom) and
    ``paired_p`` its two-sided p-value; NaN below two pairs or when every pair differs by the same amount.
    """

    diff: float
    pooled_std: float
    beyond_two_std: bool | None
    paired: tuple[float, ...] = ()
    paired_t: float = math.nan
    paired_p: float = math.nan


def compare(a: Cell, b: Cell) -> Comparison:
    """``mean(a) − mean(b)`` against ``2 s_p``, ``s_p² = ((n_a−1)s_a² + (n_b−1)s_b²) / (n_a + n_b − 2)``, and the
    paired t-test of the seeds both cells share.

    ``beyond_two_std`` is None when either cell has fewer than two seeds. A rule of thumb (the issue's "beyond 2
    standard deviations"), not a hypothesis test.
    """
    diff = a.mean - b.mean
    by_seed = dict(zip(b.seeds, b.values, strict=False))  # seeds unknown (empty): nothing is paired
    paired = tuple(v - by_seed[s] for s, v in zip(a.seeds, a.values, strict=False) if s in by_seed)
    t, p = math.nan, math.nan
    if len(paired) >= 2 and (spread := float(np.std(paired, ddof=1))) > 0:
        from scipy.stats import t as student_t

        t = float(np.mean(paired)) / (spread / math.sqrt(len(paired)))
        p = float(2 * student_t.sf(abs(t), len(paired) - 1))
    if a.n < 2 or b.n < 2:
        return Comparison(diff, math.nan, None, paired, t, p)
    pooled = math.sqrt(((a.n - 1) * a.std**2 + (b.n - 1) * b.std**2) / (a.n + b.n - 2))
    return Comparison(diff, pooled, bool(abs(diff) > 2 * pooled), paired, t, p)


def collect_cells(spec: BenchSpec) -> tuple[dict[tuple[str, str, float], Cell], list[dict[str, Any]]]:
    """Cells keyed by ``(objective, dataset, label_fraction)`` and one row per run (for ``runs.csv``)."""
    values: dict[tuple[str, str, float], list[float]] = {}
    seeds: dict[tuple[str, str, float], list[int]] = {}
    rows = []
    datasets, names = list(spec.datasets), [e.name for e in spec.objectives]

    def position(run: Run) -> tuple[int, int, float, int]:
        return datasets.index(run.dataset), names.index(run.objective), run.label_fraction, run.seed

    for run in sorted(spec.runs(), key=position):
        key = (run.objective, run.dataset, run.label_fraction)
        values.setdefault(key, [])
        seeds.setdefault(key, [])
        results_path = run.run_dir / "results.json"
        results = json.loads(results_path.read_text()) if results_path.is_file() else {}
        test = results.get("test") or {}
        if test:
            status = "finished"
        elif live_claim(run.run_dir) is not None:
            status = "running"
        else:
            status = "unfinished" if run.run_dir.is_dir() else "missing"
        progress = f"{results.get('epochs', '')} epochs" if test else run_progress(run.run_dir)
        top1 = run_top1(run.run_dir, spec.metric) if test else None
        if top1 is not None:
            values[key].append(top1)
            seeds[key].append(run.seed)
        rows.append(
            {
                "dataset": run.dataset,
                "objective": run.objective,
                "label_fraction": run.label_fraction,
                "seed": run.seed,
                "status": status,
                "progress": progress,
                "test_top1_pct": round(100 * test["top1"], 4) if test else "",
                "test_top5_pct": round(100 * test["top5"], 4) if test.get("top5") is not None else "",
                **({"val_top1_pct": "" if top1 is None else round(top1, 4)} if spec.metric == "val" else {}),
                "epochs": results.get("epochs", ""),
                "wall_time_s": results.get("wall_time_s", ""),
                "train_images_per_s": results.get("train_images_per_s", ""),
                "run_dir": str(run.run_dir),
            }
        )
    cells = {key: Cell(*key, tuple(v), tuple(seeds[key])) for key, v in values.items()}
    return cells, rows


@dataclass(frozen=True)
class TableLayout:
    """Rows (objective names and labels) and columns (``(dataset, label_fraction)`` and labels) of a summary."""

    rows: list[tuple[str, str]]
    columns: list[tuple[tuple[str, float], str]]


def table_layout(spec: BenchSpec) -> TableLayout:
    """Table 1: methods × data sets; Table 2: the ablation rows (paper order and labels) × data sets; Table 4:
    methods × label fractions. A dimension with several values that the layout does not name joins the columns."""
    from .objectives import TABLE2_ROWS

    labels = {name: label for label, name in TABLE2_ROWS} if spec.table == "table2" else {}
    rows = [(e.name, labels.get(e.name, e.name)) for e in spec.objectives]
    show_dataset = spec.table != "table4" or len(spec.datasets) > 1
    show_fraction = spec.table == "table4" or len(spec.label_fractions) > 1
    columns = []
    for dataset in spec.datasets:
        for fraction in spec.label_fractions:
            parts = [dataset] if show_dataset else []
            parts += [f"{100 * fraction:g}%"] if show_fraction else []
            columns.append(((dataset, fraction), " ".join(parts)))
    return TableLayout(rows, columns)


_TITLES = {
    "table1": "{metric} (%) of each fine-tuning method (rows) on each data set (columns), as in the paper's Table 1",
    "table2": "{metric} (%) of the ablation rows of the paper's Table 2 (Core-tuning is the last row)",
    "table4": "{metric} (%) of each fine-tuning method (rows) against the fraction of labels used, as in the "
    "paper's table of various numbers of labeled data",
}


def _markdown(spec: BenchSpec, cells: dict[tuple[str, str, float], Cell], layout: TableLayout) -> str:
    cols = [key for key, _ in layout.columns]
    with_avg = len(cols) > 1
    best = {}
    for col in cols:
        means = [cells[(name, *col)].mean for name, _ in layout.rows if cells[(name, *col)].n]
        best[col] = max(means) if means else math.nan
    title = _TITLES[spec.table].format(metric=_METRIC_TEXT[spec.metric])
    header = ["Method", *(label for _, label in layout.columns), *(["Avg."] if with_avg else [])]
    lines = [
        f"# {spec.name}",
        "",
        f"{title}: mean ± sample standard deviation (ddof = 1) over seeds {list(spec.seeds)}; "
        "n = finished runs of the cell; best mean per column in bold.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] + [":-:"] * (len(header) - 1)) + "|",
    ]
    for name, label in layout.rows:
        row = [cells[(name, *col)] for col in cols]
        texts = [
            f"**{c.text()}**" if c.n and c.mean == best[col] else c.text() for c, col in zip(row, cols, strict=True)
        ]
        if with_avg:
            texts.append(f"{np.mean([c.mean for c in row]):.2f}" if all(c.n for c in row) else "–")
        lines.append(f"| {label} | " + " | ".join(texts) + " |")
    lines += _significance(spec, cells, layout)
    return "\n".join(lines) + "\n"


def _significance(spec: BenchSpec, cells: dict[tuple[str, str, float], Cell], layout: TableLayout) -> list[str]:
    labels = dict(layout.rows)
    lines = [
        "",
        f"## Differences from {labels[spec.baseline]}",
        "",
        f"Δ = difference of mean {_METRIC_TEXT[spec.metric]} (percentage points); s_p = pooled sample standard "
        "deviation of the two cells; beyond 2σ when |Δ| > 2 s_p (a rule of thumb, not a hypothesis test; needs "
        "n ≥ 2 in both cells). Paired: the difference on each seed both cells finished (runs with one seed share "
        "the label subset, the heads' initialisation, the batches and the augmentations); t = mean / (std / √n) of "
        "those differences with n − 1 degrees of freedom, two-sided p (few seeds detect only large, consistent "
        "differences).",
        "",
        "| Column | Method | Δ (pp) | 2 s_p (pp) | beyond 2σ | paired Δ per seed (pp) | paired t (p) |",
        "|---|---|:-:|:-:|:-:|:-:|:-:|",
    ]
    for col, col_label in layout.columns:
        base = cells[(spec.baseline, *col)]
        for name, label in layout.rows:
            cell = cells[(name, *col)]
            if name == spec.baseline or not (cell.n and base.n):
                continue
            c = compare(cell, base)
            verdict = "n/a" if c.beyond_two_std is None else ("yes" if c.beyond_two_std else "no")
            two_sp = f"{2 * c.pooled_std:.2f}" if c.beyond_two_std is not None else "–"
            per_seed = " / ".join(f"{d:+.2f}" for d in c.paired) or "–"
            t_test = "–" if math.isnan(c.paired_t) else f"{c.paired_t:.1f} ({c.paired_p:.2g})"
            lines.append(f"| {col_label} | {label} | {c.diff:+.2f} | {two_sp} | {verdict} | {per_seed} | {t_test} |")
    return lines


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _summary_rows(cells: dict[tuple[str, str, float], Cell], layout: TableLayout) -> list[dict[str, Any]]:
    rows = []
    for name, label in layout.rows:
        row: dict[str, Any] = {"method": label, "objective": name}
        for col, col_label in layout.columns:
            cell = cells[(name, *col)]
            row[f"{col_label} mean (%)"] = "" if not cell.n else round(cell.mean, 4)
            row[f"{col_label} std (%)"] = "" if cell.n < 2 else round(cell.std, 4)
            row[f"{col_label} n"] = cell.n
        rows.append(row)
    return rows


def collect_curves(spec: BenchSpec) -> list[dict[str, Any]]:
    """The validated top-1 per epoch of every cell: mean and sample std (%) over its finished seeds that validated
    that epoch (``val/top1`` in each run's ``metrics.csv``: the validation split, or the test images for runs that
    hold none out), and the paired difference from the spec's baseline row in the same column: ``v − v_baseline``
    on each seed both finished and validated at that epoch, mean and sample std (percentage points) and the number
    of pairs (blank for the baseline row and without pairs). One row per (data set, objective, label fraction,
    epoch), epochs counted from 1. ``validated_on`` says what the cell's runs validated on (``results.json``'s
    ``validated_on_test_images``): ``test`` (no validation split: the test images), ``val`` (a validation split),
    ``mixed``, or blank when no run records it."""
    per_run: dict[tuple[str, str, float], dict[int, dict[int, float]]] = {}  # cell → seed → epoch → top-1 (%)
    sources: dict[tuple[str, str, float], set[str]] = {}  # cell → what its runs validated on
    for run in spec.runs():
        if not is_finished(run.run_dir) or not (metrics := run.run_dir / "metrics.csv").is_file():
            continue
        key = (run.dataset, run.objective, run.label_fraction)
        on_test = json.loads((run.run_dir / "results.json").read_text()).get("validated_on_test_images")
        sources.setdefault(key, set()).update([] if on_test is None else ["test" if on_test else "val"])
        curve = per_run.setdefault(key, {}).setdefault(run.seed, {})
        with metrics.open(newline="") as f:
            for row in csv.DictReader(f):
                if row.get("val/top1") not in (None, ""):
                    curve[int(row["epoch"]) + 1] = 100 * float(row["val/top1"])

    def mean_std(values: list[float]) -> tuple[float | str, float | str]:
        if not values:
            return "", ""
        std = round(float(np.std(values, ddof=1)), 4) if len(values) > 1 else ""
        return round(float(np.mean(values)), 4), std

    rows = []
    datasets, names = list(spec.datasets), [e.name for e in spec.objectives]
    for (dataset, objective, fraction), seeds in sorted(
        per_run.items(), key=lambda item: (datasets.index(item[0][0]), names.index(item[0][1]), item[0][2])
    ):
        base = {} if objective == spec.baseline else per_run.get((dataset, spec.baseline, fraction), {})
        for epoch in sorted({e for curve in seeds.values() for e in curve}):
            values = [curve[epoch] for curve in seeds.values() if epoch in curve]
            deltas = [c[epoch] - base[s][epoch] for s, c in seeds.items() if epoch in c and epoch in base.get(s, {})]
            mean, std = mean_std(values)
            delta_mean, delta_std = mean_std(deltas)
            rows.append(
                {
                    "dataset": dataset,
                    "objective": objective,
                    "label_fraction": fraction,
                    "epoch": epoch,
                    "n": len(values),
                    "val_top1_mean_pct": mean,
                    "val_top1_std_pct": std,
                    "validated_on": _validated_on(sources[(dataset, objective, fraction)]),
                    "baseline": spec.baseline,
                    "delta_n": len(deltas) if deltas else "",
                    "delta_mean_pp": delta_mean,
                    "delta_std_pp": delta_std,
                }
            )
    return rows


def _validated_on(sources: set[str]) -> str:
    """``test``, ``val``, ``mixed`` or blank (none known) for the set of what some runs validated on."""
    return "mixed" if len(sources) > 1 else next(iter(sources), "")


def curves_metric(curves: list[dict[str, Any]]) -> str:
    """What the curves of :func:`collect_curves` show, for the plot's axes: the test top-1 when every run that records
    it validated on the test images, the validation top-1 when every such run validated on a split of the training
    set, a generic label when they differ or none records it."""
    texts = {"test": "test top-1 (no validation split)", "val": "validation top-1"}
    validated_on = _validated_on({r["validated_on"] for r in curves} - {""})
    return texts.get(validated_on, "validated top-1 (validation split or test images)")


def _plot_label(label: str) -> str:
    """A table row's label for matplotlib: ``L_con`` and ``L^f_con`` as mathtext (``ℒ_con``, ``ℒ^f_con``)."""
    return label.replace("L^f_con", r"$\mathcal{L}^f_{con}$").replace("L_con", r"$\mathcal{L}_{con}$")


def _plot(spec: BenchSpec, cells: dict[tuple[str, str, float], Cell], layout: TableLayout) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def stats(name: str, col: tuple[str, float]) -> tuple[float, float]:
        cell = cells[(name, *col)]
        return cell.mean, (0.0 if math.isnan(cell.std) else cell.std)

    paths = []
    cols = [key for key, _ in layout.columns]
    x = np.arange(len(cols))
    width = 0.8 / len(layout.rows)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.0 + 0.35 * len(cols) * len(layout.rows)), 4.5))
    lows = []
    for i, (name, label) in enumerate(layout.rows):
        means, stds = zip(*(stats(name, col) for col in cols), strict=True)
        lows += [m - s for m, s in zip(means, stds, strict=True) if not math.isnan(m)]
        offset = (i - (len(layout.rows) - 1) / 2) * width
        ax.bar(x + offset, means, width, yerr=stds, capsize=3, label=_plot_label(label))
    if lows:
        ax.set_ylim(bottom=max(0.0, 5 * math.floor(min(lows) / 5) - 5))
    ax.set_xticks(x, [label for _, label in layout.columns])
    ax.set(ylabel=f"{_METRIC_TEXT[spec.metric]} (%)", title=f"{spec.name}: mean ± std over seeds")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over them
    paths.append(spec.output / "bars.png")
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)

    if len(spec.label_fractions) > 1:
        fractions = sorted(spec.label_fractions)
        fig, axes = plt.subplots(1, len(spec.datasets), figsize=(5 * len(spec.datasets), 4), squeeze=False)
        for ax, dataset in zip(axes[0], spec.datasets, strict=True):
            for name, label in layout.rows:
                means, stds = zip(*(stats(name, (dataset, f)) for f in fractions), strict=True)
                percent = [100 * f for f in fractions]
                ax.errorbar(percent, means, yerr=stds, marker="o", capsize=3, label=_plot_label(label))
            ax.set(xlabel="labels used (%)", ylabel=f"{_METRIC_TEXT[spec.metric]} (%)", title=dataset)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(spec.output / "label_fraction.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def _plot_curves(spec: BenchSpec, curves: list[dict[str, Any]], layout: TableLayout) -> Path:
    """``curves.png``: validated top-1 against epoch, mean ± std band over seeds, one panel per table column; below,
    when any row shares seeds with the baseline, the paired difference from the baseline row (mean ± std band over
    the shared seeds), which separates rows whose curves overlap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = [
        (col, label) for col, label in layout.columns if any((r["dataset"], r["label_fraction"]) == col for r in curves)
    ]
    with_deltas = any(r["delta_n"] != "" for r in curves)
    panels = 2 if with_deltas else 1
    fig, axes = plt.subplots(panels, len(columns), figsize=(5 * len(columns), 4 * panels), squeeze=False)
    base_label = _plot_label(dict(layout.rows)[spec.baseline])
    metric = curves_metric(curves)

    def band(ax: Any, rows: list[dict[str, Any]], stat: str, colour: str, label: str) -> None:
        """Mean line and ± std band of ``stat`` (``val_top1_*_pct`` or ``delta_*_pp``) over the epochs it has."""
        rows = [r for r in rows if r[stat.format("mean")] != ""]
        if not rows:
            return
        epochs = np.array([r["epoch"] for r in rows])
        mean = np.array([r[stat.format("mean")] for r in rows])
        std = np.array([r[stat.format("std")] or 0.0 for r in rows])
        ax.plot(epochs, mean, marker="o", markersize=3, color=colour, label=label)
        ax.fill_between(epochs, mean - std, mean + std, color=colour, alpha=0.2)

    for j, (col, col_label) in enumerate(columns):
        for i, (name, label) in enumerate(layout.rows):
            rows = [r for r in curves if (r["dataset"], r["label_fraction"]) == col and r["objective"] == name]
            band(axes[0, j], rows, "val_top1_{}_pct", f"C{i}", _plot_label(label))
            if with_deltas:
                if name == spec.baseline:
                    axes[1, j].axhline(0.0, color=f"C{i}", linestyle="--", linewidth=1)
                else:
                    band(axes[1, j], rows, "delta_{}_pp", f"C{i}", _plot_label(label))
        axes[0, j].set(xlabel="epoch", ylabel=f"{metric} (%)", title=col_label)
        if with_deltas:
            title = f"{col_label}: Δ from {base_label}, paired by seed"
            axes[1, j].set(xlabel="epoch", ylabel=f"Δ {metric.partition(' (')[0]} (pp)", title=title)
        axes[0, j].legend(fontsize=8)  # the Δ panel below uses the same colours
        for ax in axes[:, j]:
            ax.grid(alpha=0.3)
    fig.suptitle(f"{spec.name}: {metric} per epoch, mean ± std over seeds", fontsize=10)
    fig.tight_layout()
    path = spec.output / "curves.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the title may be wider than one panel
    plt.close(fig)
    return path


def write_summary(spec: BenchSpec) -> tuple[str, list[Path]]:
    """Write ``runs.csv``, ``summary.md``, ``summary.csv``, ``curves.csv`` (:func:`collect_curves`) and the plots
    into ``spec.output``.

    Returns the markdown summary and the written paths.
    """
    cells, runs = collect_cells(spec)
    layout = table_layout(spec)
    spec.output.mkdir(parents=True, exist_ok=True)
    markdown = _markdown(spec, cells, layout)
    paths = [spec.output / "runs.csv", spec.output / "summary.csv", spec.output / "summary.md"]
    _write_csv(paths[0], runs)
    _write_csv(paths[1], _summary_rows(cells, layout))
    paths[2].write_text(markdown)
    if any(cell.n for cell in cells.values()):
        paths += _plot(spec, cells, layout)
    if curves := collect_curves(spec):
        paths.append(spec.output / "curves.csv")
        _write_csv(paths[-1], curves)
        paths.append(_plot_curves(spec, curves, layout))
    return markdown, paths


def export_records(spec: BenchSpec, dest: str | Path) -> list[Path]:
    """Copy the :data:`RECORD_FILES` of every finished run of ``spec`` into ``dest``, in the layout of
    ``spec.output`` and without checkpoints or logs: a few KB per run to keep (in git, say) after the output folder
    is gone. Copying them back into ``spec.output`` makes the sweep skip those runs and count them in its tables.

    Returns the run directories written under ``dest``."""
    dest = Path(dest)
    if dest.resolve() == spec.output.resolve():
        raise ValueError(f"--export {dest} is the spec's output folder; give another folder to copy the records into")
    written = []
    for run in spec.runs():
        if not is_finished(run.run_dir):
            continue
        target = dest / run.run_dir.relative_to(spec.output)
        target.mkdir(parents=True, exist_ok=True)
        for name in RECORD_FILES:
            if (source := run.run_dir / name).is_file():
                shutil.copy2(source, target / name)
        written.append(target)
    return written


# -- command line --------------------------------------------------------------------------------------------------
def print_status(spec: BenchSpec, console: Any, whole: BenchSpec | None = None) -> None:
    """A table of every run of ``spec``: finished (top-1, in the spec's metric), how far it got, or not started;
    then the fitting left, timing not-started runs by the finished seeds of ``whole`` (the spec ``spec`` is a
    subset of; default ``spec``)."""
    from rich.table import Table

    _, rows = collect_cells(spec)
    metric = "val_top1_pct" if spec.metric == "val" else "test_top1_pct"
    table = Table("data set", "objective", "labels", "seed", _METRIC_TEXT[spec.metric] + " (%)", "progress")
    for row in rows:
        value = f"{row[metric]:.2f}" if row["status"] == "finished" else ""
        fraction = f"{100 * row['label_fraction']:g}%"
        table.add_row(row["dataset"], row["objective"], fraction, str(row["seed"]), value, row["progress"])
    counts = {s: sum(r["status"] == s for r in rows) for s in ("finished", "running", "unfinished", "missing")}
    console.print(table)
    console.print(
        f"{spec.name}: {counts['finished']} of {len(rows)} runs finished, {counts['running'] + counts['unfinished']} "
        f"started ({counts['running']} running now), {counts['missing']} not started ({spec.output})",
        highlight=False,
    )
    if unfinished := len(rows) - counts["finished"]:
        left, covered = sweep_time_left(rows, None if whole is None else collect_cells(whole)[1])
        runs, their = ("run", "its") if unfinished == 1 else ("runs", "their")
        unknown = f"no timed epoch or finished seed in {their} cell to go by"
        if covered == 0:
            note = f"time left unknown: {unfinished} unfinished {runs} with {unknown}"
        else:
            which = f"the {unfinished}" if covered == unfinished else f"{covered} of the {unfinished}"
            note = (
                f"~{format_duration(left)} of fitting left for {which} unfinished {runs}, one after another (at "
                f"{their} own pace, or {their} cell's finished seeds')"
            )
            if covered < unfinished:
                note += f"; {unfinished - covered} with {unknown}"
        console.print(note, highlight=False)


def _parser() -> Any:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(
        allow_abbrev=False,
        prog="coretune bench",
        description="Run a grid of coretune fit runs (objectives × data sets × label fractions × seeds) from a YAML "
        "spec (see configs/bench/), resumably, and tabulate mean ± std top-1 per cell (test; with 'metric: val' the "
        "final epoch's on a validation split) in summary.md, summary.csv, runs.csv, bars.png and "
        "label_fraction.png in the spec's output folder.",
    )
    parser.add_argument("config", type=str, help="The bench spec (YAML).")
    parser.add_argument(
        "--workers",
        type=int | None,
        default=None,
        help="Concurrent fit subprocesses (default: the spec's workers). Use 1 on a 2-core CPU.",
    )
    parser.add_argument(
        "--only_objectives",
        type=list[str] | None,
        default=None,
        help="Run only these objective names of the spec (the tables still cover the whole grid).",
    )
    parser.add_argument("--only_seeds", type=list[int] | None, default=None, help="Run only these seeds of the spec.")
    parser.add_argument("--dry_run", action="store_true", help="Print the fit commands of the unfinished runs.")
    parser.add_argument("--aggregate_only", action="store_true", help="Only (re)write the tables and plots.")
    parser.add_argument(
        "--status",
        action="store_true",
        help="List every run (of --only_objectives/--only_seeds if given): finished (its top-1), running, how far "
        "it got, or not started.",
    )
    parser.add_argument(
        "--export",
        type=str | None,
        default=None,
        help="Copy the small files of every finished run (of --only_objectives/--only_seeds if given: config.yaml, "
        "fit_args.json, metrics.csv, results.json; no checkpoints) into this folder, in the output folder's layout; "
        "copied back into the output folder, they count as finished runs. Runs nothing.",
    )
    return parser


def main(args: list[str]) -> None:
    from rich.console import Console

    cfg = _parser().parse_args(args)
    spec = BenchSpec.from_yaml(cfg.config)
    if cfg.workers is not None and cfg.workers < 1:
        raise ValueError(f"--workers must be >= 1 (got {cfg.workers})")
    console = Console()
    subset = spec.subset(cfg.only_objectives, cfg.only_seeds)
    if cfg.status:
        print_status(subset, console, whole=spec)
        return
    if cfg.export is not None:
        written = export_records(subset, cfg.export)
        console.print(f"copied the records of {len(written)} finished run(s) to {cfg.export}", highlight=False)
        return
    report = None
    if not cfg.aggregate_only:
        report = run_sweep(subset, workers=cfg.workers, dry_run=cfg.dry_run, console=console)
        if cfg.dry_run:
            return
    markdown, paths = write_summary(spec)
    console.print(markdown, highlight=False, markup=False, soft_wrap=True)
    console.print("wrote " + ", ".join(str(p) for p in paths), highlight=False, soft_wrap=True)
    if report is not None and report.signum is not None:
        counts = (
            f"{len(report.finished)} run(s) finished, {len(report.interrupted)} interrupted with a resumable "
            f"checkpoint, {len(report.not_started)} not started"
            + (f", {len(report.failed)} failed" if report.failed else "")
            + (f", {len(report.in_use)} run by another process" if report.in_use else "")
        )
        raise SweepInterrupted(
            report.signum,
            f"sweep stopped by {signal.Signals(report.signum).name}: {counts}. Re-run the same command to resume: "
            "finished runs are skipped, interrupted ones continue from checkpoints/last.ckpt",
        )
    if report is not None and report.in_use:
        console.print(
            f"{len(report.in_use)} run(s) skipped: another process is running them (`--status` shows how far they "
            "got; `--aggregate_only` updates the tables once they finish)",
            highlight=False,
        )
    if report is not None and (report.failed or report.interrupted):
        logs = "; ".join(str(run.run_dir / "log.txt") for run in report.failed)
        parts = [f"{len(report.failed)} failed (see {logs})"] if report.failed else []
        if report.interrupted:
            parts.append(f"{len(report.interrupted)} were interrupted (resumable)")
        raise RuntimeError(
            f"of {len(report.failed) + len(report.interrupted) + len(report.finished)} runs, {' and '.join(parts)}; "
            + ("fix the cause and " if report.failed else "")
            + "re-run the same command to run them again"
        )
