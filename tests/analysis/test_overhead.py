"""Token overhead on synthetic curves with known answers: a constant tax, a floor, noise, the
band, and the interval over seeds."""

from __future__ import annotations

import math
import random

import pytest

from stalepipe.lab.analysis import overhead as oh
from stalepipe.lab.analysis import stats


def loss(t: float) -> float:
    """A smooth pretraining-like curve: 2 + 3 exp(-t / 300) (tokens in arbitrary units)."""
    return 2.0 + 3.0 * math.exp(-t / 300.0)


def curve(ts, fn=loss, stretch=1.0):
    return [(float(t), fn(t / stretch)) for t in ts]


EVALS = [100.0 * k for k in range(1, 21)]  # 20 evals, tokens 100 .. 2000


def test_tokens_to_reach_interpolates_between_evals():
    c = [(10.0, 4.0), (20.0, 3.0), (30.0, 2.5)]
    assert oh.tokens_to_reach(c, 3.5) == pytest.approx(15.0)
    assert oh.tokens_to_reach(c, 3.0) == 20.0  # first point at or below
    assert oh.tokens_to_reach(c, 2.6) == pytest.approx(20.0 + 0.4 / 0.5 * 10.0)
    assert oh.tokens_to_reach(c, 5.0) == 10.0  # already there at the first eval
    assert math.isnan(oh.tokens_to_reach(c, 2.4))
    # first reaching, not last: a later bump above the target changes nothing
    assert oh.tokens_to_reach([(1.0, 3.0), (2.0, 1.0), (3.0, 5.0), (4.0, 0.5)], 2.0) == 1.5


def test_token_curve_counts_tokens_after_each_step():
    cfg = {"train.batch_size": 4, "data.seq_len": 32}
    assert oh.tokens_per_step(cfg) == 128
    assert oh.token_curve([(0, 3.0), (9, 2.0)], 128) == [(128.0, 3.0), (1280.0, 2.0)]


def test_band_is_hand_computed():
    sync = [(1.0, 4.0), (2.0, 3.0), (3.0, 2.0)]
    delayed = [(1.0, 4.5), (2.0, 3.5), (3.0, 2.8)]
    # drop = 4 - 2 = 2; top = min(4, 4.5) - 0.1 * 2 = 3.8; bottom = 2 + 0.05 * 2 = 2.1
    top, bottom = oh.target_band(sync, delayed)
    assert (top, bottom) == (pytest.approx(3.8), pytest.approx(2.1))
    rule = oh.BandRule(plateau_frac=0.25, margin_frac=0.5, num_targets=3)
    assert oh.target_band(sync, delayed, rule) == (pytest.approx(3.5), pytest.approx(3.0))
    assert oh.band_targets(3.5, 3.0, 3) == pytest.approx([3.5, 3.25, 3.0])
    # a delayed run that starts lower moves the top: both must have left their first eval
    assert oh.target_band(sync, [(1.0, 3.0), (2.0, 2.5)])[0] == pytest.approx(2.8)
    # no band: sync does not learn, too few evals, or the band closes
    assert math.isnan(oh.target_band([(1.0, 2.0), (2.0, 2.0)], delayed)[0])
    assert math.isnan(oh.target_band([(1.0, 2.0)], delayed)[0])
    assert math.isnan(oh.target_band(sync, [(1.0, 2.1), (2.0, 2.0)])[0])


def test_constant_tax_gives_its_multiplier_exactly():
    """The delayed curve is the sync curve stretched 1.3x in tokens, evaluated at 1.3x the
    tokens: the interpolants are stretched too, so every target's multiplier is 1.3."""
    sync = curve(EVALS)
    delayed = curve([1.3 * t for t in EVALS], stretch=1.3)
    p = oh.pair_overhead(sync, delayed)
    assert not p.floor and len(p.targets) == oh.DEFAULT_RULE.num_targets
    assert p.multipliers == pytest.approx([1.3] * len(p.targets), rel=1e-12)
    assert p.median == pytest.approx(1.3, rel=1e-12)


def test_constant_tax_on_shared_eval_points():
    """Same eval tokens for both runs (a longer delayed run): interpolation error only."""
    sync = curve(EVALS)
    delayed = curve([100.0 * k for k in range(1, 27)], stretch=1.3)
    assert oh.pair_overhead(sync, delayed).median == pytest.approx(1.3, rel=0.02)


def test_equal_budget_tax_is_a_floor_with_its_reached_multiplier():
    """At the same token budget a 1.3x tax cannot reach sync's final loss: a floor, but the
    median over the targets it did reach still reads the tax. (On a curve still falling at
    the end: on a flat one the margin absorbs a small tax.)"""

    def slow(t):
        return 2.0 + 3.0 * math.exp(-t / 1500.0)

    sync = curve(EVALS, fn=slow)
    delayed = curve(EVALS, fn=slow, stretch=1.3)
    p = oh.pair_overhead(sync, delayed)
    assert p.floor and math.isnan(p.median)
    assert p.reached_median == pytest.approx(1.3, rel=0.03)
    assert p.floor_gap == pytest.approx(slow(2000 / 1.3) - slow(2000))
    assert not oh.pair_overhead(curve(EVALS), curve(EVALS, stretch=1.3)).floor


