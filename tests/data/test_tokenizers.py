"""Tokenizers: every registered one round-trips text and saves/loads; GPT-2 gives GPT-2's ids."""

from __future__ import annotations

import pytest

from stalepipe.errors import DataError
from stalepipe.training.data import gpt2 as gpt2_module
from stalepipe.training.data import load_corpus
from stalepipe.training.data.registry import TOKENIZERS, tokenizer_class

SAMPLE = "To be, or not to be: that is the question.\n\n  Ophelia! café, naïve ✓ 日本 🎭 1234\t"


def _excerpt_texts():
    return [text for _, text in load_corpus("excerpt", None).documents()]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    texts = _excerpt_texts()
    out = {name: cls.build(lambda: texts, 300) for name, cls in TOKENIZERS.items() if name != "hf"}
    # hf is read from a user's tokenizer.json (`data prepare --tokenizer-file`): the bpe one's
    path = tmp_path_factory.mktemp("hf")
    out["bpe"].save(path)
    out["hf"] = TOKENIZERS["hf"].from_file(path / "tokenizer.json")
    return out


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_round_trip_ids_in_range_and_save_load(name, built, tmp_path):
    tok = built[name]
    assert tok.name == name
    ids = tok.encode(SAMPLE)
    assert tok.decode(ids) == SAMPLE
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert 0 <= tok.eot < tok.vocab_size
    assert tok.eot not in ids  # encode never emits the document separator
    assert tok.decode(tok.encode("")) == ""
    files = tok.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files)
    again = tokenizer_class(name).load(tmp_path)
    assert (again.vocab_size, again.eot) == (tok.vocab_size, tok.eot)
    assert again.encode(SAMPLE) == ids


def test_byte_tokenizer():
    tok = TOKENIZERS["byte"]()
    assert (tok.vocab_size, tok.eot) == (256, 0)
    assert tok.encode("Aé") == [65, 0xC3, 0xA9]
    assert tok.decode([65, 0xC3]) == "A\ufffd"  # cut mid-character: replaced, not an error


def test_gpt2_known_ids():
    tok = TOKENIZERS["gpt2"]()
    assert (tok.vocab_size, tok.eot) == (50257, 50256)
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode("Hello, world!") == [15496, 11, 995, 0]
    # A literal separator in text is text, not the eot id.
    assert 50256 not in tok.encode("a <|endoftext|> b")
    assert tok.decode([50256]) == "<|endoftext|>"


def test_gpt2_rejects_files_that_are_not_gpt2s(monkeypatch):
    monkeypatch.setitem(gpt2_module.FILE_SHA256, "vocab.bpe", "0" * 64)
    with pytest.raises(DataError, match="not GPT-2's file.*reinstall"):
        gpt2_module.gpt2_mergeable_ranks()


def test_bpe_training_is_deterministic_and_respects_vocab_size():
    texts = _excerpt_texts()
    bpe = TOKENIZERS["bpe"]
    a, b = bpe.build(lambda: texts, 400), bpe.build(lambda: texts, 400)
    assert a.vocab_size == 400
    assert a.encode(texts[0][:2000]) == b.encode(texts[0][:2000])
    # Merges learned: far fewer tokens than bytes on in-domain text.
    assert len(a.encode(texts[0])) < 0.6 * len(texts[0].encode())
    assert a.eot not in a.encode("x <|endoftext|> y")


def test_bpe_vocab_too_small():
    with pytest.raises(DataError, match=">= 257"):
        TOKENIZERS["bpe"].build(lambda: ["abc"], 100)


def test_bpe_load_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"tokenizer\.json is missing.*--force"):
        TOKENIZERS["bpe"].load(tmp_path)


def test_unknown_tokenizer_suggests_closest():
    with pytest.raises(DataError, match="did you mean 'gpt2'"):
        tokenizer_class("gpt3")
