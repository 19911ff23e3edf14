"""Collecting a sweep's runs: finished runs into cells (:class:`~.stats.Cell`) and one row per run, and their
validated top-1 per epoch into curves."""

from __future__ import annotations

import csv
from dataclasses import dataclass, fields
from typing import Any, Literal

import numpy as np

from ..runs.layout import RunDir
from .records import OtherFitArgs, RunRecord, check_run_args, run_progress, run_score_name, run_top1
from .spec import BenchSpec, BenchSpecError, Run
from .stats import Cell

__all__ = ["CurvePoint", "ValidatedOn", "collect_cells", "collect_curves", "validated_on_of"]

ValidatedOn = Literal["test", "val", "mixed"]
"""What a cell's runs validated on: the test images (no validation split), a validation split, or both."""


@dataclass(frozen=True)
class CurvePoint:
    """A cell's validated top-1 at one epoch (counted from 1), mean and sample std (%) over its ``n`` seeds, and the
    paired difference from the ``baseline`` row over ``delta_n`` seeds (percentage points); ``None`` where there is
    nothing to average (a std of one value, the baseline row's own difference, no validation record). A row of
    ``curves.csv`` once written (:meth:`csv_row`)."""

    dataset: str
    objective: str
    label_fraction: float
    epoch: int
    n: int
    val_top1_mean_pct: float | None
    val_top1_std_pct: float | None
    validated_on: ValidatedOn | None
    baseline: str
    delta_n: int | None
    delta_mean_pp: float | None
    delta_std_pp: float | None

    def csv_row(self) -> dict[str, Any]:
        """The ``curves.csv`` row: blank where a value is missing."""
        return {f.name: "" if (value := getattr(self, f.name)) is None else value for f in fields(self)}


def collect_cells(
    spec: BenchSpec, other_args: Literal["refuse", "list"] = "refuse"
) -> tuple[dict[tuple[str, str, float], Cell], list[RunRecord]]:
    """Cells keyed by ``(objective, dataset, label_fraction)`` and the record of each run (``runs.csv``).

    A run directory started with other fit arguments than the spec's is refused (:func:`check_run_args`: a table
    must not mix settings), or with ``other_args="list"`` (``--status``) listed as ``other_args`` and left out of
    the cells."""
    values: dict[tuple[str, str, float], list[float]] = {}
    seeds: dict[tuple[str, str, float], list[int]] = {}
    rebuilt: dict[tuple[str, str, float], list[int]] = {}  # seeds of reconstructed records
    rows = []
    datasets, names = list(spec.datasets), [e.name for e in spec.objectives]

    def position(run: Run) -> tuple[int, int, float, int]:
        return datasets.index(run.dataset), names.index(run.objective), run.label_fraction, run.seed

    started_from: dict[str, dict[str, list[str]]] = {}  # --model.weights → SHA-256 of the file → runs

    for run in sorted(spec.runs(), key=position):
        key = (run.objective, run.dataset, run.label_fraction)
        values.setdefault(key, [])
        seeds.setdefault(key, [])
        files = RunDir(run.run_dir)
        try:
            check_run_args(run.job)
        except OtherFitArgs:
            if other_args == "refuse":
                raise
            what = (
                "other fit arguments, running now (another sweep's)"
                if files.live_claim() is not None
                else "other fit arguments: delete the folder to redo it"
            )
            rows.append(RunRecord(
                run.dataset, run.objective, run.label_fraction, run.seed, "other_args", what,
                None, None, None, None, None, None, run.run_dir,
            ))  # fmt: skip
            continue
        results = files.read_results()
        test = results.get("test") or {}
        skipped = results.get("test_skipped") if results.get("test") is None else None  # coretune fit --test false
        done = bool(test) or bool(skipped)
        if done:
            status = "finished"
        elif files.live_claim() is not None:
            status = "running"
        elif files.divergence() is not None:
            status = "diverged"
        else:
            status = "unfinished" if run.run_dir.is_dir() else "missing"
        progress = f"{results.get('epochs', '')} epochs" if done else run_progress(run.run_dir)
        progress += ", not tested (--test false)" if skipped else ""
        top1 = run_top1(run.run_dir, spec.metric) if done else None
        reconstructed = bool(results.get("reconstructed"))
        if (
            top1 is not None
            and (weights := run.job.options().value("model.weights"))
            and (digest := results.get("weights_sha256"))
        ):
            started_from.setdefault(weights, {}).setdefault(digest, []).append(run.label)
        if top1 is not None:
            values[key].append(top1)
            seeds[key].append(run.seed)
            if reconstructed:
                rebuilt.setdefault(key, []).append(run.seed)
        rows.append(
            RunRecord(
                dataset=run.dataset,
                objective=run.objective,
                label_fraction=run.label_fraction,
                seed=run.seed,
                status=status,
                progress=progress,
                # the task's score (MIoU …); None where undefined (a test split without a pixel to score)
                test_top1_pct=round(score, 4) if test and (score := run_top1(run.run_dir)) is not None else None,
                test_top5_pct=round(100 * test["top5"], 4) if test.get("top5") is not None else None,
                val_top1_pct=None if top1 is None or spec.metric != "val" else round(top1, 4),
                epochs=results.get("epochs"),
                wall_time_s=results.get("wall_time_s"),
                cpu_time_s=results.get("cpu_time_s"),
                train_images_per_s=results.get("train_images_per_s"),
                run_dir=run.run_dir,
                reconstructed=reconstructed,
                selection=_selection_text(test.get("selection")),
            )
        )
    if other_args == "refuse":
        _check_one_file_per_weights(started_from)
    cells = {key: Cell(*key, tuple(v), tuple(seeds[key]), tuple(rebuilt.get(key, ()))) for key, v in values.items()}
    return cells, rows


