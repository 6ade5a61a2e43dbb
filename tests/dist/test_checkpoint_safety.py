"""Checkpoints that cannot run code or hide damage (issue 39, rundir.verified).

A pickle whose `__reduce__` touches a marker file is planted in every file a load reads (each
shard's `.metadata`, with and without a forged digest, state.json, checkpoint.json, a data
file with forged digests, an older version's `.pt`); every load path (the resume check, the
resume itself on the emulator and the runtime, at another split and on the other engine,
`stalepipe eval`, `stalepipe export`) refuses it with one line naming the file, and the marker
never appears. Bytes overwritten inside a data file (same size) are found; the fix the message
names (move the checkpoint aside) resumes from the previous checkpoint, bit for bit."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from stalepipe.cli import main
from stalepipe.errors import CheckpointError, TrainingError, UserError
from stalepipe.launch.train import launch_train
from stalepipe.rundir.checkpoint import (
    check_complete,
    list_checkpoints,
    load_checkpoint,
    open_checkpoint,
    save_legacy_checkpoint,
)
from stalepipe.rundir.startup import StartUp
from stalepipe.rundir.verified import ALLOWED, SafeUnpickler
from stalepipe.train.loop import train


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant(ckpt: Path, rel: str, marker: Path, *, forge: bool) -> None:
    """Write the payload pickle over `ckpt/rel`; with `forge`, record its digest in
    checkpoint.json as an attacker who can write the whole directory would."""
    data = pickle.dumps(_Payload(marker))
    (ckpt / rel).write_bytes(data)
    if forge:
        manifest = json.loads((ckpt / "checkpoint.json").read_text())
        digest = hashlib.sha256(data).hexdigest()
        entry = manifest["files"][rel]
        if "chunks" in entry:  # a data file: every recorded range now points at the payload
            entry["chunks"] = [[c[0], len(data), digest] for c in entry["chunks"]]
        else:
            entry.update(size=len(data), sha256=digest)
        (ckpt / "checkpoint.json").write_text(json.dumps(manifest))


def _loaders(ckpt: Path) -> dict:
    return {
        "resume check": lambda: check_complete(ckpt),
        "resume read": lambda: open_checkpoint(ckpt).read(open_checkpoint(ckpt).stored_keys()),
        "eval/export read": lambda: load_checkpoint(ckpt),
    }


@pytest.fixture
def trained(make_cfg, run_dist):
    """A runtime run at P = 2 with checkpoints at steps 2 and 4, and a pristine copy of it."""
    cfg = make_cfg("2bw", 2, 2, steps=4, ckpt_every=2, keep_last=3, tied=False)
    run_dist(cfg)
    run_dir = Path(cfg.out_dir) / cfg.name
    shutil.copytree(run_dir, run_dir.with_name("pristine"))
    return cfg, run_dir


def _restore(run_dir: Path) -> None:
    shutil.rmtree(run_dir)
    shutil.copytree(run_dir.with_name("pristine"), run_dir)


PLANTS = [
    ("rank_000/.metadata", True),
    ("rank_001/.metadata", False),  # a checkpoint whose digests do not match
    ("rank_001/state.json", True),
    ("checkpoint.json", False),
    ("rank_001/__0_0.distcp", True),
]


def test_a_payload_in_any_file_runs_nothing_and_names_the_file(trained, tmp_path):
    cfg, run_dir = trained
    marker = tmp_path / "PWNED"
    for rel, forge in PLANTS:
        _restore(run_dir)
        ckpt = list_checkpoints(run_dir)[-1]
        _plant(ckpt, rel, marker, forge=forge)
        for name, load in _loaders(ckpt).items():
            if name == "resume check" and rel.endswith(".distcp"):
                continue  # sizes only (the forged record matches): its bytes are read below
            with pytest.raises(CheckpointError) as err:
                load()
            msg = str(err.value)
            assert "\n" not in msg and str(ckpt / rel) in msg, (rel, name, msg)
            assert not marker.exists(), (rel, name)
    # a digest-free checkpoint (older versions) is refused by the unpickler alone
    _restore(run_dir)
    ckpt = list_checkpoints(run_dir)[-1]
    manifest = json.loads((ckpt / "checkpoint.json").read_text())
    (ckpt / "checkpoint.json").write_text(json.dumps({**manifest, "files": None}))
    _plant(ckpt, "rank_000/.metadata", marker, forge=False)
    with pytest.raises(CheckpointError, match=r"names posix\.system, which a DCP checkpoint"):
        load_checkpoint(ckpt)
    assert not marker.exists()


def _cli(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    return rc, capsys.readouterr().err


def test_every_command_refuses_a_planted_metadata(trained, tmp_path, capsys, monkeypatch):
    cfg, run_dir = trained
    marker = tmp_path / "PWNED"
    monkeypatch.chdir(tmp_path)
    ckpt = list_checkpoints(run_dir)[-1]
    _plant(ckpt, "rank_000/.metadata", marker, forge=True)
    planted = str(ckpt / "rank_000/.metadata")
    config = str(run_dir / "config.json")
    commands = {
        "eval": ("eval", str(run_dir), "--no-tasks"),
        "export": ("export", str(run_dir), "--out", str(tmp_path / "hf")),
        "resume, emulator at P = 1": (
            "train",
            "--config",
            config,
            "--resume",
            "--pipeline.engine",
            "emulate",
            "--pipeline.num_stages",
            "1",
            "--pipeline.schedule",
            "1f1b",
        ),  # fmt: skip
    }
    for name, argv in commands.items():
        rc, err = _cli(capsys, *argv)
        assert rc == 2 and planted in err and err.count("\n") == 1, (name, err)
        assert not marker.exists(), name
    with pytest.raises(UserError, match="rank_000/.metadata names posix.system"):
        launch_train(cfg, StartUp(resume=True), verbose=False)  # the runtime at P = 2
    assert not marker.exists()
    assert not (tmp_path / "hf").exists()


def test_an_old_single_file_checkpoint_with_a_payload_runs_nothing(tiny_config, tmp_path, capsys):
    run = train(tiny_config, verbose=False).run_dir
    for p in list_checkpoints(run):
        shutil.rmtree(p)
    marker = tmp_path / "PWNED"
    pt = save_legacy_checkpoint(run, 12, {"model": {}})
    pt.write_bytes(pickle.dumps(_Payload(marker)))
    for argv in (
        ("eval", str(run), "--no-tasks"),
        ("export", str(run), "--out", str(tmp_path / "hf")),
    ):
        rc, err = _cli(capsys, *argv)
        assert rc == 2 and str(pt) in err, err
    with pytest.raises(CheckpointError, match=str(pt)):
        train(tiny_config, resume=True, verbose=False)
    assert not marker.exists()


def test_damage_of_the_same_size_is_found_and_the_previous_checkpoint_resumes(
    trained, dist_utils, capsys
):
    cfg, run_dir = trained
    want = dist_utils["final_model"](cfg)
    ckpt = list_checkpoints(run_dir)[-1]
    data = ckpt / "rank_001" / "__0_0.distcp"
    size = data.stat().st_size
    with open(data, "r+b") as f:  # 4 KB of other bytes inside the file, its size unchanged
        f.seek(size // 3)
        f.write(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0))
                .to(torch.uint8).numpy().tobytes())  # fmt: skip
    assert data.stat().st_size == size
    check_complete(ckpt)  # the sizes match: the cheap check passes ...
    with pytest.raises(CheckpointError) as err:  # ... and a load that reads the bytes fails
        flat = open_checkpoint(ckpt)
        flat.read(flat.stored_keys())
    msg = str(err.value)
    assert f"{data} does not match the digest its save recorded" in msg, msg
    assert f"mv {ckpt} {ckpt}.damaged" in msg, msg
    with pytest.raises(UserError, match="does not match the digest"):  # the runtime's resume
        launch_train(cfg, StartUp(resume=True), verbose=False)
    assert [p.name for p in list_checkpoints(run_dir)] == ["ckpt_00000002", "ckpt_00000004"]
    # the fix as the message words it: move it aside, resume from the previous one
    ckpt.rename(f"{ckpt}.damaged")
    launch_train(cfg, StartUp(resume=True), verbose=False)
    dist_utils["assert_bitwise"](dist_utils["final_model"](cfg), want)
    assert Path(f"{ckpt}.damaged").is_dir()  # nothing deleted


def test_a_checkpoint_without_digests_loads_with_one_warning(trained, dist_utils, capsys):
    cfg, run_dir = trained
    want = dist_utils["final_model"](cfg)
    for ckpt in list_checkpoints(run_dir):  # as versions before issue 39 wrote them
        manifest = json.loads((ckpt / "checkpoint.json").read_text())
        manifest.pop("files")
        (ckpt / "checkpoint.json").write_text(json.dumps(manifest))
    ckpt = list_checkpoints(run_dir)[-1]
    capsys.readouterr()
    check_complete(ckpt)
    state = load_checkpoint(ckpt)
    err = capsys.readouterr().err
    assert err.count("carries no digests") == 1, err
    dist_utils["assert_bitwise"](state["model"], want)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_unpickler_admits_what_dcp_writes_and_nothing_else(tmp_path):
    import torch.distributed.checkpoint as dcp

    tensors = {
        "a": torch.ones(2, 3),
        "b": torch.zeros(4, dtype=torch.int64),
        "c": torch.tensor(1.0),
    }
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp_path / "s"), no_dist=True)
    names: set[tuple[str, str]] = set()

    class Spy(SafeUnpickler):
        def find_class(self, module, name):
            names.add((module, name))
            return super().find_class(module, name)

    with open(tmp_path / "s" / ".metadata", "rb") as f:
        md = Spy(f).load()
    assert set(md.state_dict_metadata) == {"a", "b", "c"}
    assert names - ALLOWED <= {("torch", "float32"), ("torch", "int64")}
    for module, name in [("builtins", "eval"), ("os", "system"), ("torch", "load")]:
        with pytest.raises(Exception, match=f"{module}.{name}"):
            SafeUnpickler.find_class(SafeUnpickler.__new__(SafeUnpickler), module, name)


def _poisoned(tiny_config) -> tuple:
    """A tiny emulator run with checkpoints at steps 4 and 8 (12 removed), the one of step 8
    rewritten by the run's own save path with a NaN weight: its digests are valid, its state
    is not (a checkpoint written just as the run diverged, or damaged before it was hashed)."""
    from stalepipe.train.distributed import SINGLE_PROCESS
    from stalepipe.train.emulated import EmulatorEngine
    from stalepipe.train.loop import with_resolved_optim

    tc = dataclasses.replace(tiny_config.train, ckpt_every=4, keep_last=3)
    cfg = with_resolved_optim(dataclasses.replace(tiny_config, train=tc))
    run = train(cfg, verbose=False).run_dir
    shutil.rmtree(run / "ckpt_00000012")
    ckpt = run / "ckpt_00000008"
    data = Path(cfg.data.data_dir)
    engine = EmulatorEngine(cfg, SINGLE_PROCESS, torch.device("cpu"), data, run, ckpt)
    with torch.no_grad():
        next(engine.model.parameters()).fill_(float("nan"))
    engine.checkpoint(8)
    return cfg, run, ckpt


def test_a_nonfinite_loss_right_after_a_resume_blames_the_checkpoint(tiny_config, capsys):
    cfg, run, ckpt = _poisoned(tiny_config)
    for lr in (None, cfg.optim.lr / 2):  # the LR advice is never what it gives
        again = (
            cfg
            if lr is None
            else dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=lr))
        )
        with pytest.raises(TrainingError) as err:
            train(again, resume=True, verbose=False)
        msg = str(err.value)
        assert f"from {ckpt}: that checkpoint is suspect" in msg, msg
        assert f"mv {ckpt} {ckpt}.suspect" in msg and str(run / "ckpt_00000004") in msg, msg
        assert "--optim.lr" not in msg, msg
    ckpt.rename(f"{ckpt}.suspect")  # the fix it names
    result = train(cfg, resume=True, verbose=False)
    assert torch.isfinite(torch.tensor(result.final_val_loss))
    assert Path(f"{ckpt}.suspect").is_dir()


def test_eval_of_a_checkpoint_with_nonfinite_weights_fails(tiny_config, capsys):
    cfg, run, ckpt = _poisoned(tiny_config)
    rc, err = _cli(capsys, "eval", str(run), "--no-tasks")
    assert rc == 2 and err.count("\n") == 1, err
    assert f"checkpoint {ckpt} has non-finite weights" in err, err
    assert f"stalepipe eval {run / 'ckpt_00000004'}" in err, err
    assert not list(run.glob("eval_*.json"))
    rc, _ = _cli(capsys, "eval", str(run / "ckpt_00000004"), "--no-tasks")
    assert rc == 0


def test_the_opt_out_skips_only_the_tensors_digests(trained, monkeypatch):
    """STALEPIPE_VERIFY=0 (docs/runtime.md: what hashing costs a load) skips the tensors'
    digests; the small files' digests and the safe unpickler stay."""
    from stalepipe.rundir.sharded import ShardedCheckpoint

    cfg, run_dir = trained
    ckpt = list_checkpoints(run_dir)[-1]
    monkeypatch.setenv("STALEPIPE_VERIFY", "0")
    flat = ShardedCheckpoint(ckpt)
    assert flat.verifier.chunks("rank_000/__0_0.distcp") is None
    state = (ckpt / "rank_001" / "state.json").read_text()
    (ckpt / "rank_001" / "state.json").write_text(state.replace("{", "{ ", 1))  # same JSON
    with pytest.raises(CheckpointError, match="state.json does not match the digest"):
        ShardedCheckpoint(ckpt)
