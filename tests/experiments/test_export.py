"""HF export: dense -> LlamaForCausalLM, MoE -> MixtralForCausalLM, logits equal to ours."""

import json
import os
import shutil

import pytest
import torch
import transformers

from stalepipe.config import DataConfig, ExperimentConfig, ModelConfig, TrainConfig
from stalepipe.fileio import NotOwnedError
from stalepipe.training.models import build_model
from stalepipe.training.rundir.checkpoint import commit_checkpoint
from stalepipe.training.rundir.sharded import save_part
from stalepipe.training.tools.export import ExportError, export_hf

BASE = dict(vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=128,
            max_seq_len=32, rope_theta=500.0, norm_eps=1e-6)  # fmt: skip
DENSE = ModelConfig(**BASE)
MOE = ModelConfig(**BASE, num_experts=4, top_k=2, expert_ffn_dim=32, tie_embeddings=False)


def make_run(tmp_path, model_cfg, *, tokenizer="byte", dtype="float32", name="run", fmt="dcp"):
    """A run directory holding one checkpoint of a freshly initialised model: DCP shards (what
    `stalepipe train` writes), or an older version's single file (`fmt="legacy"`)."""
    cfg = ExperimentConfig(
        name=name,
        model=model_cfg,
        data=DataConfig(tokenizer=tokenizer, seq_len=32),
        train=TrainConfig(dtype=dtype),
    )
    model = build_model(model_cfg, seed=3)
    with torch.no_grad():  # non-trivial norm gains, so a swapped norm would show
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    run_dir = tmp_path / name
    os.makedirs(run_dir)
    if fmt == "legacy":  # converted once (`stalepipe checkpoint convert`), then exported
        from stalepipe.training.rundir.convert import convert

        old = run_dir / "old" / "ckpt_00000007.pt"
        old.parent.mkdir()
        torch.save(
            {"format": 1, "step": 7, "config": cfg.to_dict(), "model": model.state_dict()}, old
        )
        convert(old, run_dir / "ckpt_00000007")
        shutil.rmtree(old.parent)
    else:
        weights = {n: p for n, p in model.named_parameters()}  # a tied head once, as the owner
        meta = {"step": 7, "policy": None, "num_stages": 1, "stages": [0], "names": {"0": []}}
        meta |= {"param_groups": [], "scalars": {}}
        save_part(run_dir, 7, 0, {f"model/{n}": t for n, t in weights.items()}, meta)
        commit_checkpoint(run_dir, 7, {"config": cfg.to_dict(), "ranks": [0]}, 1)
    return run_dir, model.eval()


@pytest.mark.parametrize(
    ("model_cfg", "arch"),
    [(DENSE, "LlamaForCausalLM"), (MOE, "MixtralForCausalLM")],
    ids=["dense", "moe"],
)
def test_exported_checkpoint_loads_in_transformers_with_equal_logits(tmp_path, model_cfg, arch):
    run_dir, model = make_run(tmp_path, model_cfg)
    result = export_hf(run_dir, tmp_path / "hf")
    assert result.architecture == arch
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(hf).__name__ == arch
    x = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), rtol=1e-4, atol=1e-4)
    # the byte tokenizer round-trips through AutoTokenizer: ids are the UTF-8 bytes
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "To be, or not to be — ¿qué?"
    assert tok(text)["input_ids"] == list(text.encode("utf-8"))
    assert tok.eos_token_id == tok.bos_token_id == 0  # our eot: byte 0


