"""`stalepipe eval`: val loss of a trained (MoE) run, offline multiple-choice scoring."""

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stalepipe.config import ModelConfig
from stalepipe.training.data import ByteTokenizer
from stalepipe.training.models import build_model
from stalepipe.training.tools.evaluate import (
    EvalError,
    MCItem,
    choice_logprobs,
    continuation_logprob,
    evaluate_run,
    format_results,
    load_task,
    multiple_choice_metrics,
    save_results,
    shakespeare_cloze,
    write_task,
)


class PrefersA(nn.Module):
    """A 'model' that puts 90% of its probability on byte 'a', the rest uniformly."""

    def forward(self, x):
        p = torch.full((256,), 0.1 / 255)
        p[ord("a")] = 0.9
        return p.log().expand(*x.shape, 256)


def test_scores_pick_the_likelier_choice_and_normalise_by_bytes():
    items = [
        MCItem("ctx ", ("bbbb", "aaaa"), 1),
        MCItem("ctx ", ("ab", "abbb"), 0),  # acc and acc_norm agree: fewer unlikely bytes
        MCItem("x", ("b", "aaaaaaaaab"), 1),  # less likely in all, likelier per byte: acc_norm
    ]
    lps = choice_logprobs(PrefersA(), ByteTokenizer(), items, max_len=32)
    la, lb = math.log(0.9), math.log(0.1 / 255)
    assert lps[0] == pytest.approx([4 * lb, 4 * la], rel=1e-5)
    m = multiple_choice_metrics(items, lps)
    # chance: two choices each, so guessing gets half right
    assert m == {"acc": pytest.approx(2 / 3), "acc_norm": 1.0, "chance": 0.5, "num_items": 3}
    assert lps[2] == pytest.approx([lb, 9 * la + lb], rel=1e-5)


def test_batched_scores_equal_one_at_a_time_and_the_loop_form():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, dim=32, num_layers=1, num_heads=2, num_kv_heads=1,
                      ffn_dim=32, max_seq_len=64, num_experts=4, top_k=2, expert_ffn_dim=16)  # fmt: skip
    model = build_model(cfg, seed=0).eval()
    items = shakespeare_cloze(num_items=6)
    batched = choice_logprobs(model, ByteTokenizer(), items, max_len=64, batch_size=16)
    single = choice_logprobs(model, ByteTokenizer(), items, max_len=64, batch_size=1)
    for a, b in zip(batched, single):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-4)
    # continuation_logprob == the per-token loop
    toks = torch.randint(0, 256, (10,))
    logits = torch.randn(9, 256)
    loop = sum(F.log_softmax(logits[t - 1], -1)[toks[t]].item() for t in range(4, 10))
    assert continuation_logprob(logits, toks, 4) == pytest.approx(loop, rel=1e-5)


def test_cloze_task_is_deterministic_and_round_trips(tmp_path):
    items = shakespeare_cloze(num_items=50, seed=1)
    assert items == shakespeare_cloze(num_items=50, seed=1) != shakespeare_cloze(50, seed=2)
    assert len(items) == 50 and all(len(i.choices) == 4 for i in items)
    assert len({i.answer for i in items}) == 4  # answers are shuffled
    assert load_task(write_task(items, tmp_path / "t.jsonl")) == items
    (tmp_path / "bad.jsonl").write_text('{"context": "a", "choices": ["x"], "answer": 0}\n')
    with pytest.raises(EvalError, match="bad.jsonl:1"):
        load_task(tmp_path / "bad.jsonl")


