"""Launching a sweep's fits: each run is an ordinary ``coretune fit`` subprocess (:func:`launch_fit`), in a run
directory it claims (:mod:`coretune.runs.claim`) and stops through its stop file (:mod:`coretune.runs.stopfile`) on
SIGINT/SIGTERM; :func:`run_sweep` runs a spec's unfinished runs, ``workers`` at a time."""

from __future__ import annotations

import os
import queue
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..runs.atomic import atomic_write, strict_json
from ..runs.claim import RunInUse, claimed, point_claim
from ..runs.layout import RunDir
from ..runs.outputs import mark_folder
from ..runs.stopfile import STOP_FILE_ENV, request_stop
from .job import SUBPROCESS_FIT_ARGS, fit_command
from .records import check_run_args, run_top1
from .spec import BenchSpec, BenchSpecError, Metric, Run, check_val_split, metric_text, unvalidated_final_epoch

__all__ = [
    "SUBPROCESS_FIT_ARGS",
    "EpochBars",
    "StopSignal",
    "SweepInterrupted",
    "SweepReport",
    "catch_stop_signals",
    "check_fit_args",
    "fit_command",
    "launch_fit",
    "prepare_sweep",
    "report_run",
    "run_sweep",
    "sweep_log_args",
    "visible_gpus",
    "worker_envs",
]


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


def check_fit_args(runs: Sequence[Run], metric: Metric = "test") -> None:
    """Before a sweep starts, resolve each run's fit configuration (``coretune fit --print_config``, in process) and
    refuse the spec when ``coretune fit`` would refuse a run's arguments or, for ``metric: val``, a run would not
    validate its final epoch on a split of the training set: a bad spec fails at once, not after the runs before it."""
    from ..engine.fitcli import FitArgsError, resolved_fit_config

    for run in runs:
        try:
            config = resolved_fit_config(run.job.argv())
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


def launch_fit(
    args: Sequence[str],
    run_dir: str | Path,
    env: dict[str, str] | None = None,
    stop: StopSignal | None = None,
    log_args: Sequence[str] = (),
    shielded: Sequence[int] = (),
) -> int | None:
    """Run one ``coretune fit`` subprocess into ``run_dir``, appending its stdout and stderr to ``log.txt``.

    The edge where a sweep's job becomes a command line: ``args`` are its :meth:`~.job.FitJob.argv`, recorded in
    ``fit_args.json`` and passed to :func:`~.job.fit_command`.

    ``log_args`` are the fit arguments of the sweep's logger (:func:`~coretune.engine.loggers.sweep_logger_args`),
    added after ``args`` but not recorded with them in ``fit_args.json``: a sweep may add or change its logger when
    it resumes.

    ``shielded``: signals the fit process starts with blocked (inherited by the processes it starts), so that only
    this process acts on them: a cluster job's warning signal, which the job turns into a stop request
    (:mod:`coretune.sweeps.clusterjob`).

    Returns the exit code; whether the run finished is :meth:`RunDir.is_finished` (test results, or why it skipped
    the test, written). Once ``stop`` holds a signal, or on Ctrl+C (``KeyboardInterrupt``) while waiting, the fit is
    asked through its stop file (:mod:`coretune.runs.stopfile`) to save a resumable checkpoint and exit, and is
    awaited.

    The run directory is claimed for the fit while it runs (:mod:`coretune.runs.claim`): raises
    :class:`~coretune.runs.claim.RunInUse`, touching nothing, when another live process is running it, and returns
    ``None`` without starting a fit when another one finished it, or saw it diverge, before the claim.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with claimed(run_dir):
        check_run_args(args, run_dir)  # under the claim: another sweep may have run it with its own arguments
        files = RunDir(run_dir)
        if files.is_finished() or files.divergence() is not None:
            return None
        with atomic_write(files.fit_args) as f:  # whole: every later sweep compares it
            f.write(strict_json(list(args), indent=1) + "\n")
        stop_file = files.stop_file
        stop_file.unlink(missing_ok=True)  # an earlier sweep's request must not stop this fit
        env = {**(os.environ if env is None else env), STOP_FILE_ENV: str(stop_file)}
        cmd = [*fit_command(args, run_dir), *log_args]
        with files.log.open("a") as log:
            log.write(f"\n# {time.strftime('%Y-%m-%d %H:%M:%S')}  {shlex.join(cmd)}\n")
            log.flush()
            with _blocked(shielded):  # the child inherits the mask; this process gets them once it is back
                proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
            with proc:
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


@contextmanager
def _blocked(signals: Sequence[int]) -> Iterator[None]:
    """``signals`` blocked in this thread for the block (nothing changes without any)."""
    if not signals:
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _wait(proc: subprocess.Popen, seconds: float) -> int | None:
    """``proc``'s exit code, or ``None`` if it still runs after ``seconds``."""
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return None


