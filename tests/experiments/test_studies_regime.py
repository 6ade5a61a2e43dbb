"""The cpu-regime study scale (issue 17): its base config, its optimizers and its estimates."""

from __future__ import annotations

import pytest

from stalepipe.errors import UserError
from stalepipe.lab.studies import ladder, scales
from stalepipe.lab.studies.registry import STUDIES
from stalepipe.lab.sweeps import plan


def test_the_optimizers_study_runs_every_registered_optimizer_but_cpu_s_left_out():
    """Every optimizer the registry holds, under each arm; `cpu` leaves out `CPU_LEFT_OUT` (its
    recorded results predate them)."""
    from stalepipe.config import OPTIMIZERS

    arms = ("sync", "2bw", "2bw+ef")
    regime = {s.group for s in STUDIES["optimizers"].specs("cpu-regime", 1)}
    cpu = {s.group for s in STUDIES["optimizers"].specs("cpu", 1)}
    assert regime == {f"{o}_{a}" for o in OPTIMIZERS for a in arms}
    assert cpu == {f"{o}_{a}" for o in OPTIMIZERS if o not in scales.CPU_LEFT_OUT for a in arms}
    assert scales.CPU_LEFT_OUT and set(scales.CPU_LEFT_OUT) <= set(OPTIMIZERS)


def test_cpu_regime_base_and_its_tuned_lrs():
    base = scales.base_config("cpu-regime")
    tc = base.train
    assert (tc.num_steps, tc.batch_size, base.data.seq_len) == (scales.REGIME_STEPS, 16, 128)
    assert tc.warmup_steps == tc.num_steps // 10 and tc.num_steps // tc.eval_every == 20
    assert base.data.tokenizer == "byte" and base.model.num_layers == 4  # P = 2, 4 exist
    adamw = dict(scales.optimizer_axis("cpu-regime", ("adamw",)))["adamw"]
    assert adamw["optim.lr"] == scales.LRS["cpu-regime"]["adamw"]


def test_the_tokens_study_keeps_each_scales_eval_density():
    for scale, evals in (("cpu", 4), ("cpu-regime", 20)):
        base = scales.base_config(scale)
        for spec in STUDIES["tokens"].specs(scale, 1):
            cfg = spec.config(base, "runs/x")
            assert cfg.train.num_steps // cfg.train.eval_every == evals, spec.name


def test_estimates_scale_with_tokens_per_step_at_each_cpu_scale():
    study = STUDIES["hparams"]
    specs = study.specs("cpu-regime", 1)
    seconds = plan.estimate_cpu_seconds(specs, study.base("cpu-regime"), "cpu-regime")
    per_run = scales.REGIME_STEPS * plan.CPU_SECONDS_PER_STEP["cpu-regime"]
    # AdamW and Muon: batch sizes /2, x1, x2 (x sync / 2bw), six runs each of the LR and wd
    # grids at x1
    assert abs(seconds - 2 * per_run * (2 * (0.5 + 1 + 2) + 12)) < 1e-6
    # paper-mini runs at cpu only: the cpu-regime table leaves it out instead of failing
    assert "paper-mini" in plan.study_table(3)
    regime = plan.study_table(3, "cpu-regime").splitlines()
    assert [ln for ln in regime if "paper-mini" in ln][0].split()[1:4] == [
        "(--scale",
        "cpu",
        "only)",
    ]
    named = plan.study_table(3).split()  # `sweep --help`: every study, with where it runs
    assert all(name in named for name in STUDIES)


