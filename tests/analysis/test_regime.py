"""The regime checks (analysis/regime.py, claims.regime_check) on hand-made curves."""

import math

import pytest

from stalepipe.lab.analysis import regime, stats
from stalepipe.lab.analysis.claims import Finding, label, regime_check
from stalepipe.lab.analysis.results import Row, Run

_real_plateau_exit_of = regime.plateau_exit_of  # before conftest's patch over it


def test_plateau_exit_and_end_slope_by_hand():
    # 100 logged steps: window 5; loss 5.0 for 30 steps, then 4.0: the trailing mean drops
    # below 5.0 - 0.3 = 4.7 once at least 2 of its 5 values are 4.0 (mean 4.6), at index 31
    losses = [5.0] * 30 + [4.0] * 70
    assert regime.plateau_exit(losses, 5.0) == 31
    assert regime.plateau_exit([5.0] * 100, 5.0) is None
    # a line falling 0.01 per step: -0.01 x 10 steps (10% of 100) = -0.1 per tenth of the run
    assert regime.end_slope([10 - 0.01 * i for i in range(100)]) == pytest.approx(-0.1)
    run = Run("r", None, "finished", {}, curve=[(i, x) for i, x in enumerate(losses)])
    assert regime.exit_fraction(run, 5.0) == pytest.approx(0.32)
    assert math.isnan(regime.exit_fraction(run, math.nan))  # data not found: not read


_EXITS: dict[Row, float] = {}  # row -> its plateau exit, as `regime.plateau_exit_of` reads it


@pytest.fixture(autouse=True)
def _exits_as_set(monkeypatch, _synthetic_runs_leave_the_plateau_at_once):
    """Rows made by `_row` leave the plateau where it says (others at once, as conftest's)."""
    monkeypatch.setattr(regime, "plateau_exit_of", lambda r: _EXITS.get(r, 0.0))
    yield
    _EXITS.clear()


def _row(label, exit_at, values, gap=math.nan, baseline=None, unmitigated=None):
    """A row with a gap of `gap` (no test or interval: check (b) reads the gap only)."""
    nan = math.nan
    diff = None if math.isnan(gap) else stats.Difference(gap, nan, nan, nan, len(values), False)
    r = Row(
        label, {}, (), tuple(values), stats.mean(values), stats.std(values),
        baseline=baseline, gap=diff, unmitigated=unmitigated,
    )  # fmt: skip
    _EXITS[r] = exit_at
    return r


def test_a_row_s_plateau_exit_is_read_once_and_kept_beside_it(monkeypatch):
    """`plateau_exit_of` caches by row without writing into it (a row is immutable)."""
    losses = [5.0] * 30 + [4.0] * 70  # leaves the plateau at index 31 (the test above)
    run = Run("r", None, "finished", {}, curve=[(i, x) for i, x in enumerate(losses)])
    calls = []
    monkeypatch.setattr(regime, "run_entropy", lambda r: calls.append(r) or 5.0)
    row = Row("r", {}, (run,), (2.0,), 2.0, math.nan)
    assert _real_plateau_exit_of(row) == pytest.approx(0.32)
    assert _real_plateau_exit_of(row) == pytest.approx(0.32) and calls == [run]
    assert row in regime._EXITS


def test_regime_check_reads_a_late_exit_then_the_seed_spread():
    sync = _row("sync", 0.05, [2.0, 2.1, 2.2])  # std 0.1
    assert regime_check(_row("late", 0.3, [3.0, 3.0], 1.0, sync)) == "(a) plateau exit at 30% > 10%"
    assert regime_check(_row("never", math.inf, [3.0], 1.0, sync)).startswith(
        "(a) plateau exit never"
    )
    late_sync = _row("sync", 0.2, [2.0, 2.1, 2.2])
    assert regime_check(_row("ok", 0.05, [3.0], 1.0, late_sync)).startswith("(a) sync plateau exit")
    assert regime_check(_row("small gap", 0.05, [2.5], 0.3, sync)) == "(b) sync std 0.1000 > gap/5"
    assert regime_check(_row("fine", 0.05, [3.0], 1.0, sync)) == ""
    # an unread check (no token data) is never a pass: it caps the claim at inconclusive
    assert regime_check(_row("unread", math.nan, [3.0], 1.0, sync)).startswith("unread: ")
    found = Finding("c", holds=True, p=1e-4, evidence="e", seeds=5, need=5, partly="unread: x")
    assert label([found])[0].verdict == "inconclusive (unread: x)"
    assert label([found._replace(partly="(a) late")])[0].verdict == "partly ((a) late)"
    assert label([found._replace(partly="")])[0].verdict == "reproduced"
    # a mitigation is held to the unmitigated gap: EF's small remaining gap is the point
    plain = _row("2bw", 0.05, [3.0], 1.0, sync)
    ef = _row("2bw+ef", 0.05, [2.2], 0.1, sync, unmitigated=plain)
    assert regime_check(ef) == ""


def test_one_arm_failing_does_not_hide_another_arm_s_unread_check():
    """A claim over two arms, the first failing (a) and the second unread, is capped at
    'inconclusive (unread)', not labelled 'partly' by the first failure found."""
    from stalepipe.lab.analysis.claims import regime_failure

    sync = _row("sync", 0.05, [2.0, 2.1, 2.2])
    late, unread = _row("late", 0.3, [3.0], 1.0, sync), _row("unread", math.nan, [3.0], 1.0, sync)
    assert regime_failure(late, unread).startswith("unread: ") and regime_failure(
        unread, late
    ) == regime_failure(late, unread)
    assert regime_failure(late, _row("fine", 0.05, [3.0], 1.0, sync)).startswith("(a) plateau exit")
