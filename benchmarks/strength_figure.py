"""The tables and the figure of ``strength_gain.py plot`` (issue 41, part 2; issue 65): the paired gains of one method
over another on one checkpoint (:class:`Gain`, :class:`Row`), their trend with the checkpoint's frozen score
(:func:`trends`), the markdown tables and the figure of gain against kNN top-1 (:func:`figure`). ``strength_gain.py``
reads the runs and the scores into :class:`Row` s; this module only lays them out."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from coretune.sweeps.stats import Cell, compare

Axis = Literal["knn", "linear"]


@dataclass(frozen=True)
class Gain:
    """Paired (same-seed) differences of a method's top-1 from a reference method's: mean, sample std, pairs, the
    paired t-test's two-sided p (NaN below 2 pairs or with no spread) and the differences themselves."""

    mean: float
    std: float
    pairs: int
    p: float = math.nan
    values: tuple[float, ...] = ()

    @classmethod
    def of(cls, cell: Cell, reference: Cell) -> Gain:
        comparison = compare(cell, reference)
        paired = comparison.paired
        if not paired:
            return cls(math.nan, math.nan, 0)
        std = float(np.std(paired, ddof=1)) if len(paired) > 1 else math.nan
        return cls(float(np.mean(paired)), std, len(paired), comparison.paired_p, tuple(paired))

    def text(self) -> str:
        if not self.pairs:
            return "–"
        spread = "" if math.isnan(self.std) else f" ± {self.std:.2f}"
        tested = "" if math.isnan(self.p) else f", p {_p(self.p) if self.p < 0.001 else f'= {_p(self.p)}'}"
        return f"{self.mean:+.2f}{spread} (n={self.pairs}{tested})"


def _p(p: float) -> str:
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


@dataclass(frozen=True)
class Row:
    """One method on one checkpoint at one label fraction."""

    checkpoint: str
    label_fraction: float
    knn: float
    linear: float
    method: str
    top1: float
    baseline_top1: float
    gain: Gain  # over the baseline (CE-tuning)
    beyond_mix: Gain | None  # Core-tuning over ce_mix: its contribution beyond the mixup


def _series(
    rows: Sequence[Row], baseline: str = "ce", axis: Axis = "knn"
) -> dict[tuple[str, float], list[tuple[str, float, Gain]]]:
    """The figure's lines: per (comparison, label fraction), each checkpoint's name, frozen score (``axis``: kNN or
    linear-probe top-1) and paired gain; the comparisons are each method against ``baseline`` and Core-tuning against
    ``ce_mix``."""
    series: dict[tuple[str, float], list[tuple[str, float, Gain]]] = {}
    for r in rows:
        x = getattr(r, axis)
        series.setdefault((f"{r.method} − {baseline}", r.label_fraction), []).append((r.checkpoint, x, r.gain))
        if r.beyond_mix is not None:
            series.setdefault(("core − ce_mix", r.label_fraction), []).append((r.checkpoint, x, r.beyond_mix))
    return series


#: The frozen scores a trend is fitted against (:class:`Row`'s fields) and their names in the trend table.
AXES = {"knn": "kNN", "linear": "linear probe"}


@dataclass(frozen=True)
class Trend:
    """A paired difference's least-squares line against the checkpoints' frozen score (:func:`trends`)."""

    comparison: str
    label_fraction: float
    slope: float  # pp of gain per 10 points of the frozen score
    slope_se: float
    p: float  # NaN when the line fits the means exactly (no residual to test against)
    checkpoints: int
    pairs: int  # the paired seeds behind the checkpoints' means
    left_out: int = 0  # scored checkpoints with fewer paired seeds than the series' most and no diverged run
    axis: str = "knn"  # the frozen score: kNN or linear-probe top-1 (AXES)