@dataclass
class SweepReport:
    """What a sweep did: runs skipped as already finished, launched and finished, launched but failed, that diverged
    (``diverged``: in this sweep, or in an earlier one and not run again), skipped because another process was
    running them (``in_use``: another sweep of the same spec); and after a signal (``signum``), the runs it
    interrupted (exit ``128 + SIGINT/SIGTERM``, resumable) and those never started; ``queued``: runs submitted as
    cluster jobs (``--launcher submitit``) that the sweep did not wait for (queued or running).
    """

    skipped: list[Run] = field(default_factory=list)
    diverged: list[Run] = field(default_factory=list)
    in_use: list[Run] = field(default_factory=list)
    finished: list[Run] = field(default_factory=list)
    failed: list[Run] = field(default_factory=list)
    interrupted: list[Run] = field(default_factory=list)
    not_started: list[Run] = field(default_factory=list)
    queued: list[Run] = field(default_factory=list)
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


def run_sweep(
    spec: BenchSpec,
    workers: int | None = None,
    dry_run: bool = False,
    console: Any = None,
    logger: str | None = None,
    retry_diverged: bool = False,
    command: str = "bench",
) -> SweepReport:
    """Run every unfinished run of ``spec`` as a ``coretune fit`` subprocess, ``workers`` at a time.

    A run whose ``results.json`` records that it diverged or collapsed (:meth:`RunDir.divergence`) is a result, as
    in ``coretune tune``: it is not run again (a seeded fit would diverge again) unless ``retry_diverged`` (e.g.
    after changing the code it runs): then its folder is moved aside (``seed1.diverged-<time>``, kept) and the run
    starts over, not from the checkpoints of the run that diverged.

    ``logger`` (``mlflow``, ``tensorboard``, ``csv``, ``wandb``) logs every run into one place in the spec's output
    folder: one MLflow experiment (or W&B project) named after the spec, each run named by its label
    (:func:`~coretune.engine.loggers.sweep_logger_args`).

    On a 2-core CPU use ``workers=1``: one fit already keeps both cores busy, and concurrent runs only split them
    (each gets ``cpu_count // workers`` threads) while holding several data sets and models in memory. On a
    machine with GPUs, each of several workers gets its own share of them (:func:`worker_envs`).

    On SIGINT (Ctrl+C) or SIGTERM no further run starts and the running fits are asked (through their stop files,
    whoever sent the signal) to save a resumable ``last.ckpt`` and exit, and are awaited; the report's ``signum``,
    ``interrupted`` and ``not_started`` say so.

    A run that another live process is running (a second sweep of the same spec, in another terminal or on another
    machine sharing the output folder) is skipped when its turn comes (``in_use``), so several sweeps of one spec
    share out its runs instead of training one twice (:mod:`coretune.runs.claim`).

    ``command``: the command whose output folder the spec's is (``bench``; ``compare`` runs its comparison as a
    spec), marked as made by it (:func:`~coretune.runs.outputs.mark_folder`).
    """
    from rich.console import Console
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
    report, todo = prepare_sweep(spec, console, f"with {workers} worker(s)", dry_run, logger, retry_diverged, command)
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
        started = {
            pool.submit(_timed_launch, run, slots, stop, bars, sweep_log_args(spec, run, logger)): run for run in todo
        }
        pending = set(started)
        try:
            while pending:  # wake up often: a signal only sets `stop`
                done = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED).done
                pending -= done
                bars.refresh()
                if stop.signum is not None and report.signum is None:
                    # Start no further run; the running fits are asked to save a resumable checkpoint (launch_fit).
                    report.signum = stop.signum
                    progress.console.print(
                        f"{signal.Signals(report.signum).name}: no further run starts; waiting for the running fits "
                        "to save a resumable checkpoint (a second signal aborts)…",
                        highlight=False,
                    )
                    cancelled = {f for f in pending if f.cancel()}
                    report.not_started.extend(started[f] for f in cancelled)
                    pending -= cancelled
                for future in sorted(done, key=lambda f: todo.index(started[f])):
                    _settle(started[future], future, report, progress, task, spec.metric)
        except BaseException:
            # The sweep's own error (not a run's): start no further run, and ask the running fits to save a
            # resumable checkpoint, before the pool waits for them; the error follows.
            stop.signum = stop.signum or signal.SIGTERM
            for future in pending:
                future.cancel()
            raise
    report.not_started.sort(key=todo.index)
    return report


