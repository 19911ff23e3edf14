"""``coretune compare``: which fine-tuning method to use on your data, chosen on a validation split of the training
set and never on the test split.

``coretune compare --data.root DATA --model.weights CKPT [--methods ce,ce_mix,core] [--seeds 3] [--budget 2h]``
fits every method × seed with the same launcher as ``coretune bench`` (resumable; one line per run; ``--status``):
each fit holds out a stratified ``--val_fraction`` of the training set (seeded by the run's seed, so that the
methods of one seed share one split and compare paired), and is scored by its final epoch's validation top-1. The
paired table (mean ± std, the paired difference to CE-tuning and its p-value) and the recommendation
(:mod:`.choice`: a method ahead beyond noise, or the simplest of a tie, saying which) go to the console,
``compare.md`` and ``compare.json`` in ``--output``. The fits run with ``coretune fit --test false``: no run scores
the test split, so no run folder holds a test score. ``--test`` then scores the chosen method's runs, and only
those, on the test split, once, at the end: ``coretune test`` on each run's final checkpoint (``last.ckpt``, the
weights whose validation top-1 chose the method), into its ``test_results.json``.

A comparison is a structured job list, the grid of a bench spec (:class:`~.spec.BenchSpec`: one data set, the
methods, the seeds, ``metric: val``), rendered as ``coretune fit`` command lines only where a process starts. Every
method runs with its documented defaults (``--objective NAME``: its class's defaults and preset) and the fit
arguments given (a ``--config`` file's values); ``--budget`` sets every run's epochs (:mod:`.budget`): ``--budget
E`` shares ``E`` epochs among the runs, ``--budget 2h`` (``90m`` …) first times one epoch of each method (a timing fit
each, in ``<output>/timing/``, resumable and counted against the budget) and gives each run the epochs that fit the
time, saying so in one line and in ``compare.json``. A validation split too small to tell methods
``--min_difference`` points apart is refused before any run (:func:`~.choice.check_val_size`).
"""

from __future__ import annotations

import json
import math
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..apps.scoring import score
from ..extras import need
from ..runs.atomic import atomic_write, strict_json
from ..runs.layout import RunDir
from ..runs.outputs import check_folder_output, data_paths
from .budget import Budget, epochs_for_time, epochs_for_total, format_time, measured_epoch_seconds, parse_budget
from .choice import MethodRow, Recommendation, check_val_size, method_rows, recommend, reference_method, simplicity
from .collect import collect_cells
from .job import FitArgs
from .launch import SweepInterrupted, run_sweep
from .records import percent
from .spec import BenchSpec, ObjectiveEntry
from .stats import Cell
from .status import print_status

__all__ = ["CompareSettings", "comparison_spec", "main"]

#: The name of the comparison's one "data set" in its run folders (``<output>/data/<method>/frac<f>/seed<s>``).
DATASET = "data"

#: The timing fits' "data set" (``<output>/timing/<method>/frac<f>/seed0``) under a wall-clock ``--budget``.
TIMING = "timing"

#: Fit arguments ``coretune compare`` sets itself, with why.
_FORBIDDEN = {
    "objective": "the methods are --methods; each runs with its documented defaults",
    "seed": "the seeds are 0 … --seeds − 1",
    "seed_everything": "the seeds are 0 … --seeds − 1",
    "data.seed": "the seeds are 0 … --seeds − 1",
    "data.val_fraction": "the validation split is coretune compare's --val_fraction",
    "run_dir": "coretune compare gives every run its own folder under --output",
    "ckpt_path": "every run starts from the pre-trained weights (--model.weights) and resumes on its own",
}

_OPTIONS = {  # coretune compare's own options: whether each takes a value
    "methods": True,
    "seeds": True,
    "budget": True,
    "val_fraction": True,
    "min_difference": True,
    "output": True,
    "workers": True,
    "status": False,
    "test": False,
    "dry_run": False,
    "help": False,
}


