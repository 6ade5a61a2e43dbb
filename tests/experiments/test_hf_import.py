"""`train --init-from hf:DIR`: an HF Llama / Mixtral directory read back into our model (the
inverse of `stalepipe export`), refused in one line when it does not fit, then trained."""

import json
import os
from pathlib import Path

import pytest
import torch
import transformers

from stalepipe.cli import main
from stalepipe.config import DataConfig, ExperimentConfig, ModelConfig
from stalepipe.errors import CheckpointError
from stalepipe.training.data import TokenLoader
from stalepipe.training.models import build_model
from stalepipe.training.models.hf import HfFormatError
from stalepipe.training.rundir.checkpoint import commit_checkpoint
from stalepipe.training.rundir.hf_checkpoint import load_hf_weights, open_hf
from stalepipe.training.rundir.metrics import read_metrics
from stalepipe.training.rundir.sharded import save_part
from stalepipe.training.tools.export import export_hf

BASE = dict(vocab_size=256, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=64,
            max_seq_len=32, rope_theta=500.0, norm_eps=1e-6)  # fmt: skip
DENSE = ModelConfig(**BASE)
MOE = ModelConfig(**BASE, num_experts=4, top_k=2, expert_ffn_dim=16, tie_embeddings=False)


def exported(tmp_path, model_cfg, seed=3):
    """Our model (norm gains off 1, so a swapped norm shows) exported with `stalepipe export`."""
    cfg = ExperimentConfig(name="run", model=model_cfg, data=DataConfig(seq_len=32))
    model = build_model(model_cfg, seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    run_dir = tmp_path / "run"
    os.makedirs(run_dir)
    meta = {"step": 7, "policy": None, "num_stages": 1, "stages": [0], "names": {"0": []}}
    meta |= {"param_groups": [], "scalars": {}}
    tensors = {f"model/{n}": p for n, p in model.named_parameters()}
    save_part(run_dir, 7, 0, tensors, meta)
    commit_checkpoint(run_dir, 7, {"config": cfg.to_dict(), "ranks": [0]}, 1)
    export_hf(run_dir, tmp_path / "hf")
    return tmp_path / "hf", model.eval()


@pytest.mark.parametrize("model_cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_export_then_import_gives_equal_weights_and_logits(tmp_path, model_cfg):
    hf_dir, ours = exported(tmp_path, model_cfg)
    back = build_model(model_cfg, seed=99)  # other weights until loaded
    load_hf_weights(dict(back.named_parameters()), model_cfg, hf_dir)
    for (name, a), (_, b) in zip(ours.named_parameters(), back.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    x = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        assert torch.equal(back.eval()(x), ours(x))
    assert open_hf(f"hf:{hf_dir}").model_config(model_cfg) == model_cfg


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_a_transformers_checkpoint_gives_its_logits(tmp_path, arch):
    """A directory transformers wrote itself (`save_pretrained`), tied (Llama) and not."""
    common = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)  # fmt: skip
    if arch == "llama":
        hf_cfg = transformers.LlamaConfig(**common, intermediate_size=48, tie_word_embeddings=True)
        hf = transformers.LlamaForCausalLM(hf_cfg)
    else:
        hf_cfg = transformers.MixtralConfig(
            **common, intermediate_size=24, num_local_experts=3, num_experts_per_tok=2
        )
        hf = transformers.MixtralForCausalLM(hf_cfg)
    hf.save_pretrained(tmp_path / "hf")
    checkpoint = open_hf(tmp_path / "hf")
    cfg = checkpoint.model_config()
    assert (cfg.dim, cfg.num_experts, cfg.tie_embeddings) == (
        32,
        3 * (arch != "llama"),
        arch == "llama",
    )
    ours = build_model(cfg, seed=0)
    load_hf_weights(dict(ours.named_parameters()), cfg, tmp_path / "hf")
    x = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(x), hf.eval()(x).logits, rtol=1e-5, atol=1e-5)


def test_another_shape_is_one_line_naming_the_flags_that_fit(tmp_path, capsys):
    hf_dir, _ = exported(tmp_path, DENSE)
    other = ModelConfig(**{**BASE, "dim": 64, "num_layers": 3, "ffn_dim": 96})
    with pytest.raises(HfFormatError) as e:
        open_hf(hf_dir).check_fits(other)
    msg = str(e.value)
    assert "\n" not in msg and "--model.dim 32 --model.num_layers 2" in msg
    assert "--model.ffn_dim 64" in msg
    # the flags it names make the model fit
    from stalepipe.config import apply_overrides

    flags = msg.split("pass ")[1].split(" (")[0].split()
    overrides = {k.removeprefix("--"): v for k, v in zip(flags[::2], flags[1::2], strict=True)}
    fixed = apply_overrides(ExperimentConfig(model=other, data=DataConfig(seq_len=32)), overrides)
    open_hf(hf_dir).check_fits(fixed.model)  # no error
    dense_as_moe = open_hf(hf_dir)
    with pytest.raises(HfFormatError, match="--model.num_experts 0"):
        dense_as_moe.check_fits(MOE)


def _edit(path, **changes):
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, **changes}))


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda d: _edit(d / "config.json", architectures=["Qwen2ForCausalLM"]), "architectures"),
        (lambda d: _edit(d / "config.json", rope_parameters={"rope_type": "llama3"}), "rope type"),
        (lambda d: _edit(d / "config.json", attention_bias=True), "biases"),
        (
            lambda d: _edit(d / "config.json", hidden_size="32"),
            "hidden_size is '32', not an integer",
        ),
        (lambda d: _edit(d / "config.json", tie_word_embeddings=1), "is 1, not true or false"),
        (lambda d: (d / "config.json").write_text("{"), "is not JSON"),
        (lambda d: (d / "config.json").unlink(), "no config.json"),
        (lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 8 + b"{}"), "header"),
        (lambda d: (d / "model.safetensors").unlink(), "holds no model.safetensors"),
    ],
    ids=[
        "qwen",
        "llama3-rope",
        "bias",
        "str",
        "int-for-bool",
        "json",
        "no-config",
        "header",
        "no-weights",
    ],
)
def test_what_our_model_cannot_hold_is_refused_in_one_line(tmp_path, damage, match):
    hf_dir, _ = exported(tmp_path, DENSE)
    damage(hf_dir)
    with pytest.raises((HfFormatError, CheckpointError), match=match) as e:
        open_hf(hf_dir).read(DENSE)
    assert "\n" not in str(e.value)


