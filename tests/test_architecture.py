"""The import direction of GUIDE section 3: models, optim, data -> delay -> pipeline -> train ->
experiments -> cli. A module may import its own layer and the layers below, never above
(function-level imports included: they are dependencies too)."""

import ast
from pathlib import Path

import pytest

import stalepipe

PACKAGE = Path(stalepipe.__file__).parent
LAYER = {
    "config": 0,
    "errors": 0,
    "fileio": 0,
    "presets": 0,
    "models": 1,
    "optim": 1,
    "data": 1,
    "delay": 2,
    "pipeline": 3,
    "train": 4,
    "experiments": 5,
    "cli": 6,
    "__main__": 6,
}


def _part(module: str) -> str:
    """'stalepipe.pipeline.stage' -> 'pipeline'."""
    return module.split(".")[1]


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out += [(node.lineno, n) for n in names if n.startswith("stalepipe.")]
    return out


MODULES = sorted(p for p in PACKAGE.rglob("*.py"))


def test_every_top_level_part_has_a_layer():
    parts = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in MODULES}
    assert parts - {"__init__"} <= LAYER.keys()


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path):
    here = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
    if here == "__init__":
        return
    bad = [
        f"line {line}: {name}" for line, name in _imports(path) if LAYER[_part(name)] > LAYER[here]
    ]
    assert not bad, f"{path.relative_to(PACKAGE)} imports from a higher layer: {bad}"
