"""Config: validation messages, dotted overrides, presets, JSON round trip."""

import os

import pytest

from stalepipe.config import ConfigError, ExperimentConfig, apply_overrides, config_help
from stalepipe.presets import PRESETS, get_preset


def test_overrides_are_typed():
    cfg = apply_overrides(
        ExperimentConfig(),
        {"optim.lr": "3e-3", "train.num_steps": "7", "model.tie_embeddings": "false", "name": "x"},
    )
    assert cfg.optim.lr == 3e-3 and cfg.train.num_steps == 7
    assert cfg.model.tie_embeddings is False and cfg.name == "x"
    assert apply_overrides(cfg, {"optim.lr": "none"}).optim.lr is None


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"optim.lrr": "1"}, "did you mean --optim.lr"),
        ({"train.stepz": "1"}, "did you mean --train.num_steps"),
        ({"optim.lr": "-1"}, "optim.lr must be > 0"),
        ({"optim.beta1": "1.0"}, r"optim.beta1 must be in \[0, 1\)"),
        ({"train.num_steps": "ten"}, "expects a int"),
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


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("train.steps", "train.num_steps"),
        ("train.eval_batches", "train.num_eval_batches"),
        ("pipeline.data_parallel", "pipeline.num_replicas"),
    ],
)
def test_renamed_keys_hint_on_the_command_line_and_load_from_old_records(old, new):
    with pytest.raises(ConfigError, match=f"^config key --{old} is now --{new}; use that name$"):
        apply_overrides(ExperimentConfig(), {old: "2"})
    record = ExperimentConfig().to_dict()
    section, key = old.split(".")
    record[section][key] = record[section].pop(new.split(".")[1])  # a record from before
    record[section][key] = 2 if old != "pipeline.data_parallel" else 1
    loaded = ExperimentConfig.from_dict(record)
    assert getattr(getattr(loaded, section), new.split(".")[1]) == record[section][key]


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
    for key in (
        "--optim.lr",
        "--train.num_steps",
        "--delay.policy",
        "--model.dim",
        "--data.tokenizer",
    ):
        assert key in text
    assert "default 200" in text  # train.num_steps


# ---- rules that join sections, each with a fix that works -----------------------------------


def _cfg(**overrides: str) -> ExperimentConfig:
    return apply_overrides(get_preset("cpu-tiny"), overrides)  # 3 layers, batch 16


DIST = {"pipeline.engine": "distributed"}


@pytest.mark.parametrize(
    ("overrides", "match", "fixes"),
    [
        (
            {"delay.policy": "wpipe", "pipeline.num_stages": "3"},
            r"delay.policy wpipe needs an even pipeline.num_stages.*got 3; set "
            r"pipeline.num_stages to 2$",
            [{"pipeline.num_stages": "2"}],
        ),
        (
            {"delay.policy": "wpipe"},  # 1 stage: 2 is the only even count <= 3 layers
            r"got 1; set pipeline.num_stages to 2$",
            [{"pipeline.num_stages": "2"}],
        ),
        (
            {**DIST, "pipeline.schedule": "2bw", "delay.policy": "2bw",
             "pipeline.num_stages": "3", "train.num_microbatches": "1"},
            r"pipeline.schedule 2bw needs train.num_microbatches >= pipeline.num_stages - 1 = 2 "
            r".*got 1; set train.num_microbatches to 2 or pipeline.num_stages to 2$",
            [{"train.num_microbatches": "2"}, {"pipeline.num_stages": "2"}],
        ),
        (  # the schedule's own rule (ScheduleSpec.sizes), asked by the config
            {**DIST, "pipeline.schedule": "pipedream", "delay.policy": "pipedream",
             "pipeline.num_stages": "2", "train.num_microbatches": "2"},
            r"pipeline.schedule pipedream updates after every microbatch-sized minibatch: set "
            r"train.num_microbatches to 1 .*got 2$",
            [{"train.num_microbatches": "1"}],
        ),
        (
            {**DIST, "pipeline.num_replicas": "3", "train.num_microbatches": "2"},
            r"train.batch_size \(16\) must be divisible by train.num_microbatches x "
            r"pipeline.num_replicas \(2 x 3\); set train.batch_size to 12 or 18$",
            [{"train.batch_size": "12"}, {"train.batch_size": "18"}],
        ),
        (
            {"train.batch_size": "10", "train.num_microbatches": "4"},
            r"divisible by train.num_microbatches \(4\); set train.batch_size to 8 or 12$",
            [{"train.batch_size": "8"}, {"train.batch_size": "12"}],
        ),
        (
            {"delay.policy": "2bw", "delay.sync_cooldown_wsd": "true"},
            r"delay.sync_cooldown_wsd .* train.lr_schedule is 'cosine'; set train.lr_schedule "
            r"to wsd, or delay.sync_cooldown_wsd to false",
            [{"train.lr_schedule": "wsd"}, {"delay.sync_cooldown_wsd": "false"}],
        ),
    ],
)  # fmt: skip
def test_cross_section_refusals_name_a_fix_that_works(overrides, match, fixes):
    with pytest.raises(ConfigError, match=match) as e:
        _cfg(**overrides)
    assert "\n" not in str(e.value) and "--" not in str(e.value)  # config terms, no CLI flags
    for fix in fixes:
        _cfg(**{**overrides, **fix})


