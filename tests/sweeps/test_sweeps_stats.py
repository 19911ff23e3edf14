"""The statistics of two cells: pooled standard deviation and the paired t-test."""

from __future__ import annotations

import math

import numpy as np
import pytest

from coretune.sweeps import Cell, compare


def test_compare_pooled_std_reference() -> None:
    a = Cell("x", "d", 1.0, (1.0, 2.0, 3.0, 4.0))  # s² = 5/3
    b = Cell("y", "d", 1.0, (10.0, 12.0))  # s² = 2
    c = compare(b, a)
    assert c.diff == pytest.approx(11 - 2.5)
    assert c.pooled_std == pytest.approx(math.sqrt((3 * 5 / 3 + 1 * 2) / 4))
    assert c.beyond_two_std is True
    assert compare(a, a).beyond_two_std is False
    assert compare(Cell("z", "d", 1.0, (5.0,)), a).beyond_two_std is None


def test_compare_pairs_the_seeds_both_cells_finished() -> None:
    from scipy.stats import ttest_rel

    a = Cell("x", "d", 1.0, (1.0, 2.0, 3.0, 4.0), (0, 1, 2, 3))
    b = Cell("y", "d", 1.0, (0.5, 1.0, 2.9), (0, 1, 3))  # seed 2 unfinished: not paired
    c = compare(a, b)
    assert c.paired == pytest.approx((0.5, 1.0, 1.1))
    diffs = [0.5, 1.0, 1.1]
    mean = sum(diffs) / 3
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2)
    assert c.paired_t == pytest.approx(mean / (sd / math.sqrt(3)))
    reference = ttest_rel([1.0, 2.0, 4.0], [0.5, 1.0, 2.9])
    assert (c.paired_t, c.paired_p) == pytest.approx((reference.statistic, reference.pvalue))
    same_gap = compare(Cell("x", "d", 1.0, (2.0, 3.0), (0, 1)), Cell("y", "d", 1.0, (1.0, 2.0), (0, 1)))
    assert same_gap.paired == (1.0, 1.0) and math.isnan(same_gap.paired_t)  # no spread: no t
    # the same gap read from float32 top-1 values (results.json: 100 × 0.6857 is 68.5699975…): still no t, not 10⁵
    read = [100 * float(np.float32(v)) for v in (0.6857, 0.6912, 0.6744, 0.6827, 0.6882, 0.6714)]
    noisy = compare(Cell("x", "d", 1.0, tuple(read[:3]), (0, 1, 2)), Cell("y", "d", 1.0, tuple(read[3:]), (0, 1, 2)))
    assert noisy.paired == pytest.approx((0.3, 0.3, 0.3), abs=1e-4)
    assert math.isnan(noisy.paired_t) and math.isnan(noisy.paired_p)
    assert compare(Cell("z", "d", 1.0, (5.0,)), a).paired == ()  # seeds unknown
    with pytest.raises(ValueError, match="2 values but 1 seeds"):
        Cell("x", "d", 1.0, (1.0, 2.0), (0,))