@dataclass(frozen=True)
class CompareSettings:
    """What a comparison runs: the methods (registered objective names), the number of seeds, the validation
    fraction, the smallest difference it must tell apart (points), the budget (``budget``: total epochs, or
    wall-clock time as ``--budget`` spells it, ``"2h"``; None: each run the fit arguments' epochs), the output folder
    and the user's fit arguments."""

    methods: tuple[str, ...]
    seeds: int = 3
    val_fraction: float = 0.2
    min_difference: float = 5.0
    budget: int | str | None = None
    output: Path = Path("runs/compare")
    fit_args: tuple[str, ...] = ()
    workers: int = 1

    def check(self) -> None:
        """ValueError, one line naming the option and the fix, for settings that cannot make a comparison."""
        from .. import objectives

        registered = objectives.available()
        if unknown := [m for m in self.methods if m not in registered]:
            raise ValueError(f"--methods: unknown method {unknown[0]!r}; the methods are {', '.join(registered)}")
        if len(self.methods) < 2 or len(set(self.methods)) != len(self.methods):
            raise ValueError(
                f"--methods {','.join(self.methods)}: give two or more different methods, e.g. --methods ce,ce_mix,core"
            )
        if self.seeds < 2:
            raise ValueError(f"--seeds must be >= 2 (got {self.seeds}): the methods are compared seed by seed")
        if not 0 < self.val_fraction < 1:
            raise ValueError(
                f"--val_fraction must lie in (0, 1) (got {self.val_fraction}): the part of the training set held out "
                "to compare the methods on (never the test split)"
            )
        if not 0 < self.min_difference < 100:
            raise ValueError(f"--min_difference must lie in (0, 100) points (got {self.min_difference})")
        self.parsed_budget  # noqa: B018 (ValueError for a budget of another form, or of nothing)
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1 (got {self.workers})")
        for name in FitArgs.parse(self.fit_args).names():
            key = "objective" if name.startswith("objective.") else name
            if key in _FORBIDDEN:
                raise ValueError(f"remove --{name} from the fit arguments: {_FORBIDDEN[key]}")
            if name == "trainer.max_epochs" and self.budget is not None:
                raise ValueError(
                    "remove --trainer.max_epochs from the fit arguments, or drop --budget: the budget sets each "
                    "run's epochs"
                )

    @property
    def runs(self) -> int:
        return len(self.methods) * self.seeds

    @property
    def parsed_budget(self) -> Budget | None:
        """``budget`` read (:func:`~.budget.parse_budget`)."""
        return parse_budget(None if self.budget is None else str(self.budget))


def _resolved(settings: CompareSettings) -> dict[str, Any]:
    """The fit configuration of the comparison's runs (its first method's), checked: a classification fit that
    ``coretune fit`` would run."""
    from ..engine.fitcli import FitArgsError, resolved_fit_config, task_of_args

    task = task_of_args(settings.fit_args)
    if task != "classification":
        raise ValueError(
            f"coretune compare compares classification fits (top-1 on a held-out part of train/), not --task {task}: "
            "compare its methods with coretune bench and 'metric: val' in the spec"
        )
    args = [*settings.fit_args, "--objective", settings.methods[0], f"--data.val_fraction={settings.val_fraction}"]
    try:
        return resolved_fit_config(args)
    except FitArgsError as error:
        raise ValueError(f"coretune fit would refuse the fit arguments: {error}. Fix them") from None


def _every(config: dict[str, Any]) -> int:
    """The validation interval of the runs' fit configuration (``--trainer.check_val_every_n_epoch``)."""
    return int((config.get("trainer") or {}).get("check_val_every_n_epoch") or 1)


def _epochs(settings: CompareSettings, config: dict[str, Any]) -> int | None:
    """Each run's epochs under a ``--budget`` of epochs (None without one): the budget shared among the runs, rounded
    down to a multiple of the validation interval so that the final epoch is validated
    (:func:`~.budget.epochs_for_total`)."""
    budget = settings.parsed_budget
    if budget is None or budget.epochs is None:
        return None
    return epochs_for_total(budget.epochs, len(settings.methods), settings.seeds, _every(config))


