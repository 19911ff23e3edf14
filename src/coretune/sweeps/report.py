"""A sweep's report: the tables of mean ± std top-1 in the layouts of the paper's Tables 1, 2, 4 and 7, and of
several measures per run in those of Tables 6 (segmentation: MPA, FWIoU, MIoU and the per-class IoU) and 8
(adversarial training: clean and robust accuracy), the differences from the baseline row, and the files
``summary.md``, ``summary.csv``, ``runs.csv`` and ``curves.csv`` (with the plots of :mod:`.plots`; Tables 6, 7 and
8 also ``summary.json``)."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..runs.atomic import atomic_write, strict_json
from ..runs.outputs import mark_folder
from .collect import collect_cells, collect_curves
from .measures import (
    ROBUST_RESULTS,
    attack_label,
    collect_measures,
    per_class_iou,
    spec_measures,
    training_domains_heldout,
)
from .plots import plot_bars, plot_curves
from .spec import BenchSpec, TableLayout, measure_layout, spec_metric_text, table_layout
from .stats import Cell, Comparison, compare

__all__ = ["write_summary"]


_TITLES = {
    "table1": "{metric} (%) of each fine-tuning method (rows) on each data set (columns), as in the paper's Table 1",
    "table2": "{metric} (%) of the ablation rows of the paper's Table 2 (Core-tuning is the last row)",
    "table4": "{metric} (%) of each fine-tuning method (rows) against the fraction of labels used, as in the "
    "paper's table of various numbers of labeled data",
    "table5": "Class-imbalanced fine-tuning: test top-1 (%) over all classes and over the many-, medium- and few-shot "
    "classes (each group's mean per-class top-1; the groups by the runs' --data.shot_thresholds; an empty group has "
    "no value), as in the paper's Table 5 (iNaturalist-18)",
    "table6": "Semantic segmentation: mean pixel accuracy (MPA), frequency-weighted IoU (FWIoU) and mean IoU (MIoU) "
    "(%) on the test split, as in the paper's Table 6 (its Appendix D gives standard errors instead: SE = std / √n, "
    "listed in summary.csv and summary.json)",
    "table7": "Domain generalization: {metric} (%) on the unseen domain of each leave-one-domain-out split "
    "(columns: the held-out domain), as in the paper's Table 7 (Avg.: each seed's mean over the domains)",
    "table8": "Adversarial training: clean accuracy and robust accuracy (%) on the test split under each attack and "
    "threat model of the runs' robust_results*.json (coretune eval robust), as in the paper's Table 8",
}

#: Cells keyed by ``(objective, *column key)``: ``(dataset, label_fraction)``, measured layouts ``(…, measure)``.
Cells = dict[tuple[Any, ...], Cell]


def _seed_average(row: list[Cell]) -> Cell:
    """The mean over a row's columns of each seed that finished in every column (Table 7's Avg.), as a cell."""
    by_seed = [dict(zip(cell.seeds, cell.values, strict=True)) for cell in row]
    seeds = [s for s in row[0].seeds if all(s in values for values in by_seed)] if row else []
    averages = tuple(float(np.mean([values[s] for values in by_seed])) for s in seeds)
    rebuilt = tuple(s for s in seeds if any(s in cell.reconstructed for cell in row))
    return Cell(row[0].objective, "avg", row[0].label_fraction, averages, tuple(seeds), rebuilt)


def _selections(spec: BenchSpec) -> dict[str, list[dict[str, Any]]]:
    """Per objective, the ``selection`` entry of each finished run that records one (domain generalization: the
    rule, whether it is an oracle, the checkpoint it tested), with the run's data set and seed."""
    from ..runs.layout import RunDir

    found: dict[str, list[dict[str, Any]]] = {}
    for run in spec.runs():
        selection = (RunDir(run.run_dir).read_results().get("test") or {}).get("selection")
        if isinstance(selection, dict) and "name" in selection:
            found.setdefault(run.objective, []).append({"dataset": run.dataset, "seed": run.seed, **selection})
    return found


def _selection_text(selections: list[dict[str, Any]]) -> str:
    """The rules of some runs' selections, an oracle marked: ``training-domain validation set``,
    ``ORACLE: test-domain validation set (oracle)``."""
    rules = {s["name"]: bool(s.get("oracle")) for s in selections}
    return ", ".join(f"{'ORACLE: ' * oracle}{name}" for name, oracle in sorted(rules.items()))


