"""What ``coretune tune`` checks of the trials' fit arguments before its first trial: the options it sets itself,
and what ``coretune fit`` would refuse, resolved as the fit would resolve them (configs, presets, the task)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..tasks import Task, get_task
from .job import FitArgs
from .spec import unvalidated_final_epoch

__all__ = ["check_fit_args", "check_trial_args"]

#: Fit arguments that coretune tune sets itself, with why.
FORBIDDEN_FIT_ARGS: dict[str, str] = {
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


def check_fit_args(fit_args: FitArgs | Sequence[str], chosen: Iterable[str] = ()) -> None:
    """Refuse a fit argument that ``coretune tune`` sets itself: the validation split, run directory, objective, seed,
    resumed checkpoint, and ``--objective.NAME`` of each hyper-parameter the study chooses (``chosen``; η and α
    always)."""
    forbidden = {
        **{f"--objective.{name}": f"{name} is what the study chooses" for name in chosen},
        **FORBIDDEN_FIT_ARGS,
    }
    options = fit_args if isinstance(fit_args, FitArgs) else FitArgs.parse(fit_args)
    for key in (f"--{name}" for name in options.names()):
        if key in forbidden:
            raise ValueError(f"remove {key} from the fit arguments: {forbidden[key]}")


def check_trial_args(
    fit_args: list[str], objective: str, val_fraction: float
) -> tuple[type[Task], tuple[str, float], bool]:
    """Before the first trial, refuse fit arguments ``coretune fit`` would refuse, an objective the fit's task
    refuses, or arguments that would not validate the final epoch (a trial is scored by its final epoch's
    ``val/<monitor>``). Returns the fit's task, the fit argument that holds out its validation split and whether
    the fits train adversarially (the holdout as a data option of the trials' jobs: ``(name, value)``)."""
    from .. import objectives
    from ..engine.fitcli import FitArgsError, resolved_fit_config, task_of_args

    task = get_task(task_of_args(fit_args))
    holdout = (task.validation_holdout, val_fraction)
    try:
        config = resolved_fit_config([*fit_args, "--objective", objective, f"--data.{holdout[0]}={holdout[1]}"])
    except FitArgsError as error:
        raise ValueError(f"coretune fit would refuse the trial arguments: {error}. Fix the fit arguments") from None
    try:
        task(config.get("model")).check_objective(
            objectives.get(objective)[0].from_settings(config["objective"]["init_args"])
        )
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