def prepare_sweep(
    spec: BenchSpec,
    console: Any,
    how: str,
    dry_run: bool = False,
    logger: str | None = None,
    retry_diverged: bool = False,
    command: str = "bench",
) -> tuple[SweepReport, list[Run]]:
    """What every launcher of a sweep does before its first fit: the report of the runs finished (skipped) and
    diverged (not run again unless ``retry_diverged``), the runs to run (their fit arguments checked, refused
    before any run), the spec's output folder marked as ``command``'s, the sweep's first line (``how`` the runs go:
    ``with 2 worker(s)``), and the commands of a dry run. Outside a dry run, a diverged run to retry is moved aside
    (``seed1.diverged-<time>``) so that it starts over."""
    from rich.markup import escape

    report = SweepReport()
    todo = []
    if logger is not None:
        from ..engine.loggers import check_sweep_logger

        check_sweep_logger(logger)
    for run in spec.runs():
        check_run_args(run.job)
        files = RunDir(run.run_dir)
        if files.is_finished():
            report.skipped.append(run)
        elif files.divergence() is not None and not retry_diverged:
            report.diverged.append(run)
        else:
            todo.append(run)
    retry = [run for run in todo if RunDir(run.run_dir).divergence() is not None]
    check_fit_args(todo, spec.metric)
    if not dry_run:
        mark_folder(spec.output, command)  # checked by the command: its next sweep may write into it again
    earlier = f"{len(report.diverged)} diverged (not run again), " if report.diverged else ""
    console.print(
        f"[bold]{spec.name}[/bold]: {len(report.skipped) + len(report.diverged) + len(todo)} runs, "
        f"{len(report.skipped)} finished (skipped), {earlier}{len(todo)} to run {how} → {spec.output}",
        soft_wrap=True,
    )
    for run in report.diverged:
        console.print(
            f"✗ {run.label} diverged in an earlier sweep: {RunDir(run.run_dir).divergence()} (not run again; "
            "--retry_diverged runs it again)",
            soft_wrap=True,
            highlight=False,
        )
    if dry_run:
        for run in todo:
            if run in retry:  # moved aside first (below): the fit starts over
                console.print(f"# {run.label}: the run that diverged is moved aside, then", highlight=False)
            line = run.job.command_str(sweep_log_args(spec, run, logger), resume=False if run in retry else None)
            console.print(escape(line), soft_wrap=True, highlight=False)
        return report, todo
    for run in retry:
        if RunDir(run.run_dir).live_claim() is None:  # claimed: another sweep is retrying it
            aside = run.run_dir.with_name(f"{run.run_dir.name}.diverged-{time.strftime('%Y%m%d-%H%M%S')}")
            try:
                run.run_dir.rename(aside)
            except FileNotFoundError:  # another sweep retrying it moved it first
                continue
            console.print(f"↻ {run.label}: starts over; the run that diverged is kept in {aside}", highlight=False)
    return report, todo


def _settle(run: Run, future: Future, report: SweepReport, progress: Any, task: Any, metric: Metric) -> None:
    """Report the run ``future`` launched: finished, diverged, interrupted, failed, in use, or queued behind a
    signal. An error of this run alone (its fit arguments changed by another sweep, a full disk while writing its
    files, a score that cannot be read) counts it as failed, with the error's line, and the sweep goes on."""
    try:
        outcome = future.result()
        if outcome is None and RunDir(run.run_dir).is_finished():
            report.skipped.append(run)
            progress.console.print(f"↷ {run.label}: finished by another process", highlight=False)
        elif outcome is None and (diverged := RunDir(run.run_dir).divergence()) is not None:
            report.diverged.append(run)
            progress.console.print(f"✗ {run.label} diverged in another process: {diverged}", highlight=False)
        elif outcome is None:  # queued behind the signal
            report.not_started.append(run)
            return
        else:
            report_run(run, *outcome, report, progress.console, metric)
    except RunInUse as error:
        report.in_use.append(run)
        progress.console.print(f"↷ {run.label} skipped: {error}", highlight=False)
    except (ValueError, OSError, KeyError, TypeError) as error:
        report.failed.append(run)
        progress.console.print(f"✗ {run.label} failed: {error}", highlight=False)
    progress.advance(task)


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


