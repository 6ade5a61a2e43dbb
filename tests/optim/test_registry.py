"""The registry as the rest of the package uses it: config resolution, parameter groups,
checkpoint round trips, gradient safety and training the tiny preset."""

from __future__ import annotations

import copy
import dataclasses
import io

import pytest
import torch

from stalepipe.config import OPTIMIZERS, ConfigError, OptimConfig
from stalepipe.config.overrides import as_dict
from stalepipe.presets import cpu_tiny
from stalepipe.training.models import build_model
from stalepipe.training.optim import build_optimizer, resolve_config, split_params
from stalepipe.training.optim.lr_schedule import apply_lr
from stalepipe.training.optim.specs import AUX_ADAMW_EPS

NAMES = list(OPTIMIZERS)


def tiny_model(seed: int = 0):
    return build_model(cpu_tiny().model, seed=seed)


def batch(step: int, size: int = 4, seq: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 256, (size, seq + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def train_steps(model, opt, steps) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step)
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# ---- config resolution and errors ---------------------------------------------------------


def test_registry_and_defaults_cover_the_same_names():
    """Every registered optimizer has defaults only for fields it reads (muon's depend on scale),
    a row in docs/optimizers.md's table of the fields each reads, naming those fields, and none
    unregistered (the registry is the list: the docs are checked against it, not a hand list)."""
    import re
    from pathlib import Path

    for name, spec in OPTIMIZERS.items():
        assert spec.name == name and set(spec.defaults) <= set(spec.reads)
    doc = (Path(__file__).parents[2] / "docs" / "optimizers.md").read_text()
    table = doc.split("| name | reads |\n|---|---|\n", 1)[1].split("\n\n", 1)[0]
    rows = dict(re.findall(r"^\| `([\w-]+)` \| (.*) \|$", table, flags=re.M))
    assert list(rows) == list(OPTIMIZERS)
    for name, reads in rows.items():
        assert [re.sub(r" \(.*\)", "", f) for f in reads.split(", ")] == list(
            OPTIMIZERS[name].reads
        ), name


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("scale", ["original", "match_rms"])
def test_resolve_fills_exactly_the_fields_the_optimizer_reads(name, scale):
    cfg = OptimConfig(name=name, muon_scale=scale) if name == "muon" else OptimConfig(name=name)
    resolved = resolve_config(cfg)
    # every field, the optimizers' own settings among them, as config.json records it
    filled = {f for f, v in as_dict(resolved).items() if v is not None}
    assert filled == {"name", *OPTIMIZERS[name].reads, *OPTIMIZERS[name].fixed}
    for f, v in OPTIMIZERS[name].fixed.items():
        assert getattr(resolved, f) == v


def test_muon_records_the_eps_its_adamw_part_uses():
    fixed = {n: spec.fixed for n, spec in OPTIMIZERS.items() if spec.fixed}
    assert fixed == {"muon": {"eps": AUX_ADAMW_EPS}}


def _hyper(opt: torch.optim.Optimizer) -> str:
    groups = [
        {k: v for k, v in g.items() if k not in ("params", "param_names")} for g in opt.param_groups
    ]
    return repr((opt.defaults, groups))


def _other(field: str, value):
    if field == "muon_scale":
        return "match_rms" if value == "original" else "original"
    if isinstance(value, bool):
        return not value
    return value + 1 if isinstance(value, int) else value / 2


@pytest.mark.parametrize(
    ("name", "field"), [(n, f) for n, spec in OPTIMIZERS.items() for f in spec.reads]
)
def test_every_field_an_optimizer_reads_changes_what_it_builds(name, field):
    """`OptimizerSpec.reads` lists no field the optimizer would ignore (the others are refused)."""
    cfg = resolve_config(OptimConfig(name=name))
    changed = dataclasses.replace(cfg, **{field: _other(field, getattr(cfg, field))})
    params = list(tiny_model().named_parameters())
    assert _hyper(build_optimizer(cfg, params)) != _hyper(build_optimizer(changed, params))


@pytest.mark.parametrize("name", NAMES)
def test_resolve_fills_defaults_and_is_idempotent(name):
    cfg = resolve_config(OptimConfig(name=name))
    assert cfg.lr is not None and cfg.lr > 0
    assert resolve_config(cfg) == cfg
    # an explicit value wins over the default
    assert resolve_config(OptimConfig(name=name, lr=0.123)).lr == 0.123


def test_muon_scale_selects_consistent_defaults():
    original = resolve_config(OptimConfig(name="muon"))
    assert (original.muon_scale, original.lr, original.adam_lr) == ("original", 0.02, 1e-3)
    rms = resolve_config(OptimConfig(name="muon", muon_scale="match_rms"))
    assert rms.lr == rms.adam_lr == OPTIMIZERS["adamw"].defaults["lr"]
    assert rms.weight_decay == OPTIMIZERS["adamw"].defaults["weight_decay"]
    assert resolve_config(OptimConfig(name="muon", muon_scale="match_rms", lr=2e-3)).adam_lr == 2e-3


def test_unknown_name_suggests_the_closest():
    with pytest.raises(ConfigError, match="did you mean 'adamw'"):
        resolve_config(OptimConfig(name="adam"))
    with pytest.raises(ConfigError, match="unknown optimizer"):
        build_optimizer(OptimConfig(name="sgd-ish-thing"), tiny_model().named_parameters())


def test_field_unused_by_the_optimizer_is_an_error():
    with pytest.raises(ConfigError, match=r"optim.gamma is not used by optim.name='adamw'.*mars"):
        resolve_config(OptimConfig(name="adamw", gamma=0.1))
    with pytest.raises(ConfigError, match="optim.eps is not used"):
        resolve_config(OptimConfig(name="lion", eps=1e-8))
    with pytest.raises(ConfigError, match=r"optim.eps is not used by optim.name='muon'"):
        OptimConfig(name="muon", eps=1e-6)  # its AdamW part's eps is fixed
    assert resolve_config(OptimConfig(name="muon", eps=AUX_ADAMW_EPS)).eps == AUX_ADAMW_EPS


@pytest.mark.parametrize(
    ("field", "value", "pattern"),
    [
        ("lr", -1e-3, r"optim.lr must be > 0"),
        ("lr", 0.0, r"optim.lr must be > 0"),
        ("beta1", 1.0, r"optim.beta1 must be in \[0, 1\)"),
        ("beta2", -0.1, r"optim.beta2 must be in \[0, 1\)"),
        ("beta3", 1.5, r"optim.beta3 must be in \[0, 1\)"),
        ("weight_decay", -0.1, r"optim.weight_decay must be >= 0"),
        ("eps", -1e-8, r"optim.eps must be >= 0"),
        ("gamma", -0.5, r"optim.gamma must be >= 0"),
        ("ns_steps", 0, r"optim.ns_steps must be >= 1"),
        ("precond_freq", 0, r"optim.precond_freq must be >= 1"),
        ("muon_scale", "spectral", r"optim.muon_scale must be"),
    ],
)
def test_bad_hyperparameters_are_clear_errors(field, value, pattern):
    with pytest.raises(ConfigError, match=pattern):
        OptimConfig(**{field: value})


# ---- parameter groups ---------------------------------------------------------------------


def test_split_kinds_and_tied_embedding_once():
    model = tiny_model()
    split = split_params(model.named_parameters(remove_duplicate=False))
    names = {k: [n for n, _ in ps] for k, ps in split.kinds()}
    assert names["embed"] == ["tok_emb.weight"]  # lm_head.weight is the same tensor
    assert all(n.endswith("norm.weight") for n in names["vector"])
    assert "layers.0.attn.wq.weight" in names["matrix"]
    total = sum(len(ps) for _, ps in split.kinds())
    assert total == len(list(model.parameters()))


@pytest.mark.parametrize("name", NAMES)
def test_groups_weight_decay_names_and_peak_lr(name):
    model = tiny_model()
    opt = build_optimizer(OptimConfig(name=name), model.named_parameters())
    seen = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(seen) == len(set(seen)) == len(list(model.parameters()))
    for g in opt.param_groups:
        assert g["kind"] in ("matrix", "embed", "vector")
        assert len(g["param_names"]) == len(g["params"])
        if g["kind"] == "vector":
            assert g["weight_decay"] == 0.0
        else:
            assert g["weight_decay"] > 0.0
        assert g["peak_lr"] == g["lr"]
    apply_lr(opt, 0.5)
    assert all(g["lr"] == 0.5 * g["peak_lr"] for g in opt.param_groups)


def test_stage_subset_builds_its_own_optimizer():
    model = tiny_model()
    stage = [(n, p) for n, p in model.named_parameters() if n.startswith(("layers.2.", "norm."))]
    opt = build_optimizer(OptimConfig(name="muon"), stage)
    assert sorted(g["kind"] for g in opt.param_groups) == ["matrix", "vector"]


# ---- behaviour as a torch optimizer -------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_step_never_touches_the_gradient(name):
    """The delay emulator hands the same stale gradient object to several steps."""
    model = tiny_model()
    opt = build_optimizer(OptimConfig(name=name), model.named_parameters())
    x, y = batch(0)
    model(x, y).backward()
    grads = {p: p.grad for p in model.parameters()}
    saved = {p: g.clone() for p, g in grads.items()}
    for _ in range(3):  # SOAP's first call differs from the rest; step at least twice
        opt.step()
    for p, g in grads.items():
        assert p.grad is g, "p.grad was replaced or set to None"
        assert torch.equal(g, saved[p]), "p.grad was modified in place"


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_continues_bitwise(name):
    cfg = OptimConfig(name=name)
    model = tiny_model()
    opt = build_optimizer(cfg, model.named_parameters())
    train_steps(model, opt, range(7))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    train_steps(model, opt, range(7, 15))  # SOAP refreshes its eigenbasis in here

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    resumed = tiny_model(seed=123)  # different init: everything must come from the checkpoint
    resumed.load_state_dict(ckpt["model"])
    opt2 = build_optimizer(cfg, resumed.named_parameters())
    opt2.load_state_dict(ckpt["opt"])
    train_steps(resumed, opt2, range(7, 15))

    for (n, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), f"{name}: {n} differs after resume"
    sd1, sd2 = opt.state_dict(), opt2.state_dict()
    assert sd1["param_groups"] == sd2["param_groups"]
    for k, st in sd1["state"].items():
        for key, v in st.items():
            w = sd2["state"][k][key]
            assert torch.equal(v, w) if torch.is_tensor(v) else v == w, f"{name}: state {key}"


def test_mars_previous_gradient_is_checkpointed():
    model = tiny_model()
    opt = build_optimizer(OptimConfig(name="mars"), model.named_parameters())
    train_steps(model, opt, range(2))
    wq = model.layers[0].attn.wq.weight
    sd = opt.state_dict()
    idx = next(i for g in sd["param_groups"] for i, n in zip(g["params"], g["param_names"])
               if n == "layers.0.attn.wq.weight")  # fmt: skip
    assert torch.equal(sd["state"][idx]["last_grad"], wq.grad)
    assert sd["state"][idx]["last_grad"].data_ptr() != wq.grad.data_ptr()


# ---- trains the tiny preset ---------------------------------------------------------------

# Tiny CPU models tolerate larger LRs than the 100M-400M defaults (as the demo does).
TINY_LR = {
    "adamw": dict(lr=3e-3),
    "muon": dict(lr=0.03, adam_lr=3e-3),
    "soap": dict(lr=3e-3),
    "adan": dict(lr=3e-3),
    "lion": dict(lr=3e-4),
    "mars": dict(lr=3e-3, adam_lr=3e-3),
    "nadamw": dict(lr=3e-3),
}


@pytest.mark.parametrize("name", NAMES)
def test_trains_tiny_preset(name):
    model = tiny_model()
    opt = build_optimizer(OptimConfig(name=name, **TINY_LR[name]), model.named_parameters())
    x, y = batch(0, size=8)
    losses = []
    for _ in range(30):
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(map(torch.isfinite, torch.tensor(losses)))
    assert losses[-1] < 0.8 * losses[0], losses
    assert sum(losses[-5:]) < sum(losses[:5]), losses


def test_configs_are_frozen_dataclasses():
    cfg = resolve_config(OptimConfig(name="soap"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 1.0  # type: ignore[misc]
    assert copy.deepcopy(cfg) == cfg


@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_parameters_step(name):
    """train.dtype=bfloat16 must work: SOAP keeps its factors and bases in float32."""
    model = build_model(cpu_tiny().model, seed=0, dtype=torch.bfloat16)
    opt = build_optimizer(OptimConfig(name=name), model.named_parameters())
    before = [p.detach().clone() for p in model.parameters()]
    train_steps(model, opt, range(3))
    after = list(model.parameters())
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(after, before))
