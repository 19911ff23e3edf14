"""What ``coretune compare`` makes of its runs: the paired table of the methods' validation scores, a recommendation
that states its uncertainty, and the rule that refuses a validation split too small to tell methods apart.

Pure functions of :class:`~.stats.Cell` s (one per method: its seeds' final-epoch validation top-1), so that the
logic is tested on synthetic tables:

- **Beyond noise**: a method is behind the best one (the highest mean) beyond noise when their paired
  difference over the seeds both finished has a two-sided p-value below :data:`ALPHA` (0.05): the paired t-test
  (:func:`~.stats.compare`), or, where the t-test is undefined because every seed differs by the same amount, the
  exact sign test (``2 · 0.5ⁿ``: all ``n`` seeds agree; 2 seeds never reach 0.05). Fewer than 2 pairs: never.
- **Recommendation**: the methods within noise of the best (the best included) are tied; the simplest of them is
  recommended (:func:`simplicity`: fewest hyper-parameters, in the order :data:`SIMPLICITY`), and the text says
  whether it won beyond noise or was chosen among a tie, and by how much.
- **Too small**: a validation split of ``n`` images measures an accuracy with a standard error of at most
  ``√(0.25/n)`` (at 50%), a difference of two accuracies with at most ``√(0.5/n)``; telling methods apart by
  ``δ`` (``--min_difference``, a fraction here) needs two standard errors within ``δ``: ``n ≥ 2/δ²`` — 800
  images for 5 points, 200 for 10 (:func:`needed_val_images`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .stats import Cell, compare

__all__ = [
    "ALPHA",
    "SIMPLICITY",
    "MethodRow",
    "Recommendation",
    "check_val_size",
    "hyperparameters",
    "method_rows",
    "needed_val_images",
    "p_value",
    "recommend",
    "reference_method",
    "simplicity",
]

#: The p-value below which a paired difference counts as beyond noise.
ALPHA = 0.05

#: The registered methods from the simplest to the most elaborate: by the number of hyper-parameters each adds to
#: CE-tuning (:func:`hyperparameters`: its declared search space less what its preset fixes; 0, then 1, then 2),
#: and, among equals, by what it adds to CE: nothing (``ce``), a schedule (RIFLE's re-initialisations, ERM++'s
#: head-only warm-up), a shift of the training logits (logit adjustment), a mixup (``manifold_mixup``, ``ce_mix``), a
#: regulariser of the features or weights (BSS, DELTA), an extra loss with its
#: own structure (M&M's triplets, Bi-tuning's contrast with a momentum head), then the two-parameter methods
#: (``ce_con``, L2-SP, SCL, ``ce_con_mixh`` and Core-tuning last: focal contrast, mined hard pairs and mixup).
#: A method not listed (a plug-in, a class path) comes after these, by its number of hyper-parameters.
SIMPLICITY: tuple[str, ...] = (
    "ce",
    "rifle",
    "erm_pp",
    "logit_adjusted",
    "manifold_mixup",
    "ce_mix",
    "bss",
    "delta",
    "mm",
    "bi_tuning",
    "ce_con",
    "l2sp",
    "scl",
    "ce_con_mixh",
    "core",
)


def hyperparameters(method: str) -> tuple[str, ...]:
    """The hyper-parameters a registered method adds to CE-tuning: its class's declared search space
    (:attr:`~coretune.objectives.Objective.search_space`) less those its preset fixes (``ce_mix``: η = 0 is its
    definition, α remains); none for a name that is not registered."""
    from .. import objectives

    if method not in objectives.available():
        return ()
    cls, preset = objectives.get(method)
    return tuple(name for name in cls.search_space if name not in preset)


def simplicity(method: str) -> tuple[int, int]:
    """The sort key of a method, simplest first: its place in :data:`SIMPLICITY`, a method not listed after them by
    its number of :func:`hyperparameters`."""
    if method in SIMPLICITY:
        return 0, SIMPLICITY.index(method)
    return 1, len(hyperparameters(method))


def reference_method(methods: Sequence[str]) -> str:
    """The method every other is compared with in the table: CE-tuning (``ce``) when compared, else the simplest."""
    return "ce" if "ce" in methods else min(methods, key=simplicity)


def p_value(a: Cell, b: Cell) -> tuple[float, int]:
    """The two-sided p-value of ``a − b`` paired by seed, and the number of pairs: the paired t-test's
    (:func:`~.stats.compare`), or where it is undefined because every pair differs by the same amount, the exact
    sign test's (``2 · 0.5ⁿ``, 1 for no difference); NaN below two pairs."""
    comparison = compare(a, b)
    n = len(comparison.paired)
    if n < 2:
        return math.nan, n
    if math.isfinite(comparison.paired_p):
        return comparison.paired_p, n
    if abs(comparison.paired[0]) < 1e-4:  # every seed the same score: no difference at all
        return 1.0, n
    return min(1.0, 2 * 0.5**n), n