def test_beyond_cpu_the_studies_retune_the_lr_and_add_muon_and_the_correctors():
    def groups(study: str, scale: str) -> set[str]:
        return {s.group for s in STUDIES[study].specs(scale, 1)}

    # momentum: each beta1 at a third, one and three times the optimizer's LR
    regime = groups("momentum", "cpu-regime")
    assert len(regime) == 2 * 4 * 3 * 2  # optimizers x momenta x LRs x sync / 2bw
    muon_lr = float(scales.LRS["cpu-regime"]["muon"])
    lrs = {f"{muon_lr / 3:.3g}", f"{muon_lr:.3g}", f"{muon_lr * 3:.3g}"}
    assert {f"muon_b10.95_lr{lr}_2bw" for lr in lrs} <= regime
    assert len(groups("momentum", "cpu")) == 2 * 4 * 2  # the recorded cpu study, unchanged
    # hparams: Muon beside AdamW
    assert any(g.startswith("muon_") for g in groups("hparams", "cpu-regime"))
    assert not any(g.startswith("muon_") for g in groups("hparams", "cpu"))
    # mitigations: the correctors beyond the paper
    correctors = {f"{o}_2bw+{c}" for o in ("adamw", "muon")
                  for c in ("taylor-const", "dcasgd-ema", "wpred", "adamom")}  # fmt: skip
    assert correctors <= groups("mitigations", "cpu-regime")
    assert not correctors & groups("mitigations", "cpu")


def test_gpu_estimates_are_the_runs_training_flops_at_the_stated_mfu():
    from stalepipe.hardware import get_device
    from stalepipe.training.models import flops_per_token

    base = scales.base_config("135m")
    specs = STUDIES["optimizers"].specs("135m", 1)[:2]
    cfg = specs[0].config(base, ".")
    tokens = cfg.train.num_steps * cfg.train.batch_size * cfg.data.seq_len
    one = flops_per_token(cfg.model, cfg.data.seq_len)["total"] * tokens
    rate = get_device(plan.GPU_DEVICE).peak_flops * plan.GPU_MFU
    assert abs(plan.estimate_gpu_seconds(specs, base) - 2 * one / rate) < 1e-6 * one / rate
    # ~6 N D for a 135M model on 2.6B tokens: the right order of magnitude, attention on top
    assert 6 * 134e6 * tokens < one < 9 * 134e6 * tokens
    assert "GPU-h" in plan.study_table(3, "135m")