def report_run(run: Run, code: int, seconds: float, report: SweepReport, console: Any, metric: Metric) -> None:
    if RunDir(run.run_dir).is_finished():
        top1 = run_top1(run.run_dir, metric)
        report.finished.append(run)
        if top1 is not None:
            score = f"{top1:.2f}%"
        elif metric == "test" and RunDir(run.run_dir).test_skipped():
            score = "not measured (its fit ran with --test false)"
        else:
            score = "undefined (no pixel to score)"
        console.print(
            f"✓ {run.label}: {metric_text(metric, run.job.argv())} {score} ({seconds:.0f} s)", highlight=False
        )
    elif (diverged := RunDir(run.run_dir).divergence()) is not None:  # a fit drops a stale record when it starts
        report.diverged.append(run)
        console.print(f"✗ {run.label} diverged after {seconds:.0f} s: {diverged}", highlight=False)
    elif code in _INTERRUPTED_CODES:
        report.interrupted.append(run)
        console.print(
            f"⏸ {run.label} interrupted after {seconds:.0f} s (exit code {code}); it resumes from "
            f"{RunDir(run.run_dir).last_checkpoint} when the sweep is re-run",
            highlight=False,
        )
    elif code in _KILLED_CODES:
        report.interrupted.append(run)
        last = RunDir(run.run_dir).last_checkpoint
        where = f"from {last} (its last saved epoch)" if last.is_file() else "from its start (no checkpoint yet)"
        console.print(
            f"⏸ {run.label} killed by {signal.Signals(-code).name} after {seconds:.0f} s, before it could save (a "
            f"second signal); it resumes {where} when the sweep is re-run",
            highlight=False,
        )
    else:
        report.failed.append(run)
        console.print(
            f"✗ {run.label} did not finish (exit code {code}): see {RunDir(run.run_dir).log}", highlight=False
        )


_INTERRUPTED_CODES = (128 + signal.SIGINT, 128 + signal.SIGTERM)
"""Exit codes of a ``coretune fit`` stopped by a signal after saving ``last.ckpt`` (``TrainingInterrupted``)."""

_KILLED_CODES = (-signal.SIGINT, -signal.SIGTERM)
"""Return codes of a ``coretune fit`` ended by a second SIGINT/SIGTERM (the signal's default action, before it could
save): interrupted too, resumable from the last epoch's checkpoint, not a failure."""


class EpochBars:
    """Beside a sweep's bar of runs, one bar per running fit: its epochs done of its length, read from its files
    (:meth:`RunDir.epochs_done`) at most every ``every`` seconds. Worker threads call :meth:`started` and :meth:`ended`,
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
        done, total = RunDir(run.run_dir).epochs_done()
        where = f"(log: {RunDir(run.run_dir).log})"
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
            done, total = RunDir(run.run_dir).epochs_done()
            if run in self._bars:
                self.progress.update(self._bars[run], completed=done, total=total)
            else:
                self._bars[run] = self.progress.add_task(f"  {run.label} (epochs)", completed=done, total=total)


def sweep_log_args(spec: BenchSpec, run: Run, logger: str | None) -> list[str]:
    """The fit arguments that log ``run`` into the sweep's ``logger`` (none without one)."""
    if logger is None:
        return []
    from ..engine.loggers import sweep_logger_args

    return sweep_logger_args(logger, spec.output, spec.name, run.label)


def _timed_launch(
    run: Run, slots: queue.SimpleQueue, stop: StopSignal, bars: EpochBars, log_args: Sequence[str] = ()
) -> tuple[int, float] | None:
    """Exit code and seconds of the run's fit (``log_args``: :func:`launch_fit`'s), in the environment of a free
    worker slot (taken from ``slots`` and put back); ``None`` when it did not start: ``stop`` held a signal, or
    another sweep finished the run, or saw it diverge, since this one listed it (also once it held the claim)."""
    files = RunDir(run.run_dir)
    if stop.signum is not None or files.is_finished() or files.divergence() is not None:
        return None
    env = slots.get()  # the pool has one thread per slot: never waits
    try:
        if files.live_claim() is None:  # else launch_fit refuses it (RunInUse): no "started" line for it
            bars.started(run)
        start = time.perf_counter()
        code = launch_fit(run.job.argv(), run.run_dir, env, stop, log_args)
        return None if code is None else (code, time.perf_counter() - start)
    finally:
        bars.ended(run)
        slots.put(env)
