"""Every committed report can be told apart from a current one (issue 41: 'every committed report
is regenerated'): a report whose sweep's run records are committed beside it is regenerable by
`stalepipe report`; one without records (those of 2026-11-29, before the labelling rule) says so
in a banner at its top, so that no old "reproduced" label can be read as a current one."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"


def _reports() -> list[Path]:
    return sorted(RESULTS.glob("*/report.md")) + sorted(RESULTS.glob("*/report/report.md"))


def test_each_committed_report_has_its_records_or_says_it_is_superseded():
    reports = _reports()
    assert len(reports) >= 10, reports  # the glob reads the committed layout
    for report in reports:
        sweep = report.parent if report.parent.name != "report" else report.parent.parent
        records = list(sweep.glob("*/meta.json"))
        head = report.read_text().split("\n\n", 3)
        if records:
            continue
        assert head[1].startswith("> **Superseded"), f"{report}: no run records and no banner"
        assert "cannot be regenerated" in head[1]
