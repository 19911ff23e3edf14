"""What a cluster job of ``coretune bench --launcher submitit`` runs: :class:`FitCall`, a submitit
``Checkpointable`` that runs one sweep run's ``coretune fit`` exactly as the local launcher does
(:func:`~coretune.sweeps.launch.launch_fit`: the run's claim, ``fit_args.json``, ``log.txt``, the stop file), on
the job's node.

Pre-emption and time limits: SLURM sends the job submitit's warning signal (``SIGUSR2``, ``--signal=USR2@<delay>``)
before it stops the job. submitit's handler in the job's process calls :meth:`FitCall.checkpoint`, which asks the fit
through its stop file to stop as on SIGTERM — the path a sweep's SIGTERM takes locally: the fit saves a resumable
``checkpoints/last.ckpt`` at its next batch end and exits — waits for it, and returns the same call, which submitit
requeues; the requeued job resumes the run from ``last.ckpt`` (:func:`~coretune.sweeps.job.fit_command`). The fit
starts with the warning signal blocked, so that only the job's process acts on it (SLURM signals every process of the
job step), and without the variables of a SLURM task in its environment: Lightning then neither takes the fit for an
``srun``-launched DDP task nor installs its own SLURM requeue handler (``SLURMEnvironment(auto_requeue=True)``):
submitit alone requeues. A SIGTERM that reaches the fit itself (a pre-emption without the warning, ``scancel``) takes
the local path: the fit saves ``last.ckpt`` and exits ``128 + SIGTERM``, reported as interrupted, resumable.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..extras import need
from ..runs.claim import read_claim
from ..runs.layout import RunDir
from ..runs.stopfile import request_stop
from .launch import launch_fit

__all__ = ["FitCall", "FitFailed", "fit_environment"]

submitit = need("submitit", "coretune bench --launcher submitit")  # coretune[cluster]; imported by that launcher only

_KEPT_SLURM = ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_JOB_NAME", "SLURM_SUBMIT_DIR")
"""The SLURM variables a job's fit keeps (which job it is); the rest describe an ``srun`` task, which it is not."""


class FitFailed(RuntimeError):
    """The run's ``coretune fit`` ended with an error (its exit code and log named)."""


def fit_environment(threads: int | None, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a job's fit: the job's, without the SLURM variables of an ``srun`` task (but the job's
    ids, :data:`_KEPT_SLURM`), so that the fit runs on the job's GPUs (``CUDA_VISIBLE_DEVICES``) and CPUs (its
    affinity) as on a machine of its own; with ``OMP_NUM_THREADS`` set to ``threads`` (the job's CPUs) unless set."""
    env = {k: v for k, v in (os.environ if environ is None else environ).items() if not _slurm_task_variable(k)}
    if threads is not None:
        env.setdefault("OMP_NUM_THREADS", str(threads))
    return env


def _slurm_task_variable(name: str) -> bool:
    return name.startswith("SLURM_") and name not in _KEPT_SLURM


def warning_signal() -> int:
    """The signal submitit's jobs receive before they are stopped (``SIGUSR2``, or ``SUBMITIT_PREEMPT_SIGNAL``)."""
    return getattr(signal, "SIG" + submitit.JobEnvironment.USR_SIG)


@dataclass
class FitCall(submitit.helpers.Checkpointable):
    """One run of a sweep as a submitit job: its fit arguments (``argv``, :meth:`~.job.FitJob.argv`), run directory
    and the sweep's logger arguments (``log_args``, not recorded); ``threads``: the job's CPUs.

    Returns ``(exit code, seconds)`` of the fit, as the local launcher reports it; ``None`` when another process
    finished the run first, or saw it diverge. Raises :class:`FitFailed` when the fit failed (the job fails, and
    ``coretune bench`` names the run's log)."""

    argv: list[str]
    run_dir: Path
    log_args: list[str]
    threads: int | None = None
    save_wait_s: float = 60.0

    def __call__(self) -> tuple[int, float] | None:
        start = time.perf_counter()
        env = fit_environment(self.threads)
        code = launch_fit(self.argv, self.run_dir, env, log_args=self.log_args, shielded=(warning_signal(),))
        if code is None:
            return None
        files = RunDir(self.run_dir)
        if code != 0 and not files.is_finished() and files.divergence() is None and code not in _STOPPED:
            raise FitFailed(f"coretune fit exited with code {code}: see {files.log}")
        return code, time.perf_counter() - start

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """On the job's warning signal: ask the fit to save ``last.ckpt`` and stop (its stop file, as on SIGTERM),
        wait for it (at most ``save_wait_s``), and requeue this same call: it resumes the run."""
        files = RunDir(self.run_dir)
        claim = read_claim(self.run_dir)
        if claim is not None and claim.local and claim.pid != os.getpid():  # the fit runs (the claim points at it)
            request_stop(files.stop_file, signal.SIGTERM)
            _wait_for_child(claim.pid, self.save_wait_s)
        return super().checkpoint(*args, **kwargs)


_STOPPED = (128 + signal.SIGINT, 128 + signal.SIGTERM, -signal.SIGINT, -signal.SIGTERM)
"""Exit codes of a fit stopped by a signal (resumable): reported as interrupted, not failed."""


def _wait_for_child(pid: int, seconds: float) -> None:
    """Wait until child process ``pid`` has exited (left for its parent to reap: ``WNOWAIT``), at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return
        except ChildProcessError:  # not this process's child (any more)
            return
        time.sleep(0.2)