def _selection_note(spec: BenchSpec) -> list[str]:
    """For runs that record a model-selection rule (domain generalization): which rule chose their checkpoints, the
    checkpoint file it tests and the epochs chosen, an oracle said to be one."""
    selections = [s for runs in _selections(spec).values() for s in runs]
    if not selections:
        return []
    rules: dict[str, tuple[bool, set[str], set[int]]] = {}
    for s in selections:
        oracle, files, epochs = rules.setdefault(s["name"], (bool(s.get("oracle")), set(), set()))
        files.update([s["checkpoint"]] if "checkpoint" in s else [])
        epochs.update([s["epoch"] + 1] if isinstance(s.get("epoch"), int) else [])
    described = []
    for name, (_, files, epochs) in sorted(rules.items()):
        tested = f"tests {', '.join(sorted(files))}" if files else ""
        chosen = f"chosen at epoch{'s' * (len(epochs) > 1)} {', '.join(map(str, sorted(epochs)))}" if epochs else ""
        detail = "; ".join(part for part in (tested, chosen) if part)
        described.append(f"{name}{f' ({detail})' if detail else ''}")
    oracle = (
        " **ORACLE**: each run tests its last checkpoint and is scored with the unseen domains' own held-out images "
        "(DomainBed's test-domain validation); runs compared or chosen by that score are not a fair comparison with "
        "methods that never see them."
        if any(oracle for oracle, _, _ in rules.values())
        else ""
    )
    return ["", f"Model selection: {', '.join(described)}.{oracle}"]


def _markdown(spec: BenchSpec, cells: Cells, layout: TableLayout, extra: list[str]) -> str:
    """The summary: the table, its notes (model selection, reconstructed records), ``extra`` lines (a layout's
    second table) and the differences from the baseline row."""
    cols = [key for key, _ in layout.columns]
    with_avg = len(cols) > 1 and not measure_layout(spec.table)  # no mean of MPA and MIoU, or clean and robust
    title = _TITLES[spec.table].format(metric=spec_metric_text(spec))
    averages = {}
    for name, _ in layout.rows if with_avg else ():
        row = [cells[(name, *col)] for col in cols]
        if spec.table == "table7":
            averages[name] = [_seed_average(row).text()]
        else:
            rebuilt = "†" if any(c.reconstructed for c in row) else ""  # a mean of means resting on such a cell
            averages[name] = [f"{np.mean([c.mean for c in row]):.2f}{rebuilt}" if all(c.n for c in row) else "–"]
    lines = [
        f"# {spec.name}",
        "",
        f"{title}: mean ± sample standard deviation (ddof = 1) over seeds {list(spec.seeds)}; "
        "n = finished runs of the cell; best mean per column in bold.",
        "",
        *_table(cells, layout, "Method", averages, ["Avg."] if with_avg else []),
    ]
    lines[3:3] = _selection_note(spec)
    lines += _reconstructed_note(cells, layout)
    lines += _diverged_note(spec)
    lines += extra
    lines += _significance(spec, cells, layout)
    return "\n".join(lines) + "\n"


def _table(
    cells: Cells, layout: TableLayout, corner: str, tails: dict[str, list[str]] | None = None, tail: Sequence[str] = ()
) -> list[str]:
    """A markdown table of ``layout``'s rows (under ``corner``) and columns, each cell's mean ± std (n), the best
    mean per column in bold (every mean equal to it as shown, to two decimals), then the columns ``tail``
    (``tails``: each row's texts in them)."""
    cols = [key for key, _ in layout.columns]
    header = [corner, *(label for _, label in layout.columns), *tail]
    best = {}
    for col in cols:
        means = [round(cells[(name, *col)].mean, 2) for name, _ in layout.rows if cells[(name, *col)].n]
        best[col] = max(means) if means else math.nan  # as shown: means equal to two decimals are both bold
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + [":-:"] * (len(header) - 1)) + "|"]
    for name, label in layout.rows:
        row = [cells[(name, *col)] for col in cols]
        texts = [
            f"**{c.text()}**" if c.n and round(c.mean, 2) == best[col] else c.text()
            for c, col in zip(row, cols, strict=True)
        ]
        lines.append(f"| {label} | " + " | ".join([*texts, *(tails or {}).get(name, [])]) + " |")
    return lines


