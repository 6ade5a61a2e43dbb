"""Checkpoint state under global names, split by stage: what each process saves and loads.

Every engine saves its state as one flat dict of tensors under global, split-independent keys
(the `torch.distributed.checkpoint` (DCP) state dict each process writes, `rundir.sharded`):

    model/<param>              the live weights a process owns (a tied head is not saved: it is
                               its owner's tensor, `delay.tied.aliases`)
    optim/<param>/<key>        the base optimizer's per-parameter tensors (exp_avg, step, ...)
    version/<v>/<param>        the kept weight versions (`DelayedOptimizer` history)
    ef_prev/<param>, taylor_ms/<param>   the EF buffer U_{k-1} and the Taylor EMA
    rng                        the CPU RNG state (the first process only)

and the rest (step, policy, its stages and their parameter names, the optimizer's param
groups, non-tensor optimizer state such as integer step counts) as one small JSON per process
(`flatten_part`'s `meta`). A process loading the state for its stages of any split reads only
the keys of the parameters it owns (`resplit_state`), so the number of stages (and with chunks,
of processes) may change between a save and a load: the keys are the reshard. Re-splitting is
defined when every stage has the same delay (sync, 2bw, fixed:N: each stage keeps the same
versions and the trajectory does not depend on the split); pipedream and wpipe across
different splits are refused (`check_resplit`).

The single-file checkpoints of older versions (one merged `ckpt_<k>.pt`) are read only by
`stalepipe checkpoint convert` (`rundir/convert.py`): `from_merged` turns one into the same keys
in memory, which the converter then writes as format 3.

Rank 0 waits for the other processes' shards on the filesystem (`wait_part`); the wait also
reads the run's failure records (`peers.failures.Failure`), so a stage that died instead of
writing its shard stops rank 0 within `FAILURE_POLL_S`, not after `pipeline.timeout_s`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from stalepipe.errors import CheckpointError
from stalepipe.training.delay import DelayedOptimizer, DelaySchedule
from stalepipe.training.peers.failures import FailureRecords, launcher_records
from stalepipe.training.peers.group import PeerError, peer_error
from stalepipe.training.peers.topology import Topology

PARTS_DIR = "parts"  # where older versions staged their parts (a run directory may hold one)
FAILURE_POLL_S = 0.1  # how often a wait for a shard reads the run's failure records
BUFFERS = ("ef_prev", "taylor_ms")  # per-parameter delay buffers, one tensor each


def staging_dir(run_dir: Path, step: int) -> Path:
    """Where every process writes its shard of the checkpoint of `step` before rank 0 renames
    the whole directory into place (`rundir.sharded.commit`)."""
    return Path(run_dir) / f".ckpt_{step:08d}.tmp"


def part_dir(run_dir: Path, step: int, pipe_rank: int) -> Path:
    """Pipeline rank `pipe_rank`'s DCP shard directory (of replica 0) in the staging dir."""
    return staging_dir(run_dir, step) / f"rank_{pipe_rank:03d}"


PART_DONE = "digests.json"  # a shard's file digests, written (atomically) once it is complete


def part_path(run_dir: Path, step: int, pipe_rank: int) -> Path:
    """The file whose presence says the shard is complete: the digests of its files, written
    last (`rundir.sharded.save_part`), after DCP wrote and synced them."""
    return part_dir(run_dir, step, pipe_rank) / PART_DONE


def wait_part(
    run_dir: Path,
    step: int,
    pipe_rank: int,
    topo: Topology,
    timeout_s: float,
    records: FailureRecords | None = None,
    rank: int = 0,
) -> Path:
    """Wait (on `rank`, the committing rank 0) until pipeline rank `pipe_rank` (of replica 0)
    wrote its shard of step `step`; return its `part_path`. Raises `PeerError` naming the failed
    rank as soon as any rank of the run has a failure record in `records` (the runtime's
    `Comm.records`; default: `failures.launcher_records()`): the process itself, a neighbour
    that saw it die, or the launcher for a killed one; naming the process after `timeout_s`
    without its shard (a hung one)."""
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
    return path


class FlatState(Protocol):
    """A checkpoint as `flatten_part` keys: the processes' `meta`s and tensors read by key
    (`rundir.sharded.ShardedCheckpoint` reads them from DCP shards, `InMemory` holds them)."""

    metas: list[dict[str, Any]]

    def stored_keys(self) -> set[str]: ...

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]: ...


@dataclass
class InMemory:
    """A `FlatState` held in memory (an old single-file checkpoint, `from_merged`)."""

    metas: list[dict[str, Any]]
    tensors: dict[str, torch.Tensor]

    def stored_keys(self) -> set[str]:
        return set(self.tensors)

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        return {k: self.tensors[k] for k in keys}


