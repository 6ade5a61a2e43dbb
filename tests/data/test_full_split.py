"""The whole-split evaluation (issue 41): every target token of the split is scored exactly once,
in non-overlapping windows, and the training loop's final `val_loss_full` is what `stalepipe
eval --full-split` gives for the same checkpoint."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from stalepipe.config import ConfigError
from stalepipe.training.data import TokenLoader
from stalepipe.training.rundir.metrics import read_metrics
from stalepipe.training.tools.evaluate import evaluate_run
from stalepipe.training.train.loop import train


@pytest.mark.parametrize("batch_size", [1, 3, 64])
def test_every_target_token_is_scored_once(excerpt_data_dir, batch_size):
    loader = TokenLoader(excerpt_data_dir, "val", 16, seed=0)
    xs, ys = zip(*loader.full_split(batch_size))
    x, y = np.concatenate([a.numpy() for a in xs]), np.concatenate([b.numpy() for b in ys])
    assert (x[:, 1:] == y[:, :-1]).all()  # next-token targets inside each window
    want = np.concatenate(  # each shard's targets 1 .. k*16 in order: every token once
        [np.asarray(t[1 : 1 + (len(t) - 1) // 16 * 16]) for t in loader._tokens]
    )
    assert np.array_equal(y.reshape(-1), want.astype(np.int64))
    assert want.size > loader.num_tokens - 17 * len(loader._tokens)  # only the tails left out
    assert all(len(b) <= batch_size for b in ys)


def test_the_final_full_eval_equals_eval_full_split(tiny_config):
    tc = dataclasses.replace(tiny_config.train, final_eval_full=True)
    run = train(dataclasses.replace(tiny_config, train=tc), verbose=False).run_dir
    last = read_metrics(run)[-1]
    result = evaluate_run(run, full_split=True, tasks=())
    assert result["val"]["tokens"] == last["val_tokens_full"] > 0
    assert result["val"]["loss"] == pytest.approx(last["val_loss_full"], rel=1e-6)
    assert json.dumps(result)  # the record is plain JSON


def test_the_runtime_refuses_it_with_the_fix(tiny_config):
    with pytest.raises(ConfigError, match="stalepipe eval RUN --full-split"):
        dataclasses.replace(
            tiny_config,
            train=dataclasses.replace(tiny_config.train, final_eval_full=True),
            pipeline=dataclasses.replace(tiny_config.pipeline, engine="distributed", num_stages=2),
        )
