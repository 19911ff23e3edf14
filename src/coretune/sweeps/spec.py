"""A sweep's spec: the grid of ``coretune fit`` runs a ``coretune bench`` YAML file describes, read and checked.

:class:`BenchSpec` lists the runs (:class:`Run`: data set × objective × label fraction × seed, with its fit
arguments and run directory); ``metric: val`` specs also need each run's fit configuration to hold out a validation
split and validate its final epoch (:func:`check_val_split`, :func:`unvalidated_final_epoch`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, get_args

import yaml

from .job import FitArgs, FitJob

__all__ = [
    "BenchSpec",
    "BenchSpecError",
    "Layout",
    "Metric",
    "ObjectiveEntry",
    "Run",
    "TableLayout",
    "check_val_split",
    "measure_layout",
    "metric_text",
    "spec_metric_text",
    "table_layout",
    "unvalidated_final_epoch",
]


Layout = Literal["table1", "table2", "table4", "table5", "table6", "table7", "table8"]


#: Table 7's row labels (domain generalization: CE, CE-Con and Core-tuning, the paper's "ours").
TABLE7_LABELS = {"ce": "CE", "ce_con": "CE-Con", "core": "Core-tuning"}

#: Table 6's row labels (segmentation: CE-tuning and Core-tuning).
TABLE6_LABELS = {"ce": "CE-tuning", "core": "Core-tuning"}

#: The layouts whose columns are several test measures of each run (Table 5, class-imbalanced data: top-1 overall and
#: of the many/medium/few-shot classes; Table 6: MPA, FWIoU and MIoU; Table 8: clean
#: and robust accuracy per attack and threat model) instead of one score per data set and label fraction, and what
#: their cells hold.
_MEASURE_TEXT = {
    "table5": "test top-1 (the column's: all classes, or the mean top-1 of the many-, medium- or few-shot classes)",
    "table6": "test score (the column's MPA, FWIoU or MIoU)",
    "table8": "test accuracy (the column's: clean, or robust under an attack and threat model)",
}


def measure_layout(table: str) -> bool:
    """Whether a layout's columns are several measures of each run (``table5``, ``table6``, ``table8``)."""
    return table in _MEASURE_TEXT


Metric = Literal["test", "val"]


_METRIC_TEXT = {"test": "test top-1", "val": "final-epoch validation top-1"}


def metric_text(metric: Metric, fit_args: Sequence[str] = ()) -> str:
    """What a sweep's ``metric`` tabulates for runs with these fit arguments: ``test top-1``, or the score of their
    task (``test MIoU`` for ``--task segmentation`` or a segmentation ``--config``)."""
    from ..engine.fitargs import task_of_args
    from ..tasks import DEFAULT_TASK, TASKS

    try:
        task = TASKS.get(task_of_args(fit_args), TASKS[DEFAULT_TASK])
    except ValueError:  # the fit itself refuses such arguments
        task = TASKS[DEFAULT_TASK]
    return _METRIC_TEXT[metric].replace("top-1", task.monitor_label)


def spec_metric_text(spec: BenchSpec) -> str:
    """What a spec's cells hold: :func:`metric_text` of its runs (its first run's arguments: the task is the spec's
    base arguments'), or for a layout of several measures (:func:`measure_layout`) what its columns measure."""
    if spec.table in _MEASURE_TEXT:
        return _MEASURE_TEXT[spec.table]
    runs = spec.runs()
    return metric_text(spec.metric, runs[0].job.argv() if runs else ())


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


class BenchSpecError(ValueError):
    """A bench spec (YAML) with a missing, unknown or invalid entry."""


