"""``coretune tune``: choose Core-tuning's η and α with an Optuna study, on a validation split of the training set.

The paper (§5.1, Appendix C) picks η and α from {0.1, 1, 10}; the default study is that 3 × 3 grid (Optuna's
``GridSampler``), ``--sampler tpe`` searches the same ranges on a log scale. Each trial is an ordinary
``coretune fit`` subprocess that holds out part of the training data for validation, by the option of the fit's
task (:attr:`~coretune.tasks.Task.validation_holdout`): ``--data.val_fraction`` > 0 (classification: a stratified
part of the training set, the held-out folder being the test split; segmentation: a part of ``train.txt``,
``val.txt``/``test.txt`` being the test split) or ``--data.holdout_fraction`` (domain generalization: each
training domain's held-out part; the unseen domains are the test). Selection never reads the test split. A trial's
value is the **final** epoch's ``val/<monitor>`` of the task (``val/top1``; ``val/miou`` for segmentation: the
weights the run keeps, which classification and segmentation test), not the best epoch's: picking the best epoch
would be a second selection on the same split. (A domain-generalization trial still tests the checkpoint its
``--data.selection`` rule picks: by default ``best.ckpt``, chosen on the same held-out parts.) ``--repeats K``
scores a trial by the mean over K fits with seeds ``seed … seed+K-1`` — each holds out another stratified split and
starts from another initialisation (repeated hold-out) — so a choice rests on K validation splits instead of one.
The study lives in a database (``sqlite:///<output>/study.db`` by default; any SQLAlchemy URL): re-running the
command resumes it (finished trials are kept, failed or interrupted grid points run again), and several
``coretune tune`` processes — on one or many machines — given the same ``--storage`` and ``--study_name`` share
the work.

A fit that diverged or collapsed (``coretune fit`` recorded ``diverged`` or ``collapsed`` in its ``results.json``)
is a result, not a failure: its trial fails with the user attribute ``diverged`` (the fit's message), is listed
in ``trials.csv``'s ``failure`` column and in ``best.yaml``'s ``# DIVERGED`` lines, and is never run again. A trial
stopped by SIGINT/SIGTERM gets the user attribute ``interrupted`` (the signal's name); a re-run queues it again
with the same point and retry history (:class:`optuna.storages.RetryHeartbeatStaleTrialCallback`, as Optuna's
heartbeat does for a process that died), in the folder of the trial it retries, so its fit resumes from its
``checkpoints/last.ckpt`` (TPE folders are named ``trial<number>`` after the original trial).

With ``--sampler tpe`` the process that creates the study queues its start-up points — ``min(10, n_trials)``
points drawn from ``--seed`` over the log-scale ranges — and samples with ``seed``; a process that joins or resumes
the study samples unseeded. Every TPE sampler uses the constant liar, so workers sharing a study pop distinct
start-up points and do not propose the point another is running; a single worker with a given ``--seed`` runs the
same points every time in one uninterrupted run (a resumed study samples unseeded after its queued points).
Needs the ``tune`` extra: ``pip install coretune[tune]``.
"""

from __future__ import annotations

import copy
import csv
import inspect
import math
import random
import shlex
import signal
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml

from ..runs.atomic import atomic_write
from ..runs.claim import RunInUse
from ..runs.layout import RunDir
from ..runs.outputs import check_folder_output, data_paths_in_args, mark_folder, marked_by_another
from ..tasks import DEFAULT_TASK, TASKS, Task, get_task
from .launch import SweepInterrupted, catch_stop_signals, launch_fit
from .records import check_run_args, final_val_top1
from .spec import unvalidated_final_epoch

__all__ = ["TrialFailed", "main", "tune"]

_FORBIDDEN_FIT_ARGS = {
    "--data.val_fraction": "the validation split is coretune tune's --val_fraction (> 0)",
    "--data.holdout_fraction": "the validation split is coretune tune's --val_fraction (> 0)",
    "--run_dir": "coretune tune gives every trial its own run directory under --output",
    "--objective": "choose the objective with coretune tune --objective",
    "--objective.eta": "η is what the study chooses",
    "--objective.alpha": "α is what the study chooses",
    "--seed": "the seed of every trial is coretune tune's --seed (with --repeats, --seed, --seed + 1, …)",
    "--seed_everything": "the seed of every trial is coretune tune's --seed (with --repeats, --seed, --seed + 1, …)",
    "--ckpt_path": "every trial starts from the pre-trained weights (--model.weights), and resumes on its own",
}


