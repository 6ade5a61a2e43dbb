"""`data prepare` from the ecosystem's formats: Parquet, JSONL with a named column, an HF
`datasets` save_to_disk directory (Arrow), with tiktoken's GPT-2 or an HF tokenizer.json; the
shards then train like the shipped corpora."""

import json
import sys

import numpy as np
import pytest

from stalepipe.cli import main
from stalepipe.training.data import load_tokenizer, read_manifest, read_shard, split_shards

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
ipc = pytest.importorskip("pyarrow.ipc")

DOCS = [f"Document {i}: to be, or not to be, that is the question number {i}." for i in range(12)]


def _parquet(path, column="content", docs=DOCS):
    pq.write_table(pa.table({"id": list(range(len(docs))), column: docs}), path)
    return path


def _datasets_dir(path, docs=DOCS):
    """What `datasets.Dataset.save_to_disk` writes: Arrow's streaming format and two JSONs."""
    path.mkdir()
    table = pa.table({"text": docs, "url": ["u"] * len(docs)})
    with ipc.new_stream(path / "data-00000-of-00001.arrow", table.schema) as writer:
        writer.write_table(table, max_chunksize=5)
    (path / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]})
    )
    (path / "dataset_info.json").write_text("{}")
    return path


def _tokens(out):
    """Every document's tokens, eot-split, from the prepared train and val shards."""
    ids = np.concatenate([read_shard(p) for s in ("train", "val") for p, _ in split_shards(out, s)])
    return ids


def _prepare(*args):
    return main(["data", "prepare", "--corpus", "text", *args])


def test_parquet_with_a_named_column_and_gpt2(tmp_path, capsys):
    from stalepipe.training.data.gpt2 import Gpt2Tokenizer

    src = _parquet(tmp_path / "shard.parquet")
    out = tmp_path / "out"
    assert (
        _prepare(
            "--text", str(src), "--text-column", "content", "--tokenizer", "gpt2", "--out", str(out)
        )
        == 0
    )
    m = read_manifest(out)
    assert m["text_column"] == "content" and m["tokenizer"]["name"] == "gpt2"
    assert sum(m["splits"][s]["num_documents"] for s in ("train", "val")) == len(DOCS)
    tokens = _tokens(out)
    first = Gpt2Tokenizer().encode(DOCS[0])
    assert any(list(tokens[i : i + len(first)]) == first for i in range(len(tokens)))
    err = capsys.readouterr().err
    assert "reading" in err and "tokenizing" in err  # progress, both passes


def test_a_missing_column_and_an_unreadable_file_are_one_line(tmp_path, capsys):
    src = _parquet(tmp_path / "shard.parquet")
    assert _prepare("--text", str(src), "--out", str(tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no column 'text' (its columns: id, content)" in err
    assert "--text-column NAME" in err and not (tmp_path / "out").exists()
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    assert _prepare("--text", str(tmp_path / "bad.parquet"), "--out", str(tmp_path / "o")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a readable Parquet file" in err
    ints = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"text": [1, 2, 3]}), ints)
    assert _prepare("--text", str(ints), "--out", str(tmp_path / "o")) == 2
    assert "holds int64, not text" in capsys.readouterr().err


def test_without_pyarrow_the_error_names_the_extra(tmp_path, monkeypatch, capsys):
    src = _parquet(tmp_path / "shard.parquet")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow -> ImportError
    assert (
        _prepare("--text", str(src), "--text-column", "content", "--out", str(tmp_path / "o")) == 2
    )
    assert "pip install 'stalepipe[data]'" in capsys.readouterr().err


def test_jsonl_column_and_datasets_directory(tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"body": d}) + "\n" for d in DOCS[:6]))
    data = _datasets_dir(tmp_path / "saved")
    out = tmp_path / "out"
    assert _prepare("--text", str(jsonl), "--text-column", "body", "--out", str(out)) == 0
    assert read_manifest(out)["splits"]["train"]["num_documents"] == 5
    out2 = tmp_path / "out2"
    assert _prepare("--text", str(data), "--out", str(out2)) == 0
    m = read_manifest(out2)
    assert sum(m["splits"][s]["num_documents"] for s in ("train", "val")) == len(DOCS)
    text = bytes(int(t) for t in _tokens(out2) if t).decode()
    assert all(d in text for d in DOCS)  # byte tokens: every row's text, whole


def test_hf_tokenizer_file_prepares_and_trains(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    hf.train_from_iterator(DOCS, trainer=trainer)
    hf.save(str(tmp_path / "tokenizer.json"))
    src = _parquet(tmp_path / "shard.parquet", column="text", docs=DOCS * 20)
    out = tmp_path / "out"
    assert (
        _prepare(
            "--text",
            str(src),
            "--tokenizer-file",
            str(tmp_path / "tokenizer.json"),
            "--out",
            str(out),
        )
        == 0
    )
    tok = load_tokenizer(out)
    assert (tok.name, tok.eot, tok.eot_text) == ("hf", hf.token_to_id("</s>"), "</s>")
    assert tok.encode(DOCS[3]) == hf.encode(DOCS[3]).ids
    vocab = read_manifest(out)["tokenizer"]["vocab_size"]
    args = [
        *("train", "--preset", "cpu-tiny", "--name", "hf-tok", "--out_dir", str(tmp_path / "runs")),
        *("--data.corpus", "text", "--data.tokenizer", "hf", "--data.data_dir", str(out)),
        *("--model.vocab_size", str(vocab), "--data.seq_len", "16", "--model.dim", "32"),
        *("--model.num_layers", "1", "--model.max_seq_len", "16", "--train.num_steps", "3"),
        *("--train.batch_size", "2", "--train.num_eval_batches", "1", "--train.progress", "false"),
    ]
    assert main(args) == 0
    assert "done: 3 steps" in capsys.readouterr().out
    # an hf tokenizer without its file, and a file without its end-of-text token: one line each
    assert _prepare("--text", str(src), "--tokenizer", "hf", "--out", str(tmp_path / "o")) == 2
    assert "pass --tokenizer-file PATH" in capsys.readouterr().err
    tok_file = str(tmp_path / "tokenizer.json")
    assert (
        _prepare(
            "--text",
            str(src),
            "--tokenizer-file",
            tok_file,
            "--eot-token",
            "<x>",
            "--out",
            str(tmp_path / "o"),
        )
        == 2
    )
    assert "--eot-token TOKEN" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
