"""The plan of the house (docs/design.md, 'Architecture'): two wings over a small core.

- the **core** (config, errors, fileio, lazy, presets, hardware) imports neither wing;
- the **training wing** (`stalepipe.training`) never imports the lab, and inside it a room
  imports only the rooms at or below its rank (`TRAINING_ORDER`: the delay sits below
  everything pipelined, the loop above what it composes);
- the **lab** (`stalepipe.lab`) never imports the runtime, peers, the loop, the launcher or the
  tools for trained models, and reads runs only through rundir's record readers
  (`RECORD_READERS`); a sweep is handed the task that trains a run;
- the **top** (cli, `__main__`) composes both wings and nothing imports it; `stalepipe.delay` is
  the stable API's one entry, re-exporting the training wing's names;
- no two modules import each other, directly or through others.

Function-level imports count: they are dependencies too.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import stalepipe

PACKAGE = Path(stalepipe.__file__).parent
CORE = {"config", "errors", "fileio", "lazy", "presets", "hardware"}
TOP = {"cli", "__main__"}
API = {"delay"}  # stalepipe.delay: the stable names (docs/api.md)
TRAINING_ORDER = {
    "models": 0,
    "optim": 0,
    "data": 0,
    "delay": 1,
    "schedules": 2,
    "runtime": 3,
    "peers": 3,
    "rundir": 4,
    "train": 5,
    "launch": 6,
    "tools": 6,
}
LAB = {"sweeps", "studies", "analysis", "sim", "verdict"}
LAB_NEVER = {"runtime", "peers", "train", "launch", "tools"}  # what executes or serves runs
RECORD_READERS = {"status", "metrics", "directory", "lease", "resume", "checkpoint"}


def _room(module: str) -> tuple[str, str]:
    """'stalepipe.training.runtime.stage' -> ('training', 'runtime'); 'stalepipe.fileio' ->
    ('core', 'fileio'); 'stalepipe.cli.demo' -> ('top', 'cli')."""
    parts = module.split(".")[1:]
    if not parts:
        return ("root", "")
    if parts[0] in ("training", "lab"):
        return (parts[0], parts[1] if len(parts) > 1 else "")
    if parts[0] in CORE:
        return ("core", parts[0])
    if parts[0] in TOP:
        return ("top", parts[0])
    if parts[0] in API:
        return ("api", parts[0])
    return ("unknown", parts[0])


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


def _here(path: Path) -> str:
    return _module_name(path)


def test_every_module_sits_in_a_wing_the_core_or_the_top():
    """A new room is placed on purpose: in `TRAINING_ORDER`, `LAB`, `CORE` or `TOP`."""
    unplaced = []
    for p in MODULES:
        wing, room = _room(_here(p))
        known = {
            "training": room in TRAINING_ORDER or room == "",
            "lab": room in LAB or room == "",
        }.get(wing, wing in ("core", "top", "api", "root"))
        if not known:
            unplaced.append(_here(p))
    assert not unplaced, f"place these rooms in tests/test_architecture.py: {unplaced}"


def _violation(here: str, name: str) -> str | None:
    """Why `here` may not import `name`, or None."""
    (wing, room), (to_wing, to_room) = _room(here), _room(name)
    if to_wing == "top" and wing != "top":
        return "nothing imports the cli"
    if wing == "core" and to_wing in ("training", "lab", "api"):
        return "the core imports neither wing"
    if wing == "training" and to_wing in ("lab", "api"):
        return "the training wing never imports the lab"
    below = wing == to_wing == "training" and to_room and room
    if below and TRAINING_ORDER[to_room] > TRAINING_ORDER[room]:
        return f"{room} sits below {to_room} in the training wing"
    if wing == "lab" and to_wing == "training" and to_room in LAB_NEVER:
        return "the lab never imports what executes runs"
    if wing == "lab" and to_wing == "training" and to_room == "rundir":
        module = name.split(".")[3] if len(name.split(".")) > 3 else ""
        if module not in RECORD_READERS:
            return "the lab reads runs only through rundir's record readers"
    if wing == "lab" and to_wing == "api":
        return "inside the package, import the training wing's own path"
    return None


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_keep_the_plan(path):
    here = _here(path)
    bad = [
        f"line {line}: {name} ({why})"
        for line, name in _imports(path)
        if (why := _violation(here, name)) is not None
    ]
    assert not bad, f"{path.relative_to(PACKAGE)}: {bad}"


@pytest.mark.parametrize(
    "here, name",
    [
        ("stalepipe.config.base", "stalepipe.training.delay.policies"),
        ("stalepipe.training.rundir.status", "stalepipe.lab.analysis.stats"),
        ("stalepipe.training.delay.emulator", "stalepipe.training.runtime.stage"),
        ("stalepipe.lab.sweeps.sweep", "stalepipe.training.train.loop"),
        ("stalepipe.lab.analysis.results", "stalepipe.training.rundir.sharded"),
        ("stalepipe.lab.verdict.command", "stalepipe.cli.demo"),
    ],
)
def test_the_rules_catch_a_wrong_import(here, name):
    assert _violation(here, name) is not None


def test_the_rules_let_the_plan_through():
    assert _violation("stalepipe.lab.analysis.results", "stalepipe.training.rundir.status") is None
    assert _violation("stalepipe.training.train.loop", "stalepipe.training.delay") is None
    assert _violation("stalepipe.cli.demo", "stalepipe.training.train.loop") is None


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


_LAB_WITHOUT_TORCH = """
import importlib, pkgutil, sys
import stalepipe.lab
from stalepipe.cli import main
for m in pkgutil.walk_packages(stalepipe.lab.__path__, "stalepipe.lab."):
    importlib.import_module(m.name)