def test_floor_reports_its_gap_not_a_multiplier():
    sync = curve(EVALS)
    delayed = curve(EVALS, fn=lambda t: max(loss(t), 2.6))  # stalls at 2.6
    p = oh.pair_overhead(sync, delayed)
    assert p.floor and math.isnan(p.median)
    assert p.floor_gap == pytest.approx(2.6 - loss(2000))
    o = oh.summarize_pairs([p])
    assert o.status == "floor" and math.isnan(o.estimate)
    assert o.describe() == f"floor (gap {2.6 - loss(2000):+.4f}; 1.00x where reached)"


def test_no_delay_cost_is_one():
    sync = curve(EVALS)
    assert oh.pair_overhead(sync, list(sync)).median == pytest.approx(1.0)


def test_noise_keeps_the_median_near_the_tax():
    """Gaussian noise (std 0.01) on 60 evals of both runs: the median over the band stays
    near 1.3, and the interval over 5 seeds holds 1.3."""
    rng = random.Random(0)
    ts = [40.0 * k for k in range(1, 61)]

    def noisy(c):
        return [(t, y + rng.gauss(0.0, 0.01)) for t, y in c]

    sync = {s: noisy(curve(ts)) for s in range(5)}
    delayed = {s: noisy(curve([1.3 * t for t in ts], stretch=1.3)) for s in range(5)}
    o = oh.overhead_over_seeds(sync, delayed)
    assert o.status == "tax" and o.num_seeds == 5
    assert all(abs(p.median - 1.3) < 0.08 for p in o.pairs)
    assert o.ci_low < 1.3 < o.ci_high and o.ci_high - o.ci_low < 0.1
    assert o.mean_pair is not None and abs(o.mean_pair.median - 1.3) < 0.05
    smoothed = oh.overhead_over_seeds(sync, delayed, oh.BandRule(ema_halflife=1.0))
    assert abs(smoothed.estimate - 1.3) < 0.1


def test_interval_over_seeds_is_a_t_interval_on_logs():
    """Three seeds taxed 1.2, 1.3, 1.4: geometric mean, t(0.975, df 2) = 4.3027 on the logs."""
    sync = {s: curve(EVALS) for s in range(3)}
    delayed = {s: curve([f * t for t in EVALS], stretch=f) for s, f in enumerate([1.2, 1.3, 1.4])}
    o = oh.overhead_over_seeds(sync, delayed)
    logs = [math.log(f) for f in (1.2, 1.3, 1.4)]
    m, sd = stats.mean(logs), stats.std(logs)
    half = 4.302652729911275 * sd / math.sqrt(3)
    assert [p.median for p in o.pairs] == pytest.approx([1.2, 1.3, 1.4], rel=1e-9)
    assert o.estimate == pytest.approx(math.exp(m))
    assert (o.ci_low, o.ci_high) == (pytest.approx(math.exp(m - half)),
                                     pytest.approx(math.exp(m + half)))  # fmt: skip
    assert (
        o.describe() == f"{math.exp(m):.2f}x [{math.exp(m - half):.2f}, {math.exp(m + half):.2f}]"
    )
    assert o.mean_pair is None  # the seeds' evals share no token count: no mean curve


def test_pairing_by_seed_and_mixed_floors():
    sync = {0: curve(EVALS), 1: curve(EVALS), 2: curve(EVALS)}
    taxed = curve([1.3 * t for t in EVALS], stretch=1.3)
    floored = curve(EVALS, fn=lambda t: max(loss(t), 2.6))
    o = oh.overhead_over_seeds(sync, {1: taxed, 2: floored, 7: taxed})  # seed 7 has no sync
    assert [p.seed for p in o.pairs] == [1, 2]
    assert o.status == "mixed" and o.num_floors == 1 and math.isnan(o.estimate)
    assert o.describe() == "floor in 1/2 seeds"
    one = oh.overhead_over_seeds(sync, {0: taxed})
    assert one.status == "tax" and one.estimate == pytest.approx(1.3)
    assert math.isnan(one.ci_low) and one.describe() == "1.30x"
    assert oh.overhead_over_seeds(sync, {}).status == "no pairs"
    flat = {0: [(1.0, 3.0), (2.0, 3.0)]}
    assert oh.overhead_over_seeds(flat, {0: taxed}).status == "no band"


def test_t_quantile_matches_tables():
    assert stats.t_quantile(0.975, 1) == pytest.approx(12.706204736, rel=1e-9)
    assert stats.t_quantile(0.975, 2) == pytest.approx(4.302652730, rel=1e-9)
    assert stats.t_quantile(0.975, 4) == pytest.approx(2.776445105, rel=1e-9)
    assert stats.t_quantile(0.025, 4) == pytest.approx(-2.776445105, rel=1e-9)
    assert stats.t_quantile(0.95, 30) == pytest.approx(1.697260887, rel=1e-9)
    m, lo, hi = stats.t_interval([1.0, 2.0, 3.0])
    assert (m, lo, hi) == (2.0, pytest.approx(2 - 4.302652730 / math.sqrt(3)),
                           pytest.approx(2 + 4.302652730 / math.sqrt(3)))  # fmt: skip