@dataclass(frozen=True)
class MethodRow:
    """A row of the comparison: a method's validation scores (``cell``: % per seed), its hyper-parameters, and the
    paired difference of its mean to the reference method's (percentage points), with its p-value and number of
    pairs (``None`` for the reference's own row)."""

    method: str
    cell: Cell
    hyperparameters: tuple[str, ...]
    diff: float | None
    p: float | None
    pairs: int

    def as_dict(self) -> dict[str, object]:
        """The row as ``compare.json`` records it."""
        return {
            "method": self.method,
            "hyperparameters": list(self.hyperparameters),
            "seeds": list(self.cell.seeds),
            "val_top1_pct": list(self.cell.values),
            "mean_pct": self.cell.mean,
            "std_pct": self.cell.std,
            "diff_to_reference_pp": self.diff,
            "p_value": self.p,
            "pairs": self.pairs,
        }


def method_rows(cells: Mapping[str, Cell], reference: str) -> list[MethodRow]:
    """The table's rows, in the order of ``cells``, each compared with ``reference`` paired by seed."""
    rows = []
    for method, cell in cells.items():
        diff, p, pairs = None, None, 0
        if method != reference and cell.n and cells[reference].n:
            paired = compare(cell, cells[reference]).paired
            diff = sum(paired) / len(paired) if paired else cell.mean - cells[reference].mean
            p, pairs = p_value(cell, cells[reference])
        rows.append(MethodRow(method, cell, hyperparameters(method), diff, p, pairs))
    return rows


@dataclass(frozen=True)
class Recommendation:
    """The method to use (``method``), the best mean (``best``), the methods within noise of the best, simplest
    first (``tied``, the best included), whether the choice won beyond noise (``beyond_noise``), and the sentence
    that says so with its uncertainty (``text``)."""

    method: str
    best: str
    tied: tuple[str, ...]
    beyond_noise: bool
    text: str

    def as_dict(self) -> dict[str, object]:
        return {
            "method": self.method,
            "best_mean": self.best,
            "tied_within_noise": list(self.tied),
            "beyond_noise": self.beyond_noise,
            "text": self.text,
        }


def _p_text(p: float, n: int) -> str:
    if math.isnan(p):
        return f"no p-value: {n} paired seed(s)"
    return f"p = {p:.2g} over {n} seeds" if p >= 0.001 else f"p < 0.001 over {n} seeds"