#: Random start-up points of the TPE sampler before it models the results; the study's creator queues them.
_TPE_STARTUP = 10

_ADVERSARIAL_NOTE = (
    "# NOTE: the trials train adversarially (--adversarial.enable true) but are scored by their clean validation "
    "score: robust accuracy plays no part in this choice; measure the chosen setting's with coretune eval robust.\n"
)

#: A trial's user attributes that say how it failed (``trials.csv``'s ``failure``); a retried copy does not keep them.
_OUTCOMES = ("diverged", "interrupted")


class TrialFailed(RuntimeError):
    """A trial's ``coretune fit`` did not finish, diverged or logged no validation score."""


def _check_storage(storage: str) -> None:
    """A ``--storage`` URL that SQLAlchemy can parse and, for SQLite, whose file's folder exists (ValueError
    naming the fix otherwise); nothing is created."""
    import sqlalchemy

    try:
        url = sqlalchemy.engine.make_url(storage)
    except sqlalchemy.exc.ArgumentError:
        raise ValueError(
            f"--storage {storage!r} is not a database URL: give one such as sqlite:///runs/tune/study.db (a file) "
            "or postgresql://user:password@host/database"
        ) from None
    folder = Path(url.database).parent if url.get_backend_name() == "sqlite" and url.database else None
    if folder is not None and not folder.is_dir():
        raise ValueError(
            f"--storage {storage}: folder {folder} does not exist: create it, or give a database file in an existing "
            "folder"
        )


def _import_optuna() -> Any:
    try:
        import optuna
    except ImportError:
        raise RuntimeError("coretune tune needs Optuna: pip install 'coretune[tune]' (or pip install optuna)") from None
    return optuna


def _check_fit_args(fit_args: list[str]) -> None:
    for arg in fit_args:
        key = arg.partition("=")[0]
        if key in _FORBIDDEN_FIT_ARGS:
            raise ValueError(f"remove {key} from the fit arguments: {_FORBIDDEN_FIT_ARGS[key]}")


def _check_trial_args(fit_args: list[str], objective: str, val_fraction: float) -> tuple[type[Task], str, bool]:
    """Before the first trial, refuse fit arguments ``coretune fit`` would refuse, an objective the fit's task
    refuses, or arguments that would not validate the final epoch (a trial is scored by its final epoch's
    ``val/<monitor>``). Returns the fit's task, the fit argument that holds out its validation split and whether
    the fits train adversarially."""
    from .. import objectives
    from ..engine.fitcli import FitArgsError, resolved_fit_config, task_of_args

    task = get_task(task_of_args(fit_args))
    holdout = f"--data.{task.validation_holdout}={val_fraction}"
    try:
        config = resolved_fit_config([*fit_args, "--objective", objective, holdout])
    except FitArgsError as error:
        raise ValueError(f"coretune fit would refuse the trial arguments: {error}. Fix the fit arguments") from None
    try:
        task(config.get("model")).check_objective(objectives.get(objective)[0](**config["objective"]["init_args"]))
    except ValueError as error:
        raise ValueError(f"coretune fit would refuse the trial arguments: {error}") from None
    if problem := unvalidated_final_epoch(config):
        raise ValueError(
            f"coretune tune scores each trial by its final epoch's validation {task.monitor_label}, but {problem}"
        )
    limit = (config.get("trainer") or {}).get("limit_val_batches")
    if limit is not None and (isinstance(limit, int) or limit != 1.0):
        raise ValueError(
            f"--trainer.limit_val_batches={limit} would score each trial on part of its validation split: drop it "
            "(or pass 1.0) so that every trial is chosen on the whole split"
        )
    if config.get("ckpt_path") is not None:
        raise ValueError(
            f"the fit arguments set ckpt_path {config['ckpt_path']}: each trial is a new fit in its own folder; drop "
            "it (delete the ckpt_path line of a run's config.yaml; an interrupted study resumes its trials itself)"
        )
    return task, holdout, bool((config.get("adversarial") or {}).get("enable"))


def _check_objective(name: str) -> dict[str, Any]:
    """The preset of a registered objective whose ``eta`` and ``alpha`` both act: not a preset that fixes ``eta``
    (``ce_mix``: η = 0 is its definition) or that mixes nothing (``ce_con``: α would have no effect)."""
    from .. import objectives

    def why_not(n: str) -> str | None:
        cls, preset = objectives.get(n)
        if not {"eta", "alpha"} <= set(inspect.signature(cls).parameters):
            return "has no eta and alpha to tune"
        if "eta" in preset:
            return f"fixes eta at {preset['eta']} (it defines the method)"
        if preset.get("mixing") == "none":
            return "mixes nothing (mixing='none'): alpha would have no effect"
        return None

    tunable = [n for n in objectives.available() if why_not(n) is None]
    if name not in tunable:
        reason = why_not(name) if name in objectives.available() else "has no eta and alpha to tune"
        raise ValueError(f"--objective {name!r} {reason}; choose one of {', '.join(tunable)}")
    return objectives.get(name)[1]