def comparison_spec(
    settings: CompareSettings,
    label_fraction: float = 1.0,
    epochs: int | None = None,
    dataset: str = DATASET,
    seeds: tuple[int, ...] | None = None,
) -> BenchSpec:
    """The comparison as a bench grid: one data set (the fit arguments, then the validation split, the budget's
    epochs and ``--test=false``, which no ``--config`` among them overrides), the methods as rows, seeds ``0 …
    seeds − 1``, the final epoch's validation top-1 as its metric, CE-tuning (or the simplest method) as the
    baseline. ``dataset`` and ``seeds``: another grid of the same fits (the timing fits: ``TIMING``, seed 0)."""
    own = (f"--data.val_fraction={settings.val_fraction}",)
    if epochs is not None:
        own += (f"--trainer.max_epochs={epochs}",)
    own += ("--test=false",)  # the test split is scored for the chosen method only, by --test at the end
    return BenchSpec(
        name="compare" if dataset == DATASET else f"compare {dataset}",
        output=Path(settings.output),
        datasets={dataset: (*settings.fit_args, *own)},
        objectives=tuple(ObjectiveEntry(m, m) for m in settings.methods),
        label_fractions=(label_fraction,),
        seeds=tuple(range(settings.seeds)) if seeds is None else seeds,
        workers=settings.workers,
        baseline=reference_method(settings.methods),
        metric="val",
    )


def _check_split(settings: CompareSettings, config: dict[str, Any]) -> None:
    """Refuse a validation split too small for ``--min_difference`` (counting image files; none is decoded)."""
    from ..tasks import TASKS

    data = TASKS["classification"].data_class(**{**(config.get("data") or {}), "cache_images": False})
    data.check_folders()
    val, train = data.class_counts("val"), data.class_counts("train")
    check_val_size(val, settings.min_difference, settings.val_fraction, sum(val.values()) + sum(train.values()))


def split_args(args: list[str]) -> tuple[list[str], list[str]]:
    """``coretune compare``'s own options, and the rest: the fit arguments (``--data.root DIR``, ``--config F`` …)."""
    own, fit, i = [], [], 0
    while i < len(args):
        word = args[i]
        name = word[2:].partition("=")[0] if word.startswith("--") else ""
        if word == "-h" or name in _OPTIONS:
            own.append(word)
            if name in _OPTIONS and _OPTIONS[name] and "=" not in word and i + 1 < len(args):
                own.append(args[i + 1])
                i += 1
        else:
            fit.append(word)
        i += 1
    return own, fit


def _parser() -> Any:
    from ..arguments import ArgumentParser

    parser = ArgumentParser(
        allow_abbrev=False,
        prog="coretune compare",
        usage="coretune compare [options] FIT_ARGS ...",
        description="Which fine-tuning method to use on your data: fit each method × seed (coretune fit with "
        "FIT_ARGS, e.g. --data.root DIR --model.weights CKPT, and the method's defaults) on the training set less "
        "a stratified validation split, resumably, then print a paired table on that split (mean ± std, paired "
        "difference to CE-tuning, p-value) and a recommendation: the method ahead beyond noise, or the simplest "
        "of a tie. Writes compare.md and compare.json into --output. The test split is never used to choose; "
        "--test shows the chosen method's test top-1 at the end.",
    )
    parser.add_argument("--methods", type=str, default="ce,ce_mix,core", help="Methods to compare, comma-separated.")
    parser.add_argument("--seeds", type=int, default=3, help="Runs per method, seeds 0 … N−1 (paired by seed).")
    parser.add_argument(
        "--budget",
        type=str | None,
        default=None,
        help="The comparison's training: total epochs shared among the runs (60: each run 60 // (methods × seeds)), "
        "or wall-clock time (2h, 90m, 1h30m): one timing epoch of each method first, then each run the epochs that "
        "fit. Default: each run trains the fit arguments' --trainer.max_epochs.",
    )
    parser.add_argument(
        "--val_fraction", type=float, default=0.2, help="Part of each class of the training set held out to compare on."
    )
    parser.add_argument(
        "--min_difference",
        type=float,
        default=5.0,
        help="The smallest difference of top-1 (points) the comparison must tell apart: a validation split of "
        "fewer than 2/δ² images (800 for 5 points) is refused.",
    )
    parser.add_argument("--output", type=str, default="runs/compare", help="Folder of the runs and results.")
    parser.add_argument("--workers", type=int, default=1, help="Concurrent fits (1 on a 2-core CPU).")
    parser.add_argument("--status", action="store_true", help="List every run: finished (its score), running, or not.")
    parser.add_argument(
        "--test",
        action="store_true",
        help="At the end, score the chosen method's runs (only those) on the test split: coretune test on each run's "
        "final checkpoint. The runs themselves never test.",
    )
    parser.add_argument("--dry_run", action="store_true", help="Print the fit commands of the unfinished runs.")
    return parser


