"""A study registered by a test module (`dummy_study.py`) is taken by `stalepipe sweep --help`,
a sweep's plan (`--dry-run`) and `stalepipe report`'s claims table, with no other file changed:
the registry is the only list of studies (studies/registry.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from stalepipe.cli import main
from stalepipe.lab.studies.registry import STUDIES, declared_claims, get_study, unregister

HERE = Path(__file__).parent
_spec = importlib.util.spec_from_file_location("curves", HERE.parent / "analysis" / "conftest.py")
_curves = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_curves)


def _load():
    """Import dummy_study.py by path (tests are no package), which registers 'dummy'."""
    spec = importlib.util.spec_from_file_location("dummy_study", HERE / "dummy_study.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def dummy():
    """'dummy' registered for one test (the registry is process-wide)."""
    yield _load()
    unregister("dummy")


def test_sweep_help_lists_it_and_takes_its_name(dummy, capsys):
    with pytest.raises(SystemExit) as e:
        main(["sweep", "--help"])
    assert e.value.code == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.split()[:1] == ["dummy"])
    assert line.split()[1:3] == ["12", "runs"]  # 2 batch sizes x sync / 2bw x 3 seeds
    assert list(STUDIES)[-1] == "dummy"  # listed last: its order is after every other


def test_a_dry_run_plans_its_runs(dummy, tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["sweep", "dummy", "--seeds", "2", "--dry-run", "--out", str(out)]) == 0
    text = capsys.readouterr()
    planned = {s.name for s in get_study("dummy").specs("cpu", 2)}
    assert len(planned) == 8
    assert all(name in text.out + text.err for name in planned)
    assert not out.exists()  # a dry run makes nothing


def test_the_report_checks_its_claim(dummy, tmp_path):
    root = tmp_path / "sweep"
    for s in get_study("dummy").specs("cpu", 2):
        delayed = s.overrides["delay.policy"] != "sync"
        _curves.write_curve_run(root, s.name, s.overrides, s.seed, stretch=1.3 if delayed else 1)
    assert main(["report", str(root)]) == 0
    table = (root / "report" / "report.md").read_text()
    assert "| A dummy study's delay costs loss (adamw_bs4_2bw) |" in table
    assert "| A dummy study's delay costs loss (adamw_bs8_2bw) |" in table


def test_it_is_gone_once_unregistered(capsys):
    dummy = _load()
    unregister("dummy")
    assert "dummy" not in STUDIES
    assert dummy.claim_dummy_delay_costs_loss not in declared_claims()
    with pytest.raises(SystemExit) as e:
        main(["sweep", "dummy", "--dry-run"])
    assert e.value.code == 2 and "invalid choice: 'dummy'" in capsys.readouterr().err


def test_a_name_or_an_order_taken_twice_is_refused(dummy):
    from dataclasses import replace

    from stalepipe.lab.studies.registry import register

    with pytest.raises(ValueError, match="'dummy' is registered twice: give it another name"):
        register(dummy.STUDY)
    with pytest.raises(ValueError, match=r"takes order 10, which 'optimizers' holds: give it"):
        register(replace(dummy.STUDY, name="dummy2", order=10))
    with pytest.raises(ValueError, match="'toy' is registered twice"):
        register(replace(dummy.STUDY, name="toy", order=10_000))