def test_distributed_engine_rules_apply_to_it_alone():
    # the emulator has no schedule: its 2bw runs with any microbatch count
    emu = _cfg(**{"delay.policy": "2bw", "pipeline.num_stages": "3", "train.num_microbatches": "1"})
    assert emu.train.num_microbatches == 1 and emu.pipeline.engine == "emulate"
    dist = _cfg(**{**DIST, "pipeline.schedule": "2bw", "delay.policy": "2bw",
                   "pipeline.num_stages": "3", "train.num_microbatches": "2"})  # fmt: skip
    assert dist.pipeline.schedule == "2bw" and dist.train.num_microbatches == 2


# ---- settings the run would ignore are refused (docs/design.md, 'Style', rule 12) -------------


def _offered_fixes(msg: str) -> list[dict[str, str]]:
    """'...; set a to 1 and b to 2, or c to 3' -> [{'a': '1', 'b': '2'}, {'c': '3'}]."""
    fixes = msg.rsplit("; set ", 1)[1]
    return [
        dict(part.split(" to ", 1) for part in fix.split(" and ")) for fix in fixes.split(", or ")
    ]


@pytest.mark.parametrize(
    ("overrides", "match", "fixes"),
    [
        (
            {"pipeline.schedule": "2bw"},
            r"^pipeline.schedule 2bw is run only by the distributed engine; the emulator "
            r"\(pipeline.engine emulate\) ignores it and takes the delay from delay.policy "
            r"\(sync\); set delay.policy to 2bw and pipeline.schedule to 1f1b, or "
            r"pipeline.engine to distributed and delay.policy to 2bw$",
            2,
        ),
        (
            {"pipeline.schedule": "gpipe"},
            r"^pipeline.schedule gpipe is run only by the distributed engine.*; set "
            r"pipeline.schedule to 1f1b, or pipeline.engine to distributed$",
            2,
        ),
        (  # 3 replicas of batch 16 cannot be split evenly: the distributed fix is not offered
            {"pipeline.num_replicas": "3"},
            r"^pipeline.num_replicas 3 is read only by the distributed engine; the emulator's "
            r"data-parallel replicas are the processes torchrun starts .*; set "
            r"pipeline.num_replicas to 1$",
            1,
        ),
        (
            {"pipeline.num_replicas": "2"},
            r"; set pipeline.num_replicas to 1, or pipeline.engine to distributed$",
            2,
        ),
        (
            {"delay.policy": "pipedream"},
            r"^delay.policy pipedream has no delay at pipeline.num_stages 1 .*; set "
            r"pipeline.num_stages to 2, or delay.policy to sync$",
            2,
        ),
        (
            {"delay.policy": "2bw", "train.lr_schedule": "wsd", "delay.sync_cooldown": "0.2",
             "delay.sync_cooldown_wsd": "true"},
            r"^delay.sync_cooldown \(0.2\) is overridden by delay.sync_cooldown_wsd.*; set "
            r"delay.sync_cooldown to 0, or delay.sync_cooldown_wsd to false$",
            2,
        ),
        (
            {"delay.taylor": "0.1"},
            r"^delay.taylor mitigates a delay, but delay.policy sync has none; set delay.taylor "
            r"to 0.0, or delay.policy to 2bw$",
            2,
        ),
        (
            {"delay.policy": "fixed:0", "delay.sync_start": "5"},
            r"^delay.sync_start mitigates a delay, but delay.policy fixed:0 has none",
            2,
        ),
        (
            {"delay.policy": "2bw", "delay.taylor_adaptive": "true"},
            r"^delay.taylor_adaptive scales delay.taylor \(lambda_0\), which is 0 \(off\); "
            r"set delay.taylor to 0.1, or delay.taylor_adaptive to false$",
            2,
        ),
        (
            {**DIST, "train.device": "cuda:1"},
            r"^train.device cuda:1: the distributed engine puts each process on the GPU of its "
            r"local rank .*; set train.device to cuda$",
            1,
        ),
    ],
)  # fmt: skip
def test_ignored_settings_are_refused_with_fixes_that_work(overrides, match, fixes):
    with pytest.raises(ConfigError, match=match) as e:
        _cfg(**overrides)
    msg = str(e.value)
    assert "\n" not in msg and "--" not in msg  # config terms, no CLI flags
    offered = _offered_fixes(msg)
    assert len(offered) == fixes
    for fix in offered:
        cfg = _cfg(**{**overrides, **fix})
        if cfg.pipeline.engine == "distributed":
            from stalepipe.training.train.pipelined import check_config

            check_config(cfg)  # the runtime's own schedule rules accept it too


