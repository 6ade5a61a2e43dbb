"""`stalepipe generate`: a run's checkpoint or its HF export continues a prompt, the same under
a seed, and the two agree token for token when greedy."""

import pytest

from stalepipe.cli import main
from stalepipe.training.train.loop import train


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, excerpt_data_dir):
    import dataclasses

    from stalepipe.config import DataConfig, ExperimentConfig, ModelConfig, TrainConfig

    out = tmp_path_factory.mktemp("runs")
    cfg = ExperimentConfig(
        name="gen",
        out_dir=str(out),
        model=ModelConfig(
            dim=32, num_layers=2, num_heads=2, num_kv_heads=1, ffn_dim=64, max_seq_len=32
        ),  # fmt: skip
        data=DataConfig(corpus="excerpt", data_dir=excerpt_data_dir, seq_len=32),
        train=TrainConfig(
            num_steps=30,
            batch_size=8,
            warmup_steps=3,
            eval_every=30,
            num_eval_batches=1,
            progress=False,
        ),  # fmt: skip
    )
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=3e-3))
    return train(cfg, verbose=False).run_dir


def _generate(capsys, *args):
    assert main(["generate", *map(str, args)]) == 0
    return capsys.readouterr().out.removesuffix("\n")


def test_a_seed_fixes_the_text_and_the_export_agrees(trained_run, tmp_path, capsys):
    text = _generate(capsys, trained_run, "To be", "--max-new-tokens", 40, "--seed", 3)
    assert text.startswith("To be") and len(text) > len("To be")
    assert text == _generate(capsys, trained_run, "To be", "--max-new-tokens", 40, "--seed", 3)
    others = {
        _generate(capsys, trained_run, "To be", "--max-new-tokens", 40, "--seed", s)
        for s in range(4, 7)
    }
    assert others != {text}
    greedy = _generate(capsys, trained_run, "ROMEO:", "--temperature", 0, "--max-new-tokens", 30)
    assert main(["export", str(trained_run), "--out", str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    hf_greedy = _generate(
        capsys, f"hf:{tmp_path / 'hf'}", "ROMEO:", "--temperature", 0, "--max-new-tokens", 30
    )
    assert hf_greedy == greedy
    top1 = _generate(
        capsys, trained_run, "ROMEO:", "--top-k", 1, "--max-new-tokens", 30, "--seed", 9
    )
    assert top1 == greedy  # top-1 sampling is greedy


def test_bad_settings_are_one_line(trained_run, tmp_path, capsys):
    for flags in (["--max-new-tokens", "0"], ["--temperature", "-1"], ["--top-k", "-2"]):
        assert main(["generate", str(trained_run), "x", *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and flags[0] in err
    assert main(["generate", str(tmp_path / "none"), "x"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
