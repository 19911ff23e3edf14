"""``coretune bench --status``: every run of a spec, finished (its top-1), running or how far it got, and the
fitting left."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..runs.layout import RunDir
from .collect import collect_cells
from .records import RunRecord, format_duration, training_time_left
from .spec import BenchSpec, spec_metric_text

__all__ = ["print_status", "sweep_time_left"]


def sweep_time_left(rows: list[RunRecord], paces: list[RunRecord] | None = None) -> tuple[float, int]:
    """Seconds of fitting the unfinished runs of :func:`collect_cells`' ``rows`` have left, one after another, and
    how many of them the sum covers: a run with a timed epoch at its own recent pace (:func:`training_time_left`;
    all epochs done: 0), one without at the median ``wall_time_s`` of its cell's finished seeds in ``paces``
    (default ``rows``; the whole spec's rows when ``rows`` are a subset's: the same fit but for the seed). A run
    with neither is left out. The paces are those of the machines that ran them."""
    from statistics import median

    def cell(row: dict[str, Any]) -> tuple[str, str, float]:
        return row.dataset, row.objective, row.label_fraction

    finished: dict[tuple[str, str, float], list[float]] = {}
    for row in rows if paces is None else paces:
        if row.status == "finished" and row.wall_time_s is not None:
            finished.setdefault(cell(row), []).append(float(row.wall_time_s))
    total, covered = 0.0, 0
    for row in rows:
        if row.status in ("finished", "diverged", "other_args"):  # neither is fitted again (as it stands)
            continue
        left = None
        if row.status != "missing":
            done, epochs = RunDir(row.run_dir).epochs_done()
            trained = epochs is not None and done >= epochs
            left = 0.0 if trained else training_time_left(row.run_dir, running=row.status == "running")
        if left is None and cell(row) in finished:
            left = median(finished[cell(row)])
        if left is not None:
            total, covered = total + left, covered + 1
    return total, covered


def print_status(spec: BenchSpec, console: Any, whole: BenchSpec | None = None) -> None:
    """A table of every run of ``spec``: finished (top-1, in the spec's metric), how far it got, or not started;
    then the fitting left, timing not-started runs by the finished seeds of ``whole`` (the spec ``spec`` is a
    subset of; default ``spec``)."""
    from rich.table import Table

    _, rows = collect_cells(spec, other_args="list")
    jobs = [
        row.run_dir for row in rows if row.status in ("unfinished", "missing") and RunDir(row.run_dir).job.is_file()
    ]
    if jobs:  # submitted by --launcher submitit
        from .cluster import job_notes

        notes = job_notes(jobs)

        def noted(row: RunRecord) -> RunRecord:
            note = notes.get(row.run_dir)
            if note is None:
                return row
            return replace(row, progress=note if row.progress == "not started" else f"{row.progress}; {note}")

        rows = list(map(noted, rows))
    table = Table("data set", "objective", "labels", "seed", spec_metric_text(spec) + " (%)", "progress")
    for row in rows:
        score = row.top1_pct(spec.metric) if row.status == "finished" else None
        value = "" if score is None else f"{score:.2f}"  # None: not tested (--test false), or undefined
        if value and row.selection and row.selection.startswith("ORACLE"):
            value += " (ORACLE)"  # chosen on the unseen domain
        fraction = f"{100 * row.label_fraction:g}%"
        table.add_row(row.dataset, row.objective, fraction, str(row.seed), value, row.progress)
    states = ("finished", "running", "diverged", "unfinished", "missing", "other_args")
    counts = {s: sum(r.status == s for r in rows) for s in states}
    console.print(table)
    set_aside = f"{counts['diverged']} diverged (not run again), " if counts["diverged"] else ""
    if counts["other_args"]:
        set_aside += (
            f"{counts['other_args']} started with other fit arguments (refused by runs and tables until their folders "
            "are deleted or the output changes), "
        )
    console.print(
        f"{spec.name}: {counts['finished']} of {len(rows)} runs finished, {set_aside}"
        f"{counts['running'] + counts['unfinished']} started ({counts['running']} running now), {counts['missing']} "
        f"not started ({spec.output})",
        highlight=False,
    )
    if unfinished := len(rows) - counts["finished"] - counts["diverged"] - counts["other_args"]:
        paces = None if whole is None else collect_cells(whole, other_args="list")[1]
        left, covered = sweep_time_left(rows, paces)
        runs, their = ("run", "its") if unfinished == 1 else ("runs", "their")
        unknown = f"no timed epoch or finished seed in {their} cell to go by"
        if covered == 0:
            note = f"time left unknown: {unfinished} unfinished {runs} with {unknown}"
        else:
            which = f"the {unfinished}" if covered == unfinished else f"{covered} of the {unfinished}"
            note = (
                f"~{format_duration(left)} of fitting left for {which} unfinished {runs}, one after another (at "
                f"{their} own pace, or {their} cell's finished seeds')"
            )
            if covered < unfinished:
                note += f"; {unfinished - covered} with {unknown}"
        console.print(note, highlight=False)