def test_the_size_ladder_is_what_results_md_registered():
    """Issue 41's ladder: 5 widths over >= 16x non-embedding parameters (counted from the model,
    not trusted from the table), 10 tokens per such parameter, 3 LRs per optimizer on sync at
    phase 1; phase 2 refuses to run before its LRs are chosen, and reuses phase 1's sync runs."""
    import dataclasses

    from stalepipe.training.models import build_model

    base = scales.regime_base().model
    counts = []
    for width, ffn, params in ladder.LADDER:
        model = build_model(dataclasses.replace(base, dim=width, ffn_dim=ffn), seed=0)
        n = sum(p.numel() for p in model.parameters()) - model.tok_emb.weight.numel()
        assert n == params, width
        assert ffn == -(-8 * width // 3 // 32) * 32  # 8/3 x width, up to a multiple of 32
        steps = int(ladder.ladder_size(width, ffn, params)[1]["train.num_steps"])
        assert abs(steps * 16 * 128 - 10 * params) <= 16 * 128  # 10 tokens per parameter
        counts.append(n)
    assert counts[-1] / counts[0] >= 16
    specs = STUDIES["ladder-lr"].specs("cpu-regime", 1)
    edges = sum(len(v) for v in ladder.LADDER_EDGE_LRS.values())  # the edge rule's extra points
    assert len(specs) == 2 * 5 * 3 + edges
    assert {s.overrides["delay.policy"] for s in specs} == {"sync"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ladder, "LADDER_LRS", {})
        with pytest.raises(UserError, match="run `stalepipe sweep ladder-lr"):
            STUDIES["ladder"].specs("cpu-regime", 3)
        mp.setattr(ladder, "LADDER_LRS", {("muon", 32): "0.04"})  # only the chosen widths
        assert {s.overrides["model.dim"] for s in STUDIES["ladder"].specs("cpu-regime", 1)} == {
            "32"
        }
    chosen = {
        (n, w): ladder.ladder_lrs(n, w)[1] for n in ("adamw", "muon") for w, *_ in ladder.LADDER
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ladder, "LADDER_LRS", chosen)
        phase2 = {s.name for s in STUDIES["ladder"].specs("cpu-regime", 3)}
    assert len(phase2) == 2 * 5 * 3 * 3
    reused = [
        s.name
        for s in specs
        if s.overrides["optim.lr"]
        == chosen[s.overrides["optim.name"], int(s.overrides["model.dim"])]
    ]
    assert len(reused) == 10 and set(reused) <= phase2  # phase 1's sync run at the chosen LR


def test_the_overhead_ladder_holds_the_token_budget_and_varies_size_alone():
    """docs/RESULTS.md 'Overhead ladder', as registered: four widths over >= 8x of non-embedding
    parameters at one token budget, Muon at one LR, 2bw and 2bw+EF at 1-1.5x, sync at 1x and
    1.2x, every run inside one epoch of the 4.78M training tokens; 48 runs a seed."""
    from stalepipe.lab.studies import overhead_ladder

    specs = STUDIES["overhead-ladder"].specs("cpu-regime", 3)
    assert len(specs) == 3 * 4 * (2 + 2 * 5)
    assert [s.seed for s in specs] == sorted(s.seed for s in specs)  # seed-major
    params = {w: n for w, _, n in ladder.LADDER}
    widths = sorted({int(s.overrides["model.dim"]) for s in specs})
    assert params[widths[-1]] / params[widths[0]] >= 8
    assert {s.overrides["optim.name"] for s in specs} == {"muon"}
    assert {s.overrides["optim.lr"] for s in specs} == {overhead_ladder.OVERHEAD_LR}
    for s in specs:
        steps = int(s.overrides["train.num_steps"])
        factor = steps / overhead_ladder.OVERHEAD_STEPS
        arm = s.overrides["delay.policy"] + ("+ef" if s.overrides.get("delay.ef") else "")
        allowed = (
            overhead_ladder.OVERHEAD_SYNC_LENGTHS
            if arm == "sync"
            else overhead_ladder.OVERHEAD_LENGTHS
        )
        assert any(abs(factor - f) < 1e-9 for f in allowed), s.name
        assert steps * 16 * 128 <= 4_780_000  # one epoch
        assert int(s.overrides["train.warmup_steps"]) == round(140 * factor)
        assert int(s.overrides["train.eval_every"]) == round(70 * factor)
    first = [s.overrides["model.dim"] for s in specs if s.seed == 0]
    assert first == sorted(first, key=int)  # a seed's narrow widths first


def test_adamw_second_lrs_are_phase_one_runner_ups_and_reuse_its_sync_runs():
    """docs/RESULTS.md "AdamW's ladder with its LR held apart", as registered: each width's
    second-best phase-1 LR by seed 0's sync whole-split loss (the committed records), sync and
    2bw at it, the seed-0 sync run phase 1's own (same name, already committed)."""
    from pathlib import Path

    from stalepipe.lab.analysis import scaling
    from stalepipe.lab.studies import ladder_adamw_lr2

    root = Path(__file__).parents[2] / "docs" / "results" / "ladder-regime"
    scan: dict[int, dict[float, float]] = {}
    for r in scaling.ladder_runs(root):
        if (r.optimizer, r.arm, r.seed) == ("adamw", "sync", 0):
            scan.setdefault(r.width, {})[r.lr] = r.loss
    for width, *_ in ladder.LADDER:
        ranked = sorted(scan[width], key=scan[width].get)
        assert f"{ranked[0]:g}" == ladder.LADDER_LRS["adamw", width]
        assert f"{ranked[1]:g}" == ladder_adamw_lr2.LADDER_ADAMW_SECOND_LRS[width]
    specs = STUDIES["ladder-adamw-lr2"].specs("cpu-regime", 3)
    assert len(specs) == 5 * 2 * 3
    assert {s.overrides["delay.policy"] for s in specs} == {"sync", "2bw"}
    reused = [s.name for s in specs if s.seed == 0 and s.overrides["delay.policy"] == "sync"]
    assert len(reused) == 5 and all((root / name / "metrics.jsonl").is_file() for name in reused)
