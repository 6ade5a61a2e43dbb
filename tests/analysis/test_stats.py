"""Statistics over seeds against hand-computed values and closed forms of Student's t."""

import math

import pytest

from stalepipe.analysis import stats


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
