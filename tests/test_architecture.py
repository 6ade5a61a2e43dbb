"""The rooms of docs/design.md ("Architecture") and their one-way import order: config ->
models, optim, data -> delay -> schedules -> sim, runtime -> rundir -> train -> launch ->
analysis -> verdict -> experiments -> cli. A module may import its own layer and the layers below, never
above (function-level imports included: they are dependencies too); no two modules import each
other, directly or through others; no room holds more than 15 Python files."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import stalepipe

PACKAGE = Path(stalepipe.__file__).parent
LAYER = {
    "config": 0,
    "errors": 0,
    "fileio": 0,
    "lazy": 0,
    "presets": 0,
    "models": 1,
    "optim": 1,
    "data": 1,
    "delay": 2,
    "schedules": 3,
    "sim": 4,
    "runtime": 4,
    "peers": 4,
    "rundir": 5,
    "train": 6,
    "launch": 7,
    "analysis": 8,
    "verdict": 9,
    "experiments": 10,
    "cli": 11,
    "__main__": 11,
}


def _part(module: str) -> str:
    """'stalepipe.runtime.stage' -> 'runtime'."""
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


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _target(node: ast.AST, name: str, modules: set[str]) -> list[str]:
    """The modules an import statement loads: `from stalepipe.a import b` is stalepipe.a.b
    when that is a module, else stalepipe.a."""
    if isinstance(node, ast.ImportFrom):
        subs = [f"{name}.{a.name}" for a in node.names if f"{name}.{a.name}" in modules]
        return subs or [name]
    return [name]


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p) for p in MODULES}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for path in MODULES:
        here = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                name = node.module
            elif isinstance(node, ast.Import):
                name = node.names[0].name
            else:
                continue
            if name.startswith("stalepipe."):
                graph[here] |= {t for t in _target(node, name, modules) if t in modules} - {here}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    assert _cycles(_graph()) == []


def test_the_circle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_room_holds_more_than_15_python_files():
    rooms = {p.parent for p in MODULES}
    crowded = {
        str(r.relative_to(PACKAGE)): n for r in rooms if (n := len(list(r.glob("*.py")))) > 15
    }
    assert not crowded


def test_sim_and_runtime_are_apart():
    """The simulator times schedules without torch.distributed; the runtime executes them
    without the cost model: neither room imports the other."""
    for path in MODULES:
        here = path.relative_to(PACKAGE).parts[0]
        if here in ("sim", "runtime"):
            other = "runtime" if here == "sim" else "sim"
            bad = [n for _, n in _imports(path) if _part(n) == other]
            assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"


def _function_lengths(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text())
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]


def test_files_and_functions_fit_on_a_screen():
    """docs/design.md, 'Style', rule 1: a backstop for reading, not a goal: no file over 450
    lines, no function over 80."""
    long_files = {
        str(p.relative_to(PACKAGE)): n
        for p in MODULES
        if (n := len(p.read_text().splitlines())) > 450
    }
    long_functions = {
        f"{p.relative_to(PACKAGE)}::{name}": n
        for p in MODULES
        for name, n in _function_lengths(p)
        if n > 80
    }
    assert not long_files and not long_functions, (long_files, long_functions)


# Every registry's names in order, as one printed line (run here and in a fresh process).
REGISTRY_NAMES = (
    "from stalepipe.config import CORRECTORS, DELAY_POLICIES, LR_SCHEDULES, OPTIMIZERS\n"
    "from stalepipe.config import PIPELINE_SCHEDULES\n"
    "regs = (OPTIMIZERS, DELAY_POLICIES, PIPELINE_SCHEDULES, LR_SCHEDULES, CORRECTORS)\n"
    "names = [list(r) for r in regs]\n"
)


@pytest.mark.parametrize("module", ["stalepipe.config", "stalepipe.cli"])
def test_config_and_cli_import_no_torch_and_see_every_component(module):
    """The registries the config validates against fill without torch (config/registry.py), so
    `stalepipe train --help` stays fast: a fresh process (this one imported torch) that imports
    only `module` sees every component that importing every module of the package registers,
    in the same order."""
    import importlib
    import pkgutil

    for m in pkgutil.walk_packages(stalepipe.__path__, "stalepipe."):
        if not m.name.endswith("__main__"):
            importlib.import_module(m.name)
    here: dict = {}
    exec(REGISTRY_NAMES, here)
    assert all(here["names"]), "an empty registry"
    code = (
        f"import sys, {module}\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch'}))\n"
        f"{REGISTRY_NAMES}print(names)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", str(here["names"])]


def test_design_counts_and_lists_every_room():
    """docs/design.md's architecture gives the rooms' count and layers as they are, and its table
    names every room."""
    import re

    text = (PACKAGE.parents[1] / "docs" / "design.md").read_text()
    section = text.split("## Architecture", 1)[1]
    m = re.search(r"\*\*(\d+) rooms on (\d+) layers\*\*", section)
    assert m, "docs/design.md: no '**N rooms on L layers**' in Architecture"
    assert (int(m[1]), int(m[2])) == (len(LAYER), len(set(LAYER.values())))
    table = section.split("```", 2)[1]
    missing = [room for room in LAYER if not re.search(rf"\b{re.escape(room)}\b", table)]
    assert not missing, f"rooms missing from design.md's table: {missing}"


def test_design_names_only_code_that_exists():
    """Every `room/file.py:Name` or `room/file.py:Class.method` that docs/design.md cites (its
    walks and recipes) names a file of the package and a function or class defined in it."""
    import re

    text = (PACKAGE.parents[1] / "docs" / "design.md").read_text()
    cited = set(re.findall(r"`([a-z_]+/[a-z_]+\.py):([A-Za-z_][\w.]*)", text))
    assert len(cited) > 20
    missing = []
    for path, name in sorted(cited):
        file = PACKAGE / path
        if not file.is_file():
            missing.append(f"{path} (no such file)")
            continue
        defined = {
            node.name
            for node in ast.walk(ast.parse(file.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        }
        if not set(name.split(".")) <= defined:
            missing.append(f"{path}:{name}")
    assert not missing, missing


def test_design_names_only_classes_and_files_that_exist():
    """Every class-like name docs/design.md puts in backticks (`DelaySchedule`,
    `PipelineSchedule.stages_of`) is defined in the package (or is a builtin), and every
    file path it cites (`delay/policies.py`, `tests/test_cli.py`) exists: a design text that
    names code which is gone (issue 43 found `LRSchedule`) fails here."""
    import builtins
    import re

    root = PACKAGE.parents[1]
    text = (root / "docs" / "design.md").read_text()
    defined = set(dir(builtins))
    for file in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Assign):
                defined |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                defined.add(node.target.id)
    classes = set(re.findall(r"`([A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*)(?:[.(][^`]*)?`", text))
    assert len(classes) > 10
    paths = set(re.findall(r"`((?:tests|benchmarks|docs)/[\w/.-]+|[a-z_]+/[a-z_]+\.py)", text))
    assert len(paths) > 20
    gone = sorted(c for c in classes if c not in defined)
    gone += sorted(p for p in paths if not (PACKAGE / p).exists() and not (root / p).exists())
    assert not gone, gone
