"""The Optuna study of ``coretune tune``: the trials a resumed study queues again, what its workers leave to one
another, what ties a study to its settings, and what its trials say (``trials.csv``'s rows, the best trial).

A study lives in a database or a journal file (:mod:`.storage`), which several workers may share. A trial stopped
by SIGINT/SIGTERM, a grid point whose every trial failed, or a trial whose worker died without a word (Optuna's
heartbeat) is queued again with the same point and retry history, so its fit resumes from its checkpoint; a
diverged trial is a result and never runs again. A worker starts a trial only while one is left to start (a grid
point no trial started, a queued retry, TPE trials short of ``--n_trials`` counting those running elsewhere), and a
grid trial drawn for a point another trial runs or finished fails as a duplicate without a fit. A study is tied to
its ``--repeats``, task, seed, validation split, sampler, objective, search space and fit arguments: trials run
otherwise would not compare.
"""

from __future__ import annotations

import copy
import shlex
import time
import warnings
from typing import Any

from ..extras import need
from ..tasks import DEFAULT_TASK, Task
from .job import current_spelling

__all__ = [
    "READY",
    "await_creator",
    "best_trial",
    "check_repeats",
    "check_settings",
    "check_task",
    "fail_stale",
    "failure",
    "grid_duplicate",
    "grid_left",
    "import_optuna",
    "interrupted_by",
    "resume_grid",
    "resume_interrupted",
    "retry_history",
    "tpe_left",
    "tpe_surplus",
    "trial_rows",
]

#: The study's user attribute its creator sets once it has recorded its settings and queued its start-up points.
READY = "ready"

#: How long a worker that joins a study waits for its creator to set it up (a creator killed meanwhile).
_CREATOR_WAIT_S = 60.0

#: A trial's user attributes that say how it failed (``trials.csv``'s ``failure``); a retried copy does not keep them.
_OUTCOMES = ("diverged", "interrupted")


def import_optuna() -> Any:
    """Optuna, or :class:`~coretune.extras.MissingExtra` naming the ``tune`` extra."""
    return need("optuna", "coretune tune")


def retry_history(optuna: Any, trial: Any) -> list[int]:
    """The numbers of the trials ``trial`` retries, the original first (empty for a trial that retries none)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RetryHeartbeatStaleTrialCallback.retry_history(trial)


def requeue(study: Any, trial: Any, retry: Any) -> None:
    """Queue ``trial`` again with ``retry`` (same point, retry history kept), without its failure's attributes."""
    queued = copy.deepcopy(trial)  # the callback appends to the retry history it copies
    queued.user_attrs = {k: v for k, v in trial.user_attrs.items() if k not in _OUTCOMES}
    retry(study, queued)


def resume_interrupted(optuna: Any, study: Any, retry: Any) -> None:
    """Queue again every trial a signal stopped that no trial retries yet: its fit resumes from its checkpoint."""
    trials = study.get_trials(deepcopy=False)
    retried = {number for t in trials for number in retry_history(optuna, t)}
    for trial in trials:
        interrupted = trial.state == optuna.trial.TrialState.FAIL and interrupted_by(trial) is not None
        if interrupted and trial.number not in retried:
            requeue(study, trial, retry)


def resume_grid(optuna: Any, study: Any, space: dict[str, list[float]], retry: Any) -> None:
    """Check that a resumed study has the same grid, and queue again the grid points whose every trial failed (a
    crash, Ctrl-C) and none diverged, as ``retry`` (Optuna's callback for stale trials) does: same point, retry
    history kept."""
    by_point: dict[int, list[Any]] = {}
    for trial in study.get_trials(deepcopy=False):
        if "grid_id" not in trial.system_attrs:
            continue
        if trial.system_attrs.get("search_space") != space:
            raise ValueError(
                f"study {study.study_name!r} was run on another grid ({trial.system_attrs.get('search_space')}, "
                f"now {space}): pass a new --study_name or --output to start a new study"
            )
        by_point.setdefault(trial.system_attrs["grid_id"], []).append(trial)
    for trials in by_point.values():
        if all(t.state == optuna.trial.TrialState.FAIL and "diverged" not in t.user_attrs for t in trials):
            requeue(study, trials[-1], retry)