def trends(
    rows: Sequence[Row],
    baseline: str = "ce",
    diverged: Sequence[tuple[str, str, float, int, str]] = (),
    axis: Axis = "knn",
) -> list[Trend]:
    """Does a gain grow with the checkpoint's strength? Per comparison and label fraction with at least 3 scored
    checkpoints ``i``, the least-squares slope ``b`` of ``mean gain_i = a + b·x_i + e_i`` (``x``: the ``axis``
    score, kNN or linear-probe top-1, in %), its standard error and
    the two-sided p of ``b = 0`` (t with ``n − 2`` degrees of freedom, ``n`` checkpoints). The checkpoints are the
    replicates: a checkpoint's seeds share its own distance from the line, which more seeds do not average away, so
    a fit through every seed would count them as evidence they are not. For the same reason a checkpoint with fewer
    paired seeds than the series' most and no diverged run among them (``diverged``: :func:`diverged_runs`; a
    column still running) is left out and counted (``left_out``), not fitted as a full replicate; one whose seeds
    diverged stays in (the divergence is a finding about it, named under the table). Fewer than 3 checkpoints left:
    the trend's numbers are NaN, its counts still shown."""
    from scipy.stats import linregress

    lost = {(column, method, fraction) for column, method, fraction, _, _ in diverged}
    found = []
    series = sorted(_series(rows, baseline, axis).items(), key=lambda i: (-i[0][1], i[0][0]))
    for (comparison, fraction), points in series:
        scored = [(name, x, gain) for name, x, gain in points if not math.isnan(x) and gain.pairs]
        if len({x for _, x, _ in scored}) < 3:
            continue
        most = max(gain.pairs for _, _, gain in scored)
        methods = comparison.split(" − ")
        means = [
            (x, gain)
            for name, x, gain in scored
            if gain.pairs == most or any((name, m, fraction) in lost for m in methods)
        ]
        pairs, left_out = sum(g.pairs for _, g in means), len(scored) - len(means)
        if len({x for x, _ in means}) < 3:
            found.append(Trend(comparison, fraction, math.nan, math.nan, math.nan, len(means), pairs, left_out, axis))
            continue
        fit = linregress([x for x, _ in means], [gain.mean for _, gain in means])
        p = float(fit.pvalue) if fit.stderr > 1e-12 else math.nan
        found.append(Trend(comparison, fraction, 10 * fit.slope, 10 * fit.stderr, p, len(means), pairs, left_out, axis))
    return found


def trend_table(found: Sequence[Trend]) -> str:
    """:func:`trends` as the lines under the gains table; empty without any."""
    if not found:
        return ""
    lines = [
        "",
        "Trend with the checkpoint's strength: least-squares slope of the checkpoints' mean paired gains against "
        "their frozen score (kNN or linear-probe top-1), in pp per 10 points of that score, ± its standard error; p "
        "of a zero slope with (checkpoints − 2) degrees of freedom.",
        "",
        "| Labels | Comparison | against | slope (pp per 10 points) | p | checkpoints (paired seeds) |",
        "|:-:|---|---|:-:|:-:|:-:|",
    ]
    lines += [
        f"| {100 * t.label_fraction:g}% | {t.comparison} | {AXES[t.axis]} | "
        f"{'– (fewer than 3 checkpoints)' if math.isnan(t.slope) else f'{t.slope:+.2f} ± {t.slope_se:.2f}'} | "
        f"{'–' if math.isnan(t.p) else _p(t.p)} | {t.checkpoints} ({t.pairs})"
        f"{f'; {t.left_out} with fewer paired seeds left out' if t.left_out else ''} |"
        for t in found
    ]
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    return "–" if math.isnan(value) else f"{value:.2f}"


def markdown(rows: list[Row], baseline: str = "ce") -> str:
    """The table of :func:`gains`: per label fraction (most labels first), checkpoints from weakest (kNN) up; each
    row's two top-1 means are over the seeds both its method and ``baseline`` finished (the gain's n)."""
    lines = [
        f"| Labels | Checkpoint | kNN top-1 | linear top-1 | {baseline} top-1 (paired seeds) | Method | top-1 (paired "
        f"seeds) | paired gain over {baseline} (pp) | Core − ce_mix (pp) |",
        "|:-:|---|:-:|:-:|:-:|---|:-:|:-:|:-:|",
    ]
    for r in sorted(rows, key=lambda r: (-r.label_fraction, r.knn, r.checkpoint, r.method)):
        lines.append(
            f"| {100 * r.label_fraction:g}% | {r.checkpoint} | {_number(r.knn)} | {_number(r.linear)} | "
            f"{_number(r.baseline_top1)} | {r.method} | {_number(r.top1)} | {r.gain.text()} | "
            f"{r.beyond_mix.text() if r.beyond_mix is not None else ''} |"
        )
    return "\n".join(lines) + "\n"