def test_the_distributed_engine_reads_schedule_and_replicas():
    accepted = [
        _cfg(**{**DIST, "pipeline.schedule": "2bw", "delay.policy": "2bw"}),
        _cfg(**{**DIST, "pipeline.schedule": "gpipe", "pipeline.num_replicas": "2"}),
        _cfg(**{"delay.policy": "pipedream", "pipeline.num_stages": "2"}),
        _cfg(**{"delay.policy": "fixed:0"}),  # an explicit zero delay: a point of a delay sweep
        _cfg(**{"delay.policy": "sync", "delay.ef": "true"}),  # EF changes undelayed updates too
    ]
    assert [c.delay.policy for c in accepted] == ["2bw", "sync", "pipedream", "fixed:0", "sync"]
    assert accepted[1].pipeline.num_replicas == 2 and accepted[4].delay.ef


def test_an_unknown_schedule_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match=r"pipeline.schedule='2bq' \(choose from gpipe, 1f1b"):
        _cfg(**{"pipeline.schedule": "2bq"})


def test_run_records_with_ignored_settings_still_load():
    """A config.json or checkpoint written before a rule existed loads with strict=False (for
    eval, export, or as the base of --config), and the refusal's fix works as an override."""
    import json

    record = json.loads(_cfg().to_json())
    record["pipeline"]["schedule"] = "2bw"
    record["delay"]["policy"] = "pipedream"  # at 1 stage
    with pytest.raises(ConfigError, match="pipeline.schedule 2bw is run only by"):
        ExperimentConfig.from_dict(record)
    old = ExperimentConfig.from_dict(record, strict=False)
    assert old.pipeline.schedule == "2bw" and old.delay.policy == "pipedream"
    with pytest.raises(ConfigError, match="delay.policy pipedream has no delay"):
        apply_overrides(old, {"pipeline.schedule": "1f1b"})
    fixed = apply_overrides(old, {"pipeline.schedule": "1f1b", "delay.policy": "sync"})
    assert fixed == _cfg()
    # every other rule still applies to records
    record["pipeline"]["num_stages"] = 9
    with pytest.raises(ConfigError, match="must be <= model.num_layers"):
        ExperimentConfig.from_dict(record, strict=False)


@pytest.mark.parametrize(
    "name",
    [
        *("", ".", "..", "a/b", "../x", f"a{os.sep}b"),
        *("a\nb", "a\udcffb", "a\x00b", "a b", "\t", "run\x1b[31m"),  # \udcff: a \xff byte
        "a" * 129,
        "a" * 300,
    ],
)
def test_the_run_name_is_one_safe_directory_name(name):
    """Nothing a run directory is named after can break a path, a printed command or a
    report: a control character, an undecodable byte, a name past 128 characters."""
    with pytest.raises(ConfigError, match=r"^name must be one directory name of 1 to 128") as e:
        _cfg(name=name)
    assert "\n" not in str(e.value) and len(str(e.value)) < 400
    suggested = str(e.value).rsplit("set name to ", 1)[1].strip("'")
    assert _cfg(name=suggested).name == suggested
    _cfg(name="my.run..2")  # dots inside a name are fine
    _cfg(name="adamw_2bw+ef_lr=3e-4_s0")  # and what a sweep names its runs
    _cfg(name="a" * 128)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("optim.lr", "inf"),
        ("optim.lr", "nan"),
        ("train.grad_clip", "inf"),
        ("train.ckpt_every_s", "inf"),
        ("pipeline.timeout_s", "inf"),
        ("model.rope_theta", "inf"),
        ("delay.taylor", "inf"),
        ("delay.sync_cooldown", "inf"),
        ("data.val_fraction", "nan"),
    ],
)
def test_a_non_finite_float_is_refused_with_a_value_that_passes(key, value):
    """`--optim.lr inf` once passed (inf > 0), diverged and then recommended itself as the
    fix; every float field now refuses a non-finite value, naming one that validates."""
    with pytest.raises(ConfigError, match=rf"^{key} ") as e:
        apply_overrides(ExperimentConfig(), {key: value})
    if "finite" in str(e.value):  # the rest: the section's own range, which nan fails
        shown = str(e.value).rsplit("its default ", 1)[1].split(" ")[0]
        assert apply_overrides(ExperimentConfig(), {key: shown})


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("train.num_steps", str(10**20), r"train.num_steps must be in \[1, 1,000,000,000\]"),
        ("train.num_steps", str(10**9 + 1), r"train.num_steps must be in \[1, 1,000,000,000\]"),
        ("model.dim", str(2**31), "model.dim must be at most 2,147,483,647"),
        ("train.warmup_steps", str(10**12), "train.warmup_steps must be at most"),
        ("train.batch_size", str(2**40), "train.batch_size must be at most"),
        ("data.seed", str(2**64), "data.seed must be at most 9,223,372,036,854,775,807"),
    ],
)
def test_counts_no_run_reaches_are_refused(key, value, match):
    with pytest.raises(ConfigError, match=match):
        apply_overrides(ExperimentConfig(), {key: value})


