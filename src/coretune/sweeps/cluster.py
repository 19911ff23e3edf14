"""``coretune bench --launcher submitit``: a sweep's runs as cluster jobs, through submitit (a SLURM job array, or
``cluster: local`` processes on this machine).

Each job runs the same ``coretune fit`` the local launcher runs, in the same run folder (:class:`~.clusterjob.FitCall`:
the run's claim, ``fit_args.json``, ``log.txt``), so ``--status``, resuming, the records and the tables are those of a
local sweep. Each run folder records the job it was submitted as (``job.json``, :class:`JobRecord`): a later
``coretune bench SPEC`` submits no second job for a run whose job is still queued or running, and ``--status`` says
which job a run waits in. submitit's own files (the pickled calls, each job's stdout and stderr) go to
``<output>/.submitit/<job id>/``. Pre-emption and time limits: :mod:`.clusterjob`.
"""

from __future__ import annotations

import json
import shutil
import socket
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..extras import need
from ..runs.atomic import atomic_write, strict_json
from ..runs.claim import RunClaim, process_started
from ..runs.layout import RunDir
from .launch import SweepReport, prepare_sweep, report_run, sweep_log_args
from .spec import BenchSpec, Run

__all__ = ["JobRecord", "SubmititSettings", "job_notes", "submit_sweep"]

Cluster = Literal["auto", "slurm", "local", "debug"]

_ACTIVE = {
    "PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "COMPLETING", "RESIZING",
    "SUSPENDED", "SIGNALING", "STAGE_OUT",
}  # fmt: skip
"""SLURM job states (``sacct``) of a job that has not ended."""


