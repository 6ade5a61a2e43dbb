"""Corpus -> tokenizer -> token shards + manifest, in one directory.

    data_dir/
      train_000000.bin ...   llm.c-format shards (a new shard past SHARD_TOKENS tokens)
      val_000000.bin ...
      tokenizer.json         only for tokenizers with files (bpe)
      .stalepipe.json        the marker of a directory stalepipe made (fileio.MARKER)
      manifest.json          written last: its presence means the directory is complete

Every document is preceded by the tokenizer's `eot` (the llm.c convention). The split is by
document: the validation set is the `round(val_fraction * N)` documents (at least 1, at most
N-1) whose SHA-256 of the name is smallest. It depends on document names only -- not on the
data seed, the file order or the machine -- so one prepared directory serves every seed.

Everything is written into a hidden staging directory beside the target and renamed into place
at the end, so an interrupted or failed prepare never leaves a half-written data directory and
never damages the previous one. `--force` replaces only a directory stalepipe made (marked)
that holds nothing but prepared data (`fileio.remove_owned_dir`'s rule).

Only the default cache (`data_dir` empty: `data_cache/<corpus>-<tokenizer>`) is prepared on
first use; an explicit `data_dir` must already hold data, so a typo is an error and not a new
directory silently filled with Shakespeare.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from stalepipe.config import DataConfig
from stalepipe.errors import DataError
from stalepipe.fileio import check_removable, make_temp_dir, mark_owned, refuse_protected
from stalepipe.lazy import require
from stalepipe.training.data.bpe import FILENAME as BPE_FILE
from stalepipe.training.data.corpora import JSONL_FIELD, Corpus, load_corpus
from stalepipe.training.data.hf_tokenizer import CONFIG as HF_CONFIG
from stalepipe.training.data.hf_tokenizer import HfTokenizer
from stalepipe.training.data.manifest import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    SPLITS,
    file_sha256,
    has_manifest,
    read_manifest,
    split_shards,
    write_manifest,
)
from stalepipe.training.data.registry import tokenizer_class
from stalepipe.training.data.shards import REPREPARE, ShardWriter, version_for_vocab
from stalepipe.training.data.tokenizer import Tokenizer

SHARD_TOKENS = 100_000_000  # as modded-nanogpt's FineWeb shards: ~200 MB of uint16 each
SPLIT_RULE = "val = round(val_fraction * N) documents (1..N-1) with the smallest sha256(name)"
DATA_KIND = "data"  # the kind in the marker of a prepared directory
# Everything prepare writes at the top of a data directory (`*.tmp` shards of a crash included):
# --force replaces a directory only when it holds nothing else.
DATA_ENTRIES = (MANIFEST, "train_*.bin", "val_*.bin", "*.tmp*", BPE_FILE, HF_CONFIG)
REPLACE_FIX = "choose another --out"
# `stalepipe data prepare`'s defaults
DEFAULT_TOKENIZER, DEFAULT_BPE_VOCAB, DEFAULT_VAL_FRACTION = "byte", 4096, 0.05


def val_mask(names: Sequence[str], val_fraction: float) -> list[bool]:
    """Which documents go to validation (see the module docstring for the rule)."""
    n = len(names)
    if n < 2:
        raise DataError(
            f"the corpus has {n} non-empty document(s); a train/val split by document needs at "
            "least 2 (split a large .txt into several files, or use .jsonl with one per line)"
        )
    num_val = min(n - 1, max(1, round(val_fraction * n)))
    # Ties (duplicate names) break by position, so the count is exact.
    order = sorted(range(n), key=lambda i: (hashlib.sha256(names[i].encode()).digest(), i))
    val = set(order[:num_val])
    return [i in val for i in range(n)]


class _SplitWriter:
    """Rolls one split's tokens over numbered shards of about SHARD_TOKENS tokens."""

    def __init__(self, directory: Path, split: str, version: int, shard_tokens: int) -> None:
        self.directory, self.split, self.version = directory, split, version
        self.shard_tokens = shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.num_documents = 0
        self.text_bytes = 0
        self.max_token_id = -1  # recorded, so that check_vocab never has to read the shards
        self._writer: ShardWriter | None = None

    def add(self, tokens: np.ndarray, text_bytes: int) -> None:
        # A document never straddles two shards: loader windows stay within one shard anyway.
        if self._writer is not None and self._writer.num_tokens >= self.shard_tokens:
            self._finish()
        if self._writer is None:
            name = f"{self.split}_{len(self.shards):06d}.bin"
            self._writer = ShardWriter(self.directory / name, self.version)
        self._writer.write(tokens)
        self.max_token_id = max(self.max_token_id, int(tokens.max()))
        self.num_documents += 1
        self.text_bytes += text_bytes

    def _finish(self) -> None:
        assert self._writer is not None
        path = self._writer.close()
        self.shards.append({"file": path.name, "num_tokens": self._writer.num_tokens})
        self._writer = None

    def close(self) -> dict[str, Any]:
        if self._writer is not None:
            self._finish()
        for shard in self.shards:
            shard["sha256"] = file_sha256(self.directory / shard["file"])
        return {
            "num_documents": self.num_documents,
            "num_tokens": sum(s["num_tokens"] for s in self.shards),
            "text_bytes": self.text_bytes,
            "max_token_id": self.max_token_id,
            "shards": self.shards,
        }

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()


