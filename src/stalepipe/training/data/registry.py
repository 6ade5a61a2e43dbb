"""The tokenizer registry and loading a data directory's tokenizer."""

from __future__ import annotations

import difflib
import os

from stalepipe.errors import DataError
from stalepipe.training.data.bpe import BpeTokenizer
from stalepipe.training.data.gpt2 import Gpt2Tokenizer
from stalepipe.training.data.hf_tokenizer import HfTokenizer
from stalepipe.training.data.manifest import read_manifest
from stalepipe.training.data.shards import REPREPARE
from stalepipe.training.data.tokenizer import ByteTokenizer, Tokenizer

TOKENIZERS: dict[str, type[Tokenizer]] = {
    "byte": ByteTokenizer,
    "gpt2": Gpt2Tokenizer,
    "bpe": BpeTokenizer,
    "hf": HfTokenizer,  # a tokenizer.json given to `data prepare --tokenizer-file`
}


def tokenizer_class(name: str) -> type[Tokenizer]:
    """The tokenizer class registered as `name`; DataError suggesting the closest name."""
    if name not in TOKENIZERS:
        close = difflib.get_close_matches(name, TOKENIZERS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise DataError(f"unknown tokenizer {name!r}; {hint}choose one of {', '.join(TOKENIZERS)}")
    return TOKENIZERS[name]


def load_tokenizer(data_dir: str | os.PathLike) -> Tokenizer:
    """The tokenizer a prepared directory was made with (for decoding samples, say)."""
    info = read_manifest(data_dir)["tokenizer"]
    tokenizer = tokenizer_class(info["name"]).load(data_dir)
    if (tokenizer.vocab_size, tokenizer.eot) != (info["vocab_size"], info["eot"]):
        raise DataError(
            f"the {info['name']} tokenizer in {data_dir} has vocab {tokenizer.vocab_size} / eot "
            f"{tokenizer.eot} but the manifest says {info['vocab_size']} / {info['eot']}; {REPREPARE}"
        )
    return tokenizer
