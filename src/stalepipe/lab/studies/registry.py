"""The registry of studies, `STUDIES`: every study module of this package, found, not listed.

A study is one module here (its grid, its own constants, the claims it owns) that declares
`STUDY = Study(...)`, or a tuple of them for a study run in phases (`ladder.py`). Importing
this module imports every module of the package in name order and registers what each
declares, so adding a study touches its file (and a test) only; a study defined elsewhere (a
test's) calls `register`. `STUDIES` lists them by `Study.order`, whatever the file names.

Every module of the package is imported by `stalepipe sweep --help`, so none imports torch at
module level (tests/test_cli.py).
"""

from __future__ import annotations

import importlib
import pkgutil

from stalepipe.config import unknown_choice
from stalepipe.lab.analysis.claims import ClaimCheck
from stalepipe.lab.studies.study import Study

STUDIES: dict[str, Study] = {}
# `stalepipe sweep toy` runs the `stalepipe toy` command (studies/toy.py), not a study
RESERVED = ("toy",)


def register(study: Study) -> Study:
    """Add `study` at its `order`; a name or an order taken twice is a programming error."""
    if study.name in STUDIES or study.name in RESERVED:
        raise ValueError(f"study {study.name!r} is registered twice: give it another name")
    holder = next((s.name for s in STUDIES.values() if s.order == study.order), None)
    if holder is not None:
        raise ValueError(
            f"study {study.name!r} takes order {study.order}, which {holder!r} holds: give it "
            f"one after {max(s.order for s in STUDIES.values())}"
        )
    listed = sorted([*STUDIES.values(), study], key=lambda s: s.order)
    STUDIES.clear()
    STUDIES.update((s.name, s) for s in listed)
    return study


def unregister(name: str) -> None:
    """Remove `name` (a test that registered a study cleans up with this)."""
    del STUDIES[name]


def _register_the_package() -> None:
    """Import every module of this package, in name order, and register what it declares."""
    package = importlib.import_module(__package__)  # stalepipe.lab.studies
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__package__}.{info.name}")
        declared = getattr(module, "STUDY", ())
        for study in declared if isinstance(declared, tuple) else (declared,):
            if not isinstance(study, Study):
                raise TypeError(f"{module.__name__}.STUDY must be a Study or a tuple of them")
            register(study)


def declared_claims() -> list[ClaimCheck]:
    """Every claim function some study declares, each once, in the order of first declaration
    (the report's claims table follows it)."""
    return list(dict.fromkeys(c for s in STUDIES.values() for c in s.claims))


def get_study(name: str) -> Study:
    """The study `name`; an unknown name raises ConfigError suggesting the closest one (`toy`
    is not a study here: `stalepipe sweep toy` runs the `stalepipe toy` command)."""
    if name not in STUDIES:
        raise unknown_choice("study", name, STUDIES)
    return STUDIES[name]


_register_the_package()