def _check_target(out: Path, force: bool) -> None:
    """Refuse to touch `out` unless it is absent, empty, or (with force) data that stalepipe
    prepared and marked, holding nothing else."""
    if not out.exists():
        return
    if not out.is_dir():
        raise DataError(f"{out} exists and is not a directory; choose another output directory")
    if has_manifest(out):
        if not force:
            raise DataError(f"{out} already holds prepared data; pass --force to rebuild it")
        check_removable(out, DATA_KIND, DATA_ENTRIES, fix=REPLACE_FIX)
        return
    if any(out.iterdir()):
        # Even with --force: a directory without our manifest may be anything of the user's.
        raise DataError(
            f"{out} exists and is not a stalepipe data directory (no {MANIFEST}); refusing to "
            "replace it: choose another output directory"
        )
    refuse_protected(out, fix=REPLACE_FIX)  # an empty working directory is not replaced either


def _tokenize(
    corpus: Corpus,
    is_val: list[bool],
    tokenizer: Tokenizer,
    staging: Path,
    shard_tokens: int,
    progress: bool,
) -> dict[str, dict[str, Any]]:
    version = version_for_vocab(tokenizer.vocab_size)
    writers = {s: _SplitWriter(staging, s, version, shard_tokens) for s in SPLITS}
    try:
        docs = tqdm(
            corpus.documents(),
            total=len(is_val),
            desc="tokenizing",
            unit="doc",
            disable=not progress,
            file=sys.stderr,
        )
        count = 0
        for count, (_, text) in enumerate(docs, start=1):
            if count > len(is_val):
                break
            tokens = np.array([tokenizer.eot, *tokenizer.encode(text)], dtype=np.uint32)
            writers["val" if is_val[count - 1] else "train"].add(tokens, len(text.encode("utf-8")))
        if count != len(is_val):
            raise DataError("the input files changed while being prepared; run the command again")
        return {s: w.close() for s, w in writers.items()}
    except BaseException:
        for w in writers.values():
            w.abort()
        raise