def grid_left(study: Any, size: int) -> bool:
    """Whether a grid point was never started or a queued retry waits (a diverged point is done)."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    started = {t.system_attrs["grid_id"] for t in trials if "grid_id" in t.system_attrs}
    return len(started) < size or any(t.state == TrialState.WAITING for t in trials)


def fail_stale(optuna: Any, study: Any) -> None:
    """Fail the trials whose worker died (heartbeat older than the storage's grace period) and queue each again
    (Optuna's heartbeat callback), before deciding whether a trial is left to start: a dead worker's trial is one."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)


def tpe_left(study: Any, target: int) -> bool:
    """Whether a TPE trial is left to start: fewer than ``target`` trials finished or running (another worker's run
    counts: it will finish one; a worker that started one more would overshoot ``--n_trials``)."""
    from optuna.trial import TrialState

    states = [t.state for t in study.get_trials(deepcopy=False)]
    return states.count(TrialState.COMPLETE) + states.count(TrialState.RUNNING) < target


def tpe_surplus(study: Any, number: int, target: int) -> bool:
    """Whether TPE trial ``number`` is one more than ``--n_trials``: ``target`` trials started before it run or
    finished. Two workers that pass :func:`tpe_left` at once both start a trial; the later one (the larger number)
    then fails without a fit, so the study never overshoots."""
    from optuna.trial import TrialState

    busy = (TrialState.RUNNING, TrialState.COMPLETE)
    return sum(t.number < number and t.state in busy for t in study.get_trials(deepcopy=False)) >= target


def grid_duplicate(study: Any, number: int) -> int | None:
    """The earlier trial that runs or finished the grid point of trial ``number`` (two workers drew the point at
    once, or both queued its retry), else None: the later trial fails without a fit."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    point = next((t.system_attrs.get("grid_id") for t in trials if t.number == number), None)
    busy = (TrialState.RUNNING, TrialState.COMPLETE)
    same = [
        t.number for t in trials if t.number < number and t.state in busy and t.system_attrs.get("grid_id") == point
    ]
    return same[0] if point is not None and same else None


def await_creator(study: Any) -> None:
    """Wait (up to a minute, for a creator killed meanwhile) until the process that created ``study`` has recorded
    its settings and queued its start-up points (:data:`READY`), so that a worker started with it checks its own
    settings against them and pops the seeded points instead of sampling its own. A study with a trial started
    (made before :data:`READY`) needs no wait."""
    from optuna.trial import TrialState

    start = time.monotonic()
    said = False
    while READY not in study.user_attrs and time.monotonic() < start + _CREATOR_WAIT_S:
        if any(t.state != TrialState.WAITING for t in study.get_trials(deepcopy=False)):
            return
        if not said and time.monotonic() > start + 2:
            print(
                f"coretune tune: waiting (up to a minute) for the process that created study {study.study_name!r} "
                "to record its settings",
                flush=True,
            )
            said = True
        time.sleep(0.2)


def trial_rows(study: Any, monitor: str, names: list[str]) -> list[dict[str, Any]]:
    """``trials.csv``'s rows: a column per hyper-parameter of the search space (``names``: ``eta``, ``alpha`` for
    Core-tuning), and a trial's value, ``final_val_<monitor>`` (``final_val_top1``, ``final_val_miou``)."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        rows.append(
            {
                "number": t.number,
                "state": t.state.name,
                **{name: t.params.get(name, "") for name in names},
                f"final_val_{monitor}": "" if t.value is None else t.value,
                f"final_val_{monitor}_per_seed": " ".join(f"{v:.4f}" for v in t.user_attrs.get("per_seed", [])),
                "run_dir": t.user_attrs.get("run_dir", ""),
                "duration_s": round(t.duration.total_seconds(), 1) if t.duration else "",
                "failure": failure(t),
            }
        )
    return rows