def test_eval_of_a_trained_moe_run_offline(tiny_config, tmp_path):
    from stalepipe.training.train.loop import train

    cfg = dataclasses.replace(
        tiny_config,
        model=dataclasses.replace(tiny_config.model, num_experts=4, top_k=2, expert_ffn_dim=32),
        train=dataclasses.replace(tiny_config.train, num_steps=4, eval_every=0),
    )
    result = train(cfg, verbose=False)
    task = write_task(shakespeare_cloze(num_items=8), tmp_path / "task.jsonl")
    out = evaluate_run(result.run_dir, tasks=("shakespeare-cloze", str(task)), num_items=12)
    # the defaults evaluate the batches the loop validated on: the same loss
    assert out["val"]["loss"] == pytest.approx(result.final_val_loss, rel=1e-5)
    assert out["val"]["perplexity"] == pytest.approx(math.exp(out["val"]["loss"]))
    # chance beside it: uniform over the vocabulary, and the training tokens' unigram entropy
    assert out["val"]["uniform_loss"] == pytest.approx(math.log(cfg.model.vocab_size))
    assert 0 < out["val"]["unigram_loss"] < out["val"]["uniform_loss"]
    text = format_results(out)
    assert f"chance: uniform {math.log(cfg.model.vocab_size):.4f}, unigram" in text
    assert "chance 0.250)" in text  # four choices per cloze item
    assert out["tasks"]["shakespeare-cloze"]["num_items"] == 12
    assert out["tasks"][str(task)]["num_items"] == 8
    assert 0.0 <= out["tasks"][str(task)]["acc"] <= 1.0
    path = save_results(out)
    assert path.name == f"eval_{out['step']:08d}.json" and json.loads(path.read_text()) == out
    with pytest.raises(EvalError, match="unknown task"):
        evaluate_run(result.run_dir, tasks=("hellaswag",), skip_loss=True)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, excerpt_data_dir):
    """A two-step tiny run to evaluate (module-wide: the refusals below only read it)."""
    from stalepipe.cli import main

    out = tmp_path_factory.mktemp("eval-runs")
    argv = ["train", "--preset", "cpu-tiny", "--out_dir", str(out), "--name", "r"]
    argv += ["--data.corpus", "excerpt", "--data.data_dir", excerpt_data_dir]
    argv += ["--train.num_steps", "2", "--train.warmup_steps", "0", "--train.progress", "false"]
    assert main(argv) == 0
    return out / "r"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--device", "cuda"], "--device cuda: this torch build (2.x+cpu) has no CUDA support; "
         "install a CUDA build of torch (README, Running at scale), or pass --device cpu"),
        (["--device", "tpu"], "--device must be cpu, cuda or cuda:N (N = a GPU index >= 0), "
         "got 'tpu'"),
        (["--num-items", "-3"], "--num-items must be a whole number >= 1, got -3"),
        (["--split", "test"], "--split must be one of train, val (the splits `stalepipe data "
         "prepare` writes), got 'test'"),
        (["--batches", "0"], "--batches must be a whole number >= 1, got 0; leave it out for "
         "the run's train.num_eval_batches"),
        (["--batches", "-1"], "--batches must be a whole number >= 1, got -1"),
        (["--batch-size", "0"], "--batch-size must be a whole number >= 1, got 0"),
        (["--seq-len", "0"], "--seq-len must be a whole number >= 1, got 0"),
    ],
)  # fmt: skip
def test_bad_eval_flags_are_one_line_before_the_checkpoint_is_read(
    trained_run, flags, message, capsys, monkeypatch
):
    """Each of these was a traceback (or, `--batches 0`, the default used silently); now one
    line listing what the flag takes, exit 2, and no eval_*.json."""
    from stalepipe.cli import main

    # a CPU-only build, whatever this one is
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch, "__version__", "2.x+cpu")
    assert main(["eval", str(trained_run), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"stalepipe: error: {message}") and err.count("\n") == 1, err
    assert not list(trained_run.glob("eval_*.json"))
    # the flags' valid neighbours work: one batch, one item (with torch as it is)
    monkeypatch.undo()
    if flags[0] in ("--batches", "--num-items"):
        out = str(trained_run.parent / "e.json")
        assert main(["eval", str(trained_run), flags[0], "1", "--out", out]) == 0
