"""Statistics over seeds against hand-computed values and closed forms of Student's t."""

import math

import pytest

from stalepipe.lab.analysis import stats


def test_mean_std_hand_computed():
    assert stats.mean([1.0, 2.0, 6.0]) == 3.0
    # deviations -2, -1, 3: squares 4 + 1 + 9 = 14, / (n - 1) = 7
    assert stats.std([1.0, 2.0, 6.0]) == pytest.approx(math.sqrt(7.0))
    assert math.isnan(stats.std([1.0]))
    assert math.isnan(stats.mean([]))


@pytest.mark.parametrize("t", [0.0, 0.3, 1.0, 2.5, 12.0])
def test_t_distribution_closed_forms(t):
    # df = 1 (Cauchy): P(|T| >= t) = 1 - 2 atan(t) / pi; df = 2: 1 - t / sqrt(2 + t^2)
    assert stats.t_sf_two_sided(t, 1) == pytest.approx(1 - 2 * math.atan(t) / math.pi, abs=1e-12)
    assert stats.t_sf_two_sided(t, 2) == pytest.approx(1 - t / math.sqrt(2 + t * t), abs=1e-12)
    assert stats.t_sf_two_sided(-t, 2) == stats.t_sf_two_sided(t, 2)


def test_t_distribution_table_values():
    # textbook critical values: t_{0.975}(10) = 2.228, t_{0.975}(inf) = 1.960, t_{0.995}(4) = 4.604
    assert stats.t_sf_two_sided(2.228, 10) == pytest.approx(0.05, abs=1e-4)
    assert stats.t_sf_two_sided(1.95996, 1e7) == pytest.approx(0.05, abs=1e-5)
    assert stats.t_sf_two_sided(4.604, 4) == pytest.approx(0.01, abs=1e-4)
    assert stats.t_sf_two_sided(math.inf, 3) == 0.0


def test_betainc_symmetry_and_uniform():
    assert stats.betainc(1.0, 1.0, 0.3) == pytest.approx(0.3)  # uniform distribution
    for a, b, x in [(2.0, 3.0, 0.4), (0.5, 5.0, 0.9), (7.0, 0.5, 0.2)]:
        assert stats.betainc(a, b, x) == pytest.approx(1 - stats.betainc(b, a, 1 - x), abs=1e-12)


def test_welch_hand_computed():
    # a: mean 2, var 1; b: mean 16/3, var 7/3 (n = 3 each)
    r = stats.welch_t_test([1.0, 2.0, 3.0], [4.0, 5.0, 7.0])
    se2 = 1 / 3 + 7 / 9
    assert r.t == pytest.approx((2 - 16 / 3) / math.sqrt(se2))
    assert r.df == pytest.approx(se2**2 / ((1 / 3) ** 2 / 2 + (7 / 9) ** 2 / 2))
    assert r.p == pytest.approx(stats.t_sf_two_sided(r.t, r.df))
    assert 0.03 < r.p < 0.05
    assert math.isnan(stats.welch_t_test([1.0], [2.0, 3.0]).p)
    assert stats.welch_t_test([1.0, 1.0], [2.0, 2.0]).p == 0.0
    assert stats.welch_t_test([1.0, 1.0], [1.0, 1.0]).p == 1.0


def test_gap_recovered_spearman():
    assert stats.gap([2.5, 2.7], [2.0, 2.2]) == pytest.approx(0.5)
    assert stats.recovered_share(0.1, 0.4) == pytest.approx(0.75)
    assert stats.recovered_share(0.5, 0.4) == pytest.approx(-0.25)
    assert math.isnan(stats.recovered_share(0.1, 0.0))
    assert stats.spearman([1, 2, 3, 4], [10, 8, 5, 1]) == pytest.approx(-1.0)
    assert stats.spearman([1, 2, 3], [1, 1, 2]) == pytest.approx(math.sqrt(3) / 2)


def test_paired_difference_by_hand():
    """Differences 1, 2, 3 over seeds 0-2 (seed 3 has no partner): mean 2, sd 1, t = 2 sqrt(3)
    with df 2; the interval is 2 -+ t_{0.975, 2} / sqrt(3) = 2 -+ 4.3027 / 1.7321."""
    a = {0: 3.0, 1: 5.0, 2: 7.0, 3: 9.0}
    b = {0: 2.0, 1: 3.0, 2: 4.0}
    d = stats.paired_difference(a, b)
    assert d.paired and d.n == 3 and d.diff == pytest.approx(2.0)
    assert d.p == pytest.approx(stats.t_sf_two_sided(2 * math.sqrt(3), 2), rel=1e-12)
    half = 4.302652729749464 / math.sqrt(3)
    assert (d.low, d.high) == pytest.approx((2 - half, 2 + half), rel=1e-9)
    one = stats.paired_difference({0: 1.0}, {0: 0.0})
    assert one.n == 1 and math.isnan(one.p) and math.isnan(one.low)
    flat = stats.paired_difference({0: 1.0, 1: 2.0}, {0: 0.5, 1: 1.5})
    assert flat.p == 0.0 and flat.low == flat.high == pytest.approx(0.5)


def test_welch_difference_interval_by_hand():
    """Two samples of 3 with variance 1 each: se = sqrt(2/3), df = 4, t_{0.975, 4} = 2.7764."""
    d = stats.welch_difference([1.0, 2.0, 3.0], [0.0, 1.0, 2.0])
    assert not d.paired and d.diff == pytest.approx(1.0)
    half = 2.7764451051977987 * math.sqrt(2 / 3)
    assert (d.low, d.high) == pytest.approx((1 - half, 1 + half), rel=1e-9)
    assert d.p == pytest.approx(stats.welch_t_test([1.0, 2.0, 3.0], [0.0, 1.0, 2.0]).p)


def test_holm_by_hand():
    """p = 0.01, 0.04, 0.03, nan: sorted 0.01 x 3, 0.03 x 2, 0.04 x 1 -> 0.03, 0.06, 0.06 (the
    step-down keeps them monotone); nan is neither counted nor changed; capped at 1."""
    adj = stats.holm([0.01, 0.04, 0.03, math.nan])
    assert adj[:3] == pytest.approx([0.03, 0.06, 0.06]) and math.isnan(adj[3])
    assert stats.holm([0.5, 0.6]) == [1.0, 1.0]
    assert stats.holm([]) == []