def test_gpt2_tokenizer_export_matches_ours(tmp_path):
    from stalepipe.training.data.gpt2 import Gpt2Tokenizer

    cfg = ModelConfig(**{**BASE, "vocab_size": 50304, "dim": 32, "ffn_dim": 32, "num_layers": 1})
    run_dir, _ = make_run(tmp_path, cfg, tokenizer="gpt2")
    export_hf(run_dir, tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = (
        "Now is the winter of our discontent\nMade glorious summer by this sun of York;  it's 42!"
    )
    assert tok(text)["input_ids"] == Gpt2Tokenizer().encode(text)
    assert tok.eos_token_id == 50256
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == 50256


def test_sharded_bfloat16_export_loads(tmp_path):
    run_dir, model = make_run(tmp_path, MOE)
    result = export_hf(run_dir, tmp_path / "hf", dtype="bfloat16", max_shard_bytes=40_000)
    assert "model.safetensors.index.json" in result.files and len(result.files) > 6
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    x = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        # bf16 weights: equal to ours up to bf16 rounding of the weights
        torch.testing.assert_close(hf(x).logits, model(x), rtol=0.05, atol=0.05)


def test_unexpressible_moe_is_refused_and_nothing_written(tmp_path):
    for i, kw in enumerate(({"num_shared_experts": 1}, {"num_dense_layers": 1})):
        run_dir, _ = make_run(tmp_path, ModelConfig(**{**MOE.__dict__, **kw}), name=f"run{i}")
        with pytest.raises(ExportError, match="Mixtral"):
            export_hf(run_dir, tmp_path / "hf")
        assert not (tmp_path / "hf").exists()


def test_refuses_to_overwrite_and_needs_a_checkpoint(tmp_path):
    from stalepipe.errors import CheckpointError

    run_dir, _ = make_run(tmp_path, DENSE)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="not a stalepipe export; choose another --out"):
        export_hf(run_dir, tmp_path / "hf")
    with pytest.raises(NotOwnedError, match="no .stalepipe.json marker"):
        export_hf(run_dir, tmp_path / "hf", overwrite=True)  # not ours: never deleted
    assert (tmp_path / "hf" / "keep.txt").read_text() == "mine"
    export_hf(run_dir, tmp_path / "hf2")
    with pytest.raises(ExportError, match="pass --overwrite"):
        export_hf(run_dir, tmp_path / "hf2")
    export_hf(run_dir, tmp_path / "hf2", overwrite=True)  # an earlier export of ours
    (tmp_path / "hf2" / "notes.md").write_text("mine")
    with pytest.raises(NotOwnedError, match="holds 'notes.md'"):
        export_hf(run_dir, tmp_path / "hf2", overwrite=True)
    assert (tmp_path / "hf2" / "notes.md").exists() and (tmp_path / "hf2" / "config.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint"):
        export_hf(tmp_path / "empty", tmp_path / "hf3")


def test_export_never_replaces_the_working_directory(tmp_path, monkeypatch, capsys):
    from stalepipe.cli import main

    run_dir, _ = make_run(tmp_path, DENSE)
    work = tmp_path / "work"
    work.mkdir()
    (work / "canary.txt").write_text("keep")
    monkeypatch.chdir(work)
    for out in (".", ".."):
        assert main(["export", str(run_dir), "--out", out, "--overwrite"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err
    assert (work / "canary.txt").read_text() == "keep"
    empty = tmp_path / "empty_cwd"
    empty.mkdir()
    monkeypatch.chdir(empty)
    assert main(["export", str(run_dir), "--out", "."]) == 2  # empty, but the working directory
    assert "refusing to delete ." in capsys.readouterr().err and empty.is_dir()


def test_exported_files_follow_the_umask(tmp_path):
    import stat

    run_dir, _ = make_run(tmp_path, DENSE)
    old = os.umask(0o022)
    try:
        export_hf(run_dir, tmp_path / "hf")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "hf").stat().st_mode) == 0o755
    for f in (tmp_path / "hf").iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f.name


@pytest.mark.parametrize("fmt", ["dcp", "legacy"])
def test_cli_export_and_eval(tmp_path, capsys, fmt):
    from stalepipe.cli import main

    run_dir, _ = make_run(tmp_path, MOE, fmt=fmt)
    assert main(["export", str(run_dir), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert "MixtralForCausalLM" in capsys.readouterr().out
    assert main(["export", str(run_dir), "--out", str(tmp_path / "hf")]) == 2  # not empty
    assert "--overwrite" in capsys.readouterr().err
    args = [
        "eval",
        str(run_dir),
        "--no-loss",
        "--num-items",
        "4",
        "--out",
        str(tmp_path / "e.json"),
    ]
    assert main(args) == 0
    assert "shakespeare-cloze: acc" in capsys.readouterr().out
    assert json.loads((tmp_path / "e.json").read_text())["tasks"]["shakespeare-cloze"]


def test_bpe_tokenizer_is_found_from_another_working_directory(tmp_path, monkeypatch):
    """A run's relative data_dir (config.json as written) is located from where the run
    directory is, so export from elsewhere still writes the run's trained tokenizer."""
    from stalepipe.training.data import prepare_corpus

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    data = DataConfig(
        corpus="excerpt", tokenizer="bpe", bpe_vocab_size=300, data_dir="data/b", seq_len=32
    )
    prepare_corpus(data, progress=False)
    model_cfg = ModelConfig(**{**BASE, "vocab_size": 320})
    cfg = ExperimentConfig(name="run", out_dir="runs", model=model_cfg, data=data)
    run_dir = work / "runs" / "run"
    run_dir.mkdir(parents=True)
    model = build_model(model_cfg, seed=3)
    meta = {"step": 7, "policy": None, "num_stages": 1, "stages": [0], "names": {"0": []}}
    meta |= {"param_groups": [], "scalars": {}}
    save_part(run_dir, 7, 0, {f"model/{n}": t for n, t in model.named_parameters()}, meta)
    commit_checkpoint(run_dir, 7, {"config": cfg.to_dict(), "ranks": [0]}, 1)
    monkeypatch.chdir(tmp_path)
    result = export_hf(run_dir, tmp_path / "hf")
    assert result.tokenizer == "bpe", result.notes
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() != b""