def _reconstructed_note(cells: Cells, layout: TableLayout) -> list[str]:
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


def _diverged_note(spec: BenchSpec) -> list[str]:
    """The runs that diverged or collapsed, each with its message: left out of the table (its ``n`` counts finished
    runs), but results, which ``coretune bench`` does not run again; nothing without any."""
    from ..runs.layout import RunDir

    diverged = [
        f"- {run.label}: {message}"
        for run in spec.runs()
        if not RunDir(run.run_dir).is_finished() and (message := RunDir(run.run_dir).divergence()) is not None
    ]
    if not diverged:
        return []
    return [
        "",
        f"✗ {len(diverged)} run(s) diverged or collapsed and are not in the table (n counts finished runs; a lower "
        "learning rate or gradient clipping needs a spec entry under a new name, and after a code change "
        "`coretune bench --retry_diverged` runs them again from the start):",
        *diverged,
    ]


def _comparisons(spec: BenchSpec, cells: Cells, layout: TableLayout) -> list[tuple[str, str, Comparison]]:
    """``(column label, row label, comparison with the baseline row)`` of every finished non-baseline cell, column
    by column; Table 7 adds its Avg. (each seed's mean over the domains, paired by seed like the domains)."""
    columns = [(label, {name: cells[(name, *col)] for name, _ in layout.rows}) for col, label in layout.columns]
    if spec.table == "table7" and len(layout.columns) > 1:
        averages = {name: _seed_average([cells[(name, *col)] for col, _ in layout.columns]) for name, _ in layout.rows}
        columns.append(("Avg.", averages))
    found = []
    for col_label, by_row in columns:
        base = by_row[spec.baseline]
        for name, label in layout.rows:
            if name != spec.baseline and by_row[name].n and base.n:
                found.append((col_label, label, compare(by_row[name], base)))
    return found


def _significance(spec: BenchSpec, cells: Cells, layout: TableLayout) -> list[str]:
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
    marked = False
    for col_label, label, c in _comparisons(spec, cells, layout):
        rebuilt = "†" if c.reconstructed else ""  # the means and the pooled std use every seed of both cells
        on_pair = "†" if set(c.paired_seeds) & set(c.reconstructed) else ""
        marked = marked or bool(rebuilt)
        verdict = "n/a" if c.beyond_two_std is None else ("yes" if c.beyond_two_std else "no")
        two_sp = f"{2 * c.pooled_std:.2f}{rebuilt}" if c.beyond_two_std is not None else "–"
        per_seed = (
            " / ".join(f"{d:+.2f}{'†' * (s in c.reconstructed)}" for d, s in zip(c.paired, c.paired_seeds, strict=True))
            or "–"
        )
        t_test = "–" if math.isnan(c.paired_t) else f"{c.paired_t:.1f} ({c.paired_p:.2g}){on_pair}"
        lines.append(
            f"| {col_label} | {label} | {c.diff:+.2f}{rebuilt} | {two_sp} | {verdict} | {per_seed} | {t_test} |"
        )
    if marked:
        lines += ["", "† Rests, wholly or in part, on reconstructed records (marked † in the table above)."]
    return lines


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with atomic_write(path, newline="") as f:  # whole: another bench of the folder may read or write it
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _summary_rows(spec: BenchSpec, cells: Cells, layout: TableLayout) -> list[dict[str, Any]]:
    selections = _selections(spec)
    rows = []
    for name, label in layout.rows:
        row: dict[str, Any] = {"method": label, "objective": name}
        columns = [(cells[(name, *col)], col_label) for col, col_label in layout.columns]
        if spec.table == "table7" and len(columns) > 1:
            columns.append((_seed_average([cell for cell, _ in columns]), "Avg."))
        for cell, col_label in columns:
            row[f"{col_label} mean (%)"] = "" if not cell.n else round(cell.mean, 4)
            row[f"{col_label} std (%)"] = "" if cell.n < 2 else round(cell.std, 4)
            if spec.table == "table6":  # the paper's Appendix D gives standard errors
                row[f"{col_label} se (%)"] = "" if cell.n < 2 else round(cell.std / math.sqrt(cell.n), 4)
            row[f"{col_label} n"] = cell.n
            # the seeds whose records are reconstructed (summary.md marks their cells †): space-separated, or empty
            row[f"{col_label} reconstructed seeds"] = " ".join(map(str, cell.reconstructed))
        if spec.table == "table7":
            row["selection"] = _selection_text(selections.get(name, []))
        rows.append(row)
    return rows


