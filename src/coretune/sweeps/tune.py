"""``coretune tune``: choose an objective's hyper-parameters (Core-tuning's η and α) with an Optuna study, on a
validation split of the training set.

The paper (§5.1, Appendix C) picks η and α from {0.1, 1, 10}; the default study is that 3 × 3 grid (Optuna's
``GridSampler``), ``--sampler tpe`` searches the same ranges on a log scale. Another objective is tuned over the
search space its class declares (:mod:`.space`; ``--space`` gives other values). Each trial is an ordinary
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
The study lives in a database (``sqlite:///<output>/study.db`` by default; any SQLAlchemy URL, such as
``postgresql://…``) or a journal file (``journal:PATH``; :mod:`.storage`): re-running the command resumes it
(finished trials are kept, failed or interrupted grid points run again), and several ``coretune tune`` processes —
on one or many machines — given the same ``--storage`` and ``--study_name`` share the work: each trial runs once,
and the trial of a worker that died is queued again after ``--grace_period`` seconds without its heartbeat
(:mod:`.study`).

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

import csv
import math
import signal
from pathlib import Path
from typing import Any, Literal

import yaml

from ..runs.atomic import atomic_write
from ..runs.claim import RunInUse
from ..runs.layout import RunDir
from ..runs.outputs import check_folder_output, mark_folder
from ..tasks import DEFAULT_TASK, TASKS, Task
from .job import FitArgs, FitJob, FitOption
from .launch import SweepInterrupted, catch_stop_signals, launch_fit
from .records import check_run_args, final_val_top1
from .space import objective_space, point_label, point_symbols, resolve_space, trial_folder
from .space import startup_points as _startup_points
from .storage import GRACE_PERIOD_S, check_storage, open_storage
from .study import (
    READY,
    await_creator,
    best_trial,
    check_repeats,
    check_settings,
    check_task,
    fail_stale,
    grid_duplicate,
    grid_left,
    import_optuna,
    resume_grid,
    resume_interrupted,
    retry_history,
    tpe_left,
    tpe_surplus,
    trial_rows,
)
from .trialargs import check_fit_args, check_trial_args

__all__ = ["TrialFailed", "best_trial", "main", "tune"]


#: Random start-up points of the TPE sampler before it models the results; the study's creator queues them.
_TPE_STARTUP = 10

_ADVERSARIAL_NOTE = (
    "# NOTE: the trials train adversarially (--adversarial.enable true) but are scored by their clean validation "
    "score: robust accuracy plays no part in this choice; measure the chosen setting's with coretune eval robust.\n"
)


class TrialFailed(RuntimeError):
    """A trial's ``coretune fit`` did not finish, diverged or logged no validation score."""


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
    space: dict[str, list[float]] | None = None,
    grace_period: int = GRACE_PERIOD_S,
) -> Any:
    """Run (or resume) the study; write ``trials.csv`` and ``best.yaml`` into ``output``; return the study.

    ``eta``/``alpha``: the grid values (``grid``) or the ends of the log-scale ranges (``tpe``) of Core-tuning's η
    and α, default {0.1, 1, 10}; ``space``: values of any hyper-parameter of the objective's declared search space
    (:attr:`~coretune.objectives.Objective.search_space`, whose values are the default). ``n_trials``: TPE's
    number of completed trials (default 20): a run starts at most ``n_trials`` minus those already completed,
    and failed, diverged and duplicate trials use up that number too (re-run the command to complete more); the
    grid runs every point once.
    ``repeats``: fits per trial (seeds ``seed``, ``seed + 1``, …); the trial's value is their mean final
    ``val/<monitor>`` (the fit's task's: top-1, or MIoU for segmentation). ``val_fraction``: the part of the
    training data each fit holds out for validation (the task's :attr:`~coretune.tasks.Task.validation_holdout`).
    ``logger`` (``mlflow``, ``tensorboard``, ``csv``, ``wandb``): every fit logs into one place in ``output``, one
    MLflow experiment (or W&B project) named ``study_name``, each fit named by its trial folder.
    ``storage``: an SQLAlchemy URL (``postgresql://…`` for workers on several machines) or ``journal:PATH``
    (:mod:`.storage`); ``grace_period``: seconds without a heartbeat after which a running trial's worker is taken
    for dead and its trial queued again.
    """
    optuna = import_optuna()
    if not 0 < val_fraction < 1:
        raise ValueError(
            f"--val_fraction must lie in (0, 1) (got {val_fraction}): tuning selects on a validation split "
            "carved from the training set and never on the test split"
        )
    user_args = FitArgs.parse(fit_args)
    check_fit_args(user_args)
    if logger is not None:
        from ..engine.loggers import check_sweep_logger

        check_sweep_logger(logger)
    preset, space = resolve_space(objective, eta, alpha, space)
    check_fit_args(user_args, space)
    if n_trials is not None and n_trials < 1:
        raise ValueError(f"--n_trials must be >= 1 (got {n_trials}): the number of TPE trials to run")
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1 (got {repeats}): the number of fits, one per seed, a trial averages")
    if grace_period < 1:
        raise ValueError(
            f"--grace_period must be >= 1 second (got {grace_period}): the time without a heartbeat after which a "
            "running trial's worker is taken for dead (default 300)"
        )
    if sampler == "grid" and n_trials is not None:
        raise ValueError("--n_trials applies to --sampler tpe; the grid runs each of its points once")
    task, holdout, adversarial = check_trial_args(fit_args, objective, val_fraction)
    if adversarial:
        print(f"coretune tune: {_ADVERSARIAL_NOTE[2:]}")
    if storage is not None:
        check_storage(storage)
    output = Path(output)
    check_folder_output(output, "tune", data=user_args.data_paths(), ours=_holds_a_study)
    mark_folder(output, "tune")
    storage = storage or f"sqlite:///{output / 'study.db'}"
    db, retry = open_storage(optuna, storage, grace_period)

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
        await_creator(study)  # a worker started with the creator checks against its settings, pops its points
    check_repeats(study, repeats)
    check_task(study, task)
    settings = {"seed": seed, "val_fraction": val_fraction, "sampler": sampler, "objective": objective}
    settings["fit_args"] = list(fit_args)
    if sampler == "tpe" and list(space) == ["eta", "alpha"]:  # a grid's points are checked by resume_grid
        settings["eta_alpha"] = [[v[0], v[-1]] for v in space.values()]  # TPE's ranges: the ends
    elif sampler == "tpe":
        settings["space"] = {name: [v[0], v[-1]] for name, v in space.items()}
    check_settings(study, settings)
    target = 20 if n_trials is None else n_trials
    if created and sampler == "tpe":  # every worker pops its own start-up points from the queue
        for point in _startup_points(space, min(_TPE_STARTUP, target), seed):
            study.enqueue_trial(point)
    if created:
        study.set_user_attr(READY, True)

    def log_args(run_dir: Path) -> list[str]:
        if logger is None:
            return []
        from ..engine.loggers import sweep_logger_args

        return sweep_logger_args(logger, output, study_name, run_dir.relative_to(output / "trials").as_posix())

    def folder_of(trial: Any, params: dict[str, float]) -> str:
        """A grid point's folder, or the TPE trial's, named after the trial it retries (resumed from its
        checkpoint). A TPE retry whose original another worker's copy already finished fails as a duplicate: two
        workers resuming at once may both queue it, and a trial counted twice would skew ``--n_trials`` and TPE. A
        TPE trial started after ``--n_trials`` others fails as surplus (two workers passed ``tpe_left`` at once)."""
        if sampler == "grid":
            if (earlier := grid_duplicate(study, trial.number)) is not None:
                trial.set_user_attr("duplicate", f"duplicate of trial {earlier}, which runs or finished its point")
                raise TrialFailed(f"trial {trial.number}: {trial.user_attrs['duplicate']}")
            return trial_folder(params)
        if tpe_surplus(study, trial.number, target):
            trial.set_user_attr("surplus", f"surplus: {target} trials of --n_trials {target} started before it")
            raise TrialFailed(f"trial {trial.number}: {trial.user_attrs['surplus']}")
        trials = study.get_trials(deepcopy=False)
        origin = {t.number: (retry_history(optuna, t) or [t.number])[0] for t in trials}
        first = origin.get(trial.number, trial.number)
        done = [t.number for t in trials if t.state == optuna.trial.TrialState.COMPLETE and origin[t.number] == first]
        if done:
            trial.set_user_attr("duplicate", f"duplicate of trial {done[0]}, which finished trial {first}'s point")
            raise TrialFailed(f"trial {trial.number}: {trial.user_attrs['duplicate']}")
        return f"trial{first:04d}"

    def run_trial(trial: Any) -> float:
        params = {name: trial.suggest_float(name, v[0], v[-1], log=v[0] > 0) for name, v in space.items()}
        trial_dir = output / "trials" / folder_of(trial, params)
        trial.set_user_attr("run_dir", str(trial_dir))
        values = []
        for run_seed in range(seed, seed + repeats):
            run_dir = trial_dir if repeats == 1 else trial_dir / f"seed{run_seed}"
            job = FitJob(
                run_dir=run_dir,
                objective=objective,
                seed=run_seed,
                fit_args=user_args,
                objective_args=FitArgs(tuple(FitOption(f"objective.{name}", f"{v}") for name, v in params.items())),
                data=(holdout,),
            )
            check_run_args(job)  # a finished folder of another study (seed, split, fit args) is no result
            if not RunDir(run_dir).is_finished():
                if stop.signum is None and RunDir(run_dir).divergence() is None:
                    try:
                        code = launch_fit(job.argv(), run_dir, stop=stop, log_args=log_args(run_dir))
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

    def left(work: Any) -> bool:
        """Whether a trial is left to start, once the trials of dead workers are queued again: one at a time, so
        that a worker never starts a trial that others run."""
        fail_stale(optuna, study)
        return work()

    state = optuna.trial.TrialState
    with catch_stop_signals() as stop:  # SIGINT/SIGTERM: the running fit saves a checkpoint, no further trial starts
        if sampler == "grid":
            size = math.prod(len(values) for values in space.values())
            resume_grid(optuna, study, space, retry)
            while left(lambda: grid_left(study, size)):  # a point no worker started, or a queued retry
                study.optimize(run_trial, n_trials=1, catch=catch)
        else:
            resume_interrupted(optuna, study, retry)
            done = len(study.get_trials(deepcopy=False, states=(state.COMPLETE,)))
            for _ in range(max(0, target - done)):  # failed, diverged and duplicate trials use up this run's too
                if not left(lambda: tpe_left(study, target)):
                    break
                study.optimize(run_trial, n_trials=1, catch=catch)
    _write_outputs(study, output, objective, preset, task, val_fraction, list(space), adversarial)
    return study


