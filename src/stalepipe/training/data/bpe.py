"""A byte-level BPE tokenizer trained on the corpus itself, with HF `tokenizers`.

Byte-level means the base alphabet is the 256 bytes (GPT-2's printable-character mapping), so
any text encodes without unknown tokens. Training sees only the train split, so validation text
never leaks into the vocabulary. The trained tokenizer is saved beside the shards as
`tokenizer.json` (HF format: `tokenizers.Tokenizer.from_file` reads it as is).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from stalepipe.errors import DataError
from stalepipe.lazy import require
from stalepipe.training.data.tokenizer import Tokenizer

EOT_TEXT = "<|endoftext|>"
FILENAME = "tokenizer.json"


class BpeTokenizer(Tokenizer):
    """Byte-level BPE; `eot` is the special token `<|endoftext|>` (id 0).

    `vocab_size` is the trained size: at most the requested size, smaller when the corpus has
    too few distinct pairs to merge.
    """

    name = "bpe"
    needs = ("tokenizers",)

    def __init__(self, hf: Any) -> None:
        self._hf = hf
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        eot = hf.token_to_id(EOT_TEXT)
        assert eot is not None, "a stalepipe BPE tokenizer always has <|endoftext|>"
        self.eot = eot

    def encode(self, text: str) -> list[int]:
        # HF matches added tokens before BPE; strip the literal separator so user text can
        # never inject a document boundary (same contract as tiktoken's encode_ordinary).
        return self._hf.encode(text.replace(EOT_TEXT, ""), add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._hf.decode(ids, skip_special_tokens=False)

    def save(self, directory: str | os.PathLike) -> list[str]:
        self._hf.save(str(Path(directory) / FILENAME))
        return [FILENAME]

    @classmethod
    def load(cls, directory: str | os.PathLike) -> BpeTokenizer:
        path = Path(directory) / FILENAME
        if not path.is_file():
            raise DataError(f"{path} is missing; re-run `stalepipe data prepare --force`")
        try:
            return cls(require("tokenizers", "the bpe tokenizer").Tokenizer.from_file(str(path)))
        except Exception as e:  # HF raises a bare Exception for unparsable files
            raise DataError(
                f"{path} is not a valid tokenizer file ({e}); re-run `stalepipe data prepare --force`"
            ) from e

    @classmethod
    def build(
        cls, texts: Callable[[], Iterable[str]], vocab_size: int, progress: bool = False
    ) -> BpeTokenizer:
        """Train on `texts()` to (at most) `vocab_size` ids, `<|endoftext|>` included."""
        if vocab_size < 257:
            raise DataError(f"bpe vocab size must be >= 257 (256 bytes + eot), got {vocab_size}")
        tk = require("tokenizers", "the bpe tokenizer")
        hf = tk.Tokenizer(tk.models.BPE())
        # GPT-2's split regex and no prefix space: the same pre-tokenization as the gpt2 tokenizer.
        hf.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        hf.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT_TEXT],
            # All 256 bytes up front, so text unseen in training still encodes.
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
            show_progress=progress,
        )
        hf.train_from_iterator((t.replace(EOT_TEXT, "") for t in texts()), trainer=trainer)
        return cls(hf)
