"""A sweep's plots: ``bars.png`` (mean ± std per cell), ``label_fraction.png`` and ``curves.png`` (validated top-1
per epoch, and the paired difference from the baseline row)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from ..extras import need
from .collect import CurvePoint, validated_on_of
from .spec import BenchSpec, TableLayout, measure_layout, spec_metric_text
from .stats import Cell

__all__ = ["curves_metric", "plot_bars", "plot_curves"]

#: The bars' axis of the layouts of several measures (the columns say which).
_MEASURE_AXIS = {"table5": "test top-1", "table6": "test score", "table8": "test accuracy"}


def curves_metric(curves: list[CurvePoint]) -> str:
    """What the curves of :func:`collect_curves` show, for the plot's axes: the test top-1 when every run that records
    it validated on the test images, the validation top-1 when every such run validated on a split of the training
    set, a generic label when they differ or none records it."""
    texts = {"test": "test top-1 (no validation split)", "val": "validation top-1"}
    validated_on = validated_on_of({r.validated_on for r in curves} - {None})
    return texts.get(validated_on, "validated top-1 (validation split or test images)")


def _plot_label(label: str) -> str:
    """A table row's label for matplotlib: ``L_con`` and ``L^f_con`` as mathtext (``ℒ_con``, ``ℒ^f_con``)."""
    return label.replace("L^f_con", r"$\mathcal{L}^f_{con}$").replace("L_con", r"$\mathcal{L}_{con}$")


#: The footnote of a figure with a bar or point marked †, as summary.md's.
_RECONSTRUCTED = "† includes reconstructed records (the run's numbers without its files; see summary.md)"


def plot_bars(
    spec: BenchSpec, cells: dict[tuple[Any, ...], Cell], layout: TableLayout, title_note: str = ""
) -> list[Path]:
    """``bars.png`` (the table's cells, mean ± std, grouped by column; ``title_note`` follows the title, e.g. an
    oracle's mark) and, with several label fractions, ``label_fraction.png``. A cell of one seed has no error bar
    (its std is unknown, not 0), and its bar is marked ``n=1``; a bar or point resting on reconstructed records is
    marked †, with a footnote (as in summary.md)."""
    matplotlib = need("matplotlib", "a report's figures", "bench")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def stats(name: str, col: tuple[Any, ...]) -> tuple[float, float]:
        cell = cells[(name, *col)]
        return cell.mean, cell.std  # std NaN below two seeds: no error bar

    paths = []
    cols = [key for key, _ in layout.columns]
    x = np.arange(len(cols))
    width = 0.8 / len(layout.rows)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.0 + 0.35 * len(cols) * len(layout.rows)), 4.5))
    lows = []
    for i, (name, label) in enumerate(layout.rows):
        means, stds = zip(*(stats(name, col) for col in cols), strict=True)
        lows += [m if math.isnan(s) else m - s for m, s in zip(means, stds, strict=True) if not math.isnan(m)]
        offset = (i - (len(layout.rows) - 1) / 2) * width
        ax.bar(x + offset, means, width, yerr=stds, capsize=3, label=_plot_label(label))
        for position, col, mean, std in zip(x + offset, cols, means, stds, strict=True):
            cell = cells[(name, *col)]
            mark = " ".join(["n=1"] * (cell.n == 1) + ["†"] * bool(cell.reconstructed))
            if mark:  # above the error bar, where there is one
                ax.text(position, mean if math.isnan(std) else mean + std, mark, ha="center", va="bottom", fontsize=7)
    if lows:
        ax.set_ylim(bottom=max(0.0, 5 * math.floor(min(lows) / 5) - 5))
    measured = measure_layout(spec.table)  # long column labels (attack and threat model), a long metric text
    ax.set_xticks(
        x, [label for _, label in layout.columns], rotation=20 if measured else 0, ha="right" if measured else "center"
    )
    ylabel = _MEASURE_AXIS.get(spec.table, spec_metric_text(spec))
    ax.set(ylabel=f"{ylabel} (%)", title=f"{spec.name}: mean ± std over seeds{title_note}")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over them
    if any(cell.reconstructed for cell in cells.values()):  # below the (rotated, for measures) column labels
        ax.text(0.0, -0.3 if measured else -0.12, _RECONSTRUCTED, transform=ax.transAxes, fontsize=7, va="top")
    paths.append(spec.output / "bars.png")
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)

    if len(spec.label_fractions) > 1 and not measure_layout(spec.table):  # Tables 6 and 8: the bars show it all
        fractions = sorted(spec.label_fractions)
        fig, axes = plt.subplots(1, len(spec.datasets), figsize=(5 * len(spec.datasets), 4), squeeze=False)
        for ax, dataset in zip(axes[0], spec.datasets, strict=True):
            for name, label in layout.rows:
                means, stds = zip(*(stats(name, (dataset, f)) for f in fractions), strict=True)
                percent = [100 * f for f in fractions]
                ax.errorbar(percent, means, yerr=stds, marker="o", capsize=3, label=_plot_label(label))
                for p, m, f in zip(percent, means, fractions, strict=True):
                    if cells[(name, dataset, f)].reconstructed:
                        ax.text(p, m, "†", ha="left", va="bottom", fontsize=8)
            ax.set(xlabel="labels used (%)", ylabel=f"{spec_metric_text(spec)} (%)", title=dataset)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        if any(cell.reconstructed for cell in cells.values()):
            fig.text(0.01, -0.02, _RECONSTRUCTED, fontsize=7, va="top")
        paths.append(spec.output / "label_fraction.png")
        fig.savefig(paths[-1], dpi=110, bbox_inches="tight")  # the footnote sits below the axes
        plt.close(fig)
    return paths