@dataclass(frozen=True)
class SubmititSettings:
    """``--launcher.*``: where and how ``coretune bench --launcher submitit`` submits its runs, one job a run.

    Args:
        cluster: ``slurm`` (a job array through ``sbatch``), ``local`` (each job a process on this machine, as
            submitit's LocalExecutor runs them: for trying a spec out), ``debug`` (in this process, one after
            another) or ``auto`` (``slurm``; refused where ``srun`` is not on the PATH).
        partition: the SLURM partition (``--partition``); null: the cluster's default.
        gpus_per_run: GPUs of each job (``--gpus-per-node``); the fit sees them as its devices. For DDP inside each
            fit put ``--trainer.strategy ddp --trainer.devices N`` in the spec's ``base_args``.
        cpus_per_run: CPUs of each job (``--cpus-per-task``; also the fit's ``OMP_NUM_THREADS``); null: the
            cluster's default.
        timeout_min: each job's time limit in minutes (``--time``). A job still running near it (and a pre-empted
            one) saves ``last.ckpt`` and is requeued, resuming where it stopped.
        mem_gb: memory of each job in GB (``--mem``); null: the cluster's default.
        account: the SLURM account to charge (``--account``).
        additional: more ``sbatch`` options as a mapping, e.g. ``{qos: high, constraint: a100}`` (submitit's
            ``slurm_additional_parameters``).
        array_parallelism: at most this many jobs of the array run at once (``--array=0-N%K``); null: all.
        signal_delay_s: seconds before the time limit that SLURM sends the warning signal (SIGUSR2): time for the
            fit to finish its batch and save ``last.ckpt``.
        wait: wait for the jobs, with a line per finished run, then write the tables; ``false``: return once they
            are submitted; re-running the same command later aggregates (and submits nothing twice).
    """

    cluster: Cluster = "auto"
    partition: str | None = None
    gpus_per_run: int = 1
    cpus_per_run: int | None = None
    timeout_min: int = 24 * 60
    mem_gb: float | None = None
    account: str | None = None
    additional: dict[str, Any] = field(default_factory=dict)
    array_parallelism: int | None = None
    signal_delay_s: int = 120
    wait: bool = True

    def __post_init__(self) -> None:
        if self.cluster not in ("auto", "slurm", "local", "debug"):
            raise ValueError(f"--launcher.cluster must be auto, slurm, local or debug (got {self.cluster!r})")
        for name, low in (("gpus_per_run", 0), ("cpus_per_run", 1), ("timeout_min", 1), ("array_parallelism", 1)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ValueError(f"--launcher.{name} must be an integer >= {low} (got {value!r})")
        if self.mem_gb is not None and not self.mem_gb > 0:
            raise ValueError(f"--launcher.mem_gb must be > 0 (got {self.mem_gb!r})")
        if not 10 <= self.signal_delay_s < 60 * self.timeout_min:
            raise ValueError(
                f"--launcher.signal_delay_s must be at least 10 s and less than --launcher.timeout_min (got "
                f"{self.signal_delay_s} s for {self.timeout_min} min)"
            )
        if not isinstance(self.additional, dict) or not all(isinstance(k, str) for k in self.additional):
            raise ValueError(f"--launcher.additional must map sbatch option names to values (got {self.additional!r})")
        if self.cluster == "debug" and not self.wait:
            raise ValueError("--launcher.cluster debug runs the jobs in this process: it cannot return before them")

    def resolved_cluster(self) -> str:
        """``auto`` as ``slurm``; ``slurm`` refused in one line where there is no SLURM (no ``srun`` on the PATH)."""
        if self.cluster in ("auto", "slurm") and shutil.which("srun") is None:
            raise ValueError(
                "--launcher submitit: no SLURM here (srun is not on the PATH); submit from a SLURM login node, or "
                "use --launcher.cluster local to run the jobs as processes on this machine"
            )
        return "slurm" if self.cluster == "auto" else self.cluster

    def executor(self, folder: Path, name: str) -> Any:
        """The ``submitit.AutoExecutor`` of these settings, writing its files into ``folder/<job id>``."""
        submitit = need("submitit", "coretune bench --launcher submitit", "cluster")
        executor = submitit.AutoExecutor(folder=folder / "%j", cluster=self.resolved_cluster())
        parameters: dict[str, Any] = {"name": name, "timeout_min": self.timeout_min, "nodes": 1, "tasks_per_node": 1}
        if self.gpus_per_run or executor.cluster != "slurm":
            parameters["gpus_per_node"] = self.gpus_per_run
        if self.cpus_per_run is not None:
            parameters["cpus_per_task"] = self.cpus_per_run
        if self.mem_gb is not None:
            parameters["mem_gb"] = self.mem_gb
        slurm = {
            "partition": self.partition,
            "account": self.account,
            "array_parallelism": self.array_parallelism,
            "signal_delay_s": self.signal_delay_s,
            "additional_parameters": dict(self.additional) or None,
        }
        parameters |= {f"slurm_{key}": value for key, value in slurm.items() if value is not None}
        executor.update_parameters(**parameters)
        return executor


@dataclass(frozen=True)
class JobRecord:
    """The job a run was submitted as (``RUN/job.json``): its id, cluster, submitit's log of it (``stdout``,
    ``stderr``), when and from which host; for a ``local`` job the start time of its controller process (its id is
    that process's), so that a pid reused later does not count as the job."""

    job_id: str
    cluster: str
    stdout: str
    stderr: str
    submitted: str
    host: str
    started: float = 0.0

    def write(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        with atomic_write(RunDir(run_dir).job) as f:
            f.write(strict_json(asdict(self), indent=1) + "\n")

    @classmethod
    def read(cls, run_dir: Path) -> JobRecord | None:
        """The run's record, or None (none, or unreadable: then it counts as no job)."""
        try:
            return cls(**json.loads(RunDir(run_dir).job.read_text()))
        except (FileNotFoundError, ValueError, TypeError):
            return None

    def state(self) -> str:
        """``PENDING``, ``RUNNING`` … as SLURM's ``sacct`` reports it (``UNKNOWN`` when it cannot tell);
        ``RUNNING`` or ``ENDED`` for a local job; ``ENDED`` for a debug one."""
        if self.cluster == "local":
            if self.host != socket.gethostname():
                return "UNKNOWN"  # another machine's process
            return "RUNNING" if RunClaim(int(self.job_id), self.host, self.started).alive() else "ENDED"
        if self.cluster != "slurm":
            return "ENDED"
        return str(self.slurm_job().state)

    def slurm_job(self) -> Any:
        """The SLURM job as submitit knows it (its state from ``sacct``)."""
        submitit = need("submitit", "a sweep's cluster jobs", "cluster")
        return submitit.SlurmJob(folder=Path(self.stdout).parent, job_id=self.job_id)

    def active(self, state: str | None = None) -> bool:
        """Whether the job has not ended: queued, running or requeued."""
        state = self.state() if state is None else state
        return state.split(" ")[0] in _ACTIVE


def job_notes(run_dirs: Sequence[Path]) -> dict[Path, str]:
    """``--status``' note on each unfinished run of ``run_dirs`` submitted as a job: ``job 12_3 (PENDING)``, or once
    the job ended without finishing the run, ``job 12_3 ended (FAILED): see`` submitit's log of it. The SLURM jobs'
    states come from one ``sacct`` call."""
    records = {run_dir: record for run_dir in run_dirs if (record := JobRecord.read(run_dir)) is not None}
    if any(record.cluster == "slurm" for record in records.values()):
        need("submitit", "a sweep's cluster jobs", "cluster")
        for record in records.values():
            record.slurm_job()  # registered with submitit's watcher first: the first state query covers them all
    notes = {}
    for run_dir, record in records.items():
        state = record.state()
        if record.active(state):
            notes[run_dir] = f"job {record.job_id} ({state})"
        else:
            notes[run_dir] = f"job {record.job_id} ended ({state}): see {record.stderr}"
    return notes


def submit_sweep(
    spec: BenchSpec,
    settings: SubmititSettings,
    console: Any = None,
    dry_run: bool = False,
    logger: str | None = None,
    retry_diverged: bool = False,
    poll_s: float = 0.5,
) -> SweepReport:
    """Submit every unfinished run of ``spec`` as a submitit job (one job array on SLURM) and, with
    ``settings.wait``, wait for them, printing a line per finished run as the local launcher does.

    Runs another process holds (a running job, another sweep) are ``in_use``; runs whose earlier job is still
    queued or running are ``queued`` and get no second job; without ``wait`` the submitted runs are ``queued`` too.
    A job that fails is a failed run, named with the run's log (and submitit's log of the job)."""
    from rich.console import Console

    from .clusterjob import FitCall

    console = console or Console()
    cluster = settings.resolved_cluster()
    need("submitit", "coretune bench --launcher submitit", "cluster")
    report, todo = prepare_sweep(
        spec, console, f"as submitit jobs ({cluster})", dry_run, logger, retry_diverged, command="bench"
    )
    if dry_run or not todo:
        return report
    submit = []
    for run in todo:
        files = RunDir(run.run_dir)
        if (claim := files.live_claim()) is not None:
            report.in_use.append(run)
            console.print(f"↷ {run.label}: running ({claim.where()})", highlight=False)
        elif (record := JobRecord.read(run.run_dir)) is not None and record.active(state := record.state()):
            report.queued.append(run)
            console.print(f"⧗ {run.label}: already submitted, job {record.job_id} ({state})", highlight=False)
        else:
            submit.append(run)
    if not submit:
        return report
    folder = spec.output / ".submitit"
    executor = settings.executor(folder, f"coretune-{spec.name}")
    calls = [
        FitCall(run.job.argv(), run.run_dir, sweep_log_args(spec, run, logger), settings.cpus_per_run,
                save_wait_s=max(5.0, settings.signal_delay_s - 30.0))
        for run in submit
    ]  # fmt: skip
    with executor.batch():
        jobs = [executor.submit(call) for call in calls]
    for run, job in zip(submit, jobs, strict=True):
        _record(run, job, cluster)
    first, last = jobs[0].job_id, jobs[-1].job_id
    ids = first if len(jobs) == 1 else f"{first} … {last}"
    console.print(f"submitted {len(jobs)} job(s) ({ids}); submitit's logs: {folder}", highlight=False, soft_wrap=True)
    if not settings.wait:
        report.queued.extend(submit)
        return report
    _await(jobs, submit, report, console, spec, poll_s)
    return report


def _record(run: Run, job: Any, cluster: str) -> None:
    started = 0.0
    if cluster == "local":
        try:
            started = process_started(int(job.job_id))
        except (ProcessLookupError, PermissionError, ValueError):
            started = 0.0
    JobRecord(
        job_id=str(job.job_id),
        cluster=cluster,
        stdout=str(job.paths.stdout),
        stderr=str(job.paths.stderr),
        submitted=time.strftime("%Y-%m-%d %H:%M:%S"),
        host=socket.gethostname(),
        started=started,
    ).write(run.run_dir)


def _await(jobs: Sequence[Any], runs: Sequence[Run], report: SweepReport, console: Any, spec: BenchSpec,
           poll_s: float) -> None:  # fmt: skip
    """Wait for ``jobs`` (of ``runs``), settling each as it ends; Ctrl+C stops waiting (the jobs go on)."""
    from .launch import SweepInterrupted

    pending = dict(zip(jobs, runs, strict=True))
    try:
        while pending:
            for job in [j for j in pending if j.done()]:
                _settle(pending.pop(job), job, report, console, spec)
            if pending:
                time.sleep(poll_s)
    except KeyboardInterrupt:
        import signal

        report.queued.extend(pending.values())
        raise SweepInterrupted(
            signal.SIGINT,
            f"stopped waiting for {len(pending)} job(s): they go on (`coretune bench SPEC --status` shows them); "
            "re-run the same command to wait again and write the tables",
        ) from None


def _settle(run: Run, job: Any, report: SweepReport, console: Any, spec: BenchSpec) -> None:
    """Report the run of the ended ``job`` (finished, diverged, interrupted, failed or held by another process)."""
    try:
        outcome = job.result()
    except Exception as error:  # the job raised (its traceback is in the message) or ended without a result
        line = next((x for x in reversed(str(error).splitlines()) if x.strip()), str(error)).strip()
        if "RunInUse" in line:
            report.in_use.append(run)
            console.print(f"↷ {run.label} skipped: {line.partition(': ')[2] or line}", highlight=False)
            return
        report.failed.append(run)
        what = line.partition(": ")[2] if "FitFailed" in line else f"{line} (job log: {job.paths.stderr})"
        console.print(f"✗ {run.label} failed (job {job.job_id}): {what}", highlight=False, soft_wrap=True)
        return
    files = RunDir(run.run_dir)
    if outcome is not None:
        report_run(run, *outcome, report, console, spec.metric)
    elif files.is_finished():
        report.skipped.append(run)
        console.print(f"↷ {run.label}: finished by another process", highlight=False)
    else:
        report.diverged.append(run)
        console.print(f"✗ {run.label} diverged in another process: {files.divergence()}", highlight=False)
