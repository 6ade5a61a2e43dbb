"""Each number the README's "What we found so far" states is recomputed from the committed
records (docs/results/optimizers-regime), and each label read from the report the records give
(issue 41: 'a test recomputes each number the README states from the records'). The labels
come from the committed report because its regime checks read the token data, which a fresh
clone has not prepared (there they are 'unread' and cap every claim)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stalepipe.lab.analysis import stats
from stalepipe.lab.analysis.results import build_rows, load_runs, recovered_shares

ROOT = Path(__file__).resolve().parents[2]
SWEEP = ROOT / "docs" / "results" / "optimizers-regime"


@pytest.fixture(scope="module")
def rows():
    return {r.label: r for r in build_rows(load_runs(SWEEP))}


@pytest.fixture(scope="module")
def readme() -> str:
    return " ".join((ROOT / "README.md").read_text().split())


def _label(claim: str) -> str:
    """The committed report's label of `claim` (its claims table)."""
    for line in (SWEEP / "report" / "report.md").read_text().splitlines():
        if line.startswith(f"| {claim} |"):
            return line.split(" | ")[1]
    raise AssertionError(f"no claim {claim!r} in the committed report")


def test_the_gap_ratio(rows, readme):
    adam, muon = rows["adamw_2bw"], rows["muon_2bw"]
    seeds = min(len(adam.values), len(muon.values))
    text = (
        f"AdamW loses {adam.gap_diff / muon.gap_diff:.1f}x more to the delay than Muon "
        f"({adam.gap_diff:.3f} against {muon.gap_diff:.3f}, {seeds} seeds): **{_label(CLAIM_GAP)}**."
    )
    assert text in readme


CLAIM_GAP = "AdamW's gap (2bw) is much larger than Muon's"
CLAIM_EF = "Error feedback recovers most of the gap ({}_2bw)"


def _share(row) -> str:
    shares = recovered_shares(row)
    m, lo, hi = stats.t_interval(shares)
    assert m == pytest.approx(row.recovered.share)  # one estimator for the point and the interval
    return f"{m:.0%}".replace("%", " %") + f" [{lo * 100:.0f}, {hi * 100:.0f}]"


def test_error_feedback_s_share(rows, readme):
    """The size by the registered "inside" (issue 51): AdamW's miss states its scale; Muon's
    size is read beside its inconclusive direction."""
    adam = _label(CLAIM_EF.format("adamw"))
    direction, size, at = re.match(
        r"direction (.+); size (\S+ ?\S*) \(.*; measured at (.+)\)$", adam
    ).groups()
    assert f"recovers {_share(rows['adamw_2bw+ef'])} of AdamW's gap" in readme
    assert f"(direction **{direction}**)" in readme and f"(size **{size}** at {at})" in readme
    muon = re.match(r"direction (\w+) \(.*\); size (.+)$", _label(CLAIM_EF.format("muon")))
    assert muon and muon[2] == "consistent with the paper's 50%-70%"
    said = f"(direction **{muon[1]}**, size **{muon[2].replace('50%-70%', '50-70 %')}**)"
    assert f"of Muon's {_share(rows['muon_2bw+ef'])} {said}" in readme


def test_momentum_s_confounded_miss(readme):
    """AdamW's momentum claim misses with the LR moving with beta1: inconclusive (issue 51)."""
    momentum = SWEEP.parent / "momentum-regime" / "report" / "report.md"
    line = next(x for x in momentum.read_text().splitlines()
                if x.startswith("| Higher momentum shrinks the gap (adamw 2bw) |"))  # fmt: skip
    assert line.split(" | ")[1] == (
        "inconclusive (misses the claim, confounded: the LR moves with beta1)"
    )
    assert "but the LR moves with beta1 (**inconclusive**: a confounded miss" in readme


def test_muon_ef_s_gap_at_equal_tokens(rows, readme):
    r = rows["muon_2bw+ef"]
    lo, hi = r.gap.low, r.gap.high
    assert f"Muon+EF ends {r.gap_diff:.3f} [{lo:.3f}, {hi:.3f}] above" in readme
    assert "At equal tokens no delayed arm reaches sync's final loss at 0.43M parameters" in readme
    from stalepipe.lab.analysis.claims import scale_of

    at = scale_of(r).removeprefix("measured at ")
    assert f"**not reproduced** at {at}" in readme
    delayed = [rows[f"{o}_2bw{ef}"] for o in ("adamw", "muon") for ef in ("", "+ef")]
    assert all(d.gap.low > 0 for d in delayed)  # every interval above sync's loss


