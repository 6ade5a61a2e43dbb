"""The size ladder's labels by the project's own rules (analysis/ladder_labels.py, issue 51 item
2): the tests on hand-made ladders, then every figure RESULTS states, recomputed from the
committed records (docs/results/ladder-regime)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

from stalepipe.lab.analysis import ladder_labels as ll
from stalepipe.lab.analysis import scaling
from stalepipe.lab.studies.ladder import LADDER, LADDER_LRS

ROOT = Path(__file__).resolve().parents[2]
LADDER_ROOT = ROOT / "docs" / "results" / "ladder-regime"
SIZES = [n for _, _, n in LADDER]


def _ladder(c: float, noise: float, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {n: {s: 0.02 * (n / scaling.N0) ** -c + noise * rng.standard_normal()
                for s in range(3)} for n in SIZES}  # fmt: skip


def test_the_rank_tests_find_a_falling_gap_and_not_a_flat_one():
    j, pairs, p = ll.jonckheere(_ladder(1.0, 0.0005), draws=20_000)
    assert (j, pairs) == (90, 90) and p < 1e-4
    flat = [ll.jonckheere(_ladder(0.0, 0.01, seed=i), draws=2_000)[2] for i in range(60)]
    assert 0.0 < np.mean(np.array(flat) < 0.05) < 0.15  # about 5 % of flat ladders at 5 %
    rho, p = ll.rank_means({n: 1 / n for n in SIZES})  # falls at every one of 5 rungs
    assert rho == -1 and p == pytest.approx(2 / 120)  # exact, two-sided: 1/60


def test_the_per_seed_power_law_and_its_lack_of_fit():
    b, c, lo, hi = ll.per_seed_power(_ladder(0.8, 0.0005))
    assert lo < 0.8 < hi and c == pytest.approx(0.8, abs=0.1) and b == pytest.approx(0.02, 0.1)
    chi2, df, p = ll.lack_of_fit(_ladder(0.8, 0.0005))
    assert df == 3 and p > 0.001
    kinked = {n: {s: (0.05 if n < scaling.N0 else 0.001) * (1 + 0.02 * s) for s in range(3)}
              for n in SIZES}  # fmt: skip
    assert ll.lack_of_fit(kinked)[2] < 1e-6
    assert math.isnan(ll.lack_of_fit({**kinked, SIZES[-1]: {0: -0.01, 1: 0.0, 2: 0.001}})[0])


def test_chi2_sf_against_its_closed_forms():
    for x in (0.5, 2.0, 7.81, 12.5, 30.5, 193.4):  # 3 df: erfc(sqrt z) + 2 sqrt(z / pi) e^-z
        z = x / 2
        closed = math.erfc(math.sqrt(z)) + 2 * math.sqrt(z / math.pi) * math.exp(-z)
        assert ll.chi2_sf(x, 3) == pytest.approx(closed, rel=1e-9)
    assert ll.chi2_sf(3.841459, 1) == pytest.approx(0.05, rel=1e-5)


def _check(**kw) -> ll.WidthCheck:
    base = dict(optimizer="muon", width=32, params=49_440, steps=241, tokens=493_568, epochs=0.1,
                exits={"sync": 0.05, "2bw": 0.05, "2bw+ef": 0.05}, sync_sd=0.001,
                gaps={"2bw": 0.1, "2bw+ef": 0.05})  # fmt: skip
    return ll.WidthCheck(**{**base, **kw})


def test_regime_fails_names_each_check_and_an_unread_one_first():
    assert ll.regime_fails(_check(), ("sync", "2bw"), "2bw") == []
    late = _check(exits={"sync": 0.57, "2bw": math.inf, "2bw+ef": 0.05})
    assert ll.regime_fails(late, ("sync", "2bw"), "2bw") == [
        "(a) sync plateau exit at 57% > 10%", "(a) 2bw plateau exit never > 10%"]  # fmt: skip
    noisy = _check(sync_sd=0.003)  # against the arm's own gap: 0.05 / 5 = 0.01 passes
    assert ll.regime_fails(noisy, ("sync", "2bw+ef"), "2bw+ef") == []
    assert ll.regime_fails(_check(sync_sd=0.03), ("sync",), "2bw+ef") == [
        "(b) sync std 0.0300 > gap/5 (0.0100)"]  # fmt: skip
    assert ll.regime_fails(_check(gaps={"2bw": -0.001}), ("sync",), "2bw")[0].startswith("(b)")
    unread = _check(exits={"sync": math.nan, "2bw": 0.5})
    assert ll.regime_fails(unread, ("sync", "2bw"), "2bw")[0].startswith("unread: ")


def test_fit_label_follows_the_claims_table_s_rule():
    falls = scaling.trend(_ladder(1.0, 0.0005))
    d = ll.direction_tests(_ladder(1.0, 0.0005))
    fails = ["width 32: (a) sync plateau exit at 57% > 10%", "width 48: (a) 2bw plateau",
             "width 136: (b) sync std 0.0021 > gap/5 (0.0003)"]  # fmt: skip
    assert ll.fit_label(falls, 0.01, d, 0.01, fails) == (
        f"partly: {ll.CONFOUND} (regime checks failed: (a) at widths 32, 48; (b) at width 136)"
    )
    assert ll.fit_label(falls, 0.2, d, 0.01, []) == f"partly: {ll.CONFOUND}"  # per seed alone
    assert ll.fit_label(falls, 0.2, d, 0.2, []).startswith("inconclusive (registered Holm p 0.2")
    assert ll.fit_label(falls, 0.01, d, 0.01, ["width 32: unread: no data"]) == (
        "inconclusive (width 32: unread: no data)"
    )
    grows = scaling.trend(_ladder(-0.5, 0.0005))
    d_grows = ll.direction_tests(_ladder(-0.5, 0.0005))
    assert ll.fit_label(grows, 0.01, d_grows, 0.01, []).startswith("inconclusive (the gap grows")


# ---- the committed ladder ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def ladder():
    sys.path.insert(0, str(ROOT / "benchmarks" / "studies"))
    import ladder_fit

    finals = ladder_fit.finals(LADDER_ROOT)
    records = ll.ladder_records(LADDER_ROOT, LADDER_LRS)
    return ladder_fit, finals, records


def test_the_recorded_data_is_the_prepared_data():
    """RECORDED is what the token data gives, where it is on this machine (a fresh clone has no
    data_cache; the ladder's checks then read RECORDED)."""
    import json

    from stalepipe.training.data.manifest import unigram_entropy

    data = ROOT / "data_cache" / "shakespeare-byte-val0.08"
    if not (data / "manifest.json").exists():
        pytest.skip("the ladder's token data is not prepared here")
    train = json.loads((data / "manifest.json").read_text())["splits"]["train"]
    assert train["shards"][0]["sha256"] == ll.RECORDED["train_sha256"]
    assert train["num_tokens"] == ll.RECORDED["train_tokens"]
    assert unigram_entropy.__wrapped__(str(data)) == pytest.approx(ll.RECORDED["unigram_entropy"])


def test_the_ladder_s_regime_checks_from_its_records(ladder):
    """The figures RESULTS states: Muon sync leaves the plateau at 57 / 20 / 11 % of the run at
    widths 32-64, AdamW 2bw never in two seeds at width 32; width 136 trains 1.78 epochs."""
    _, finals, records = ladder
    checks = ll.width_checks(records, finals, {w: n for w, _, n in LADDER})
    assert len(checks) == 10
    muon = [round(100 * checks["muon", w].exits["sync"]) for w in (32, 48, 64, 96, 136)]
    assert muon == [57, 20, 11, 6, 3]
    exits = [ll.regime.exit_fraction(r, ll.RECORDED["unigram_entropy"])
             for r in records["adamw", 32, "2bw"].values()]  # fmt: skip
    assert sum(math.isinf(x) for x in exits) == 2
    assert round(checks["muon", 136].epochs, 2) == 1.78
    assert round(checks["muon", 96].sync_sd, 4) == 0.0030
    assert round(checks["muon", 136].sync_sd, 4) == 0.0021


def test_the_ladder_s_direction_tests_from_its_records(ladder):
    """The referee's figures (issue 51), reproduced: per-seed least squares c = 0.94 [0.59, 1.30]
    for Muon+EF; lack of fit 193 / 28.3 / 30.5 / 12.5 on 3 df; Muon's width means fall at every
    rung (exact p 1/60); every arm's label 'partly: ... not separated'."""
    ladder_fit, finals, records = ladder
    checks = ll.width_checks(records, finals, {w: n for w, _, n in LADDER})
    fitted = ladder_fit.registered_fits(finals)
    d = {k: ll.direction_tests(g) for k, (g, _, _) in fitted.items()}
    _, c, lo, hi = ll.per_seed_power(fitted["muon", "2bw+ef"][0])
    assert (round(c, 2), round(lo, 2), round(hi, 2)) == (0.94, 0.59, 1.30)
    chi2 = [round(d[k].chi2, 1) for k in fitted]  # adamw 2bw, 2bw+ef, muon 2bw, 2bw+ef
    assert chi2 == [193.4, 28.3, 30.5, 12.5]
    assert d["muon", "2bw"].rank_p == d["muon", "2bw+ef"].rank_p == pytest.approx(1 / 60)
    q_jt = dict(zip(d, ll.stats.holm([x.jt_p for x in d.values()])))
    for (name, arm), (_, t, q) in fitted.items():
        fails = [f"width {w.width}: {f}" for w in checks.values() if w.optimizer == name
                 for f in ll.regime_fails(w, ("sync", arm), arm)]  # fmt: skip
        label = ll.fit_label(t, q, d[name, arm], q_jt[name, arm], fails)
        assert label.startswith(f"partly: {ll.CONFOUND} (regime checks failed: (a) at widths 32")
