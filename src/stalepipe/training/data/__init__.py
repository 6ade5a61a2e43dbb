"""Data: corpus -> tokenizer -> llm.c-format token shards (memmap) -> deterministic batches.

Typical use::

    data_dir = ensure_prepared(cfg.data)            # prepares the default cache on first use
    check_vocab(data_dir, cfg.model.vocab_size)
    train = TokenLoader(data_dir, "train", cfg.data.seq_len, cfg.data.seed)
    x, y = train.batch(step, batch_size)           # a pure function of (seed, split, step)

`prepare_main` is the body of `stalepipe data prepare`.
"""

from stalepipe.training.data.corpora import CORPORA, Corpus, load_corpus
from stalepipe.training.data.loader import (
    EVAL_SEED,
    TokenLoader,
    batch_seed,
    check_vocab,
    max_token_id,
)
from stalepipe.training.data.manifest import fingerprint, read_manifest, split_shards, verify
from stalepipe.training.data.prepare import (
    ensure_prepared,
    is_data_dir,
    prepare_command,
    prepare_corpus,
    prepare_main,
    summary,
    val_mask,
)
from stalepipe.training.data.registry import TOKENIZERS, load_tokenizer, tokenizer_class
from stalepipe.training.data.shards import ShardWriter, read_header, read_shard, write_shard
from stalepipe.training.data.tokenizer import ByteTokenizer, Tokenizer

__all__ = [
    "CORPORA",
    "EVAL_SEED",
    "TOKENIZERS",
    "ByteTokenizer",
    "Corpus",
    "ShardWriter",
    "TokenLoader",
    "Tokenizer",
    "batch_seed",
    "check_vocab",
    "ensure_prepared",
    "is_data_dir",
    "max_token_id",
    "prepare_command",
    "fingerprint",
    "load_corpus",
    "load_tokenizer",
    "prepare_corpus",
    "prepare_main",
    "read_header",
    "read_manifest",
    "read_shard",
    "split_shards",
    "summary",
    "tokenizer_class",
    "val_mask",
    "verify",
    "write_shard",
]
