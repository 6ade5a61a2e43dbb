"""LR schedules: the registered ones by hand, and a schedule registered in this module taken by
the config, the command line, `--help` and the synchronous cooldown with no other change."""

from __future__ import annotations

import pytest

from stalepipe.cli import main
from stalepipe.config import (
    LR_SCHEDULES,
    ConfigError,
    ExperimentConfig,
    LRScheduleSpec,
    TrainConfig,
    apply_overrides,
)
from stalepipe.training.delay import DelaySchedule
from stalepipe.training.optim.lr_schedule import lr_multiplier


def linear(step: int, cfg: TrainConfig) -> float:
    """Linear decay from 1 after the warmup to `min_lr_ratio` at the last step."""
    span = max(cfg.num_steps - 1 - cfg.warmup_steps, 1)
    return 1.0 - (1.0 - cfg.min_lr_ratio) * (step - cfg.warmup_steps) / span


@pytest.fixture
def linear_schedule():
    """'linear' registered for one test (the registry is process-wide); its decay phase is the
    whole run after the warmup."""
    spec = LR_SCHEDULES.register(
        LRScheduleSpec(
            name="linear", multiplier=linear, decay_steps=lambda c: c.num_steps - c.warmup_steps
        )
    )
    yield spec
    LR_SCHEDULES.unregister("linear")


def test_the_registered_schedules_by_hand():
    kw = dict(num_steps=11, warmup_steps=2, min_lr_ratio=0.1, decay_frac=0.2)
    at = {
        s: [lr_multiplier(k, TrainConfig(lr_schedule=s, **kw)) for k in range(11)]
        for s in LR_SCHEDULES
    }
    assert at["constant"] == [0.5, 1.0] + [1.0] * 9
    assert at["wsd"][:9] == [0.5, 1.0] + [1.0] * 7  # 2 decay steps: 11 - round(0.2 * 11)
    assert at["wsd"][9:] == pytest.approx([0.55, 0.1])
    assert at["cosine"][2] == 1.0 and at["cosine"][10] == pytest.approx(0.1)
    assert at["cosine"][6] == pytest.approx(0.55)  # halfway: the mean of 1 and the floor
    assert next(iter(LR_SCHEDULES)) == TrainConfig().lr_schedule  # --help lists the default first


def test_a_registered_schedule_is_taken_everywhere(linear_schedule, capsys):
    over = {"train.lr_schedule": "linear", "train.num_steps": "11", "train.warmup_steps": "0"}
    cfg = apply_overrides(ExperimentConfig(), {**over, "train.min_lr_ratio": "0"})
    assert [lr_multiplier(k, cfg.train) for k in (0, 5, 10)] == [1.0, 0.5, 0.0]
    # a synchronous cooldown aligned with its decay phase (`LRScheduleSpec.decay_steps`)
    cfg = apply_overrides(cfg, {"delay.policy": "2bw", "delay.sync_cooldown_wsd": "true"})
    assert DelaySchedule.build(cfg.delay, 1, 11, train=cfg.train).cooldown == 11
    assert main(["info", *(f"--{k}={v}" for k, v in over.items())]) == 0
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "--train.lr_schedule" in x)
    assert line.endswith("cosine | wsd | constant | linear")


def test_an_unregistered_schedule_is_a_one_line_error(capsys):
    with pytest.raises(ConfigError, match=r"unknown LR schedule train.lr_schedule='linear'"):
        TrainConfig(lr_schedule="linear")
    assert main(["info", "--train.lr_schedule", "cosin"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'cosine'" in err and err.count("\n") == 1
    with pytest.raises(ConfigError, match=r"train.lr_schedule is 'constant'; set train.lr_sch"):
        apply_overrides(
            ExperimentConfig(),
            {
                "train.lr_schedule": "constant",
                "delay.policy": "2bw",
                "delay.sync_cooldown_wsd": "1",
            },
        )