def _retry_history(optuna: Any, trial: Any) -> list[int]:
    """The numbers of the trials ``trial`` retries, the original first (empty for a trial that retries none)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RetryHeartbeatStaleTrialCallback.retry_history(trial)


def _requeue(study: Any, trial: Any, retry: Any) -> None:
    """Queue ``trial`` again with ``retry`` (same point, retry history kept), without its failure's attributes."""
    queued = copy.deepcopy(trial)  # the callback appends to the retry history it copies
    queued.user_attrs = {k: v for k, v in trial.user_attrs.items() if k not in _OUTCOMES}
    retry(study, queued)


def _resume_interrupted(optuna: Any, study: Any, retry: Any) -> None:
    """Queue again every trial a signal stopped that no trial retries yet: its fit resumes from its checkpoint."""
    trials = study.get_trials(deepcopy=False)
    retried = {number for t in trials for number in _retry_history(optuna, t)}
    for trial in trials:
        interrupted = trial.state == optuna.trial.TrialState.FAIL and _interrupted(trial) is not None
        if interrupted and trial.number not in retried:
            _requeue(study, trial, retry)


def _resume_grid(optuna: Any, study: Any, space: dict[str, list[float]], retry: Any) -> None:
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
            _requeue(study, trials[-1], retry)


def _grid_left(study: Any, size: int) -> bool:
    """Whether a grid point was never started or a queued retry waits (a diverged point is done)."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    started = {t.system_attrs["grid_id"] for t in trials if "grid_id" in t.system_attrs}
    return len(started) < size or any(t.state == TrialState.WAITING for t in trials)


def _trial_rows(study: Any, monitor: str) -> list[dict[str, Any]]:
    """``trials.csv``'s rows: a trial's value is ``final_val_<monitor>`` (``final_val_top1``, ``final_val_miou``)."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        rows.append(
            {
                "number": t.number,
                "state": t.state.name,
                "eta": t.params.get("eta", ""),
                "alpha": t.params.get("alpha", ""),
                f"final_val_{monitor}": "" if t.value is None else t.value,
                f"final_val_{monitor}_per_seed": " ".join(f"{v:.4f}" for v in t.user_attrs.get("per_seed", [])),
                "run_dir": t.user_attrs.get("run_dir", ""),
                "duration_s": round(t.duration.total_seconds(), 1) if t.duration else "",
                "failure": _failure(t),
            }
        )
    return rows


def _interrupted(trial: Any) -> str | None:
    """The signal that stopped ``trial`` itself (its mark names its number: a copy Optuna's heartbeat queued of a
    trial killed after it was marked carries the mark, not the interruption), else None."""
    mark = trial.user_attrs.get("interrupted")
    return mark["signal"] if isinstance(mark, dict) and mark.get("trial") == trial.number else None


def _failure(trial: Any) -> str:
    """``trials.csv``'s ``failure``: ``diverged: <the fit's message>``, ``interrupted by SIGINT`` or empty."""
    if trial.state.name == "COMPLETE":
        return ""
    if "diverged" in trial.user_attrs:
        return f"diverged: {trial.user_attrs['diverged']}"
    if (signal_name := _interrupted(trial)) is not None:
        return f"interrupted by {signal_name}"
    return trial.user_attrs.get("duplicate", "")


def _startup_points(space: dict[str, list[float]], count: int, seed: int) -> list[dict[str, float]]:
    """``count`` random points drawn from ``seed`` over the ranges ``run_trial`` suggests from (log scale where the
    range starts above 0): the TPE sampler's start-up trials, which the study's creator queues."""
    rng = random.Random(seed)

    def draw(low: float, high: float) -> float:
        if low <= 0:
            return rng.uniform(low, high)
        return min(max(math.exp(rng.uniform(math.log(low), math.log(high))), low), high)  # exp(log(x)) may pass x

    return [{name: draw(v[0], v[-1]) for name, v in space.items()} for _ in range(count)]


