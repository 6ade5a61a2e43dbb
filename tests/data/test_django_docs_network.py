"""The real second corpus: downloads Django==5.2's sdist from PyPI (network, ~30 s with the BPE).

The one test that downloads it; everything else about the corpus runs on fake archives
(tests/data/test_corpora.py)."""

from __future__ import annotations

import json

import pytest

from stalepipe.config import DataConfig
from stalepipe.lab.studies.corpus2 import CORPUS2
from stalepipe.training.data import fetch, prepare_corpus, read_manifest, verify


@pytest.mark.network
def test_prepare_real_django_docs_as_the_corpus2_study_does(tmp_path, monkeypatch):
    monkeypatch.setenv("STALEPIPE_CACHE", str(tmp_path / "cache"))
    data = {k.removeprefix("data."): v for k, v in CORPUS2[1].items() if k.startswith("data.")}
    cfg = DataConfig(
        corpus=data["corpus"],
        tokenizer=data["tokenizer"],
        bpe_vocab_size=int(data["bpe_vocab_size"]),
        val_fraction=float(data["val_fraction"]),
        data_dir=str(tmp_path / "d"),
    )
    assert (cfg.corpus, cfg.tokenizer) == ("django-docs", "bpe")
    d = prepare_corpus(cfg, progress=False)
    m = read_manifest(d)
    train, val = m["splits"]["train"], m["splits"]["val"]
    # 617 pages, 6,017,944 bytes (pinned archive); 93 of them held out whole.
    assert train["num_documents"] + val["num_documents"] == 617
    assert train["text_bytes"] + val["text_bytes"] == 6_017_944
    assert val["num_documents"] == round(0.15 * 617)
    assert val["num_tokens"] >= 256_000  # 301,816 with tokenizers 0.23.3
    names = m["sources"]
    assert len(names) == 617 and "topics/db/models.txt" in names
    assert set(m["val_documents"]) < set(names)  # whole pages, named as in the sources
    # The tokenizer: 256 bytes + <|endoftext|> + merges, 1-4k merges.
    merges = json.loads((d / "tokenizer.json").read_text())["model"]["merges"]
    assert m["tokenizer"]["vocab_size"] == cfg.bpe_vocab_size == 257 + len(merges)
    assert 1_000 <= len(merges) <= 4_000
    assert m["license"].startswith("BSD-3-Clause") and fetch.DJANGO_DOCS.sha256 in m["origin"]
    verify(d)
    # A second prepare reuses the cache (no download) and splits identically.
    monkeypatch.setattr(fetch, "urlopen", lambda *a, **k: pytest.fail("downloaded twice"))
    again = read_manifest(prepare_corpus(cfg, force=True, progress=False))
    assert again["val_documents"] == m["val_documents"]
    assert again["splits"]["val"]["num_tokens"] == val["num_tokens"]
