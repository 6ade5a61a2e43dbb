"""GPT-2's BPE tokenizer (50257 ids), built offline with tiktoken.

tiktoken normally downloads GPT-2's `vocab.bpe` / `encoder.json` from OpenAI's blob store. The
same two files ship inside stalepipe (`data/gpt2_files/`, under GPT-2's licence, beside them):
we check their SHA-256 against the published GPT-2 files and build the `tiktoken.Encoding` from
them: no network at run time, and ids identical to tiktoken's "gpt2". tiktoken is the extra
`tokenizers` (`pip install 'stalepipe[tokenizers]'`), named in one line when missing.
"""

from __future__ import annotations

import functools
import hashlib
import json
from importlib import resources
from typing import Any

from stalepipe.errors import DataError
from stalepipe.lazy import require
from stalepipe.training.data.tokenizer import Tokenizer

EOT_TEXT = "<|endoftext|>"
EOT_ID = 50256
VOCAB_SIZE = 50257
# The split regex of the original GPT-2 release (openai/gpt-2 encoder.py).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# SHA-256 of GPT-2's published files (the same hashes tiktoken checks for its download).
FILE_SHA256 = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable character table, as character -> byte.

    GPT-2 stores tokens as strings in which each byte is one printable character: bytes that are
    printable Latin-1 (other than space) stand for themselves, the remaining 68 are shifted to
    code points 256, 257, ... in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def _read_package_file(name: str) -> bytes:
    try:
        data = resources.files("stalepipe.training.data").joinpath("gpt2_files", name).read_bytes()
    except FileNotFoundError as e:
        raise DataError(
            f"stalepipe/data/gpt2_files/{name} is missing: a broken install; reinstall stalepipe"
        ) from e
    if hashlib.sha256(data).hexdigest() != FILE_SHA256[name]:
        raise DataError(
            f"stalepipe/data/gpt2_files/{name} is not GPT-2's file (SHA-256 mismatch); "
            "reinstall stalepipe (pip install --force-reinstall stalepipe)"
        )
    return data


def gpt2_mergeable_ranks() -> dict[bytes, int]:
    """GPT-2's BPE ranks as tiktoken wants them: token bytes -> rank (= token id)."""
    alphabet = _byte_alphabet()
    encoder = json.loads(_read_package_file("encoder.json"))
    ranks = {bytes(alphabet[c] for c in token): i for token, i in encoder.items()}
    ranks.pop(EOT_TEXT.encode(), None)  # special, not a mergeable token
    # tiktoken merges by rank, so ranks must follow vocab.bpe's merge order: merge i makes token
    # 256 + i. Checking it costs ~50 ms and catches a mismatched pair of files.
    merges = _read_package_file("vocab.bpe").decode("utf-8").split("\n")[1:-1]
    for i, line in enumerate(merges):
        first, second = line.split(" ")
        token = bytes(alphabet[c] for c in first + second)
        assert ranks[token] == 256 + i, f"vocab.bpe merge {i} does not match encoder.json"
    assert len(ranks) == VOCAB_SIZE - 1
    return ranks


@functools.cache
def gpt2_encoding() -> Any:
    """The GPT-2 `tiktoken.Encoding`, built once per process from the packaged files."""
    return require("tiktoken", "the gpt2 tokenizer").Encoding(
        name="gpt2",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=gpt2_mergeable_ranks(),
        special_tokens={EOT_TEXT: EOT_ID},
        explicit_n_vocab=VOCAB_SIZE,
    )


class Gpt2Tokenizer(Tokenizer):
    """GPT-2 BPE: vocab 50257, `eot` = `<|endoftext|>` = 50256. Needs no files beside shards.

    Note the vocab is above what a tiny model's `vocab_size` covers: use `model.vocab_size 50304`
    (50257 rounded up to a multiple of 64, as nanoGPT does).
    """

    name = "gpt2"
    needs = ("tiktoken",)

    def __init__(self) -> None:
        self._enc = gpt2_encoding()
        self.vocab_size = VOCAB_SIZE
        self.eot = EOT_ID

    def encode(self, text: str) -> list[int]:
        # encode_ordinary: a literal "<|endoftext|>" in user text is text, not a separator.
        return self._enc.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids, errors="replace")