def test_unknown_or_misshapen_tensors_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    hf_dir, _ = exported(tmp_path, DENSE)
    tensors = load_file(hf_dir / "model.safetensors")
    save_file(
        {**tensors, "model.layers.0.extra.bias": torch.zeros(3)}, hf_dir / "model.safetensors"
    )
    with pytest.raises(CheckpointError, match="extra.bias, which stalepipe's model has no place"):
        open_hf(hf_dir).read(DENSE)
    tensors["model.norm.weight"] = torch.zeros(31)
    save_file(tensors, hf_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"holds model.norm.weight as \(31,\), not \(32,\)"):
        open_hf(hf_dir).read(DENSE)


SHAPE = ("--model.dim", "32", "--model.num_layers", "2", "--model.ffn_dim", "64",
         "--model.max_seq_len", "16", "--model.rope_theta", "500", "--model.norm_eps", "1e-6")  # fmt: skip


def _train_args(tmp_path, data_dir, name, *extra):
    return [
        *("train", "--preset", "cpu-tiny", "--name", name, "--out_dir", str(tmp_path / "runs")),
        *("--data.corpus", "excerpt", "--data.data_dir", data_dir, "--data.seq_len", "16"),
        *("--train.num_steps", "3", "--train.batch_size", "4", "--train.num_microbatches", "2"),
        *("--train.num_eval_batches", "1", "--train.progress", "false"),
        *extra,
    ]


@pytest.mark.parametrize(
    "engine",
    [
        ("--delay.policy", "2bw", "--delay.ef", "true", "--pipeline.num_stages", "2"),
        ("--pipeline.engine", "distributed", "--pipeline.num_stages", "2", "--delay.policy",
         "2bw", "--pipeline.schedule", "2bw", "--pipeline.timeout_s", "60"),
    ],
    ids=["emulator", "runtime"],
)  # fmt: skip
def test_a_run_starts_from_the_hf_weights_on_either_engine(tmp_path, excerpt_data_dir, engine):
    hf_dir, ours = exported(tmp_path, DENSE)
    args = _train_args(tmp_path, excerpt_data_dir, "from-hf", *SHAPE, *engine)
    assert main([*args, "--init-from", f"hf:{hf_dir}"]) == 0
    run = tmp_path / "runs" / "from-hf"
    assert json.loads((run / "meta.json").read_text())["parent"] == {"hf": str(hf_dir.resolve())}
    # step 0 reads W_0 under 2bw: its loss is the HF weights' loss on batch 0
    seed = json.loads((run / "config.json").read_text())["data"]["seed"]
    x, y = TokenLoader(Path(excerpt_data_dir), "train", 16, seed).batch(0, 4)
    with torch.no_grad():
        want = sum(ours(xm, ym).item() for xm, ym in zip(x.chunk(2), y.chunk(2), strict=True)) / 2
    rows = read_metrics(run)
    assert abs(rows[0]["loss"] - want) < 1e-5 and len(rows) == 3


def test_cli_refuses_a_mismatch_before_writing(tmp_path, excerpt_data_dir, capsys):
    hf_dir, _ = exported(tmp_path, DENSE)
    shape = list(SHAPE)
    shape[1] = "64"  # --model.dim 64
    args = _train_args(tmp_path, excerpt_data_dir, "bad", *shape, "--init-from", f"hf:{hf_dir}")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pass --model.dim 32 (" in err
    assert not (tmp_path / "runs" / "bad").exists()
    assert main(["train", "--preset", "cpu-tiny", "--init-from", f"hf:{tmp_path}/nope"]) == 2
    assert "not a Hugging Face model directory" in capsys.readouterr().err


def test_the_cli_spells_the_readers_prefix():
    """cli/__init__.py spells `hf:` out (its --help imports no torch): the reader's own."""
    from stalepipe import cli
    from stalepipe.training.rundir import hf_checkpoint

    assert cli.HF_PREFIX == hf_checkpoint.PREFIX