def check_val_split(config: dict[str, Any], run: str, results: dict[str, Any] | None = None) -> None:
    """Refuse (``metric: val``) a run that validates on its test split: a finished run's ``results`` say so
    (``validated_on_test_images``); before it runs, its resolved fit ``config`` must hold out part of the training
    set (the task's holdout option > 0: ``data.val_fraction``, ``data.holdout_fraction`` for domain
    generalization) or name data with a validation split of its own (``val/`` beside ``test/``, ``val.txt`` beside
    ``test.txt``; the data module's ``separate_validation``, reading no image)."""
    from ..tasks import DEFAULT_TASK, TASKS

    task = TASKS.get((config.get("model") or {}).get("task") or DEFAULT_TASK, TASKS[DEFAULT_TASK])
    option = task.validation_holdout
    data = config.get("data") or {}
    if results is not None and results.get("validated_on_test_images") is not None:
        separate = not results["validated_on_test_images"]
    elif float(data.get(option) or 0) > 0:
        return
    else:
        try:
            separate = bool(data) and task.data_class(**data).separate_validation()
        except (ValueError, OSError, TypeError):  # data not here (records of another machine) or not readable
            separate = False
    if not separate:
        raise BenchSpecError(
            f"metric 'val' needs a validation split other than the test split, but {run} validates on its test "
            f"split (data.{option} is not > 0 and the data has no validation split of its own): add "
            f"--data.{option}=0.2 to the spec's base_args (with a new output folder if runs finished without it), or "
            "use metric 'test'"
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


@dataclass(frozen=True)
class ObjectiveEntry:
    """A table row: ``name`` (row label and folder name), the ``--objective`` value and extra fit ``args``."""

    name: str
    objective: str
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Run:
    """One cell × seed of the grid (``objective``: the row's name) and its fit (:class:`~.job.FitJob`: its run
    directory and arguments)."""

    dataset: str
    objective: str
    label_fraction: float
    seed: int
    job: FitJob

    @property
    def run_dir(self) -> Path:
        return self.job.run_dir

    @property
    def args(self) -> tuple[str, ...]:
        """The fit arguments (without ``--run_dir``), as ``fit_args.json`` records them: :meth:`FitJob.argv`."""
        return tuple(self.job.argv())

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
        seeds = _parse_numbers(_check_seeds(raw.get("seeds", [0]), fail), int, "seeds", fail)
        workers = raw.get("workers", 1)
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise fail(f"workers must be an integer >= 1 (got {workers!r})")
        metric = raw.get("metric", "test")
        if metric not in get_args(Metric):
            raise fail(f"metric must be one of {', '.join(get_args(Metric))} (got {metric!r})")
        if metric != "test" and measure_layout(table):
            raise fail(
                f"{table} tabulates measures of the test split ({_MEASURE_TEXT[table]}); metric {metric!r} does not "
                "apply: drop it, or use table1 for the final epoch's validation score"
            )
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
                        job = FitJob(
                            run_dir=self.output / dataset / entry.name / f"frac{fraction:g}" / f"seed{seed}",
                            objective=entry.objective,
                            seed=seed,
                            fit_args=FitArgs.parse((*self.base_args, *dataset_args)),
                            objective_args=FitArgs.parse(entry.args),
                            data=(("label_fraction", fraction),),
                        )
                        runs.append(Run(dataset, entry.name, fraction, seed, job))
        return runs

    def compared_with(self, baseline: str) -> BenchSpec:
        """The same grid whose tables compare every row with ``baseline`` (one of its objective names)."""
        names = [e.name for e in self.objectives]
        if baseline not in names:
            raise BenchSpecError(f"--baseline {baseline!r} is not a row of the spec {self.name!r} ({', '.join(names)})")
        return replace(self, baseline=baseline)

    def subset(
        self,
        objectives: Sequence[str] | None = None,
        seeds: Sequence[int] | None = None,
        datasets: Sequence[str] | None = None,
    ) -> BenchSpec:
        """The same grid restricted to some objective names, seeds and data sets (e.g. the main comparison's seeds
        first, or the columns whose checkpoint is on this machine)."""
        names = [e.name for e in self.objectives]
        unknown = (
            sorted(set(objectives or ()) - set(names))
            + sorted(set(seeds or ()) - set(self.seeds))
            + sorted(set(datasets or ()) - set(self.datasets))
        )
        if unknown:
            raise BenchSpecError(
                f"{', '.join(map(str, unknown))} not in the spec {self.name!r} (objectives: {', '.join(names)}; "
                f"seeds: {', '.join(map(str, self.seeds))}; datasets: {', '.join(self.datasets)})"
            )
        return replace(
            self,
            objectives=tuple(e for e in self.objectives if objectives is None or e.name in objectives),
            seeds=tuple(s for s in self.seeds if seeds is None or s in seeds),
            datasets={k: v for k, v in self.datasets.items() if datasets is None or k in datasets},
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


def _check_seeds(value: Any, fail: Any) -> Any:
    """``value`` when each of its seeds (or it, one seed) is an integer; a float (``1.9``, which ``int`` truncated
    to seed 1) or a bool is refused."""
    for seed in value if isinstance(value, list) else [value]:
        if isinstance(seed, bool | float):
            raise fail(f"seeds must be integers, e.g. [0, 1, 2]; {seed!r} is not (got {value!r})")
    return value


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
    from ..objectives import TABLE2_ROWS, available

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


@dataclass(frozen=True)
class TableLayout:
    """Rows (objective names and labels) and columns (``(dataset, label_fraction)`` and labels) of a summary."""

    rows: list[tuple[str, str]]
    columns: list[tuple[tuple[Any, ...], str]]  # (dataset, label_fraction) or, measured, (…, measure key)


def table_layout(spec: BenchSpec, measures: Sequence[tuple[str, str]] = ()) -> TableLayout:
    """Table 1: methods × data sets; Table 2: the ablation rows (paper order and labels) × data sets; Table 4:
    methods × label fractions; Table 7 (domain generalization): methods (CE, CE-Con, Core-tuning) × held-out domains
    (one "data set" of the spec per leave-one-domain-out split); Tables 5, 6 and 8 (:func:`measure_layout`): methods ×
    ``measures`` (``(key, label)``; columns keyed ``(dataset, label_fraction, key)``). A dimension with several
    values that the layout does not name joins the columns."""
    from ..objectives import TABLE2_ROWS

    labels = {
        "table2": {name: label for label, name in TABLE2_ROWS},
        "table6": TABLE6_LABELS,
        "table7": TABLE7_LABELS,
    }.get(spec.table, {})
    rows = [(e.name, labels.get(e.name, e.name)) for e in spec.objectives]
    measured = measure_layout(spec.table)
    show_dataset = (spec.table != "table4" and not measured) or len(spec.datasets) > 1
    show_fraction = spec.table == "table4" or len(spec.label_fractions) > 1
    columns: list[tuple[tuple[Any, ...], str]] = []
    for dataset in spec.datasets:
        for fraction in spec.label_fractions:
            parts = [dataset] if show_dataset else []
            parts += [f"{100 * fraction:g}%"] if show_fraction else []
            if not measured:
                columns.append(((dataset, fraction), " ".join(parts)))
            columns += [((dataset, fraction, key), " ".join([*parts, label])) for key, label in measures]
    return TableLayout(rows, columns)
