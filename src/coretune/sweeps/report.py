"""A sweep's report: the tables of mean ± std top-1 in the layouts of the paper's Tables 1, 2, 4 and 7, the
differences from the baseline row, and the files ``summary.md``, ``summary.csv``, ``runs.csv`` and ``curves.csv``
(with the plots of :mod:`.plots`)."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import numpy as np

from .collect import collect_cells, collect_curves
from .plots import _plot, _plot_curves
from .spec import BenchSpec, TableLayout, spec_metric_text, table_layout
from .stats import Cell, compare

__all__ = ["write_summary"]


_TITLES = {
    "table1": "{metric} (%) of each fine-tuning method (rows) on each data set (columns), as in the paper's Table 1",
    "table2": "{metric} (%) of the ablation rows of the paper's Table 2 (Core-tuning is the last row)",
    "table4": "{metric} (%) of each fine-tuning method (rows) against the fraction of labels used, as in the "
    "paper's table of various numbers of labeled data",
    "table7": "Domain generalization: {metric} (%) on the unseen domain of each leave-one-domain-out split "
    "(columns: the held-out domain), as in the paper's Table 7 (Avg.: each seed's mean over the domains)",
}


def _seed_average(row: list[Cell]) -> Cell:
    """The mean over a row's columns of each seed that finished in every column (Table 7's Avg.), as a cell."""
    by_seed = [dict(zip(cell.seeds, cell.values, strict=True)) for cell in row]
    seeds = [s for s in row[0].seeds if all(s in values for values in by_seed)] if row else []
    averages = tuple(float(np.mean([values[s] for values in by_seed])) for s in seeds)
    return Cell(row[0].objective, "avg", row[0].label_fraction, averages, tuple(seeds))


def _selection_note(spec: BenchSpec) -> list[str]:
    """For runs that record a model-selection rule (domain generalization): which rule chose their checkpoints, an
    oracle said to be one."""
    from ..rundir import RunDir

    rules = {}
    for run in spec.runs():
        selection = (RunDir(run.run_dir).read_results().get("test") or {}).get("selection")
        if isinstance(selection, dict) and "name" in selection:
            rules[selection["name"]] = bool(selection.get("oracle"))
    if not rules:
        return []
    names = ", ".join(sorted(rules))
    oracle = (
        " **ORACLE**: checkpoints scored with the unseen domains' own held-out images, not a fair comparison with "
        "methods that never see them."
        if any(rules.values())
        else ""
    )
    return ["", f"Model selection: {names}.{oracle}"]


def _markdown(spec: BenchSpec, cells: dict[tuple[str, str, float], Cell], layout: TableLayout) -> str:
    cols = [key for key, _ in layout.columns]
    with_avg = len(cols) > 1
    best = {}
    for col in cols:
        means = [cells[(name, *col)].mean for name, _ in layout.rows if cells[(name, *col)].n]
        best[col] = max(means) if means else math.nan
    title = _TITLES[spec.table].format(metric=spec_metric_text(spec))
    header = ["Method", *(label for _, label in layout.columns), *(["Avg."] if with_avg else [])]
    lines = [
        f"# {spec.name}",
        "",
        f"{title}: mean ± sample standard deviation (ddof = 1) over seeds {list(spec.seeds)}; "
        "n = finished runs of the cell; best mean per column in bold.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] + [":-:"] * (len(header) - 1)) + "|",
    ]
    for name, label in layout.rows:
        row = [cells[(name, *col)] for col in cols]
        texts = [
            f"**{c.text()}**" if c.n and c.mean == best[col] else c.text() for c, col in zip(row, cols, strict=True)
        ]
        if with_avg and spec.table == "table7":
            texts.append(_seed_average(row).text())
        elif with_avg:
            texts.append(f"{np.mean([c.mean for c in row]):.2f}" if all(c.n for c in row) else "–")
        lines.append(f"| {label} | " + " | ".join(texts) + " |")
    lines[3:3] = _selection_note(spec)
    lines += _reconstructed_note(cells, layout)
    lines += _significance(spec, cells, layout)
    return "\n".join(lines) + "\n"


def _reconstructed_note(cells: dict[tuple[str, str, float], Cell], layout: TableLayout) -> list[str]:
    """The footnote of the cells marked † (some of their runs' records are reconstructed); nothing without any."""
    labels = dict(layout.rows)
    marked = [
        f"{labels[name]}{f' ({label})' if len(layout.columns) > 1 else ''} seed{'s' * (len(c.reconstructed) > 1)} "
        + ", ".join(map(str, c.reconstructed))
        for col, label in layout.columns
        for name, _ in layout.rows
        if (c := cells[(name, *col)]).reconstructed
    ]
    if not marked:
        return []
    return [
        "",
        "† Includes reconstructed records: "
        + "; ".join(marked)
        + ". Their runs' files were lost; results.json holds the numbers recorded when they finished, marked "
        "`reconstructed` (docs/records/README.md), and no per-class accuracy, loss or configuration.",
    ]


def _significance(spec: BenchSpec, cells: dict[tuple[str, str, float], Cell], layout: TableLayout) -> list[str]:
    labels = dict(layout.rows)
    lines = [
        "",
        f"## Differences from {labels[spec.baseline]}",
        "",
        f"Δ = difference of mean {spec_metric_text(spec)} (percentage points); s_p = pooled sample standard "
        "deviation of the two cells; beyond 2σ when |Δ| > 2 s_p (a rule of thumb, not a hypothesis test; needs "
        "n ≥ 2 in both cells). Paired: the difference on each seed both cells finished (runs with one seed share "
        "the label subset, the heads' initialisation, the batches and the augmentations); t = mean / (std / √n) of "
        "those differences with n − 1 degrees of freedom, two-sided p (few seeds detect only large, consistent "
        "differences).",
        "",
        "| Column | Method | Δ (pp) | 2 s_p (pp) | beyond 2σ | paired Δ per seed (pp) | paired t (p) |",
        "|---|---|:-:|:-:|:-:|:-:|:-:|",
    ]
    for col, col_label in layout.columns:
        base = cells[(spec.baseline, *col)]
        for name, label in layout.rows:
            cell = cells[(name, *col)]
            if name == spec.baseline or not (cell.n and base.n):
                continue
            c = compare(cell, base)
            verdict = "n/a" if c.beyond_two_std is None else ("yes" if c.beyond_two_std else "no")
            two_sp = f"{2 * c.pooled_std:.2f}" if c.beyond_two_std is not None else "–"
            per_seed = " / ".join(f"{d:+.2f}" for d in c.paired) or "–"
            t_test = "–" if math.isnan(c.paired_t) else f"{c.paired_t:.1f} ({c.paired_p:.2g})"
            lines.append(f"| {col_label} | {label} | {c.diff:+.2f} | {two_sp} | {verdict} | {per_seed} | {t_test} |")
    return lines


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _summary_rows(
    spec: BenchSpec, cells: dict[tuple[str, str, float], Cell], layout: TableLayout
) -> list[dict[str, Any]]:
    rows = []
    for name, label in layout.rows:
        row: dict[str, Any] = {"method": label, "objective": name}
        columns = [(cells[(name, *col)], col_label) for col, col_label in layout.columns]
        if spec.table == "table7" and len(columns) > 1:
            columns.append((_seed_average([cell for cell, _ in columns]), "Avg."))
        for cell, col_label in columns:
            row[f"{col_label} mean (%)"] = "" if not cell.n else round(cell.mean, 4)
            row[f"{col_label} std (%)"] = "" if cell.n < 2 else round(cell.std, 4)
            row[f"{col_label} n"] = cell.n
        rows.append(row)
    return rows


def write_summary(spec: BenchSpec) -> tuple[str, list[Path]]:
    """Write ``runs.csv``, ``summary.md``, ``summary.csv``, ``curves.csv`` (:func:`collect_curves`) and the plots
    into ``spec.output``.

    Returns the markdown summary and the written paths.
    """
    cells, runs = collect_cells(spec)
    layout = table_layout(spec)
    spec.output.mkdir(parents=True, exist_ok=True)
    markdown = _markdown(spec, cells, layout)
    paths = [spec.output / "runs.csv", spec.output / "summary.csv", spec.output / "summary.md"]
    _write_csv(paths[0], [run.csv_row(spec.metric) for run in runs])
    _write_csv(paths[1], _summary_rows(spec, cells, layout))
    paths[2].write_text(markdown)
    if any(cell.n for cell in cells.values()):
        paths += _plot(spec, cells, layout)
    if curves := collect_curves(spec):
        paths.append(spec.output / "curves.csv")
        _write_csv(paths[-1], [point.csv_row() for point in curves])
        paths.append(_plot_curves(spec, curves, layout))
    return markdown, paths
