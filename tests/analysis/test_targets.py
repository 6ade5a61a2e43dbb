"""Token overhead at sync's final loss (analysis/targets.py) on hand-made curves, and a
verdict-style reading where the band's median says "sooner" and the final target "later"."""

import math

import pytest

from stalepipe.analysis import targets
from stalepipe.analysis.overhead import overhead_over_seeds

# sync: 3.0 at 100 tokens falling linearly to 2.0 at 1000 tokens (10 evals)
SYNC = [(100.0 * i, 3.0 - (i - 1) / 9) for i in range(1, 11)]


def test_targets_are_the_final_loss_and_shares_of_the_drop():
    t = targets.target_losses(SYNC)
    assert t["final"] == pytest.approx(2.0)
    assert t["90%"] == pytest.approx(3.0 - 0.9) and t["99%"] == pytest.approx(3.0 - 0.99)


def test_a_delayed_run_short_of_the_final_loss_is_a_bound_until_a_longer_run_reaches_it():
    # the delayed run is the same line 0.05 higher: it ends at 2.05, never reaching 2.0 ...
    delayed = [(x, y + 0.05) for x, y in SYNC]
    one = targets.target_overheads({0: SYNC}, {0: [delayed]}, warmup_tokens=0.0)
    assert one["final"].missed == 1 and one["final"].describe() == "> 1.00x (1/1 seeds short)"
    # ... at 90% of the drop (2.1) it is late by 0.05 / (1/900) = 45 tokens: T_sync(2.1) = 910
    assert one["90%"].seeds[0].multiplier == pytest.approx(955 / 910)
    # a run planned twice as long (3.5 at 100 tokens, 0.1 lower per 100) reaches 2.0 at 1600
    # tokens: 1.6x sync's 1000
    longer = [(100.0 * i, 3.5 - 0.1 * (i - 1)) for i in range(1, 21)]
    two = targets.target_overheads({0: SYNC}, {0: [delayed, longer]}, warmup_tokens=0.0)
    assert two["final"].missed == 0 and two["final"].seeds[0].multiplier == pytest.approx(1.6)
    assert two["final"].describe() == "1.60x"


def test_targets_inside_warmup_are_not_read():
    got = targets.target_overheads({0: SYNC}, {0: [SYNC]}, warmup_tokens=2000.0)
    assert all(t.describe() == "in warmup" for t in got.values())
    assert math.isnan(got["final"].interval()[0])


def test_over_seeds_geometric_mean_with_an_interval():
    delayed = {s: [[(x * m, y) for x, y in SYNC]] for s, m in enumerate((1.1, 1.2, 1.3))}
    got = targets.target_overheads({s: SYNC for s in range(3)}, delayed, warmup_tokens=0.0)
    est, low, high = got["final"].interval()
    assert est == pytest.approx((1.1 * 1.2 * 1.3) ** (1 / 3)) and low < est < high


def test_the_band_median_says_sooner_where_the_final_target_says_later():
    """A delayed run that keeps pace early and stalls at the end: the band's median multiplier
    (most targets early) is about 1, but sync's final loss is never reached: the final target
    is a bound above 1, which a verdict must not read as a speed-up."""
    stall = [(x, max(y, 2.08)) for x, y in SYNC]
    band = overhead_over_seeds({0: SYNC}, {0: stall})
    final = targets.target_overheads({0: SYNC}, {0: [stall]}, warmup_tokens=0.0)["final"]
    assert band.status == "floor" and band.pairs[0].reached_median == pytest.approx(1.0)
    assert final.missed == 1 and final.describe().startswith("> 1.00x")
