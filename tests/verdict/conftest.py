"""The verdict's tests read the same fixture run directories as the analysis tests (whole
validation curves with a known token overhead): tests/analysis/conftest.py, loaded here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "analysis_curve_fixtures", Path(__file__).parents[1] / "analysis" / "conftest.py"
)
assert _spec and _spec.loader
_curves = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_curves)

curve_sweep = _curves.curve_sweep
curve_run = _curves.curve_run
_synthetic_runs_leave_the_plateau_at_once = _curves._synthetic_runs_leave_the_plateau_at_once