def tune(
    fit_args: list[str],
    output: str | Path = "runs/tune",
    objective: str = "core",
    eta: list[float] | None = None,
    alpha: list[float] | None = None,
    sampler: Literal["grid", "tpe"] = "grid",
    n_trials: int | None = None,
    val_fraction: float = 0.2,
    seed: int = 0,
    repeats: int = 1,
    storage: str | None = None,
    study_name: str = "coretune",
    logger: str | None = None,
) -> Any:
    """Run (or resume) the study; write ``trials.csv`` and ``best.yaml`` into ``output``; return the study.

    ``eta``/``alpha``: the grid values (``grid``) or the ends of the log-scale ranges (``tpe``), default
    {0.1, 1, 10}. ``n_trials``: TPE's number of completed trials (default 20): a run starts at most ``n_trials``
    minus those already completed, and failed, diverged and duplicate trials use up that number too (re-run the
    command to complete more); the grid runs every point once.
    ``repeats``: fits per trial (seeds ``seed``, ``seed + 1``, …); the trial's value is their mean final
    ``val/<monitor>`` (the fit's task's: top-1, or MIoU for segmentation). ``val_fraction``: the part of the
    training data each fit holds out for validation (the task's :attr:`~coretune.tasks.Task.validation_holdout`).
    ``logger`` (``mlflow``, ``tensorboard``, ``csv``, ``wandb``): every fit logs into one place in ``output``, one
    MLflow experiment (or W&B project) named ``study_name``, each fit named by its trial folder.
    """
    optuna = _import_optuna()
    if not 0 < val_fraction < 1:
        raise ValueError(
            f"--val_fraction must lie in (0, 1) (got {val_fraction}): tuning selects on a validation split "
            "carved from the training set and never on the test split"
        )
    _check_fit_args(fit_args)
    if logger is not None:
        from ..engine.loggers import check_sweep_logger

        check_sweep_logger(logger)
    preset = _check_objective(objective)
    grid = [0.1, 1.0, 10.0]  # the paper's
    eta, alpha = grid if eta is None else list(eta), grid if alpha is None else list(alpha)
    if not eta or not alpha:
        raise ValueError(f"--eta and --alpha need at least one value each (got eta {eta}, alpha {alpha})")
    if not all(math.isfinite(v) for v in [*eta, *alpha]) or min(alpha) <= 0 or min(eta) < 0:
        raise ValueError(f"α must be finite and > 0, η finite and >= 0 (got eta {eta}, alpha {alpha})")
    if n_trials is not None and n_trials < 1:
        raise ValueError(f"--n_trials must be >= 1 (got {n_trials}): the number of TPE trials to run")
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1 (got {repeats}): the number of fits, one per seed, a trial averages")
    if sampler == "grid" and n_trials is not None:
        raise ValueError("--n_trials applies to --sampler tpe; the grid runs each of its points once")
    task, holdout, adversarial = _check_trial_args(fit_args, objective, val_fraction)
    if adversarial:
        print(f"coretune tune: {_ADVERSARIAL_NOTE[2:]}")
    if storage is not None:
        _check_storage(storage)
    output = Path(output)
    check_folder_output(output, "tune", data=data_paths_in_args(fit_args), ours=_holds_a_study)
    mark_folder(output, "tune")
    storage = storage or f"sqlite:///{output / 'study.db'}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        # a trial whose process died without a word (kill -9, a lost machine) is failed after the grace period
        # and queued again
        import sqlalchemy

        try:
            db = optuna.storages.RDBStorage(
                storage,
                heartbeat_interval=60,
                grace_period=300,
                heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=3),
            )
        except (ImportError, sqlalchemy.exc.SQLAlchemyError) as err:
            reason = str(err).splitlines()[0]
            raise ValueError(
                f"cannot open the study storage --storage {storage} ({reason}): check the URL, that its database "
                "server runs and that its driver is installed"
            ) from None
        retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=None)
    space = {"eta": sorted({float(v) for v in eta}), "alpha": sorted({float(v) for v in alpha})}

    def make_sampler(sampler_seed: int | None) -> Any:
        if sampler == "grid":
            return optuna.samplers.GridSampler(space, seed=seed)
        return optuna.samplers.TPESampler(n_startup_trials=_TPE_STARTUP, seed=sampler_seed, constant_liar=True)

    try:  # without load_if_exists, exactly one of the processes starting at once creates the study
        study = optuna.create_study(study_name=study_name, storage=db, direction="maximize", sampler=make_sampler(seed))
        created = True
    except optuna.exceptions.DuplicatedStudyError:  # joined or resumed: another seed than the creator's proposals
        study = optuna.load_study(study_name=study_name, storage=db, sampler=make_sampler(None))
        created = False
    _check_repeats(study, repeats)
    _check_task(study, task)
    settings = {"seed": seed, "val_fraction": val_fraction, "sampler": sampler, "objective": objective}
    settings["fit_args"] = list(fit_args)
    if sampler == "tpe":  # a grid's points are checked by _resume_grid
        settings["eta_alpha"] = [[v[0], v[-1]] for v in (space["eta"], space["alpha"])]  # TPE's ranges: the ends
    _check_settings(study, settings)
    target = 20 if n_trials is None else n_trials
    if created and sampler == "tpe":  # every worker pops its own start-up points from the queue
        for point in _startup_points(space, min(_TPE_STARTUP, target), seed):
            study.enqueue_trial(point)

    def log_args(run_dir: Path) -> list[str]:
        if logger is None:
            return []
        from ..engine.loggers import sweep_logger_args

        return sweep_logger_args(logger, output, study_name, run_dir.relative_to(output / "trials").as_posix())

    def trial_folder(trial: Any, params: dict[str, float]) -> str:
        """A grid point's folder, or the TPE trial's, named after the trial it retries (resumed from its
        checkpoint). A TPE retry whose original another worker's copy already finished fails as a duplicate: two
        workers resuming at once may both queue it, and a trial counted twice would skew ``--n_trials`` and TPE."""
        if sampler == "grid":
            return f"eta{params['eta']:g}_alpha{params['alpha']:g}"
        trials = study.get_trials(deepcopy=False)
        origin = {t.number: (_retry_history(optuna, t) or [t.number])[0] for t in trials}
        first = origin.get(trial.number, trial.number)
        done = [t.number for t in trials if t.state == optuna.trial.TrialState.COMPLETE and origin[t.number] == first]
        if done:
            trial.set_user_attr("duplicate", f"duplicate of trial {done[0]}, which finished trial {first}'s point")
            raise TrialFailed(f"trial {trial.number}: {trial.user_attrs['duplicate']}")
        return f"trial{first:04d}"

    def run_trial(trial: Any) -> float:
        params = {name: trial.suggest_float(name, v[0], v[-1], log=v[0] > 0) for name, v in space.items()}
        trial_dir = output / "trials" / trial_folder(trial, params)
        trial.set_user_attr("run_dir", str(trial_dir))
        values = []
        for run_seed in range(seed, seed + repeats):
            run_dir = trial_dir if repeats == 1 else trial_dir / f"seed{run_seed}"
            args = [
                *fit_args,
                "--objective",
                objective,
                f"--objective.eta={params['eta']}",
                f"--objective.alpha={params['alpha']}",
                holdout,
                f"--seed={run_seed}",
            ]
            check_run_args(args, run_dir)  # a finished folder of another study (seed, split, fit args) is no result
            if not RunDir(run_dir).is_finished():
                if stop.signum is None and RunDir(run_dir).divergence() is None:
                    try:
                        code = launch_fit(args, run_dir, stop=stop, log_args=log_args(run_dir))
                    except RunInUse as err:  # another worker of the study runs this grid point
                        raise TrialFailed(f"trial {trial.number}: {err}") from None
                    except KeyboardInterrupt:  # a second Ctrl+C: the fit may have saved a checkpoint all the same
                        trial.set_user_attr("interrupted", {"signal": signal.SIGINT.name, "trial": trial.number})
                        raise
                if stop.signum is not None:  # the fit saved a resumable checkpoint; Optuna marks the trial FAIL
                    mark = {"signal": signal.Signals(stop.signum).name, "trial": trial.number}
                    trial.set_user_attr("interrupted", mark)
                    raise SweepInterrupted(stop.signum, _interrupted_message(stop.signum))
                if (diverged := RunDir(run_dir).divergence()) is not None:  # a result: never run again
                    trial.set_user_attr("diverged", diverged)
                    raise TrialFailed(f"trial {trial.number} diverged: {diverged}")
                if not RunDir(run_dir).is_finished():
                    raise TrialFailed(
                        f"trial {trial.number} did not finish (exit code {code}): see {RunDir(run_dir).log}"
                    )
            try:
                value = final_val_top1(RunDir(run_dir).metrics, task.monitor)
            except ValueError as err:
                raise TrialFailed(str(err)) from None
            if not math.isfinite(value):  # a validation split without a pixel to score: no value to rank a trial by
                raise TrialFailed(
                    f"trial {trial.number}: the final val/{task.monitor} of {run_dir} is undefined (its validation "
                    "masks hold no pixel to score): give the validation images labelled masks"
                )
            values.append(value)
        trial.set_user_attr("per_seed", values)
        return sum(values) / len(values)

    catch = (TrialFailed,)
    state = optuna.trial.TrialState
    with catch_stop_signals() as stop:  # SIGINT/SIGTERM: the running fit saves a checkpoint, no further trial starts
        if sampler == "grid":
            size = len(space["eta"]) * len(space["alpha"])
            _resume_grid(optuna, study, space, retry)
            while _grid_left(study, size):  # a retried point after the grid's end needs another round
                study.optimize(run_trial, catch=catch)
        else:
            _resume_interrupted(optuna, study, retry)
            done = len(study.get_trials(deepcopy=False, states=(state.COMPLETE,)))
            if done < target:
                enough = optuna.study.MaxTrialsCallback(target, states=(state.COMPLETE,))
                study.optimize(run_trial, n_trials=target - done, catch=catch, callbacks=[enough])
    _write_outputs(study, output, objective, preset, task, val_fraction, adversarial)
    return study