def test_the_largest_counts_still_validate():
    cfg = apply_overrides(
        ExperimentConfig(), {"train.num_steps": str(10**9), "train.seed": str(2**63 - 1)}
    )
    assert cfg.train.num_steps == 10**9


def test_device_names_are_checked_without_hardware():
    with pytest.raises(ConfigError, match=r"train.device must be cpu, cuda or cuda:N"):
        _cfg(**{"train.device": "gpu"})
    with pytest.raises(ConfigError, match=r"train.device must be"):
        _cfg(**{"train.device": "cuda:x"})
    assert _cfg(**{"train.device": "cuda:3"}).train.device == "cuda:3"  # no GPU needed to plan


def test_warmup_as_long_as_the_run_warns_with_a_fix():
    assert _cfg().warnings() == []
    (w,) = _cfg(**{"train.num_steps": "20"}).warnings()  # cpu-tiny warms up for 30 steps
    assert w.startswith("train.warmup_steps (30) >= train.num_steps (20): the LR rises")
    assert w.endswith("set train.warmup_steps to 2, or fewer than 20")
    assert _cfg(**{"train.num_steps": "20", "train.warmup_steps": "2"}).warnings() == []


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_have_no_warnings(name):
    assert get_preset(name).warnings() == []


def test_delay_policy_names_are_the_implemented_ones():
    from stalepipe import config
    from stalepipe.config import DELAY_POLICIES
    from stalepipe.training.delay.policies import parse_policy

    assert list(DELAY_POLICIES)
    for name in DELAY_POLICIES:  # the config accepts each; delay/policies.py implements each
        assert config.DelayConfig(policy=name).policy == parse_policy(name).name == name
    # the refusal names every registered policy, in the registry's order, and the family
    names = ", ".join(DELAY_POLICIES)
    with pytest.raises(ConfigError, match=f"must be {names} or fixed:N"):
        config.DelayConfig(policy="2bq")


# ---- optimizer fields --------------------------------------------------------------------


def test_a_field_the_optimizer_does_not_read_is_refused():
    with pytest.raises(ConfigError) as e:
        _cfg(**{"optim.name": "muon", "optim.eps": "1e-6"})
    msg = str(e.value)
    assert msg.startswith("optim.eps is not used by optim.name='muon' (muon fixes optim.eps at")
    assert "which reads optim.lr, optim.beta1, optim.weight_decay, optim.nesterov" in msg
    assert msg.endswith("set optim.eps to none (used by adamw, soap, adan, mars, nadamw)")
    with pytest.raises(
        ConfigError, match=r"^optim.beta3, optim.eps are not used by optim.name='lion'"
    ):
        _cfg(
            **{
                "optim.name": "lion",
                "optim.beta2": "0.9",
                "optim.eps": "1e-6",
                "optim.beta3": "0.9",
            }
        )
    # the fix works; so does repeating the value muon fixes (every muon config.json so far has it)
    _cfg(**{"optim.name": "muon", "optim.eps": "none"})
    _cfg(**{"optim.name": "muon", "optim.eps": "1e-8"})


def test_stored_configs_of_every_optimizer_load():
    """config.json holds the resolved optimizer config; reading it back must not be refused."""
    import dataclasses
    import json

    from stalepipe.config import OPTIMIZERS
    from stalepipe.training.optim import resolve_config

    for name in OPTIMIZERS:
        for scale in ("original", "match_rms") if name == "muon" else (None,):
            cfg = _cfg(**{"optim.name": name})
            if scale:
                cfg = apply_overrides(cfg, {"optim.muon_scale": scale})
            cfg = dataclasses.replace(cfg, optim=resolve_config(cfg.optim))
            assert ExperimentConfig.from_dict(json.loads(cfg.to_json())) == cfg
    # a muon record as train() wrote it before optim.eps was refused for muon
    old = {"name": "muon", "lr": 0.02, "beta1": 0.95, "beta2": None, "beta3": None, "eps": 1e-08,
           "weight_decay": 0.01, "nesterov": True, "ns_steps": 5, "muon_scale": "original",
           "adam_lr": 0.001, "precond_freq": None, "gamma": None}  # fmt: skip
    assert ExperimentConfig.from_dict({"optim": old}).optim.eps == 1e-8