def _interrupted_message(signum: int) -> str:
    """What ``coretune tune`` says when a signal stopped it."""
    return (
        f"study stopped by {signal.Signals(signum).name}: the running trial's fit saved a resumable checkpoint and "
        "its Optuna trial is marked FAIL. Re-run the same command to resume the study: finished trials are kept and "
        "the interrupted trial runs again, in its folder, from its checkpoints/last.ckpt"
    )


def _write_outputs(
    study: Any,
    output: Path,
    objective: str,
    preset: dict[str, Any],
    task: type[Task],
    val_fraction: float,
    names: list[str],
    adversarial: bool = False,
) -> None:
    """``trials.csv`` and ``best.yaml`` (with its findings: ties, diverged and unfinished points); ``names``: the
    search space's hyper-parameters, whose values make a point."""
    from optuna.trial import TrialState

    from .. import objectives

    def point(values: dict[str, Any]) -> tuple[Any, ...]:
        return tuple(values[name] for name in names)

    def label(values: tuple[Any, ...]) -> str:
        return point_label(dict(zip(names, values, strict=True)))

    rows = trial_rows(study, task.monitor, names)
    if rows:
        with atomic_write(output / "trials.csv", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    complete = [r for r in rows if r["state"] == "COMPLETE"]
    done = {point(r) for r in complete}
    diverged = {
        point(t.params): t.user_attrs["diverged"]
        for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
        if "diverged" in t.user_attrs and point(t.params) not in done
    }
    if not complete:
        if diverged and set(diverged) == {point(r) for r in rows if r[names[0]] != ""}:
            points = ", ".join(label(p) for p in sorted(diverged))
            raise TrialFailed(
                f"every trial of study {study.study_name!r} diverged ({points}; each fit's message is in the failure "
                f"column of {output / 'trials.csv'}): lower the learning rate (--model.optim.lr) or clip the gradients "
                "(--trainer.gradient_clip_val 1.0) in the fit arguments, and tune into a new --output"
            )
        raise TrialFailed(f"no trial of study {study.study_name!r} finished: see the logs under {output / 'trials'}")
    best = best_trial(study)
    ties = sorted(
        {
            point(t.params)
            for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if round(t.value, 9) == round(best.value, 9)
        }
        - {point(best.params)}  # a point two workers both finished is one point
    )
    tied = (
        f"# TIE: {label(point(best.params))} (the earliest trial, chosen) and "
        + ", ".join(label(p) for p in ties)
        + " reach the same value.\n"
        if ties
        else ""
    )
    findings = "".join(f"# DIVERGED: {label(p)}: {message}\n" for p, message in sorted(diverged.items()))
    settled = done | set(diverged)  # a diverged point is finished: a finding, not retried
    unfinished = sorted({(point(r), r["state"]) for r in rows if r[names[0]] != "" and point(r) not in settled})
    partial = ""
    if unfinished and type(study.sampler).__name__ == "GridSampler":  # crashed, interrupted or running elsewhere
        points = ", ".join(f"{label(p)} ({state})" for p, state in unfinished)
        running = (
            " (a RUNNING point runs in another worker, or its worker died: it is retried once its heartbeat is "
            "--grace_period old)"
            if any(state == "RUNNING" for _, state in unfinished)
            else ""
        )
        partial = f"# PARTIAL: not finished: {points}; re-run the same command to retry them{running}.\n"
    for line in (findings + partial).splitlines():
        print(f"coretune tune: {line[2:]}")
    cls = objectives.get(objective)[0]
    class_path = f"{cls.__module__}.{cls.__qualname__}"
    init_args = {**preset, **{name: best.params[name] for name in names}}
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
    parser.add_argument(
        "--objective", type=str, default="core", help="A registered objective that declares a search space."
    )
    parser.add_argument(
        "--eta", type=float, nargs="+", default=None, help="η grid (TPE: its range); Core-tuning's: 0.1 1 10."
    )
    parser.add_argument(
        "--alpha", type=float, nargs="+", default=None, help="α grid (TPE: its range); Core-tuning's: 0.1 1 10."
    )
    parser.add_argument(
        "--space",
        type=dict[str, list[float]] | None,
        default=None,
        help="Values of the objective's hyper-parameters in place of its declared ones, e.g. '{lam: [0.5, 0.9]}'.",
    )
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
        help="Optuna storage (default sqlite:///<output>/study.db): postgresql://USER:PASSWORD@HOST:PORT/DB or "
        "journal:PATH (a file on a shared disk) for workers on several machines.",
    )
    parser.add_argument("--study_name", type=str, default="coretune", help="Study name inside the storage.")
    parser.add_argument(
        "--grace_period",
        type=int,
        default=GRACE_PERIOD_S,
        help="Seconds without a heartbeat after which a running trial's worker is taken for dead and its trial is "
        "queued again for a live worker (heartbeat every grace_period/5 s, at most 60 s).",
    )
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
    results)."""
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
            space=cfg.space,
            grace_period=cfg.grace_period,
        )
    except KeyboardInterrupt:  # a second Ctrl+C
        raise SweepInterrupted(signal.SIGINT, _interrupted_message(signal.SIGINT)) from None
    best, label = best_trial(study), TASKS[study.user_attrs.get("task", DEFAULT_TASK)].monitor_label
    chosen = point_symbols({name: best.params[name] for name in objective_space(cfg.objective)[1]})
    Console().print(
        f"best: {chosen} (final val {label} "
        f"{100 * best.value:.2f}%, trial {best.number}); wrote {Path(cfg.output) / 'best.yaml'} and "
        f"{Path(cfg.output) / 'trials.csv'}",
        highlight=False,
    )