def interrupted_by(trial: Any) -> str | None:
    """The signal that stopped ``trial`` itself (its mark names its number: a copy Optuna's heartbeat queued of a
    trial killed after it was marked carries the mark, not the interruption), else None."""
    mark = trial.user_attrs.get("interrupted")
    return mark["signal"] if isinstance(mark, dict) and mark.get("trial") == trial.number else None


def failure(trial: Any) -> str:
    """``trials.csv``'s ``failure``: ``diverged: <the fit's message>``, ``interrupted by SIGINT``, a duplicate's or a
    surplus trial's reason, or empty."""
    if trial.state.name == "COMPLETE":
        return ""
    if "diverged" in trial.user_attrs:
        return f"diverged: {trial.user_attrs['diverged']}"
    if (signal_name := interrupted_by(trial)) is not None:
        return f"interrupted by {signal_name}"
    return trial.user_attrs.get("duplicate", "") or trial.user_attrs.get("surplus", "")


def check_repeats(study: Any, repeats: int) -> None:
    """Tie a study to its number of fits per trial: values averaged over other seed counts do not compare."""
    recorded = study.user_attrs.get("repeats")
    if recorded is None and not study.get_trials(deepcopy=False):
        study.set_user_attr("repeats", repeats)
    elif (recorded or 1) != repeats:  # studies from before --repeats ran one fit per trial
        raise ValueError(
            f"study {study.study_name!r} scores trials over {recorded or 1} fit(s) (--repeats), not {repeats}: "
            "pass the same --repeats, or a new --study_name or --output to start a new study"
        )


def check_settings(study: Any, settings: dict[str, Any]) -> None:
    """Tie a study to its ``--seed`` (the validation split, and the grid's order), ``--val_fraction``,
    ``--sampler``, ``--objective``, ``--eta``/``--alpha`` or ``--space`` (TPE's ranges) and fit arguments: trials
    fitted or scored otherwise do not compare (fit arguments in their current spelling: ``--model.lr`` is
    ``--model.optim.lr``), and a grid resumed in another order would run some points twice and
    others never. A study from before a setting was recorded is taken as it is."""
    names = {"eta_alpha": "--eta/--alpha", "space": "--space", "fit_args": "fit arguments"}

    def shown(key: str, value: Any) -> str:
        return shlex.join(value) if key == "fit_args" else str(value)

    changed = [
        f"{names.get(key, f'--{key}')} {shown(key, study.user_attrs[key])} (now {shown(key, value)})"
        for key, value in settings.items()
        if key in study.user_attrs and _current(key, study.user_attrs[key]) != _current(key, value)
    ]
    if changed:
        raise ValueError(
            f"study {study.study_name!r} was run with {', '.join(changed)}: pass the same, or a new --study_name "
            "or --output to start a new study"
        )
    if not study.get_trials(deepcopy=False):
        for key, value in settings.items():
            study.set_user_attr(key, value)


def _current(key: str, value: Any) -> Any:
    """A recorded study setting as it compares: fit arguments in their current spelling (``--model.lr`` is
    ``--model.optim.lr``: :func:`~.job.current_spelling`)."""
    return current_spelling(value) if key == "fit_args" and isinstance(value, list) else value


def check_task(study: Any, task: type[Task]) -> None:
    """Tie a study to the task its trials fit: one task's scores (top-1, MIoU) do not compare with another's."""
    recorded = study.user_attrs.get("task")
    if recorded is None and not study.get_trials(deepcopy=False):
        study.set_user_attr("task", task.name)
    elif (recorded or DEFAULT_TASK) != task.name:  # studies from before --task fitted classification
        raise ValueError(
            f"study {study.study_name!r} scores fits of --task {recorded or DEFAULT_TASK}, not {task.name}: pass a "
            "new --study_name or --output to start a new study"
        )


def best_trial(study: Any) -> Any:
    """The finished trial of the highest value, the earliest among equal values (Optuna's ``best_trial`` picks
    among ties in storage order; small validation splits tie often)."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    return max(trials, key=lambda t: (round(t.value, 9), -t.number))  # a mean of seeds in another order: one value
