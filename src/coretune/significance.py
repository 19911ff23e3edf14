"""Whether a paired difference is beyond the seeds' noise, with the standard library alone: the paired t-test's
two-sided p-value (Student's t distribution through the regularised incomplete beta function), for the demo, which
installs no SciPy; ``coretune bench`` reports the same test (:mod:`coretune.sweeps.stats`)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PairedTest", "paired_t_test", "student_t_two_sided_p"]


def _incomplete_beta(x: float, a: float, b: float, y: float | None = None) -> float:
    """The regularised incomplete beta function ``I_x(a, b)``, by its continued fraction (modified Lentz); ``y`` is
    ``1 - x`` when the caller knows it more precisely than the subtraction gives it."""
    y = 1.0 - x if y is None else y
    if x <= 0.0:
        return 0.0
    if y <= 0.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):  # the fraction converges fast below this point: use the symmetry
        return 1.0 - _incomplete_beta(y, b, a, x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log(y)) / a
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 500):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return front * f


def student_t_two_sided_p(t: float, df: float) -> float:
    """``P(|T| >= |t|)`` for Student's t with ``df`` degrees of freedom."""
    if math.isinf(t):
        return 0.0
    return _incomplete_beta(df / (df + t * t), df / 2.0, 0.5, t * t / (df + t * t))


@dataclass(frozen=True)
class PairedTest:
    """``b - a`` paired by seed: mean difference, its t statistic and two-sided p-value over ``n`` pairs. When every
    pair differs by the same amount the t statistic is undefined (no spread): ``t`` is NaN and ``p`` is the exact
    sign test's, ``2 · 0.5ⁿ`` (1 when there is no difference). NaN p below two pairs."""

    difference: float
    t: float
    p: float
    n: int

    def beyond_noise(self, alpha: float = 0.05) -> bool:
        return self.p < alpha


def paired_t_test(a: Sequence[float], b: Sequence[float]) -> PairedTest:
    """The paired t-test of ``b`` against ``a`` (equal lengths, one value per seed)."""
    if len(a) != len(b):
        raise ValueError(f"paired values need one of each per seed, got {len(a)} and {len(b)}")
    diffs = [y - x for x, y in zip(a, b, strict=True)]
    n = len(diffs)
    if n < 2:
        return PairedTest(diffs[0] if diffs else math.nan, math.nan, math.nan, n)
    mean = statistics.fmean(diffs)
    spread = statistics.stdev(diffs)
    if spread <= 1e-12 * max(1.0, abs(mean)):
        return PairedTest(mean, math.nan, 1.0 if mean == 0 else min(1.0, 2 * 0.5**n), n)
    t = mean / (spread / math.sqrt(n))
    return PairedTest(mean, t, student_t_two_sided_p(t, n - 1), n)