def _interrupted_message(signum: int) -> str:
    """What ``coretune tune`` says when a signal stopped it."""
    return (
        f"study stopped by {signal.Signals(signum).name}: the running trial's fit saved a resumable checkpoint and "
        "its Optuna trial is marked FAIL. Re-run the same command to resume the study: finished trials are kept and "
        "the interrupted trial runs again, in its folder, from its checkpoints/last.ckpt"
    )


def _check_repeats(study: Any, repeats: int) -> None:
    """Tie a study to its number of fits per trial: values averaged over other seed counts do not compare."""
    recorded = study.user_attrs.get("repeats")
    if recorded is None and not study.get_trials(deepcopy=False):
        study.set_user_attr("repeats", repeats)
    elif (recorded or 1) != repeats:  # studies from before --repeats ran one fit per trial
        raise ValueError(
            f"study {study.study_name!r} scores trials over {recorded or 1} fit(s) (--repeats), not {repeats}: "
            "pass the same --repeats, or a new --study_name or --output to start a new study"
        )


def _check_settings(study: Any, settings: dict[str, Any]) -> None:
    """Tie a study to its ``--seed`` (the validation split, and the grid's order), ``--val_fraction``,
    ``--sampler``, ``--objective``, ``--eta``/``--alpha`` (TPE's ranges) and fit arguments: trials
    fitted or scored otherwise do not compare, and a grid resumed in another order would run some points twice and
    others never. A study from before a setting was recorded is taken as it is."""
    names = {"eta_alpha": "--eta/--alpha", "fit_args": "fit arguments"}

    def shown(key: str, value: Any) -> str:
        return shlex.join(value) if key == "fit_args" else str(value)

    changed = [
        f"{names.get(key, f'--{key}')} {shown(key, study.user_attrs[key])} (now {shown(key, value)})"
        for key, value in settings.items()
        if key in study.user_attrs and study.user_attrs[key] != value
    ]
    if changed:
        raise ValueError(
            f"study {study.study_name!r} was run with {', '.join(changed)}: pass the same, or a new --study_name "
            "or --output to start a new study"
        )
    if not study.get_trials(deepcopy=False):
        for key, value in settings.items():
            study.set_user_attr(key, value)


