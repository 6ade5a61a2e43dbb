"""Checkpoints as DCP shards (rundir.sharded): a runtime run at P = 2 writes one shard per
process under global names; it resumes at P = 2 and on the emulator at P = 1 bit for bit as
the uninterrupted run continues; each process reads only its own parameters' keys; an older
version's checkpoint (format 1 or 2) is refused in one line, converts, and then resumes; a damaged shard is one line naming the fix
(tests/train/test_checkpoint_safety.py: payloads and damage in every file a load reads)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader

from stalepipe.errors import CheckpointError
from stalepipe.training.rundir import checkpoint_parts as stage_ckpt
from stalepipe.training.rundir.checkpoint import (
    check_complete,
    checkpoint_step,
    list_checkpoints,
    open_checkpoint,
    remove_checkpoint,
)
from stalepipe.training.rundir.convert import convert
from stalepipe.training.rundir.sharded import ShardedCheckpoint
from stalepipe.training.rundir.verified import DATA, INDEX
from stalepipe.training.train.distributed import SINGLE_PROCESS
from stalepipe.training.train.emulated import EmulatorEngine
from stalepipe.training.train.loop import train


def _run_dir(cfg) -> Path:
    return Path(cfg.out_dir) / cfg.name


def _drop_after(cfg, step: int) -> None:
    for p in list_checkpoints(_run_dir(cfg)):
        if checkpoint_step(p) > step:
            remove_checkpoint(p)


def _emulator(cfg, P: int):
    pc = dataclasses.replace(cfg.pipeline, engine="emulate", num_stages=P, schedule="1f1b")
    return dataclasses.replace(cfg, pipeline=pc)


def test_runtime_p2_shards_resume_on_p2_and_on_the_emulator_p1(make_cfg, run_dist, dist_utils):
    # Untied: at P = 1 a tied matrix's two gradients are summed by autograd, at P = 2 in the
    # runtime's fixed order (docs/design.md, 'Exactness'), so only an untied run is bitwise
    # across that change of split.
    cfg = make_cfg("2bw", 2, 2, steps=6, ckpt_every=2, keep_last=3, tied=False)
    cfg = dataclasses.replace(cfg, delay=dataclasses.replace(cfg.delay, ef=True))  # EF state too
    run_dist(cfg)
    want = dist_utils["final_model"](cfg)
    # the runtime still equals the emulator (exact mode) bit for bit
    dist_utils["assert_bitwise"](dist_utils["reference"](cfg), want)

    ckpt = _run_dir(cfg) / "ckpt_00000002"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        ".stalepipe.json",
        "checkpoint.json",
        "rank_000",
        "rank_001",
    ]
    assert json.loads((ckpt / "checkpoint.json").read_text())["ranks"] == [0, 1]
    flat = ShardedCheckpoint(ckpt)
    names = stage_ckpt.saved_split(flat)[2]
    for r in (0, 1):  # each shard holds its own stage's weights, optimizer, versions, EF
        shard = ckpt / f"rank_{r:03d}"  # safetensors and JSON: no pickle anywhere
        assert sorted(p.name for p in shard.iterdir()) == sorted([DATA, INDEX, "state.json"])
        keys = set(HuggingFaceStorageReader(str(shard)).read_metadata().state_dict_metadata)
        assert {_param(k) for k in keys if k != "rng"} == set(names[r])
        assert {f"model/{n}" for n in names[r]} <= keys
        assert any(k.startswith("version/1/") for k in keys)  # 2bw keeps W_1 beside W_2
        assert any(k.startswith("ef_prev/") for k in keys)
        assert any(k.startswith("optim/") and k.endswith("/exp_avg_sq") for k in keys)
    assert "rng" in flat.stored_keys()

    _drop_after(cfg, 2)  # runtime P=2 -> runtime P=2
    run_dist(cfg, resume=True)
    dist_utils["assert_bitwise"](dist_utils["final_model"](cfg), want)
    _drop_after(cfg, 2)  # runtime P=2 -> emulator P=1
    torch.set_num_threads(1)
    train(_emulator(cfg, 1), resume=True, verbose=False)
    dist_utils["assert_bitwise"](dist_utils["final_model"](cfg), want)


def _param(key: str) -> str:
    """The parameter a key of the flat state is about (checkpoint_parts' key scheme)."""
    kind, _, rest = key.partition("/")
    return rest.split("/", 1)[1] if kind == "version" else rest.split("/", 1)[0]


def test_a_process_reads_only_its_own_keys(make_cfg, run_dist, monkeypatch):
    cfg = make_cfg("2bw", 2, 2, steps=2)
    run_dist(cfg)
    flat = open_checkpoint(list_checkpoints(_run_dir(cfg))[-1])
    names = stage_ckpt.saved_split(flat)[2]
    asked: list[str] = []
    real = ShardedCheckpoint.read

    def spy(self, keys):
        keys = list(keys)
        asked.extend(keys)
        return real(self, keys)

    monkeypatch.setattr(ShardedCheckpoint, "read", spy)
    for stage in (0, 1):
        asked.clear()
        stage_ckpt.stage_state(flat, [stage], names, {"state": {}, "param_groups": []}, [{1}] * 2)
        assert {_param(k) for k in asked if k != "rng"} == set(names[stage])


@pytest.mark.parametrize("fmt", [1, 2])
def test_an_older_format_is_refused_then_converts_and_resumes(
    make_cfg, run_dist, dist_utils, old_formats, fmt
):
    cfg = make_cfg("2bw", 2, 2, steps=6, ckpt_every=2, keep_last=3)
    run_dist(cfg)
    want = dist_utils["final_model"](cfg)
    run_dir = _run_dir(cfg)
    if fmt == 1:  # what an older version wrote at step 2: the whole state in one .pt file
        emu = _emulator(cfg, 2)
        engine = EmulatorEngine(
            emu,
            SINGLE_PROCESS,
            torch.device("cpu"),
            Path(cfg.data.data_dir),
            run_dir,
            run_dir / "ckpt_00000002",
        )
        state = {
            "config": emu.to_dict(),
            "model": engine.model.state_dict(),
            "engine": engine.emulator.state_dict(),
            "rng": torch.get_rng_state(),
        }
        for p in list_checkpoints(run_dir):
            remove_checkpoint(p)
        old = old_formats.write_format1(run_dir, 2, state)
    else:  # the shards of the runtime at P = 2, with DCP's pickled metadata
        _drop_after(cfg, 2)
        old = run_dir / "ckpt_00000002"
        old_formats.to_format2(old)
    for resume in (
        lambda: check_complete(old),
        lambda: train(_emulator(cfg, 2), resume=True, verbose=False),
    ):
        with pytest.raises(CheckpointError) as err:
            resume()
        msg = str(err.value)
        assert "\n" not in msg and f"stalepipe checkpoint convert {old} " in msg, msg
    new = run_dir / "ckpt_00000002"
    if fmt == 1:  # the fix as the message words it
        convert(old, new)
        old.rename(f"{old}.old")
    else:
        convert(old, Path(f"{old}.v3"))
        old.rename(f"{old}.old")
        Path(f"{old}.v3").rename(new)
    assert (new / "rank_000" / DATA).is_file()
    run_dist(cfg, resume=True)  # the runtime resumes it bit for bit
    dist_utils["assert_bitwise"](dist_utils["final_model"](cfg), want)
    assert [p.name for p in list_checkpoints(run_dir)] == [
        "ckpt_00000002",
        "ckpt_00000004",
        "ckpt_00000006",
    ]


def test_a_damaged_shard_is_one_line_and_loses_nothing(make_cfg, run_dist):
    cfg = make_cfg("2bw", 2, 2, steps=4, ckpt_every=2)
    run_dist(cfg)
    last = list_checkpoints(_run_dir(cfg))[-1]
    (last / "rank_001" / DATA).unlink()
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(last).read(["model/norm.weight"])
    msg = str(err.value)
    assert "\n" not in msg and "rank_001" in msg and f"mv {last} {last}.damaged" in msg, msg
    (last / "rank_000" / DATA).write_bytes(b"garbage!")
    with pytest.raises(CheckpointError, match=rf"rank_000/{DATA} is 8 bytes, not \d+; move"):
        open_checkpoint(last)
    assert [checkpoint_step(p) for p in list_checkpoints(_run_dir(cfg))] == [2, 4]