def dodge(keys: Sequence[tuple[str, float]], xs: Sequence[float], step: float = 0.01) -> dict[tuple[str, float], float]:
    """Each line's sideways offset in the figure, so that the points of one checkpoint (the same kNN score on every
    line) do not hide one another: the lines, in the order drawn, spaced ``step`` of the drawn kNN range apart and
    centred on the true score (0 for a single line, or when every point has one score)."""
    known = [x for x in xs if not math.isnan(x)]
    width = step * (max(known) - min(known)) if len(known) > 1 else 0.0
    middle = (len(keys) - 1) / 2
    return {key: (i - middle) * width for i, key in enumerate(keys)}


def figure(
    rows: list[Row],
    path: Path,
    baseline: str = "ce",
    diverged: Sequence[tuple[str, str, float, int, str]] = (),
    footnote: str = "",
) -> Path:
    """Each method's paired gain over ``baseline`` (mean ± std over seeds) against the checkpoint's kNN top-1, one
    line per (method, label fraction): one colour per comparison (Core-tuning's gain over ``ce_mix`` in black), one
    line style and marker per label fraction (10%: solid, circles; 1%: dashed, squares). A point resting on fewer
    paired seeds than the most any point has is hollow; a series whose runs (or its reference's) diverged says how many
    (``diverged``: :func:`diverged_runs`); the lines are set apart sideways (:func:`dodge`, said in the title) so that
    no point hides another; the checkpoints are named along the top, the legend stands to the right of
    the axes; ``footnote`` goes underneath."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = _series(rows, baseline)
    most = max((g.pairs for points in series.values() for _, _, g in points), default=0)
    fig, ax = plt.subplots(figsize=(9.2, 4.6))
    colours = {f"ce_mix − {baseline}": "C0", f"core − {baseline}": "C1", "core − ce_mix": "black"}
    for label, _ in series:  # another method of a spec: a colour of its own, never one of the three above
        colours.setdefault(label, f"C{len(colours) - 1}")
    ordered = sorted(series.items(), key=lambda item: (-item[0][1], item[0][0]))
    shift = dodge([key for key, _ in ordered], [x for _, points in ordered for _, x, _ in points])
    for (label, fraction), points in ordered:
        shown = sorted(((x, g) for _, x, g in points if not math.isnan(x) and g.pairs), key=lambda p: p[0])
        shown = [(x + shift[label, fraction], g) for x, g in shown]
        if not shown:
            continue
        lost = sum(1 for _, m, f, _, _ in diverged if f == fraction and m in label.split(" − "))
        line = ax.errorbar(
            [x for x, _ in shown],
            [g.mean for _, g in shown],
            yerr=[0 if math.isnan(g.std) else g.std for _, g in shown],
            capsize=3,
            marker="o" if fraction >= 0.1 else "s",
            linestyle="-" if fraction >= 0.1 else "--",
            color=colours.get(label),
            label=f"{label}, {100 * fraction:g}% labels" + (f" ({lost} diverged run(s) on this line)" if lost else ""),
        )[0]
        few = [(x, g.mean) for x, g in shown if g.pairs < most]
        if few:  # hollow: fewer paired seeds than the others
            ax.plot([x for x, _ in few], [y for _, y in few], linestyle="none", marker=line.get_marker(),
                    markerfacecolor="white", markeredgecolor=line.get_color(), zorder=3)  # fmt: skip
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_xlabel("checkpoint's kNN top-1 (%), frozen features (bank: every labelled training image)", fontsize=9)
    ax.set_ylabel("paired gain in fine-tuned top-1 (pp)")
    named = sorted({(r.knn, r.checkpoint) for r in rows if not math.isnan(r.knn)})
    if named:
        top = ax.secondary_xaxis("top")
        top.set_xticks([x for x, _ in named], labels=[n for _, n in named], fontsize=7, rotation=30, ha="left")
    title = f"Fine-tuning gain against pre-training strength (mean ± std over seeds; hollow: < {most} pairs)"
    spread = max((abs(v) for v in shift.values()), default=0.0)
    if spread:
        title += f"\nthe lines are set apart sideways by up to ±{spread:.2g} kNN points so that none hides another"
    ax.set_title(title, fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)  # beside: covers no point
    else:  # no checkpoint both scored (evaluate) and fine-tuned by two methods yet
        ax.text(0.5, 0.5, "no scored checkpoint with finished runs yet", ha="center", transform=ax.transAxes)
    wrapped = textwrap.wrap(footnote, 130)
    if wrapped:
        fig.text(0.01, 0.01, "\n".join(wrapped), fontsize=6.5, va="bottom")
    fig.tight_layout(rect=(0, 0.03 + 0.025 * len(wrapped) if wrapped else 0, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