def test_muon_ef_s_token_overhead(readme):
    """Read from the lengths study's complete runs (1, 1.1, 1.2, 1.35 and 1.5x, issue 40)."""
    lengths = {r.label: r for r in build_rows(load_runs(SWEEP.parent / "lengths-regime"))}
    est, lo, hi = lengths["muon_2bw+ef"].targets["final"].interval()
    assert f"Muon+EF needs {est:.2f}x [{lo:.2f}, {hi:.2f}] sync's tokens" in readme
    adamw_ef = lengths["adamw_2bw+ef"].targets["final"].interval()[0]
    muon = lengths["muon_2bw"].targets["final"].interval()[0]
    assert f"AdamW+EF ({adamw_ef:.2f}x the tokens)" in readme and f"Muon ({muon:.2f}x)" in readme


def test_the_ladder_s_overhead_and_its_360m_interval(readme):
    """The README's size-ladder sentence: the widths' non-embedding sizes, the range of
    Muon+EF's width means, and the registered fit's interval at 360M, from the ladder's records."""
    from stalepipe.lab.analysis import scaling

    ladder = ROOT / "docs" / "results" / "ladder-regime"
    points, _ = scaling.ladder_overheads(scaling.ladder_runs(ladder), "muon", "2bw+ef")
    means = [1 + m for m in scaling.width_means(points).values()]
    sizes = f"{min(points) // 1000}k-{max(points) // 1000}k non-embedding parameters"
    assert sizes in readme
    assert f"stays at {min(means):.2f}-{max(means):.2f}x" in readme
    _, lo, hi, _ = scaling.overhead_at(ladder, scaling.SMOLLM_360M)
    assert f"[{lo:.2f}, {hi:.1e}]" in readme


def test_the_ladder_s_gap_fits_and_muon_s_360m_interval(readme, ladder_fit):
    """The README's size-ladder bullet: the label by the project's rules (issue 51), the
    per-seed rank test, Muon sync's plateau exits, each registered fit's shrink rate, interval
    and Holm p, their lack of fit, and Muon's 360M prediction, as
    `benchmarks/studies/ladder_fit.py` prints them from the records."""
    import sys

    from stalepipe.lab.analysis.ladder_labels import CONFOUND

    stdout = ladder_fit[0]  # the script's output, run once for every test (tests/conftest.py)
    fit = r"^(\w+) (2bw\S*): power fit, shrink rate (\S+) \[(\S+), (\S+)\], Holm p (\S+): (\w+)"
    fits = {(m[1], m[2]): m.groups()[2:] for m in re.finditer(fit, stdout, re.M)}
    assert len(fits) == 4, stdout[-500:]

    def said(key) -> str:
        c, lo, hi, q, _ = fits[key]
        return f"{float(c):.2f} [{float(lo):.2f}, {float(hi):.2f}], Holm p {float(q):.2g}"

    assert f"Muon+EF's shrink rate {said(('muon', '2bw+ef'))}" in readme
    assert f"Muon's {said(('muon', '2bw'))}; AdamW's {said(('adamw', '2bw'))}" in readme
    labels = re.findall(r"^  label \(issue 51\): (.+)$", stdout, re.M)
    assert len(labels) == 4 and all(x.startswith(f"partly: {CONFOUND} (") for x in labels)
    assert f"**partly: {CONFOUND}**" in readme
    holm = re.findall(r"^  per seed: .* \(Holm (\S+)\); width", stdout, re.M)
    assert holm[2] == holm[3] and f"Holm p {holm[2]} for Muon and Muon+EF" in readme
    exits = [re.search(rf"^muon +{w} .* (\d+)% / \S+ / \S+ ", stdout, re.M)[1]
             for w in (32, 48, 64)]  # fmt: skip
    assert f"({exits[0]} %, {exits[1]} %, {exits[2]} % of the run)" in readme
    chi2 = [float(x) for x in re.findall(r"lack of fit of the width means: chi2 (\S+)", stdout)]
    assert f"chi-squared {min(chi2):.3g} to {max(chi2):.3g} on 3 df" in readme
    muon = re.search(
        r"^muon 2bw: .*\n(?:  .*\n)*?  one run at 360M \(amended method\): \S+ (\[\S+ \S+\]); "
        r"paper 0.012: (.+)$", stdout, re.M,
    )  # fmt: skip
    assert muon and muon[2] == "inconclusive (too wide)"
    assert f"puts Muon's gap at {muon[1]}, below the paper's 0.012" in readme
    ladder = ROOT / "docs" / "results" / "ladder-regime"
    sys.path.insert(0, str(ROOT / "benchmarks" / "studies"))
    import ladder_fit as script

    widest = list(script.gaps(script.finals(ladder), "muon", "2bw+ef").values())[-1]
    m, lo, hi = stats.t_interval(list(widest.values()))
    assert f"Muon+EF's gap is {m:.4f} [{lo:+.4f}, {hi:+.4f}]: not told from 0" in readme
