"""A Hugging Face tokenizer file (`tokenizer.json`: SmolLM's, Llama's, any `tokenizers` model) as
our tokenizer `hf`.

`stalepipe data prepare --tokenizer-file PATH` copies the file beside the shards (as `bpe` keeps
its own), so a data directory carries the tokenizer it was made with. `eot`, the id written
before every document, is the tokenizer's end-of-text token: `--eot-token`, else the
`eos_token` of a `tokenizer_config.json` beside the file, else the first of `EOT_CANDIDATES` the
tokenizer knows.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from stalepipe.errors import DataError
from stalepipe.lazy import require
from stalepipe.training.data.tokenizer import Tokenizer

FILENAME = "tokenizer.json"
CONFIG = "tokenizer_config.json"  # beside it: its eos_token, as transformers writes it
EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")


def _config_eos(path: Path) -> str | None:
    """The `eos_token` of the `tokenizer_config.json` beside `path`, if any."""
    config = path.parent / CONFIG
    try:
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    return eos.get("content") if isinstance(eos, dict) else eos if isinstance(eos, str) else None


class HfTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` read from a tokenizer.json file, with its end-of-text token."""

    name = "hf"
    needs = ("tokenizers",)

    def __init__(self, hf, eot_text: str) -> None:
        self._hf, self.eot_text = hf, eot_text
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self.eot = hf.token_to_id(eot_text)
        assert self.eot is not None

    @classmethod
    def from_file(cls, path: str | os.PathLike, eot_token: str | None = None) -> HfTokenizer:
        """The tokenizer in `path` (DataError, one line: missing, unreadable, no end-of-text)."""
        path = Path(path)
        Hf = require("tokenizers", "--tokenizer-file").Tokenizer
        if not path.is_file():
            raise DataError(f"--tokenizer-file {path} does not exist; give a tokenizer.json file")
        try:
            hf = Hf.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for unparsable files
            reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise DataError(f"--tokenizer-file {path} is not a tokenizer.json ({reason})") from None
        wanted = [eot_token] if eot_token else [_config_eos(path), *EOT_CANDIDATES]
        found = [t for t in wanted if t and hf.token_to_id(t) is not None]
        if not found:
            raise DataError(
                f"--tokenizer-file {path} has none of {', '.join(t for t in wanted if t)} as a "
                f"token; pass the token that ends a document with --eot-token TOKEN"
            )
        return cls(hf, found[0])

    def encode(self, text: str) -> list[int]:
        # no special tokens added, and user text that spells eot never becomes a boundary
        return self._hf.encode(text.replace(self.eot_text, ""), add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._hf.decode(ids, skip_special_tokens=False)

    def save(self, directory: str | os.PathLike) -> list[str]:
        """tokenizer.json, and its end-of-text token as the eos_token of a tokenizer_config.json
        (so `load`, and transformers' AutoTokenizer, find the same one)."""
        self._hf.save(str(Path(directory) / FILENAME))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": self.eot_text}
        (Path(directory) / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        return [FILENAME, CONFIG]

    @classmethod
    def load(cls, directory: str | os.PathLike) -> HfTokenizer:
        """The tokenizer `save` wrote into `directory` (a prepared data directory)."""
        return cls.from_file(Path(directory) / FILENAME)

    @classmethod
    def build(cls, texts, vocab_size, progress=False) -> HfTokenizer:
        raise DataError("the hf tokenizer is read from a file: pass --tokenizer-file PATH")