def _move_into_place(staging: Path, out: Path) -> None:
    old = None
    if out.exists():
        # Keep the old directory until the new one is in place; remove it afterwards.
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    try:
        os.replace(staging, out)
    except OSError:
        if old is not None:
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def prepare_corpus(
    cfg: DataConfig,
    text_paths: Sequence[str | os.PathLike] | None = None,
    force: bool = False,
    progress: bool = True,
    shard_tokens: int = SHARD_TOKENS,
    *,
    text_column: str = JSONL_FIELD,
    tokenizer_file: str | os.PathLike | None = None,
    eot_token: str | None = None,
) -> Path:
    """Tokenize `cfg.corpus` with `cfg.tokenizer` into shards in `cfg.resolved_dir()`.

    `text_paths` are the files/directories of the `text` corpus (`text_column`: a .jsonl
    field's or a table column's name). The `hf` tokenizer is `tokenizer_file` (a
    tokenizer.json; `eot_token` its end-of-text token when it cannot be found). Refuses
    (DataError) to replace an existing prepared directory unless `force`, and never replaces a
    directory that is not one. Returns the directory. `shard_tokens` exists for tests; leave it
    at the default.
    """
    out = Path(cfg.resolved_dir())
    _check_target(out, force)
    tokenizer_cls = tokenizer_class(cfg.tokenizer)
    for module in tokenizer_cls.needs:  # named in one line before the corpus is read
        require(module, f"the {cfg.tokenizer} tokenizer")
    if cfg.tokenizer == "hf" and tokenizer_file is None:
        raise DataError("the hf tokenizer is a file: pass --tokenizer-file PATH (tokenizer.json)")
    if tokenizer_file is not None and cfg.tokenizer != "hf":
        raise DataError(f"--tokenizer-file is the hf tokenizer; drop --tokenizer {cfg.tokenizer}")
    if eot_token is not None and tokenizer_file is None:
        raise DataError("--eot-token names a token of a --tokenizer-file; give that file too")
    hf = HfTokenizer.from_file(tokenizer_file, eot_token) if tokenizer_file else None
    paths = [str(p) for p in text_paths or []]
    corpus = load_corpus(cfg.corpus, paths, progress, text_column)
    docs = tqdm(
        corpus.documents(), desc="reading", unit="doc", disable=not progress, file=sys.stderr
    )
    names = [name for name, _ in docs]  # the split is a function of the names
    is_val = val_mask(names, cfg.val_fraction)

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = make_temp_dir(out.parent, prefix=f".{out.name}.tmp-")
    try:
        mark_owned(staging, DATA_KIND)

        def train_texts():
            return (t for i, (_, t) in enumerate(corpus.documents()) if not is_val[i])

        tokenizer = hf or tokenizer_cls.build(train_texts, cfg.bpe_vocab_size, progress)
        tokenizer_files = tokenizer.save(staging)
        splits = _tokenize(corpus, is_val, tokenizer, staging, shard_tokens, progress)
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "corpus": corpus.name,
            "origin": corpus.origin,
            "license": corpus.license,
            "tokenizer": {
                "name": tokenizer.name,
                "vocab_size": tokenizer.vocab_size,
                "eot": tokenizer.eot,
                "files": tokenizer_files,
                **({"requested_vocab_size": cfg.bpe_vocab_size} if cfg.tokenizer == "bpe" else {}),
                **({"eot_text": hf.eot_text, "source": str(Path(tokenizer_file))} if hf else {}),
            },
            **({"text_column": text_column} if cfg.corpus == "text" else {}),
            "shard_version": version_for_vocab(tokenizer.vocab_size),
            "val_fraction": cfg.val_fraction,
            "split_rule": SPLIT_RULE,
            "splits": splits,
            "val_documents": [n for n, v in zip(names, is_val) if v],
            "sources": corpus.sources(),
        }
        write_manifest(staging, manifest)
        _check_target(out, force)  # again: another process may have prepared it meanwhile
        _move_into_place(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def is_data_dir(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds token data: a manifest, or shards of another tool
    (`*train*.bin`, e.g. from llm.c). Cheap: nothing is read or checked."""
    directory = Path(directory)
    return has_manifest(directory) or (directory.is_dir() and any(directory.glob("*train*.bin")))


def prepare_command(cfg: DataConfig, out: str | os.PathLike | None = None) -> str:
    """The `stalepipe data prepare` command that makes `cfg`'s data (into `out` if given)."""
    parts = ["stalepipe data prepare", f"--corpus {cfg.corpus}"]
    if cfg.corpus == "text":
        parts.append("--text PATH")
    if cfg.tokenizer == "hf":
        parts.append("--tokenizer-file PATH")
    elif cfg.tokenizer != DEFAULT_TOKENIZER:
        parts.append(f"--tokenizer {cfg.tokenizer}")
    if cfg.tokenizer == "bpe" and cfg.bpe_vocab_size != DEFAULT_BPE_VOCAB:
        parts.append(f"--bpe-vocab-size {cfg.bpe_vocab_size}")
    if cfg.val_fraction != DEFAULT_VAL_FRACTION:
        parts.append(f"--val-fraction {cfg.val_fraction:g}")
    if out is not None:
        parts.append(f"--out {out}")
    return " ".join(parts)


def reprepare(directory: str | os.PathLike, manifest: dict[str, Any]) -> str:
    """The fix for damaged shards in `directory`: the prepare command its manifest describes,
    with --force (the generic advice when the manifest names no corpus this stalepipe has)."""
    tokenizer = manifest["tokenizer"]
    try:
        cfg = DataConfig(
            corpus=str(manifest["corpus"]),
            tokenizer=str(tokenizer["name"]),
            val_fraction=float(manifest.get("val_fraction", DEFAULT_VAL_FRACTION)),
            bpe_vocab_size=int(tokenizer.get("requested_vocab_size", DEFAULT_BPE_VOCAB)),
        )
    except (KeyError, TypeError, ValueError):  # ConfigError is a ValueError
        return REPREPARE
    return f"re-prepare it: `{prepare_command(cfg, directory)} --force`"


def _check_split_and_vocab(out: Path, manifest: dict[str, Any], cfg: DataConfig) -> None:
    """A prepared directory must hold the split and the BPE size `cfg` asks for: the default
    cache's name says only the corpus and the tokenizer, so data prepared with another
    `val_fraction` would otherwise be read silently as if it were this config's."""
    have = {"data.val_fraction": manifest.get("val_fraction")}
    want: dict[str, Any] = {"data.val_fraction": cfg.val_fraction}
    if cfg.tokenizer == "bpe":
        have["data.bpe_vocab_size"] = manifest["tokenizer"].get("requested_vocab_size")
        want["data.bpe_vocab_size"] = cfg.bpe_vocab_size
    wrong = [f"{k}={have[k]} (the config asks for {v})" for k, v in want.items() if have[k] != v]
    if wrong:
        raise DataError(
            f"{out} was prepared with {', '.join(wrong)}; set data.data_dir to another "
            f"directory, or rebuild it with `{prepare_command(cfg, out)} --force`"
        )


def ensure_prepared(cfg: DataConfig, progress: bool = True) -> Path:
    """The data directory for `cfg`, preparing built-in corpora in the default cache.

    A directory with a manifest is checked (corpus and tokenizer match `cfg`, shard headers
    and sizes match the manifest) and returned. A directory of foreign shards (no manifest,
    `*train*.bin` present, e.g. from llm.c) is returned as is. An explicit `cfg.data_dir`
    without data (missing, empty, a typo) is a DataError naming the prepare command. Otherwise
    (the default cache) `shakespeare` and `excerpt` are prepared now; `text` needs an explicit
    `stalepipe data prepare`.
    """
    out = Path(cfg.resolved_dir())
    if has_manifest(out):
        manifest = read_manifest(out)
        have = (manifest["corpus"], manifest["tokenizer"]["name"])
        if have != (cfg.corpus, cfg.tokenizer):
            raise DataError(
                f"{out} holds corpus={have[0]} tokenizer={have[1]}, but the config asks for "
                f"corpus={cfg.corpus} tokenizer={cfg.tokenizer}; to train on it pass "
                f"--data.corpus {have[0]} --data.tokenizer {have[1]}, else set --data.data_dir to "
                "another directory"
            )
        _check_split_and_vocab(out, manifest, cfg)
        for split in SPLITS:
            split_shards(out, split)
        return out
    if is_data_dir(out):
        return out
    if cfg.data_dir:
        what = (
            "does not exist"
            if not out.exists()
            else "is not a directory"
            if not out.is_dir()
            else "is empty"
            if not any(out.iterdir())
            else f"holds no token data (no {MANIFEST}, no *train*.bin shards)"
        )
        raise DataError(
            f"data.data_dir {out} {what}; prepare it with `{prepare_command(cfg, out)}`, or "
            "leave data.data_dir empty to use the default cache"
        )
    if cfg.corpus == "text":
        raise DataError(f"no prepared data in {out}; run `{prepare_command(cfg)}`")
    try:
        return prepare_corpus(cfg, progress=progress)
    except DataError:
        if has_manifest(out):  # another process (e.g. another rank) prepared it meanwhile
            return ensure_prepared(cfg, progress)
        raise


def prepare_main(
    corpus: str | None = None,
    tokenizer: str | None = None,
    text: Sequence[str] | None = None,
    out: str | None = None,
    bpe_vocab_size: int = DEFAULT_BPE_VOCAB,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    force: bool = False,
    progress: bool = True,
    text_column: str = JSONL_FIELD,
    tokenizer_file: str | None = None,
    eot_token: str | None = None,
) -> Path:
    """`stalepipe data prepare`: prepare a corpus and print a short summary to stdout.

    `corpus=None` means `text` when `text` paths are given, else `shakespeare`. `out=None`
    means the default `data_cache/<corpus>-<tokenizer>`. Bad input raises a UserError
    (DataError / ConfigError) whose message is meant to be printed as one line.
    """
    corpus = corpus or ("text" if text else "shakespeare")
    tokenizer = tokenizer or ("hf" if tokenizer_file else DEFAULT_TOKENIZER)
    cfg = DataConfig(
        corpus=corpus,
        tokenizer=tokenizer,
        data_dir=out or "",
        bpe_vocab_size=bpe_vocab_size,
        val_fraction=val_fraction,
    )
    directory = prepare_corpus(
        cfg,
        text_paths=text,
        force=force,
        progress=progress,
        text_column=text_column,
        tokenizer_file=tokenizer_file,
        eot_token=eot_token,
    )
    print(summary(directory))
    return directory


def summary(directory: str | os.PathLike) -> str:
    """A few lines describing a prepared directory (corpus, tokenizer, docs/tokens per split)."""
    m = read_manifest(directory)
    tok = m["tokenizer"]
    lines = [
        f"prepared {m['corpus']} with the {tok['name']} tokenizer (vocab {tok['vocab_size']}, "
        f"eot {tok['eot']}) in {directory}"
    ]
    for split in SPLITS:
        s = m["splits"][split]
        docs = f"{s['num_documents']} document{'s' * (s['num_documents'] != 1)}"
        shards = f"{len(s['shards'])} shard{'s' * (len(s['shards']) != 1)}"
        lines.append(f"  {split + ':':6} {docs}, {s['num_tokens']:,} tokens in {shards}")
    return "\n".join(lines)
