"""Token overhead at sync's final loss (analysis/targets.py) on hand-made curves, and a
verdict-style reading where the band's median says "sooner" and the final target "later"."""

import math

import pytest

from stalepipe.lab.analysis import targets
from stalepipe.lab.analysis.overhead import overhead_over_seeds

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
    # a run planned twice as long (3.5 at 100 tokens, 0.1 lower per 100) ends at 1.6 after
    # 2000 tokens. Only complete runs are read (issue 40): its curve passes 2.0 mid-schedule at
    # 1600 tokens (1.6x, the old reading), but the final loss against planned length goes from
    # 2.05 at 1000 to 1.6 at 2000 and crosses 2.0 a ninth of the way, in log tokens: 2^(1/9)
    longer = [(100.0 * i, 3.5 - 0.1 * (i - 1)) for i in range(1, 21)]
    two = targets.target_overheads({0: SYNC}, {0: [delayed, longer]}, warmup_tokens=0.0)
    assert two["final"].missed == 0
    assert two["final"].seeds[0].multiplier == pytest.approx(2 ** (0.05 / 0.45))
    assert two["final"].describe() == "1.08x"
    # the order the runs come in does not matter: no run is picked as the best of several
    swapped = targets.target_overheads({0: SYNC}, {0: [longer, delayed]}, warmup_tokens=0.0)
    assert swapped["final"].seeds[0].multiplier == two["final"].seeds[0].multiplier


def test_the_final_crossing_reads_complete_runs_only():
    runs = [[(0.0, 5.0), (l, f)] for l, f in ((1.1, 2.04), (1.2, 2.02), (1.35, 1.99), (1.5, 1.97))]
    # 2.0 lies a third of the way from 2.02 (1.2x) to 1.99 (1.35x), in log tokens
    want = math.exp(math.log(1.2) + (0.02 / 0.03) * (math.log(1.35) - math.log(1.2)))
    assert targets.final_crossing(runs, 2.0) == pytest.approx(want)
    assert targets.final_crossing(runs, 2.05) == 1.1  # the shortest already there: its length
    assert math.isnan(targets.final_crossing(runs, 1.9))  # none: a bound, never extrapolated


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