def _check_task(study: Any, task: type[Task]) -> None:
    """Tie a study to the task its trials fit: one task's scores (top-1, MIoU) do not compare with another's."""
    recorded = study.user_attrs.get("task")
    if recorded is None and not study.get_trials(deepcopy=False):
        study.set_user_attr("task", task.name)
    elif (recorded or DEFAULT_TASK) != task.name:  # studies from before --task fitted classification
        raise ValueError(
            f"study {study.study_name!r} scores fits of --task {recorded or DEFAULT_TASK}, not {task.name}: pass a "
            "new --study_name or --output to start a new study"
        )


def _write_outputs(
    study: Any,
    output: Path,
    objective: str,
    preset: dict[str, Any],
    task: type[Task],
    val_fraction: float,
    adversarial: bool = False,
) -> None:
    from optuna.trial import TrialState

    from .. import objectives

    rows = _trial_rows(study, task.monitor)
    if rows:
        with atomic_write(output / "trials.csv", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    complete = [r for r in rows if r["state"] == "COMPLETE"]
    done = {(r["eta"], r["alpha"]) for r in complete}
    diverged = {
        (t.params["eta"], t.params["alpha"]): t.user_attrs["diverged"]
        for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
        if "diverged" in t.user_attrs and (t.params["eta"], t.params["alpha"]) not in done
    }
    if not complete:
        if diverged and set(diverged) == {(r["eta"], r["alpha"]) for r in rows if r["eta"] != ""}:
            points = ", ".join(f"eta {e:g} alpha {a:g}" for e, a in sorted(diverged))
            raise TrialFailed(
                f"every trial of study {study.study_name!r} diverged ({points}; each fit's message is in the failure "
                f"column of {output / 'trials.csv'}): lower the learning rate (--model.lr) or clip the gradients "
                "(--trainer.gradient_clip_val 1.0) in the fit arguments, and tune into a new --output"
            )
        raise TrialFailed(f"no trial of study {study.study_name!r} finished: see the logs under {output / 'trials'}")
    best = best_trial(study)
    ties = sorted(
        {
            (t.params["eta"], t.params["alpha"])
            for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if round(t.value, 9) == round(best.value, 9)
        }
        - {(best.params["eta"], best.params["alpha"])}  # a point two workers both finished is one point
    )
    tied = (
        f"# TIE: eta {best.params['eta']:g} alpha {best.params['alpha']:g} (the earliest trial, chosen) and "
        + ", ".join(f"eta {e:g} alpha {a:g}" for e, a in ties)
        + " reach the same value.\n"
        if ties
        else ""
    )
    findings = "".join(
        f"# DIVERGED: eta {e:g} alpha {a:g}: {message}\n" for (e, a), message in sorted(diverged.items())
    )
    settled = done | set(diverged)  # a diverged point is finished: a finding, not retried
    unfinished = sorted(
        {(r["eta"], r["alpha"], r["state"]) for r in rows if r["eta"] != "" and (r["eta"], r["alpha"]) not in settled}
    )
    partial = ""
    if unfinished and type(study.sampler).__name__ == "GridSampler":  # crashed, interrupted or running elsewhere
        points = ", ".join(f"eta {e:g} alpha {a:g} ({state})" for e, a, state in unfinished)
        partial = f"# PARTIAL: not finished: {points}; re-run the same command to retry them.\n"
    for line in (findings + partial).splitlines():
        print(f"coretune tune: {line[2:]}")
    cls = objectives.get(objective)[0]
    class_path = f"{cls.__module__}.{cls.__qualname__}"
    init_args = {**preset, "eta": best.params["eta"], "alpha": best.params["alpha"]}
    ran = _trial_objective(best.user_attrs.get("run_dir"))
    if ran is not None:  # what the trial's fit resolved: every setting, a config's preset and --objective.* included
        class_path, init_args = ran["class_path"], ran.get("init_args") or {}
    header = (
        f"# coretune tune: best of {len(complete)} finished trials of study {study.study_name!r} "
        f"({cls.__name__} via --objective {objective}),\n"
        f"# selected by the final-epoch val/{task.monitor} = {best.value:.4f} on a {val_fraction:g} validation split "
        f"of the training set{_per_seed_note(best)} (trial run directory: {best.user_attrs.get('run_dir')}).\n"
        f"# Use it with: coretune fit --config YOUR_CONFIG.yaml --config best.yaml{_final_fit_note(task)}.\n"
        f"{tied}{findings}{partial}{_ADVERSARIAL_NOTE if adversarial else ''}"
    )
    body = yaml.safe_dump({"objective": {"class_path": class_path, "init_args": init_args}}, sort_keys=False)
    with atomic_write(output / "best.yaml") as f:  # whole: a sweep or a person reads it
        f.write(header + body)


def best_trial(study: Any) -> Any:
    """The finished trial of the highest value, the earliest among equal values (Optuna's ``best_trial`` picks
    among ties in storage order; small validation splits tie often)."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    return max(trials, key=lambda t: (round(t.value, 9), -t.number))  # a mean of seeds in another order: one value


def _trial_objective(run_dir: str | None) -> dict[str, Any] | None:
    """The ``objective`` block of a trial's ``config.yaml`` (its first seed's with ``--repeats``), or None."""
    if not run_dir:
        return None
    for config in (RunDir(run_dir).config, *sorted(Path(run_dir).glob("seed*/config.yaml"))):
        if config.is_file():
            objective = (yaml.safe_load(config.read_text()) or {}).get("objective")
            if isinstance(objective, dict) and "class_path" in objective:
                return objective
    return None


def _final_fit_note(task: type[Task]) -> str:
    """How the final fit uses the training data: all of it, where the task can validate elsewhere."""
    if task.validation_holdout == "val_fraction":
        return " (training on the whole training set, val_fraction 0)"
    return f" (holding out {task.validation_holdout} for validation, as every fit of the task does)"


def _per_seed_note(trial: Any) -> str:
    per_seed = trial.user_attrs.get("per_seed", [])
    if len(per_seed) < 2:
        return ""
    return f", mean of {len(per_seed)} seeds and splits ({', '.join(f'{v:.4f}' for v in per_seed)})"


def _parser() -> Any:
    from ..arguments import ArgumentParser

    parser = ArgumentParser(
        allow_abbrev=False,
        prog="coretune tune",
        usage="coretune tune [options] -- FIT_ARGS ...",
        description="Choose η and α of Core-tuning (or a Table 2 preset) with an Optuna study. Every trial runs "
        "coretune fit with FIT_ARGS (everything after --, e.g. --config configs/cpu/cifar10.yaml --data.root "
        "DIR) plus the trial's η and α, and is scored by its final-epoch val/<monitor> of the fit's task (top-1; "
        "MIoU for segmentation) on a validation split held out of the training data (never the test split). "
        "Writes trials.csv and best.yaml into --output.",
    )
    parser.add_argument("--output", type=str, default="runs/tune", help="Folder for the trials, study and results.")
    parser.add_argument("--objective", type=str, default="core", help="A registered objective with eta and alpha.")
    parser.add_argument("--eta", type=float, nargs="+", default=[0.1, 1.0, 10.0], help="η grid (TPE: its range).")
    parser.add_argument("--alpha", type=float, nargs="+", default=[0.1, 1.0, 10.0], help="α grid (TPE: its range).")
    parser.add_argument("--sampler", type=Literal["grid", "tpe"], default="grid", help="grid or tpe.")
    parser.add_argument(
        "--n_trials", type=int | None, default=None, help="TPE: completed trials wanted (20; failed ones count too)."
    )
    parser.add_argument(
        "--val_fraction",
        type=float,
        default=0.2,
        help="Fraction of the training data held out for selection (classification: stratified; domain "
        "generalization: --data.holdout_fraction, of each domain); must be > 0.",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="Seed of the trials' fits and of the sampler (TPE: of its start-up points)."
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="Fits per trial, seeds seed..seed+repeats-1 (each another validation split); the value is their mean.",
    )
    parser.add_argument(
        "--storage",
        type=str | None,
        default=None,
        help="Optuna storage URL (default sqlite:///<output>/study.db); share one to run many workers.",
    )
    parser.add_argument("--study_name", type=str, default="coretune", help="Study name inside the storage.")
    parser.add_argument(
        "--logger",
        type=str | None,
        default=None,
        help="Log every fit into one place in --output: mlflow (one experiment named --study_name, in OUTPUT/mlruns), "
        "tensorboard, csv or wandb (offline).",
    )
    return parser


def _holds_a_study(folder: Path) -> bool:
    """Whether ``folder`` is a ``coretune tune`` output made before it marked its folders (its study, trials or
    results), and no other command's."""
    if marked_by_another(folder, "tune"):
        return False
    return any((folder / name).exists() for name in ("study.db", "trials", "trials.csv", "best.yaml"))


