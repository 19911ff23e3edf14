"""The standard-library paired t-test against SciPy's (the demo installs no SciPy), its t distribution against a
50-digit reference (mpmath)."""

from __future__ import annotations

import math

import mpmath
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from scipy import stats

from coretune.significance import paired_t_test, student_t_two_sided_p


def _two_sided_p(t: float, df: int) -> float:
    """``P(|T| >= |t|) = I_{df/(df+t²)}(df/2, 1/2)`` at 50 digits (mpmath): SciPy's ``t.sf`` loses digits near 0 at
    df = 1 (2·sf(1e-8, 1) = 0.99999999051, against the Cauchy distribution's exact 1 − 2·atan(1e-8)/π =
    0.99999999363)."""
    with mpmath.workdps(50):
        x = df / (df + mpmath.mpf(t) ** 2)
        return float(mpmath.betainc(mpmath.mpf(df) / 2, mpmath.mpf(1) / 2, 0, x, regularized=True))


@example(t=1e-8, df=1)
@given(t=st.floats(-50, 50), df=st.integers(1, 60))
def test_the_t_distribution_matches_a_50_digit_reference(t: float, df: int) -> None:
    assert student_t_two_sided_p(t, df) == pytest.approx(_two_sided_p(t, df), rel=1e-9, abs=1e-14)
    if df == 1:  # the Cauchy distribution's closed form
        assert student_t_two_sided_p(t, df) == pytest.approx(1 - 2 * math.atan(abs(t)) / math.pi, rel=1e-12)


@pytest.mark.filterwarnings("ignore:Precision loss occurred:RuntimeWarning")
@settings(max_examples=200)
@given(pairs=st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)), min_size=2, max_size=10))
def test_the_paired_test_matches_scipys_ttest_rel(pairs: list[tuple[float, float]]) -> None:
    a, b = zip(*pairs, strict=True)
    test = paired_t_test(a, b)
    reference = stats.ttest_rel(b, a)
    if math.isnan(test.t):  # no spread: the sign test's p (SciPy's t is infinite or undefined there)
        assert test.p == (1.0 if test.difference == 0 else min(1.0, 2 * 0.5 ** len(a)))
        return
    assert test.t == pytest.approx(float(reference.statistic), rel=1e-9)
    assert test.p == pytest.approx(float(reference.pvalue), rel=1e-7, abs=1e-14)


def test_edge_cases() -> None:
    assert math.isnan(paired_t_test([0.5], [0.6]).p)  # one pair: no test
    assert paired_t_test([0.5, 0.6, 0.7], [0.6, 0.7, 0.8]).p == pytest.approx(0.25)  # all +0.1: sign test
    assert paired_t_test([0.5, 0.6], [0.5, 0.6]).p == 1.0
    assert student_t_two_sided_p(math.inf, 3) == 0.0 and student_t_two_sided_p(0.0, 3) == 1.0
    with pytest.raises(ValueError, match="one of each per seed, got 2 and 3"):
        paired_t_test([0.1, 0.2], [0.1, 0.2, 0.3])
