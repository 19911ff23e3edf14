"""``coretune compare``: which fine-tuning method to use on your data, chosen on a validation split of the training
set and never on the test split.

``coretune compare --data.root DATA --model.weights CKPT [--methods ce,ce_mix,core] [--seeds 3] [--budget EPOCHS]``
fits every method × seed with the same launcher as ``coretune bench`` (resumable; one line per run; ``--status``):
each fit holds out a stratified ``--val_fraction`` of the training set (seeded by the run's seed, so that the
methods of one seed share one split and compare paired), and is scored by its final epoch's validation top-1. The
paired table (mean ± std, the paired difference to CE-tuning and its p-value) and the recommendation
(:mod:`.choice`: a method ahead beyond noise, or the simplest of a tie, saying which) go to the console,
``compare.md`` and ``compare.json`` in ``--output``. ``--test`` then shows the chosen method's test top-1, once, at
the end: the test scores of the other methods are never shown (every ``coretune fit`` ends by testing, and records
it in its run folder, as ``coretune tune``'s trials do; nothing here reads them but ``--test``'s).

A comparison is a structured job list, the grid of a bench spec (:class:`~.spec.BenchSpec`: one data set, the
methods, the seeds, ``metric: val``), rendered as ``coretune fit`` command lines only where a process starts. Every
method runs with its documented defaults (``--objective NAME``: its class's defaults and preset) and the fit
arguments given (a ``--config`` file's values); ``--budget E`` shares ``E`` epochs among the runs: each trains
``E // (methods × seeds)`` epochs (a multiple of ``--trainer.check_val_every_n_epoch``). A validation split too small
to tell methods ``--min_difference`` points apart is refused before any run (:func:`~.choice.check_val_size`).
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..extras import need
from ..runs.atomic import atomic_write, strict_json
from ..runs.outputs import check_folder_output, data_paths
from .choice import MethodRow, Recommendation, check_val_size, method_rows, recommend, reference_method, simplicity
from .collect import collect_cells
from .job import FitArgs
from .launch import SweepInterrupted, run_sweep
from .records import run_top1
from .spec import BenchSpec, ObjectiveEntry
from .stats import Cell
from .status import print_status

__all__ = ["CompareSettings", "comparison_spec", "main"]

#: The name of the comparison's one "data set" in its run folders (``<output>/data/<method>/frac<f>/seed<s>``).
DATASET = "data"

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
    fraction, the smallest difference it must tell apart (points), the total epochs (``budget``, None: each run the
    fit arguments' epochs), the output folder and the user's fit arguments."""

    methods: tuple[str, ...]
    seeds: int = 3
    val_fraction: float = 0.2
    min_difference: float = 5.0
    budget: int | None = None
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
        if self.budget is not None and self.budget < 1:
            raise ValueError(f"--budget must be >= 1 epoch (got {self.budget})")
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


def _epochs(settings: CompareSettings, config: dict[str, Any]) -> int | None:
    """Each run's epochs under ``--budget`` (None without one): the budget shared among the runs, rounded down to a
    multiple of the validation interval so that the final epoch is validated."""
    if settings.budget is None:
        return None
    every = (config.get("trainer") or {}).get("check_val_every_n_epoch") or 1
    epochs = settings.budget // settings.runs // every * every
    if epochs < 1:
        need_total = settings.runs * every
        raise ValueError(
            f"--budget {settings.budget} gives each of the {settings.runs} runs ({len(settings.methods)} methods × "
            f"{settings.seeds} seeds) less than {every} epoch(s), the validation interval: give --budget "
            f"{need_total} or more, or fewer --methods or --seeds"
        )
    return epochs


def comparison_spec(settings: CompareSettings, label_fraction: float = 1.0, epochs: int | None = None) -> BenchSpec:
    """The comparison as a bench grid: one data set (the fit arguments, then the validation split and the
    budget's epochs, which no ``--config`` among them overrides), the methods as rows, seeds ``0 … seeds − 1``, the
    final epoch's validation top-1 as its metric, CE-tuning (or the simplest method) as the baseline."""
    own = (f"--data.val_fraction={settings.val_fraction}",)
    if epochs is not None:
        own += (f"--trainer.max_epochs={epochs}",)
    return BenchSpec(
        name="compare",
        output=Path(settings.output),
        datasets={DATASET: (*settings.fit_args, *own)},
        objectives=tuple(ObjectiveEntry(m, m) for m in settings.methods),
        label_fractions=(label_fraction,),
        seeds=tuple(range(settings.seeds)),
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
        type=int | None,
        default=None,
        help="Total training epochs of the comparison, shared among the runs (each: budget // (methods × seeds)). "
        "Default: each run trains the fit arguments' --trainer.max_epochs.",
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
    parser.add_argument("--test", action="store_true", help="At the end, show the chosen method's test top-1.")
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
    spec = comparison_spec(settings, float((config.get("data") or {}).get("label_fraction", 1.0)), epochs)
    console = Console()
    if cfg.status:
        print_status(spec, console)
        return
    need("scipy", "coretune compare", "bench")  # the paired t-tests, before any run
    if not cfg.dry_run:
        reads = [("a --config file", path) for path in FitArgs.parse(fit_args).configs()]
        reads.append(("the pre-trained weights", (config.get("model") or {}).get("weights")))
        data = [*FitArgs.parse(fit_args).data_paths(), *data_paths(config.get("data"))]
        check_folder_output(settings.output, "compare", reads=reads, data=data)
    _check_split(settings, config)
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
    test = _test_scores(spec, choice.method) if cfg.test else None
    text = _markdown(settings, spec, rows, choice, test, per_run)
    with atomic_write(settings.output / "compare.md") as f:
        f.write(text)
    record = {
        "settings": {
            "methods": list(settings.methods),
            "seeds": settings.seeds,
            "val_fraction": settings.val_fraction,
            "min_difference_pp": settings.min_difference,
            "budget_epochs": settings.budget,
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


def _test_scores(spec: BenchSpec, method: str) -> dict[str, Any]:
    """The test top-1 (%) of ``method``'s runs (recorded by their fits; read now, once the choice is made)."""
    runs = [run for run in spec.runs() if run.objective == method]
    values = [run_top1(run.run_dir, "test") for run in runs]
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
            "The test split was not looked at: `--test` shows the chosen method's test top-1, once, at the end."
        )
    else:
        values = ", ".join(_number(v) for v in test["test_top1_pct"])
        lines.append(
            f"Test top-1 of {test['method']} (the chosen method; its runs, trained on the training set less the "
            f"validation split): "
            f"{_number(test['mean_pct'])} ± {_number(test['std_pct'])} (seeds: {values})."
        )
    return "\n".join(lines) + "\n"