def main(args: list[str]) -> None:
    from rich.console import Console

    split = args.index("--") if "--" in args else len(args)
    cfg = _parser().parse_args(args[:split])
    if split == len(args):
        raise ValueError(
            "pass the trials' fit arguments after --, e.g. coretune tune -- --config configs/cpu/cifar10.yaml "
            "--data.root DIR --model.weights CKPT"
        )
    try:
        study = tune(
            args[split + 1 :],
            output=cfg.output,
            objective=cfg.objective,
            eta=cfg.eta,
            alpha=cfg.alpha,
            sampler=cfg.sampler,
            n_trials=cfg.n_trials,
            val_fraction=cfg.val_fraction,
            seed=cfg.seed,
            repeats=cfg.repeats,
            storage=cfg.storage,
            study_name=cfg.study_name,
            logger=cfg.logger,
        )
    except KeyboardInterrupt:  # a second Ctrl+C
        raise SweepInterrupted(signal.SIGINT, _interrupted_message(signal.SIGINT)) from None
    best, label = best_trial(study), TASKS[study.user_attrs.get("task", DEFAULT_TASK)].monitor_label
    Console().print(
        f"best: η = {best.params['eta']:g}, α = {best.params['alpha']:g} (final val {label} "
        f"{100 * best.value:.2f}%, trial {best.number}); wrote {Path(cfg.output) / 'best.yaml'} and "
        f"{Path(cfg.output) / 'trials.csv'}",
        highlight=False,
    )
