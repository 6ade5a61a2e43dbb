"""The tokenizer interface every tokenizer implements, and the byte tokenizer.

A tokenizer maps text to ids in `[0, vocab_size)` and back. `eot` is the id written before every
document in the shards (the llm.c / modded-nanogpt convention: a shard starts with `eot`, and
`eot` separates documents), so a model learns where documents start.

Tokenizers that need files (the trained `bpe`) write them beside the shards with `save(dir)` and
are rebuilt with `load(dir)`; the manifest records which tokenizer a data directory uses.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import ClassVar


class Tokenizer(ABC):
    """Text <-> token ids. Subclasses set `name`, `vocab_size` and `eot`."""

    name: ClassVar[str]
    needs: ClassVar[tuple[str, ...]] = ()  # optional packages it imports (stalepipe.lazy.EXTRAS)
    vocab_size: int
    eot: int

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; never emits `eot` (text that spells a special token stays text)."""

    @abstractmethod
    def decode(self, ids: list[int]) -> str:
        """Text of `ids`; invalid UTF-8 (e.g. a sequence cut mid-character) becomes U+FFFD."""

    def save(self, directory: str | os.PathLike) -> list[str]:
        """Write the files `load` needs into `directory`; returns their names (none by default)."""
        return []

    @classmethod
    def load(cls, directory: str | os.PathLike) -> Tokenizer:
        """Rebuild the tokenizer `save` wrote into `directory`."""
        return cls()

    @classmethod
    def build(
        cls, texts: Callable[[], Iterable[str]], vocab_size: int, progress: bool = False
    ) -> Tokenizer:
        """Make the tokenizer for a corpus. `texts()` yields the training documents (only
        trained tokenizers call it); `vocab_size` is the target size for trained tokenizers."""
        return cls()


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens: vocab 256, no training, no files.

    The document separator `eot` is byte 0 (NUL), so the vocabulary stays 256 and a tiny model's
    `vocab_size=256` covers it. NUL never occurs in real text; documents are read with NULs
    removed (see `corpora.clean_text`) so the separator is unambiguous.
    """

    name = "byte"

    def __init__(self) -> None:
        self.vocab_size = 256
        self.eot = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")