def main(args: list[str]) -> None:
    from rich.console import Console

    own, fit_args = split_args(args)
    cfg = _parser().parse_args(own)
    settings = CompareSettings(
        methods=tuple(m.strip() for m in cfg.methods.split(",") if m.strip()),
        seeds=cfg.seeds,
        val_fraction=cfg.val_fraction,
        min_difference=cfg.min_difference,
        budget=cfg.budget,
        output=Path(cfg.output),
        fit_args=tuple(fit_args),
        workers=cfg.workers,
    )
    settings.check()
    if not any(name.startswith("data.") or name == "config" for name in FitArgs.parse(fit_args).names()):
        raise ValueError("give the data to compare on, e.g. coretune compare --data.root DIR --model.weights CKPT")
    config = _resolved(settings)
    epochs = _epochs(settings, config)
    fraction = float((config.get("data") or {}).get("label_fraction", 1.0))
    console = Console()
    if not cfg.status:
        need("scipy", "coretune compare", "bench")  # the paired t-tests, before any run
        if not cfg.dry_run:
            reads = [("a --config file", path) for path in FitArgs.parse(fit_args).configs()]
            reads.append(("the pre-trained weights", (config.get("model") or {}).get("weights")))
            data = [*FitArgs.parse(fit_args).data_paths(), *data_paths(config.get("data"))]
            check_folder_output(settings.output, "compare", reads=reads, data=data)
        _check_split(settings, config)
    timing: dict[str, Any] | None = None
    if (budget := settings.parsed_budget) is not None and budget.seconds is not None:
        timing = _timing(settings, config, fraction, console, not (cfg.status or cfg.dry_run), cfg.dry_run)
        if timing is None:  # --status or --dry_run before the timing fits have run
            return
        epochs = timing["epochs_per_run"]
    spec = comparison_spec(settings, fraction, epochs)
    if cfg.status:
        print_status(spec, console)
        return
    per_run = epochs or (config.get("trainer") or {}).get("max_epochs")
    console.print(
        f"coretune compare: {', '.join(settings.methods)} × {settings.seeds} seeds, {per_run} epoch(s) each, on a "
        f"{settings.val_fraction:g} validation split of the training set",
        highlight=False,
    )
    try:
        report = run_sweep(spec, workers=settings.workers, dry_run=cfg.dry_run, console=console, command="compare")
    except KeyboardInterrupt:  # a second Ctrl+C
        raise SweepInterrupted(signal.SIGINT, _stopped(signal.SIGINT)) from None
    if cfg.dry_run:
        return
    if report.signum is not None:
        raise SweepInterrupted(report.signum, _stopped(report.signum))
    if report.failed or report.interrupted or report.in_use:
        logs = ", ".join(str(run.run_dir / "log.txt") for run in report.failed)
        raise RuntimeError(
            f"{len(report.failed)} run(s) failed{f' (see {logs})' if logs else ''}, {len(report.interrupted)} "
            f"interrupted, {len(report.in_use)} run by another process: fix the cause and re-run the same command "
            "(finished runs are skipped); `--status` lists them"
        )
    cells = {entry.name: cell for (entry, cell) in _cells(spec)}
    rows = method_rows(cells, spec.baseline)
    choice = recommend(cells)
    test = _test_scores(spec, choice.method, console) if cfg.test else None
    text = _markdown(settings, spec, rows, choice, test, per_run)
    with atomic_write(settings.output / "compare.md") as f:
        f.write(text)
    record = {
        "settings": {
            "methods": list(settings.methods),
            "seeds": settings.seeds,
            "val_fraction": settings.val_fraction,
            "min_difference_pp": settings.min_difference,
            "budget": None if budget is None else budget.text,
            "budget_epochs": None if budget is None else budget.epochs,
            "budget_seconds": None if budget is None else budget.seconds,
            "timing": timing,  # a wall-clock budget: the measured seconds per epoch of each method
            "epochs_per_run": per_run,
            "fit_args": list(settings.fit_args),
        },
        "reference": spec.baseline,
        "rows": [row.as_dict() for row in rows],
        "recommendation": choice.as_dict(),
        "test": test,
    }
    with atomic_write(settings.output / "compare.json") as f:
        f.write(strict_json(record, indent=1) + "\n")
    console.print(text, highlight=False, markup=False, soft_wrap=True)
    console.print(f"wrote {settings.output / 'compare.md'} and {settings.output / 'compare.json'}", highlight=False)


