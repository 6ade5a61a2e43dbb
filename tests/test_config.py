"""Config: validation messages, dotted overrides, presets, JSON round trip."""

import pytest

from stalepipe.config import ConfigError, ExperimentConfig, apply_overrides, config_help
from stalepipe.presets import PRESETS, get_preset


def test_overrides_are_typed():
    cfg = apply_overrides(
        ExperimentConfig(),
        {"optim.lr": "3e-3", "train.steps": "7", "model.tie_embeddings": "false", "name": "x"},
    )
    assert cfg.optim.lr == 3e-3 and cfg.train.steps == 7
    assert cfg.model.tie_embeddings is False and cfg.name == "x"
    assert apply_overrides(cfg, {"optim.lr": "none"}).optim.lr is None


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"optim.lrr": "1"}, "did you mean --optim.lr"),
        ({"train.stepz": "1"}, "did you mean --train.steps"),
        ({"optim.lr": "-1"}, "optim.lr must be > 0"),
        ({"optim.beta1": "1.0"}, r"optim.beta1 must be in \[0, 1\)"),
        ({"train.steps": "ten"}, "expects a int"),
        ({"train.batch_size": "10", "train.num_microbatches": "4"}, "divisible"),
        ({"pipeline.num_stages": "9"}, "must be <= model.num_layers"),
        ({"delay.policy": "3bw"}, "delay.policy must be"),
        ({"model.dim": "90", "model.num_heads": "6"}, "even for RoPE"),
        ({"data.seq_len": "4096"}, "max_seq_len"),
        ({"model.dropout": "1"}, r"model.dropout must be in \[0, 1\)"),
    ],
)
def test_bad_values_name_the_field(overrides, match):
    with pytest.raises(ConfigError, match=match):
        apply_overrides(ExperimentConfig(), overrides)


def test_unknown_preset_suggests_closest():
    with pytest.raises(ConfigError, match="did you mean 'cpu-tiny'"):
        get_preset("cpu-tiy")


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_round_trips_through_json(name):
    cfg = get_preset(name)
    import json

    assert ExperimentConfig.from_dict(json.loads(cfg.to_json())) == cfg


def test_help_lists_every_field_with_default():
    text = config_help()
    for key in ("--optim.lr", "--train.steps", "--delay.policy", "--model.dim", "--data.tokenizer"):
        assert key in text
    assert "default 200" in text  # train.steps
