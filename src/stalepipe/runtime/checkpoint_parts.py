"""Stage checkpoint parts and the stage-agnostic checkpoint they form.

Each process of replica 0 saves its part, its stages' state, atomically
(`parts/step_<k>/rank_<r>.pt`, r its pipeline rank); rank 0 merges the parts
into the ordinary `ckpt_<k>.pt` of single-process training (`rundir.checkpoint`), which holds:

    model   the whole model's state_dict (global names; a key no part holds is the tensor of the
            key it aliases, as in the model)
    engine  `DelayEmulator.state_dict()` for P stages: {"mode", "delayed": {step, policy,
            num_stages, names, optimizer, history, ef_prev, taylor_ms}}; the optimizer state is
            the one a whole-model optimizer would hold (param ids of the whole model)

so `stalepipe train` with the emulator resumes it, and either engine with another number of
stages re-splits it by parameter name (`resplit_state`: `stage_state` for one runtime process,
`emulator_state` for the emulator). Re-splitting is defined when every stage has the same delay
(sync, 2bw, fixed:N: each stage keeps the same versions and the trajectory does not depend on
the split); pipedream and wpipe across different splits are refused (`check_resplit`).

Rank 0 waits for the other processes' parts on the filesystem (`wait_part`); the wait also reads
the run's failure records (`runtime.failures.Failure`), so a stage that died instead of writing
its part stops rank 0 within `FAILURE_POLL_S`, not after `pipeline.timeout_s`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from stalepipe.delay import DelayedOptimizer, DelaySchedule
from stalepipe.errors import CheckpointError
from stalepipe.fileio import torch_save_atomic
from stalepipe.runtime.comm import PeerError, peer_error
from stalepipe.runtime.failures import FailureRecords, launcher_records
from stalepipe.runtime.topology import Topology

PARTS_DIR = "parts"
FAILURE_POLL_S = 0.1  # how often a wait for a part reads the run's failure records


def part_path(run_dir: Path, step: int, pipe_rank: int) -> Path:
    return Path(run_dir) / PARTS_DIR / f"step_{step:08d}" / f"rank_{pipe_rank:03d}.pt"


def save_part(run_dir: Path, step: int, pipe_rank: int, part: dict[str, Any]) -> Path:
    """Write one process's part atomically (temporary file, fsync, rename)."""
    path = part_path(run_dir, step, pipe_rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    return torch_save_atomic(path, part)


def wait_part(
    run_dir: Path,
    step: int,
    pipe_rank: int,
    topo: Topology,
    timeout_s: float,
    records: FailureRecords | None = None,
    rank: int = 0,
) -> dict[str, Any]:
    """Wait (on `rank`, the merging rank 0) until pipeline rank `pipe_rank` (of replica 0)
    wrote its part of step `step`, then load it. Raises `PeerError` naming the failed rank as
    soon as any rank of the run has a failure record in `records` (the runtime's `Comm.records`;
    default: `failures.launcher_records()`): the process itself, a neighbour that saw it die,
    or the launcher for a killed one; naming the process after `timeout_s` without its part
    (a hung one)."""
    records = launcher_records() if records is None else records
    path = part_path(run_dir, step, pipe_rank)
    peer = topo.rank(pipe_rank)  # its first stage is its pipeline rank
    what = f"the checkpoint part of {topo.describe(peer)} at step {step}"
    start = time.monotonic()
    next_check = start
    while not path.exists():
        now = time.monotonic()
        if now >= next_check:
            if (f := records.first()) is not None and f.rank != rank:
                root = f.root if f.root not in (None, rank) else f.rank
                raise peer_error(topo, rank, root, what, timeout_s, f.line)
            next_check = now + FAILURE_POLL_S
        if now - start > timeout_s:
            raise PeerError(
                f"{topo.describe(rank)}: {topo.describe(peer)} did not write its checkpoint "
                f"part {path} within {timeout_s:g}s",
                peer,
            )
        time.sleep(0.02)
    return torch.load(path, map_location="cpu", weights_only=True)


def _group_key(g: dict[str, Any], i: int) -> Any:
    return g.get("kind", i)


def merge_optimizer(skeleton: dict[str, Any], parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Whole-model optimizer state_dict from per-stage ones, matched by parameter name.

    `skeleton` is the state_dict of a whole-model optimizer built the same way (its groups give
    the parameter ids and names); group hyperparameters come from the stages' groups."""
    gid = {n: i for g in skeleton["param_groups"] for i, n in zip(g["params"], g["param_names"])}
    state: dict[int, Any] = {}
    hyper: dict[Any, dict[str, Any]] = {}
    for sd in parts:
        for i, g in enumerate(sd["param_groups"]):
            hyper.setdefault(_group_key(g, i), g)
            for lid, name in zip(g["params"], g["param_names"], strict=True):
                if lid in sd["state"]:
                    state[gid[name]] = sd["state"][lid]
    groups = []
    for i, g in enumerate(skeleton["param_groups"]):
        src = hyper.get(_group_key(g, i), g)
        groups.append(
            {
                **{k: v for k, v in src.items() if k not in ("params", "param_names")},
                "params": list(g["params"]),
                "param_names": list(g["param_names"]),
            }
        )
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def split_optimizer(full: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """The part of a whole-model optimizer state_dict `full` for the optimizer whose own
    (empty or current) state_dict is `own`, matched by parameter name."""
    by_name = {
        n: full["state"][i]
        for g in full["param_groups"]
        for i, n in zip(g["params"], g["param_names"])
        if i in full["state"]
    }
    hyper = {_group_key(g, i): g for i, g in enumerate(full["param_groups"])}
    groups, state = [], {}
    for i, g in enumerate(own["param_groups"]):
        src = hyper.get(_group_key(g, i), g)
        groups.append(
            {
                **{k: v for k, v in src.items() if k not in ("params", "param_names")},
                "params": list(g["params"]),
                "param_names": list(g["param_names"]),
            }
        )
        for lid, n in zip(g["params"], g["param_names"], strict=True):
            if n in by_name:
                state[lid] = by_name[n]
    return {"state": state, "param_groups": groups}


def merge_parts(
    parts: list[dict[str, Any]],
    skeleton_optim: dict[str, Any],
    model_keys: list[str],
    aliases: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The stage-agnostic checkpoint body (`model`, `engine`, `rng`) from every process's part
    (each names its `stages`), pipeline rank 0 first. `aliases`: model keys whose tensor is
    another key's (a matrix the model shares under two names)."""
    by_stage = {s: part for part in parts for s in part["stages"]}
    P = len(by_stage)
    assert sorted(by_stage) == list(range(P)), sorted(by_stage)
    weights: dict[str, torch.Tensor] = {}
    for part in parts:
        weights.update(part["model"])
    for key, source in (aliases or {}).items():
        if key in model_keys:
            weights[key] = weights[source]
    missing = [k for k in model_keys if k not in weights]
    assert not missing, f"parts miss {missing[:3]}"
    model = {k: weights[k] for k in model_keys}
    delayed = [by_stage[s]["delayed"] for s in range(P)]  # stage s's process's state
    d0 = delayed[0]

    def per_stage(key: str) -> list | None:
        vals = [d[key][s] if d[key] is not None else None for s, d in enumerate(delayed)]
        return None if all(v is None for v in vals) else [v or [] for v in vals]

    merged = {
        "step": d0["step"],
        "policy": d0["policy"],
        "num_stages": P,
        "names": [d["names"][s] for s, d in enumerate(delayed)],
        "optimizer": merge_optimizer(skeleton_optim, [p["delayed"]["optimizer"] for p in parts]),
        "history": [d["history"][s] for s, d in enumerate(delayed)],
        "ef_prev": per_stage("ef_prev"),
        "taylor_ms": per_stage("taylor_ms"),
    }
    assert all(d["step"] == d0["step"] for d in delayed), [d["step"] for d in delayed]
    return {
        "model": model,
        "engine": {"mode": "exact", "delayed": merged},
        "rng": parts[0]["rng"],
    }


def check_resplit(engine: dict[str, Any] | None, names_per_stage: list[list[str]]) -> None:
    """Refuse (CheckpointError) to re-split delay state whose policy delays stages differently
    (pipedream, wpipe) onto another split: each parameter's delay, and with it the trajectory
    and the weight versions it needs, would change."""
    if engine is None:
        return
    d = engine["delayed"]
    if [list(n) for n in d["names"]] == [list(n) for n in names_per_stage]:
        return
    old_p, new_p, policy = d["num_stages"], len(names_per_stage), d["policy"]
    if not all(DelaySchedule.build(policy, p).uniform for p in (old_p, new_p)):
        raise CheckpointError(
            f"the checkpoint at step {d['step']} was saved with pipeline.num_stages {old_p} "
            f"under delay.policy {policy}, which delays each stage differently; resume with "
            f"--pipeline.num_stages {old_p}"
        )


def resplit_state(
    ckpt: dict[str, Any],
    names_per_stage: list[list[str]],
    own_optim: dict[str, Any],
    needed_versions: list[set[int]],
    stages: list[int] | None = None,
) -> tuple[dict[str, Any], dict[str, dict[int, torch.Tensor]]]:
    """The `DelayedOptimizer` state for the split `names_per_stage` from a merged (or
    single-process) checkpoint of any split, matched by global parameter name; stages not in
    `stages` (default: all) are left empty, as a runtime process holds only its own.

    `needed_versions[s]`: the past versions stage s must keep (`DelayedOptimizer.
    versions_to_keep`). `own_optim`: the state_dict of the optimizer the state is for (its
    parameter ids). Returns (state, per-parameter history {name: {version: tensor}}).
    Raises CheckpointError when the split cannot change (`check_resplit`) or a needed version
    is not in the checkpoint."""
    engine = ckpt.get("engine")
    check_resplit(engine, names_per_stage)
    step = int(ckpt["step"])
    P = len(names_per_stage)
    stages = list(range(P)) if stages is None else stages
    per_param: dict[str, dict[int, torch.Tensor]] = {}
    ef: dict[str, torch.Tensor] = {}
    ms: dict[str, torch.Tensor] = {}
    if engine is not None:
        d = engine["delayed"]
        for s, old_names in enumerate(d["names"]):
            for v, ts in d["history"][s].items():
                for n, t in zip(old_names, ts, strict=True):
                    per_param.setdefault(n, {})[int(v)] = t
            for key, out in (("ef_prev", ef), ("taylor_ms", ms)):
                if d[key] is not None and d[key][s]:
                    out.update(zip(old_names, d[key][s], strict=True))
        full_optim = d["optimizer"]
        policy = d["policy"]
    else:  # a checkpoint without delay state (plain optimizer)
        full_optim = ckpt["optimizer"]
        policy = None
    history: list[dict[int, list[torch.Tensor]]] = [{} for _ in range(P)]
    for s in stages:
        names = names_per_stage[s]
        for v in sorted(needed_versions[s]):
            if v == step:
                continue
            if not all(v in per_param.get(n, {}) for n in names):
                raise CheckpointError(
                    f"the checkpoint at step {step} lacks weight version {v} for stage {s} of "
                    f"{P}; resume a {policy or 'plain'} run with the pipeline.num_stages it was "
                    f"saved with"
                )
            history[s][v] = [per_param[n][v] for n in names]
    state = {
        "step": step,
        "policy": policy,
        "num_stages": P,
        "names": [list(ns) if s in stages else [] for s, ns in enumerate(names_per_stage)],
        "optimizer": split_optimizer(full_optim, own_optim),
        "history": history,
        "ef_prev": None,
        "taylor_ms": None,
    }
    for key, src in (("ef_prev", ef), ("taylor_ms", ms)):
        if src:
            state[key] = [
                [src[n] for n in ns] if s in stages else [] for s, ns in enumerate(names_per_stage)
            ]
    return state, per_param


def stage_state(
    ckpt: dict[str, Any],
    stages: list[int],
    names_per_stage: list[list[str]],
    own_optim: dict[str, Any],
    needed_versions: list[set[int]],
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, dict[int, torch.Tensor]]]:
    """What the runtime process of `stages` (of a possibly different split) loads from a
    merged checkpoint: (weights by name, `DelayedOptimizer` state for this process,
    per-parameter history). `needed_versions[s]`: the past versions stage s keeps.

    Raises CheckpointError when the split cannot change or a weight version one of these
    stages must keep is not in the checkpoint."""
    weights = {n: ckpt["model"][n] for s in stages for n in names_per_stage[s]}
    needed = [needed_versions[s] if s in stages else set() for s in range(len(names_per_stage))]
    state, per_param = resplit_state(ckpt, names_per_stage, own_optim, needed, list(stages))
    return weights, state, per_param


def emulator_state(ckpt: dict[str, Any], delayed: DelayedOptimizer) -> dict[str, Any]:
    """`DelayEmulator.load_state_dict`'s argument for `delayed` (the emulator's delayed
    optimizer) from a checkpoint of any engine and split: the checkpoint's own engine state
    when the split and the optimizer's param groups are the same (bit for bit what was saved),
    else re-split by name (a runtime checkpoint's whole-model groups onto the per-stage groups
    the per-stage correctors make, `delay.correctors.group_stages`)."""
    engine = ckpt["engine"]
    own = delayed.state_dict()
    if (
        engine is not None
        and engine["delayed"]["names"] == own["names"]
        and len(engine["delayed"]["optimizer"]["param_groups"])
        == len(own["optimizer"]["param_groups"])
    ):
        return engine
    state, _ = resplit_state(
        ckpt, own["names"], own["optimizer"], delayed.versions_to_keep(int(ckpt["step"]))
    )
    if state["policy"] is None:
        state["policy"] = own["policy"]
    return {"mode": engine["mode"] if engine else "exact", "delayed": state}