def _stopped(signum: int) -> str:
    return (
        f"comparison stopped by {signal.Signals(signum).name}: the running fits saved a resumable checkpoint. Re-run "
        "the same command to resume: finished runs are skipped"
    )


def _cells(spec: BenchSpec) -> list[tuple[ObjectiveEntry, Cell]]:
    cells, _ = collect_cells(spec)
    fraction = spec.label_fractions[0]
    return [(entry, cells[(entry.name, DATASET, fraction)]) for entry in spec.objectives]


def _timing(
    settings: CompareSettings, config: dict[str, Any], fraction: float, console: Any, run: bool, dry_run: bool = False
) -> dict[str, Any] | None:
    """Under a wall-clock ``--budget``: the measured seconds per epoch of each method and each run's epochs, said in
    one line (the record ``compare.json`` keeps). The timing fits (:func:`_run_timing_fits`) run when ``run``; else
    (``--status``, ``--dry_run``) until they have all finished, their status (their commands: ``dry_run``) is shown
    and None returned."""
    budget = settings.parsed_budget
    assert budget is not None and budget.seconds is not None
    every = _every(config)
    spec = comparison_spec(settings, fraction, every, dataset=TIMING, seeds=(0,))
    if not run and not all(RunDir(r.run_dir).is_finished() for r in spec.runs()):
        if dry_run:
            run_sweep(spec, dry_run=True, console=console, command="compare")
        else:
            print_status(spec, console)
        console.print(
            f"coretune compare: --budget {budget.text} sets each run's epochs once these timing fits ({every} epoch(s) "
            "of each method) have run: run the comparison without --status / --dry_run",
            highlight=False,
        )
        return None
    if run:
        _run_timing_fits(spec, console)
    per_epoch, spent = _measured(spec)
    epochs = epochs_for_time(budget, per_epoch, settings.seeds, every, spent)
    total = spent + epochs * settings.seeds * sum(per_epoch.values())
    measured = ", ".join(f"{method} {seconds:.1f} s/epoch" for method, seconds in per_epoch.items())
    console.print(
        f"coretune compare: --budget {budget.text}: measured {measured} (timing fits: {spent:.0f} s) → {epochs} "
        f"epoch(s) per run, {settings.runs} runs one after another: ~{format_time(total)} in all",
        highlight=False,
    )
    return {
        "seconds_per_epoch": {method: round(seconds, 3) for method, seconds in per_epoch.items()},
        "timing_seconds": round(spent, 2),
        "timing_runs": [str(r.run_dir) for r in spec.runs()],
        "epochs_per_run": epochs,
        "estimated_seconds": round(total, 1),
    }


def _run_timing_fits(spec: BenchSpec, console: Any) -> None:
    """Run the timing fits of ``spec`` (one per method; resumable: finished ones are skipped); RuntimeError (or
    :class:`~.launch.SweepInterrupted`) when they did not all finish."""
    try:
        report = run_sweep(spec, workers=1, console=console, command="compare")
    except KeyboardInterrupt:  # a second Ctrl+C
        raise SweepInterrupted(signal.SIGINT, _stopped(signal.SIGINT)) from None
    if report.signum is not None:
        raise SweepInterrupted(report.signum, _stopped(report.signum))
    if report.failed or report.interrupted or report.in_use or report.diverged:
        logs = ", ".join(str(run.run_dir / "log.txt") for run in [*report.failed, *report.diverged])
        raise RuntimeError(
            f"the timing fits of --budget did not all finish{f' (see {logs})' if logs else ''}: fix the cause and "
            "re-run the same command (finished ones are skipped), or give --budget in epochs"
        )