def _cell_json(cell: Cell) -> dict[str, Any]:
    """A cell for ``summary.json``: mean, sample std, standard error (std / √n), n, and each seed's value (%)."""
    spread = cell.n >= 2
    return {
        "mean": None if not cell.n else cell.mean,
        "std": cell.std if spread else None,
        "se": cell.std / math.sqrt(cell.n) if spread else None,
        "n": cell.n,
        "seeds": list(cell.seeds),
        "values": list(cell.values),
        "reconstructed_seeds": list(cell.reconstructed),
    }


def _summary_json(spec: BenchSpec, cells: Cells, layout: TableLayout, rows: dict[str, dict[str, Any]]) -> str:
    """``summary.json``: per row, every column's cell (:func:`_cell_json`) and the layout's ``rows`` entries; the
    paired differences from the baseline row per column."""
    differences = [
        {
            "column": col_label,
            "method": label,
            "diff_pp": c.diff,
            "paired_pp": list(c.paired),
            "paired_seeds": list(c.paired_seeds),
            "reconstructed_seeds": list(c.reconstructed),  # the tables' †: seeds whose record is reconstructed
            "paired_t": None if math.isnan(c.paired_t) else c.paired_t,
            "paired_p": None if math.isnan(c.paired_p) else c.paired_p,
        }
        for col_label, label, c in _comparisons(spec, cells, layout)
    ]
    summary = {
        "name": spec.name,
        "table": spec.table,
        "values": f"{spec_metric_text(spec)} in % (differences in percentage points)",
        "seeds": list(spec.seeds),
        "baseline": spec.baseline,
        "rows": [
            {
                "method": label,
                "objective": name,
                "columns": {col_label: _cell_json(cells[(name, *col)]) for col, col_label in layout.columns},
                **rows.get(name, {}),
            }
            for name, label in layout.rows
        ],
        "differences": differences,
    }
    return strict_json(summary, indent=1, ensure_ascii=False) + "\n"


def _per_class_section(spec: BenchSpec, layout: TableLayout) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Table 6's second table, the test IoU (%) of each class (rows) per method (columns; per data set and label
    fraction when the spec has several), mean ± std over seeds (n), and per row for summary.json: each class's cell
    per ``"<dataset> <fraction %>"``."""
    per_class = per_class_iou(spec)
    groups = [(dataset, fraction) for dataset in spec.datasets for fraction in spec.label_fractions]
    columns = [(name, label, group) for name, label in layout.rows for group in groups]
    classes = list(dict.fromkeys(c for name, _, group in columns for c in per_class.get((name, *group), {})))
    json_rows: dict[str, dict[str, Any]] = {}
    for name, _, (dataset, fraction) in columns:
        found = per_class.get((name, dataset, fraction), {})
        cells = {c: _cell_json(found[c]) for c in classes if c in found}
        json_rows.setdefault(name, {"per_class_iou": {}})["per_class_iou"][f"{dataset} {100 * fraction:g}%"] = cells
    if not classes:
        return [], json_rows
    header = ["Class"]
    for _, label, (dataset, fraction) in columns:
        header.append(f"{label} ({dataset} {100 * fraction:g}%)" if len(groups) > 1 else label)
    lines = [
        "",
        "## Per-class IoU",
        "",
        "Test IoU (%) of each class (results.json's per_class_iou): mean ± std over seeds (n); a class absent from "
        "a run's test split has no IoU there. MIoU is each run's mean over its classes.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] + [":-:"] * (len(header) - 1)) + "|",
    ]
    for c in classes:
        texts = []
        for name, _, group in columns:
            cell = per_class.get((name, *group), {}).get(c)
            texts.append("–" if cell is None else cell.text())
        lines.append(f"| {c} | " + " | ".join(texts) + " |")
    return lines, json_rows


def _heldout_section(spec: BenchSpec, layout: TableLayout) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Table 7's second table, each split's accuracy on the held-out parts of its training domains (the
    training-domain validation score of the checkpoint each run tested), and per row for summary.json: those cells
    and the runs' selections."""
    cells, found = collect_measures(spec, training_domains_heldout)
    selections = _selections(spec)
    json_rows: dict[str, dict[str, Any]] = {name: {"selection": selections.get(name, [])} for name, _ in layout.rows}
    if not found:
        return [], json_rows
    heldout = TableLayout(layout.rows, [((*col, "heldout"), label) for col, label in layout.columns])
    for name, _ in layout.rows:
        json_rows[name]["training domains held-out"] = {
            label: _cell_json(cells[(name, *col)]) for col, label in heldout.columns
        }
    return [
        "",
        "## Held-out accuracy of the training domains",
        "",
        "Top-1 (%) on the held-out 20% of each split's training domains (columns: the split's unseen domain), mean "
        "over those domains: the in-domain accuracy of the checkpoint each run tested (its training-domain "
        "validation score). Mean ± std over seeds (n).",
        "",
        *_table(cells, heldout, "Method"),
    ], json_rows