def flatten_part(
    delayed: dict[str, Any],
    stages: list[int],
    weights: dict[str, torch.Tensor],
    rng: torch.Tensor | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One process's state under global keys (module docstring): `delayed` its
    `DelayedOptimizer.state_dict()`, `stages` the stages it holds, `weights` its owned live
    weights by name. Returns (tensors, meta): meta is the non-tensor rest, JSON-safe."""
    tensors = {f"model/{n}": t for n, t in weights.items()}
    opt, scalars, groups = delayed["optimizer"], {}, []
    own = {n for s in stages for n in delayed["names"][s]}
    for g in opt["param_groups"]:
        groups.append({k: v for k, v in g.items() if k != "params"})
        groups[-1]["param_names"] = [n for n in g["param_names"] if n in own]
        for i, n in zip(g["params"], g["param_names"], strict=True):
            if n not in own:
                continue
            for key, v in opt["state"].get(i, {}).items():
                if isinstance(v, torch.Tensor):
                    tensors[f"optim/{n}/{key}"] = v
                else:  # integer step counts and the like
                    scalars.setdefault(n, {})[key] = v
    for s in stages:
        names = delayed["names"][s]
        for v, ts in delayed["history"][s].items():
            tensors.update({f"version/{int(v)}/{n}": t for n, t in zip(names, ts, strict=True)})
        for key in BUFFERS:
            if delayed[key] is not None and delayed[key][s]:
                tensors.update({f"{key}/{n}": t for n, t in zip(names, delayed[key][s])})
    if rng is not None:
        tensors["rng"] = rng
    meta = {
        "step": int(delayed["step"]),
        "policy": delayed["policy"],
        "num_stages": int(delayed["num_stages"]),
        "stages": list(stages),
        "names": {str(s): list(delayed["names"][s]) for s in stages},
        "param_groups": groups,
        "scalars": scalars,
    }
    return tensors, meta


def from_merged(ckpt: dict[str, Any], aliases: dict[str, str]) -> InMemory:
    """An old single-file checkpoint (`rundir.checkpoint` format 1: the whole model and a
    whole-model engine state) as the keys of the new format. `aliases`: model keys that are
    another key's tensor (a tied head), left out as the new format does."""
    weights = {k: t for k, t in ckpt["model"].items() if k not in aliases}
    engine = ckpt.get("engine")
    if engine is not None:
        delayed = engine["delayed"]
    else:  # a checkpoint without delay state (plain optimizer): one stage, no versions
        names = [n for g in ckpt["optimizer"]["param_groups"] for n in g["param_names"]]
        delayed = {"step": ckpt["step"], "policy": None, "num_stages": 1, "names": [names]}
        delayed |= {"optimizer": ckpt["optimizer"], "history": [{}]}
        delayed |= dict.fromkeys(BUFFERS)
    stages = list(range(len(delayed["names"])))
    tensors, meta = flatten_part(delayed, stages, weights, ckpt.get("rng"))
    return InMemory([meta], tensors)


def _group_key(g: dict[str, Any], i: int) -> Any:
    return g.get("kind", i)


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


def _saved_optimizer(
    metas: list[dict[str, Any]], tensors: dict[str, torch.Tensor], names: set[str]
) -> dict[str, Any]:
    """The saved optimizer state of the parameters `names` as one state_dict (ids by position;
    `split_optimizer` matches them by name), param groups merged by their kind."""
    per_name: dict[str, dict[str, Any]] = {}
    for key, t in tensors.items():
        if key.startswith("optim/"):
            _, n, k = key.split("/", 2)
            per_name.setdefault(n, {})[k] = t
    groups: dict[Any, dict[str, Any]] = {}
    state: dict[int, dict[str, Any]] = {}
    ids = itertools.count()
    for meta in metas:
        for gi, g in enumerate(meta["param_groups"]):
            merged = groups.setdefault(_group_key(g, gi), {**g, "params": [], "param_names": []})
            for n in g["param_names"]:
                if n in names:
                    i = next(ids)
                    merged["params"].append(i)
                    merged["param_names"].append(n)
                    state[i] = {**per_name.get(n, {}), **meta["scalars"].get(n, {})}
    return {"state": {i: s for i, s in state.items() if s}, "param_groups": list(groups.values())}


def saved_split(flat: FlatState) -> tuple[int, str | None, list[list[str]]]:
    """(step, delay policy, parameter names per stage) a checkpoint was saved with."""
    meta = flat.metas[0]
    names = {int(s): ns for m in flat.metas for s, ns in m["names"].items()}
    return int(meta["step"]), meta["policy"], [names[s] for s in sorted(names)]


def check_resplit(flat: FlatState, names_per_stage: list[list[str]]) -> None:
    """Refuse (CheckpointError) to re-split delay state whose policy delays stages differently
    (pipedream, wpipe) onto another split: each parameter's delay, and with it the trajectory
    and the weight versions it needs, would change."""
    step, policy, old = saved_split(flat)
    if policy is None or old == [list(n) for n in names_per_stage]:
        return
    old_p, new_p = len(old), len(names_per_stage)
    if not all(DelaySchedule.build(policy, p).uniform for p in (old_p, new_p)):
        raise CheckpointError(
            f"the checkpoint at step {step} was saved with pipeline.num_stages {old_p} "
            f"under delay.policy {policy}, which delays each stage differently; resume with "
            f"--pipeline.num_stages {old_p}"
        )


def _keys_of(flat: FlatState, names: set[str]) -> list[str]:
    """Every key of `flat` about the parameters `names` (and the RNG)."""
    out = []
    for key in flat.stored_keys():
        kind, _, rest = key.partition("/")
        name = rest.split("/", 1)[1] if kind == "version" else rest.split("/", 1)[0]
        if key == "rng" or name in names:
            out.append(key)
    return out


def stage_state(
    flat: FlatState,
    stages: list[int],
    names_per_stage: list[list[str]],
    own_optim: dict[str, Any],
    needed_versions: list[set[int]],
    extra: Iterable[str] = (),
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, dict[int, torch.Tensor]]]:
    """What the process of `stages` (of a split `names_per_stage`, maybe not the saved one)
    loads: it reads only its parameters' keys (and those of the parameters `extra`: a tied
    head's owner). Returns (weights by name, the `DelayedOptimizer` state for this process,
    per-parameter versions {name: {version: tensor}}); stages not in `stages` are left empty.
    `needed_versions[s]`: the past versions stage s keeps (`DelayedOptimizer.
    versions_to_keep`); `own_optim`: the state_dict of the optimizer the state is for.

    Raises CheckpointError when the split cannot change (`check_resplit`) or a needed version
    is not in the checkpoint."""
    check_resplit(flat, names_per_stage)
    step, policy, _ = saved_split(flat)
    P = len(names_per_stage)
    names = {n for s in stages for n in names_per_stage[s]} | set(extra)
    read = flat.read(_keys_of(flat, names))
    per_param: dict[str, dict[int, torch.Tensor]] = {}
    for key, t in read.items():
        if key.startswith("version/"):
            _, v, n = key.split("/", 2)
            per_param.setdefault(n, {})[int(v)] = t
    history: list[dict[int, list[torch.Tensor]]] = [{} for _ in range(P)]
    for s in stages:
        for v in sorted(needed_versions[s] - {step}):
            if not all(v in per_param.get(n, {}) for n in names_per_stage[s]):
                raise CheckpointError(
                    f"the checkpoint at step {step} lacks weight version {v} for stage {s} of "
                    f"{P}; resume a {policy or 'plain'} run with the pipeline.num_stages it was "
                    f"saved with"
                )
            history[s][v] = [per_param[n][v] for n in names_per_stage[s]]
    saved = _saved_optimizer(flat.metas, read, names)
    state = {
        "step": step,
        "policy": policy,
        "num_stages": P,
        "names": [list(ns) if s in stages else [] for s, ns in enumerate(names_per_stage)],
        "optimizer": split_optimizer(saved, own_optim),
        "history": history,
    }
    for key in BUFFERS:
        have = any(f"{key}/{n}" in read for n in names)
        state[key] = (
            [
                [read[f"{key}/{n}"] for n in ns] if s in stages else []
                for s, ns in enumerate(names_per_stage)
            ]
            if have
            else None
        )
    weights = {n: read[f"model/{n}"] for n in names if f"model/{n}" in read}
    return weights, state, per_param


def emulator_state(
    flat: FlatState, delayed: DelayedOptimizer
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(weights by name, `DelayEmulator.load_state_dict`'s argument) for the emulator whose
    delayed optimizer is `delayed`, from a checkpoint of any engine and split: every stage is
    this process's, re-split by name (a runtime checkpoint's groups onto the per-stage groups
    the per-stage correctors make, `delay.correctors.group_stages`)."""
    own = delayed.state_dict()
    step = saved_split(flat)[0]
    stages = list(range(len(own["names"])))
    weights, state, _ = stage_state(
        flat, stages, own["names"], own["optimizer"], delayed.versions_to_keep(step)
    )
    if state["policy"] is None:
        state["policy"] = own["policy"]
    return weights, {"mode": "exact", "delayed": state}