def _measured(spec: BenchSpec) -> tuple[dict[str, float], float]:
    """Each method's seconds per epoch, measured by its finished timing fit in ``spec``, and the fits' wall time in
    all (:func:`~.budget.measured_epoch_seconds`)."""
    per_epoch, spent = {}, 0.0
    for run in spec.runs():
        per_epoch[run.objective], wall = measured_epoch_seconds(run.run_dir)
        spent += wall
    return per_epoch, spent


def _test_scores(spec: BenchSpec, method: str, console: Any) -> dict[str, Any]:
    """The test top-1 (%) of ``method``'s runs, the chosen method's, scored now, once the choice is made: ``coretune
    test`` on each run's final checkpoint (its ``last.ckpt``, whose validation chose the method), with the data
    options of the run's ``config.yaml`` and its accelerator and precision, into the run's ``test_results.json``.
    No other run is scored."""
    runs = [run for run in spec.runs() if run.objective == method]
    for run in runs:
        if not RunDir(run.run_dir).last_checkpoint.is_file():
            raise ValueError(
                f"--test: {run.label} has no {RunDir(run.run_dir).last_checkpoint} to score (copied without its "
                "checkpoints?): restore it, or run the comparison without --test"
            )
    values = []
    for run in runs:
        files = RunDir(run.run_dir)
        trainer = files.read_config().get("trainer") or {}
        where = [f"--trainer.{key}={trainer[key]}" for key in ("accelerator", "precision") if trainer.get(key)]
        console.print(
            f"coretune compare --test: {run.label}: coretune test on {files.last_checkpoint}", highlight=False
        )
        written = score("test", [f"--ckpt_path={files.last_checkpoint}", f"--config={files.config}", *where])
        values.append(percent(json.loads(written.read_text())["test"].get("top1")))
    scored = [v for v in values if v is not None]
    cell = Cell(method, DATASET, spec.label_fractions[0], tuple(scored))
    return {"method": method, "seeds": [run.seed for run in runs], "test_top1_pct": values, "mean_pct": cell.mean,
            "std_pct": cell.std}  # fmt: skip


def _number(value: float | None, digits: int = 2, sign: bool = False) -> str:
    if value is None or not math.isfinite(value):
        return "–"
    return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def _markdown(
    settings: CompareSettings,
    spec: BenchSpec,
    rows: list[MethodRow],
    choice: Recommendation,
    test: dict[str, Any] | None,
    epochs: Any,
) -> str:
    lines = [
        "# coretune compare",
        "",
        f"Final-epoch validation top-1 (%) on a {settings.val_fraction:g} stratified hold-out of the training set "
        f"(one per seed, shared by the methods), {settings.seeds} seeds, {epochs} epoch(s) per run; differences to "
        f"{spec.baseline} paired by seed, two-sided p-values (paired t-test; sign test where every seed differs "
        "alike).",
        "",
        f"| method | hyper-parameters | val top-1 (%) | − {spec.baseline} (points) | p |",
        "|---|---|---|---|---|",
    ]
    for row in sorted(rows, key=lambda r: simplicity(r.method)):
        hyper = ", ".join(row.hyperparameters) or "none"
        p = _number(row.p, 3) if row.p is not None else "–"
        lines.append(f"| {row.method} | {hyper} | {row.cell.text()} | {_number(row.diff, sign=True)} | {p} |")
    lines += ["", f"**Recommendation**: {choice.text}", ""]
    if test is None:
        lines.append(
            "The test split was not looked at (no run tested): `--test` scores the chosen method's runs on it, once, "
            "at the end."
        )
    else:
        values = ", ".join(_number(v) for v in test["test_top1_pct"])
        lines.append(
            f"Test top-1 of {test['method']} (the chosen method; its runs' final checkpoints, trained on the "
            "training set less the validation split, scored once by coretune test; no other run was tested): "
            f"{_number(test['mean_pct'])} ± {_number(test['std_pct'])} (seeds: {values})."
        )
    return "\n".join(lines) + "\n"