def _check_one_file_per_weights(started_from: dict[str, dict[str, list[str]]]) -> None:
    """Refuse a table whose finished runs name one ``--model.weights`` path but recorded different files there
    (``results.json``'s ``weights_sha256``): the file was re-made or replaced between runs, so the runs side by side
    (and the paired differences) did not start from one checkpoint."""
    for weights, digests in started_from.items():
        if len(digests) > 1:
            found = "; ".join(f"{digest[:12]}… for {', '.join(runs[:3])}" for digest, runs in digests.items())
            raise BenchSpecError(
                f"the runs that name --model.weights {weights} started from {len(digests)} different files ({found}): "
                "the file was replaced between runs. Move the runs of the other file aside and run them again from "
                "one file"
            )


def _selection_text(selection: Any) -> str | None:
    """A run's model-selection rule as runs.csv and ``--status`` show it: its name, ``ORACLE: `` before an oracle's."""
    if not isinstance(selection, dict) or "name" not in selection:
        return None
    return f"{'ORACLE: ' if selection.get('oracle') else ''}{selection['name']}"


def collect_curves(spec: BenchSpec) -> list[CurvePoint]:
    """The validated top-1 (the runs' task's score: MIoU for segmentation) per epoch of every cell: mean and sample
    std (%) over its finished seeds that validated that epoch (``val/top1`` in each run's ``metrics.csv``:
    the validation split, or the test images for runs that hold none out), and the paired difference from the
    spec's baseline row in the same column: ``v − v_baseline`` on each seed both finished and validated at
    that epoch, mean and sample std (percentage points) and the number of pairs (None for the baseline row
    and without pairs). One row per (data set, objective, label fraction, epoch), epochs counted from 1.
    ``validated_on`` says what the cell's runs validated on (``results.json``'s
    ``validated_on_test_images``): ``test`` (no validation split: the test images), ``val`` (a validation
    split), ``mixed``, or None when no run records it."""
    per_run: dict[tuple[str, str, float], dict[int, dict[int, float]]] = {}  # cell → seed → epoch → top-1 (%)
    sources: dict[tuple[str, str, float], set[str]] = {}  # cell → what its runs validated on
    for run in spec.runs():
        files = RunDir(run.run_dir)
        if not files.is_finished() or not (metrics := files.metrics).is_file():
            continue
        key = (run.dataset, run.objective, run.label_fraction)
        on_test = files.read_results().get("validated_on_test_images")
        sources.setdefault(key, set()).update([] if on_test is None else ["test" if on_test else "val"])
        curve = per_run.setdefault(key, {}).setdefault(run.seed, {})
        score = f"val/{run_score_name(run.run_dir)}"  # val/top1 for classification
        with metrics.open(newline="") as f:
            for row in csv.DictReader(f):
                if row.get(score) not in (None, ""):
                    curve[int(row["epoch"]) + 1] = 100 * float(row[score])

    def mean_std(values: list[float]) -> tuple[float | None, float | None]:
        if not values:
            return None, None
        std = round(float(np.std(values, ddof=1)), 4) if len(values) > 1 else None
        return round(float(np.mean(values)), 4), std

    rows = []
    datasets, names = list(spec.datasets), [e.name for e in spec.objectives]
    for (dataset, objective, fraction), seeds in sorted(
        per_run.items(), key=lambda item: (datasets.index(item[0][0]), names.index(item[0][1]), item[0][2])
    ):
        base = {} if objective == spec.baseline else per_run.get((dataset, spec.baseline, fraction), {})
        for epoch in sorted({e for curve in seeds.values() for e in curve}):
            values = [curve[epoch] for curve in seeds.values() if epoch in curve]
            deltas = [c[epoch] - base[s][epoch] for s, c in seeds.items() if epoch in c and epoch in base.get(s, {})]
            mean, std = mean_std(values)
            delta_mean, delta_std = mean_std(deltas)
            rows.append(
                CurvePoint(
                    dataset=dataset,
                    objective=objective,
                    label_fraction=fraction,
                    epoch=epoch,
                    n=len(values),
                    val_top1_mean_pct=mean,
                    val_top1_std_pct=std,
                    validated_on=validated_on_of(sources[(dataset, objective, fraction)]),
                    baseline=spec.baseline,
                    delta_n=len(deltas) if deltas else None,
                    delta_mean_pp=delta_mean,
                    delta_std_pp=delta_std,
                )
            )
    return rows


def validated_on_of(sources: set[str]) -> ValidatedOn | None:
    """``test``, ``val``, ``mixed`` or None (none known) for the set of what some runs validated on."""
    return "mixed" if len(sources) > 1 else next(iter(sources), None)