def recommend(cells: Mapping[str, Cell], alpha: float = ALPHA) -> Recommendation:
    """The recommendation from the methods' cells (see the module's rules); methods without a finished seed are
    left out. ValueError when no method has one."""
    scored = {method: cell for method, cell in cells.items() if cell.n}
    if not scored:
        raise ValueError("no method has a finished run to compare: run the comparison first")
    best = max(scored, key=lambda m: (round(scored[m].mean, 6), tuple(-k for k in simplicity(m))))
    behind: dict[str, tuple[float, float, int]] = {}  # method → (mean difference to the best, p, pairs)
    for method, cell in scored.items():
        if method != best:
            p, n = p_value(scored[best], cell)
            behind[method] = (scored[best].mean - cell.mean, p, n)
    tied = tuple(sorted([best, *(m for m, (_, p, _) in behind.items() if not p < alpha)], key=simplicity))
    chosen = tied[0]
    if len(scored) == 1:
        text = f"{chosen} is the only method with finished runs: nothing to compare it with."
        return Recommendation(chosen, best, tied, False, text)
    best_text = f"{best} has the highest mean validation top-1 ({scored[best].mean:.2f}%)"
    if len(tied) == 1:
        runner = min(behind, key=lambda m: behind[m][0])
        gap, p, n = behind[runner]
        text = (
            f"use {chosen}: {best_text} and is ahead of every other method beyond noise (the closest, {runner}, by "
            f"{gap:.2f} points, {_p_text(p, n)}; a difference counts when p < {alpha:g})."
        )
        return Recommendation(chosen, best, tied, True, text)
    within = ", ".join(
        f"{m} (−{behind[m][0]:.2f} points, {_p_text(behind[m][1], behind[m][2])})" for m in tied if m != best
    )
    simplest = f"{chosen}, the simplest of them ({_hyper_text(chosen)})"
    if chosen == best:
        text = (
            f"use {chosen}: {best_text}, and it is also the simplest of the methods within noise of it: {within}. "
            "The ranking among these is uncertain."
        )
    else:
        text = (
            f"use {simplest}: {best_text}, but {within} {'is' if len(tied) == 2 else 'are'} within noise of it, so "
            "the simplest of the tie is recommended. The ranking among them is uncertain: more seeds (--seeds) "
            "or a larger validation split could separate them."
        )
    return Recommendation(chosen, best, tied, False, text)


def _hyper_text(method: str) -> str:
    names = hyperparameters(method)
    return f"hyper-parameters: {', '.join(names)}" if names else "no hyper-parameter of its own"


def needed_val_images(min_difference_pp: float) -> int:
    """The validation images needed to tell accuracies ``min_difference_pp`` points apart: ``⌈2/δ²⌉`` for ``δ`` the
    difference as a fraction (two standard errors of a difference of two accuracies, at most ``√(0.5/n)``, within
    ``δ``)."""
    delta = min_difference_pp / 100
    return math.ceil(2 / delta**2 - 1e-9)


def check_val_size(per_class: Mapping[str, int], min_difference_pp: float, val_fraction: float, train: int) -> None:
    """Refuse a validation split of too few images (``per_class``: its images per class; ``train``: the images of
    the training set it is held out of, at ``val_fraction``) to tell methods ``min_difference_pp`` points apart,
    naming how many images per class it needs and the fixes."""
    n, classes = sum(per_class.values()), max(1, len(per_class))
    needed = needed_val_images(min_difference_pp)
    if n >= needed:
        return
    per = math.ceil(needed / classes)
    fraction = needed / train if train else math.inf
    raise_it = (
        f"raise --val_fraction to {math.ceil(100 * fraction) / 100:g}" if fraction < 0.5 else "use more training images"
    )
    coarsest = math.ceil(1000 * math.sqrt(2 / max(n, 1))) / 10
    low, high = min(per_class.values(), default=0), max(per_class.values(), default=0)
    held = f"{low}" if low == high else f"{low}-{high}"
    raise ValueError(
        f"the validation split holds {n} images ({held} per class, --val_fraction {val_fraction:g} of {train} training "
        f"images): too few to tell methods apart by {min_difference_pp:g} points, which needs {needed} images, "
        f"{per} per class of {classes} (two standard errors of an accuracy difference, √(0.5/n), within "
        f"{min_difference_pp:g} points); {raise_it}, or accept a coarser comparison with --min_difference "
        f"{coarsest:g}"
    )
