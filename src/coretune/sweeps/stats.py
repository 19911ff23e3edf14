"""Statistics of a sweep's cells: mean ± sample std over seeds, and the comparison of two cells (pooled standard
deviation, paired t-test of the seeds both finished)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..extras import need

__all__ = ["Cell", "Comparison", "compare"]


@dataclass(frozen=True)
class Cell:
    """The finished seeds of one (objective, data set, label fraction): top-1 in percent (the spec's metric)."""

    objective: str
    dataset: str
    label_fraction: float
    values: tuple[float, ...]
    seeds: tuple[int, ...] = ()  # the seed of each value, when known (pairs runs across cells)
    reconstructed: tuple[int, ...] = ()  # the seeds whose records are reconstructed (marked † in the tables)

    def __post_init__(self) -> None:
        if self.seeds and len(self.seeds) != len(self.values):
            raise ValueError(f"{len(self.values)} values but {len(self.seeds)} seeds: give one seed per value or none")

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return float(np.mean(self.values)) if self.values else math.nan

    @property
    def std(self) -> float:
        """Sample standard deviation (ddof = 1); NaN below two seeds."""
        return float(np.std(self.values, ddof=1)) if self.n >= 2 else math.nan

    def text(self) -> str:
        if not self.values:
            return "–"
        spread = f" ± {self.std:.2f}" if self.n >= 2 else ""
        return f"{self.mean:.2f}{spread} (n={self.n}){'†' if self.reconstructed else ''}"


@dataclass(frozen=True)
class Comparison:
    """Difference of two cells' means against twice their pooled standard deviation, and the paired view.

    ``paired``: ``a − b`` for each seed both cells finished (seed order). Runs with one seed share the label
    subset, the new heads' initialisation, the batches and the augmentations, so the per-seed differences are
    free of that variation. ``paired_t`` = mean / (std / √n) of those differences (n − 1 degrees of freedom) and
    ``paired_p`` its two-sided p-value (:func:`scipy.stats.ttest_rel`); NaN below two pairs or when every pair
    differs by the same amount (to 1e-4 pp: the float32 readings of a test score carry noise below that).
    ``paired_seeds``: the seed of each paired difference; ``reconstructed``: the seeds whose record is reconstructed
    in either cell (the tables mark what rests on them with †).
    """

    diff: float
    pooled_std: float
    beyond_two_std: bool | None
    paired: tuple[float, ...] = ()
    paired_t: float = math.nan
    paired_p: float = math.nan
    paired_seeds: tuple[int, ...] = ()
    reconstructed: tuple[int, ...] = ()


def compare(a: Cell, b: Cell) -> Comparison:
    """``mean(a) − mean(b)`` against ``2 s_p``, ``s_p² = ((n_a−1)s_a² + (n_b−1)s_b²) / (n_a + n_b − 2)``, and the
    paired t-test of the seeds both cells share.

    ``beyond_two_std`` is None when either cell has fewer than two seeds. A rule of thumb (the issue's "beyond 2
    standard deviations"), not a hypothesis test.
    """
    diff = a.mean - b.mean
    by_seed = dict(zip(b.seeds, b.values, strict=False))  # seeds unknown (empty): nothing is paired
    matched = [(s, v, by_seed[s]) for s, v in zip(a.seeds, a.values, strict=False) if s in by_seed]
    pairs = [(x, y) for _, x, y in matched]
    paired = tuple(x - y for x, y in pairs)
    seeds = tuple(s for s, _, _ in matched)
    rebuilt = tuple(sorted(set(a.reconstructed) | set(b.reconstructed)))
    t, p = math.nan, math.nan
    # equal gaps read from float32 top-1 values differ by ~1e-5 pp, which would give a t of 10⁵: no spread below 1e-4 pp
    if len(paired) >= 2 and float(np.std(np.round(paired, 4), ddof=1)) > 0:
        test = need("scipy.stats", "the paired t-test of a report", "bench").ttest_rel(*zip(*pairs, strict=True))
        t, p = float(test.statistic), float(test.pvalue)
    if a.n < 2 or b.n < 2:
        return Comparison(diff, math.nan, None, paired, t, p, seeds, rebuilt)
    pooled = math.sqrt(((a.n - 1) * a.std**2 + (b.n - 1) * b.std**2) / (a.n + b.n - 2))
    return Comparison(diff, pooled, bool(abs(diff) > 2 * pooled), paired, t, p, seeds, rebuilt)