def _robust_note(spec: BenchSpec) -> list[str]:
    """Table 8's notes: the test images each attack scored, and the finished runs without robust results."""
    from ..runs.layout import RunDir

    images: dict[str, set[int]] = {}
    unscored = []
    for run in spec.runs():
        if not RunDir(run.run_dir).is_finished():
            continue
        files = sorted(run.run_dir.glob(ROBUST_RESULTS))
        if not files:
            unscored.append(run.label)
        for path in files:
            for report in json.loads(path.read_text())["reports"]:
                images.setdefault(attack_label(report), set()).add(report["num_images"])
    lines = ["", "Robust accuracy counts an image robust when it is classified correctly both clean and attacked."]
    if images:
        counts = "; ".join(f"{a}: {', '.join(map(str, sorted(n)))}" for a, n in sorted(images.items()))
        lines[-1] += f" Test images scored per attack: {counts} (clean: the report on the most images)."
    if unscored:
        lines[-1] += (
            f" {len(unscored)} finished run(s) have no robust_results*.json yet ({', '.join(unscored)}): score them "
            "with `python benchmarks/robust_table.py evaluate SPEC` (coretune eval robust per run)."
        )
    return lines


def write_summary(spec: BenchSpec) -> tuple[str, list[Path]]:
    """Write ``runs.csv``, ``summary.md``, ``summary.csv``, ``curves.csv`` (:func:`collect_curves`) and the plots
    into ``spec.output``; for Tables 6, 7 and 8 also ``summary.json`` (every cell's seeds and values, its standard
    error, the paired differences, and the layout's second table: per-class IoU, the training domains' held-out
    accuracy and each run's model selection).

    Returns the markdown summary and the written paths.
    """
    cells: Cells
    cells, runs = collect_cells(spec)  # type: ignore[assignment]
    measures: list[tuple[str, str]] = []
    if measure_layout(spec.table):
        cells, measures = collect_measures(spec, *spec_measures(spec.table))  # type: ignore[assignment]
    layout = table_layout(spec, measures)
    extra, json_rows = {
        "table6": lambda: _per_class_section(spec, layout),
        "table7": lambda: _heldout_section(spec, layout),
        "table8": lambda: (_robust_note(spec), {}),
    }.get(spec.table, lambda: ([], {}))()
    mark_folder(spec.output, "bench")
    markdown = _markdown(spec, cells, layout, extra)
    paths = [spec.output / "runs.csv", spec.output / "summary.csv", spec.output / "summary.md"]
    _write_csv(paths[0], [run.csv_row(spec.metric, selection=spec.table == "table7") for run in runs])
    _write_csv(paths[1], _summary_rows(spec, cells, layout))
    with atomic_write(paths[2]) as f:
        f.write(markdown)
    if spec.table in ("table6", "table7", "table8"):
        paths.append(spec.output / "summary.json")
        with atomic_write(paths[-1]) as f:
            f.write(_summary_json(spec, cells, layout, json_rows))
    if any(cell.n for cell in cells.values()):
        oracle = any(s.get("oracle") for runs in _selections(spec).values() for s in runs)
        paths += plot_bars(spec, cells, layout, " (ORACLE model selection)" if oracle else "")
    if curves := collect_curves(spec):
        paths.append(spec.output / "curves.csv")
        _write_csv(paths[-1], [point.csv_row() for point in curves])
        paths.append(plot_curves(spec, curves, layout))
    return markdown, paths