for argv in (["simulate", "--model", "smollm-360m", "--stages", "4", "--microbatches", "8"],
             ["info", "--preset", "moe-10b", "--pipeline.num_stages", "4"], ["presets"]):
    assert main(argv) == 0, argv
print(sorted({m.split(".")[0] for m in sys.modules} & {"torch"}), file=sys.stderr)
"""


def test_the_lab_and_the_model_arithmetic_load_no_torch():
    """The lab reads records, simulates and judges without torch (2 s of every command's start
    here): a fresh process that imports every module of the lab and runs `simulate`, `info` and
    `presets` (the model's counts, FLOPs and stage split: `config.shapes`) has not loaded it.
    The lab imports the training side's data or checkpoints only inside the functions that
    read them."""
    out = subprocess.run(
        [sys.executable, "-c", _LAB_WITHOUT_TORCH], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == "[]", out.stderr[-2000:]
    assert "4-stage split (balanced" in out.stdout and "moe-10b" in out.stdout


def _resolve(path: str) -> Path:
    """A file design.md cites by its room (`delay/policies.py`, `sweeps/sweep.py`), found in
    the core, the training wing or the lab (room names are unique across them)."""
    for base in (PACKAGE, PACKAGE / "training", PACKAGE / "lab"):
        if (base / path).exists():
            return base / path
    return PACKAGE / path


def test_design_draws_every_room():
    """docs/design.md's architecture picture names every room of both wings and the core."""
    import re

    text = (PACKAGE.parents[1] / "docs" / "design.md").read_text()
    section = text.split("## Architecture", 1)[1].split("\n## ", 1)[0]
    rooms = CORE | TOP | set(TRAINING_ORDER) | LAB
    missing = sorted(r for r in rooms if not re.search(rf"\b{re.escape(r)}\b", section))
    assert not missing, f"rooms missing from design.md's Architecture: {missing}"


def test_design_names_only_code_that_exists():
    """Every `room/file.py:Name` or `room/file.py:Class.method` that docs/design.md cites (its
    walks and recipes) names a file of the package and a function or class defined in it."""
    import re

    text = (PACKAGE.parents[1] / "docs" / "design.md").read_text()
    cited = set(re.findall(r"`([a-z_]+/[a-z_]+\.py):([A-Za-z_][\w.]*)", text))
    assert len(cited) > 20
    missing = []
    for path, name in sorted(cited):
        file = _resolve(path)
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
    gone += sorted(p for p in paths if not _resolve(p).exists() and not (root / p).exists())
    assert not gone, gone