def plot_curves(spec: BenchSpec, curves: list[CurvePoint], layout: TableLayout) -> Path:
    """``curves.png``: validated top-1 against epoch, mean ± std band over seeds, one panel per table column; below,
    when any row shares seeds with the baseline, the paired difference from the baseline row (mean ± std band over
    the shared seeds), which separates rows whose curves overlap."""
    matplotlib = need("matplotlib", "a report's figures", "bench")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = [
        (col, label) for col, label in layout.columns if any((r.dataset, r.label_fraction) == col for r in curves)
    ]
    if not columns:  # a layout whose columns are measures (table6, table8): one panel per data set and fraction
        cols = list(dict.fromkeys((r.dataset, r.label_fraction) for r in curves))
        columns = [(col, col[0] if len(cols) == 1 else f"{col[0]} {col[1]:g}") for col in cols]
    with_deltas = any(r.delta_n is not None for r in curves)
    panels = 2 if with_deltas else 1
    fig, axes = plt.subplots(panels, len(columns), figsize=(5 * len(columns), 4 * panels), squeeze=False)
    base_label = _plot_label(dict(layout.rows)[spec.baseline])
    metric = curves_metric(curves)

    def band(ax: Any, rows: list[CurvePoint], stat: str, colour: str, label: str) -> None:
        """Mean line and ± std band of ``stat`` (``val_top1_*_pct`` or ``delta_*_pp``) over the epochs it has; no band
        where one seed gives the mean."""
        rows = [r for r in rows if getattr(r, stat.format("mean")) is not None]
        if not rows:
            return
        epochs = np.array([r.epoch for r in rows])
        mean = np.array([getattr(r, stat.format("mean")) for r in rows])
        std = np.array([np.nan if (s := getattr(r, stat.format("std"))) is None else s for r in rows])  # n = 1: none
        ax.plot(epochs, mean, marker="o", markersize=3, color=colour, label=label)
        ax.fill_between(epochs, mean - std, mean + std, color=colour, alpha=0.2)

    for j, (col, col_label) in enumerate(columns):
        for i, (name, label) in enumerate(layout.rows):
            rows = [r for r in curves if (r.dataset, r.label_fraction) == col and r.objective == name]
            band(axes[0, j], rows, "val_top1_{}_pct", f"C{i}", _plot_label(label))
            if with_deltas:
                if name == spec.baseline:
                    axes[1, j].axhline(0.0, color=f"C{i}", linestyle="--", linewidth=1)
                else:
                    band(axes[1, j], rows, "delta_{}_pp", f"C{i}", _plot_label(label))
        axes[0, j].set(xlabel="epoch", ylabel=f"{metric} (%)", title=col_label)
        if with_deltas:
            title = f"{col_label}: Δ from {base_label}, paired by seed"
            axes[1, j].set(xlabel="epoch", ylabel=f"Δ {metric.partition(' (')[0]} (pp)", title=title)
        axes[0, j].legend(fontsize=8)  # the Δ panel below uses the same colours
        for ax in axes[:, j]:
            ax.grid(alpha=0.3)
    fig.suptitle(f"{spec.name}: {metric} per epoch, mean ± std over seeds", fontsize=10)
    fig.tight_layout()
    path = spec.output / "curves.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the title may be wider than one panel
    plt.close(fig)
    return path
