"""Checkpoints that cannot run code, reach outside their directory or hide damage (issues 39
and 50; rundir.verified, rundir.legacy, rundir.convert).

Format 3 holds no pickle: a payload planted in any file a load reads is refused with one line
naming the file, and nothing runs. Sizes are checked before anything is allocated (a header
that claims more than its file, a config that claims a larger model than its tensors). A link
out of the checkpoint is refused. Older formats are refused with one line naming the
conversion, which reads them through a hardened unpickler in a memory-capped child. Bytes
overwritten inside a data file (same size) are found; the fix the message names (move the
checkpoint aside) resumes from the previous checkpoint, bit for bit. A full disk while saving
loses nothing."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import io
import json
import os
import pickle
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch

from stalepipe.cli import main
from stalepipe.errors import CheckpointError, TrainingError, UserError
from stalepipe.training.launch.pooled import worker_entry
from stalepipe.training.launch.train import launch_train
from stalepipe.training.rundir import legacy
from stalepipe.training.rundir.checkpoint import (
    check_complete,
    list_checkpoints,
    load_checkpoint,
    open_checkpoint,
)
from stalepipe.training.rundir.startup import StartUp
from stalepipe.training.rundir.verified import DATA
from stalepipe.training.train.loop import train

from .conftest import tiny_cfg


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _forge(ckpt: Path, rel: str, data: bytes) -> None:
    """Write `data` over `ckpt/rel` and its digests into checkpoint.json, as an attacker who
    can write the whole directory would."""
    (ckpt / rel).write_bytes(data)
    manifest = json.loads((ckpt / "checkpoint.json").read_text())
    entry = manifest["files"][rel]
    if "chunks" in entry:  # the data file: one recorded range, the whole new file
        entry.update(size=len(data), chunks=[[0, len(data), hashlib.sha256(data).hexdigest()]])
    else:
        entry.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    (ckpt / "checkpoint.json").write_text(json.dumps(manifest))


def _loaders(ckpt: Path) -> dict:
    return {
        "resume check": lambda: check_complete(ckpt),
        "resume read": lambda: open_checkpoint(ckpt).read(open_checkpoint(ckpt).stored_keys()),
        "eval/export read": lambda: load_checkpoint(ckpt),
    }


@pytest.fixture(scope="module")
def trained_once(tmp_path_factory, excerpt_data_dir, pool):
    """A runtime run at P = 2 with checkpoints at steps 2 and 4, trained once for the module."""
    out = tmp_path_factory.mktemp("trained") / "runs"
    cfg = tiny_cfg(str(out), excerpt_data_dir, "2bw", 2, 2, steps=4, ckpt_every=2, keep_last=3,
                   tied=False)  # fmt: skip
    pool.run(worker_entry, (cfg, False, True), 2, timeout_s=180)
    return cfg


@pytest.fixture
def trained(trained_once, tmp_path):
    """The module's run copied into this test's directory (each test damages its own), and a
    pristine copy of it."""
    cfg = dataclasses.replace(trained_once, out_dir=str(tmp_path / "runs"))
    run_dir = Path(cfg.out_dir) / cfg.name
    shutil.copytree(Path(trained_once.out_dir) / cfg.name, run_dir)
    shutil.copytree(run_dir, run_dir.with_name("pristine"))
    return cfg, run_dir


def _restore(run_dir: Path) -> Path:
    shutil.rmtree(run_dir)
    shutil.copytree(run_dir.with_name("pristine"), run_dir)
    return list_checkpoints(run_dir)[-1]


def _safetensors(header: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


PLANTS = {  # file -> bytes, each forged into checkpoint.json
    f"rank_000/{DATA}": lambda p: p,  # a pickle where the safetensors file was
    "rank_001/state.json": lambda p: p,
    # a well-formed header whose one tensor claims 10^12 elements in 4 bytes
    f"rank_001/{DATA}": lambda p: _safetensors(
        {"x": {"dtype": "F32", "shape": [10**6, 10**6], "data_offsets": [0, 4]}}, b"\0" * 4
    ),
    # a header length of 2^60 (the file is a few bytes)
    "rank_000/model-00001-of-00001.safetensors": lambda p: struct.pack("<Q", 1 << 60) + b"{}",
}


def test_a_payload_or_a_crafted_size_in_any_file_is_one_line(trained, tmp_path):
    cfg, run_dir = trained
    marker = tmp_path / "PWNED"
    payload = pickle.dumps(_Payload(marker))
    for rel, make in [*PLANTS.items(), ("checkpoint.json", lambda p: p)]:
        ckpt = _restore(run_dir)
        if rel == "checkpoint.json":
            (ckpt / rel).write_bytes(payload)
        else:
            _forge(ckpt, rel, make(payload))
        for name, load in _loaders(ckpt).items():
            with pytest.raises(CheckpointError) as err:
                load()
            msg = str(err.value)
            assert "\n" not in msg and str(ckpt / rel) in msg, (rel, name, msg)
            assert not marker.exists(), (rel, name)
    assert not any(ckpt.rglob(".metadata")) and not any(ckpt.rglob("*.pt"))


def test_a_recorded_size_is_never_allocated_on_trust(trained):
    """A checkpoint.json that records state.json as 10^12 bytes: refused by the file's real
    size before anything is read or allocated."""
    cfg, run_dir = trained
    ckpt = list_checkpoints(run_dir)[-1]
    manifest = json.loads((ckpt / "checkpoint.json").read_text())
    manifest["files"]["rank_000/state.json"]["size"] = 10**12
    (ckpt / "checkpoint.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"state.json is \d+ bytes, not 1000000000000"):
        load_checkpoint(ckpt)


def test_a_config_larger_than_the_stored_tensors_is_refused_before_anything_is_built(
    trained, tmp_path, capsys
):
    """A checkpoint.json whose config claims dim 65536 (17 GB of model) over the stored tiny
    tensors: eval refuses it in one line, the model is never built."""
    cfg, run_dir = trained
    ckpt = list_checkpoints(run_dir)[-1]
    manifest = json.loads((ckpt / "checkpoint.json").read_text())
    manifest["config"]["model"].update(dim=65536, ffn_dim=65536)
    (ckpt / "checkpoint.json").write_text(json.dumps(manifest))
    built = []
    import stalepipe.training.models.transformer as transformer

    real = transformer.materialize
    transformer.materialize = lambda *a, **k: built.append(1) or real(*a, **k)
    try:
        rc, err = _cli(capsys, "eval", str(ckpt), "--no-tasks")
    finally:
        transformer.materialize = real
    assert rc == 2 and err.count("\n") == 1, err
    assert "describes a model its tensors do not hold" in err and "65536" in err, err
    assert not built


def test_a_link_out_of_the_checkpoint_is_refused_and_a_linked_run_directory_is_not(
    trained, tmp_path
):
    cfg, run_dir = trained
    for i, rel in enumerate((f"rank_001/{DATA}", "rank_000", "rank_001/state.json")):
        ckpt = _restore(run_dir)
        outside = tmp_path / f"elsewhere{i}"
        shutil.move(ckpt / rel, outside)  # the same bytes, reached through a link
        (ckpt / rel).symlink_to(outside)
        for name, load in _loaders(ckpt).items():
            with pytest.raises(CheckpointError) as err:
                load()
            msg = str(err.value)
            assert "\n" not in msg and f"{ckpt / rel} is a symbolic link" in msg, (rel, name, msg)
            assert f"cp --remove-destination {outside} {ckpt / rel}" in msg or "cp -r" in msg, msg
    ckpt = _restore(run_dir)  # a checkpoint directory linked in from outside the run
    shutil.move(ckpt, tmp_path / "ckpt")
    ckpt.symlink_to(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=f"{ckpt} is a symbolic link"):
        list_checkpoints(run_dir)
    _restore(run_dir)  # the run directory itself may be a link
    linked = tmp_path / "linked-run"
    linked.symlink_to(run_dir)
    state = load_checkpoint(list_checkpoints(linked)[-1])
    assert state["step"] == 4


def _cli(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    return rc, capsys.readouterr().err


def test_every_command_refuses_an_older_format_and_the_conversion_resumes_it(
    trained, tmp_path, capsys, monkeypatch, dist_utils, old_formats, run_dist
):
    cfg, run_dir = trained
    want = dist_utils["final_model"](cfg)
    marker = tmp_path / "PWNED"
    monkeypatch.chdir(tmp_path)
    ckpt = list_checkpoints(run_dir)[-1]
    old_formats.to_format2(ckpt)
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
    fix = f"`stalepipe checkpoint convert {ckpt} {ckpt}.v3 && mv {ckpt} {ckpt}.old && mv "
    for name, argv in commands.items():
        rc, err = _cli(capsys, *argv)
        assert rc == 2 and fix in err and err.count("\n") == 1, (name, err)
    with pytest.raises(UserError, match="stalepipe checkpoint convert"):
        launch_train(cfg, StartUp(resume=True), verbose=False)  # the runtime at P = 2
    assert not (tmp_path / "hf").exists()
    # a planted payload in the old .metadata: the conversion refuses it, nothing runs
    saved = (ckpt / "rank_000/.metadata").read_bytes()
    (ckpt / "rank_000/.metadata").write_bytes(pickle.dumps(_Payload(marker)))
    manifest = json.loads((ckpt / "checkpoint.json").read_text())
    (ckpt / "checkpoint.json").write_text(json.dumps({**manifest, "files": None}))
    rc, err = _cli(capsys, "checkpoint", "convert", str(ckpt), str(tmp_path / "new"))
    assert rc == 2 and "names posix.system" in err and err.count("\n") == 1, err
    assert not marker.exists() and not (tmp_path / "new").exists()
    assert not list(run_dir.glob(".ckpt_*.tmp")) and not list(tmp_path.glob(".ckpt_*.tmp"))
    # the real one converts (the command the message names) and resumes bit for bit
    (ckpt / "rank_000/.metadata").write_bytes(saved)
    (ckpt / "checkpoint.json").write_text(json.dumps(manifest))
    rc, err = _cli(capsys, "checkpoint", "convert", str(ckpt), f"{ckpt}.v3")
    assert rc == 0, err
    ckpt.rename(f"{ckpt}.old")
    Path(f"{ckpt}.v3").rename(ckpt)
    list(map(shutil.rmtree, list_checkpoints(run_dir)[:-1]))
    run_dist(cfg, resume=True)  # the launcher's part was the refusal above; the ranks' here
    dist_utils["assert_bitwise"](dist_utils["final_model"](cfg), want)


def test_the_hardened_unpickler_reads_dcp_metadata_and_refuses_steering(tmp_path):
    """What DCP writes loads; a BUILD on an admitted class (which would set `Path.parent` for
    the whole process), a memo index of 2^29 (8 GiB in the C unpickler) and a frame longer
    than the pickle are refused; names outside the allow-list never resolve."""
    import pathlib
    import warnings

    import torch.distributed.checkpoint as dcp

    tensors = {
        "a": torch.ones(2, 3),
        "b": torch.zeros(4, dtype=torch.int64),
        "c": torch.tensor(1.0),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp_path / "s"), no_dist=True)
    md = legacy.SafeUnpickler(io.BytesIO((tmp_path / "s" / ".metadata").read_bytes())).load()
    assert set(md.state_dict_metadata) == {"a", "b", "c"} and legacy.check_metadata(md) is None
    steer = (
        b"\x80\x04cpathlib\nPosixPath\nN}X\x06\x00\x00\x00parentX\n\x00\x00\x00/elsewheres\x86b."
    )
    cases = {
        steer: "a BUILD on PosixPath",
        b"\x80\x04N" + b"r" + struct.pack("<I", 1 << 29) + b".": None,  # a dict memo: no 8 GiB
        b"\x80\x04\x95" + struct.pack("<Q", 1 << 32) + b"N.": "a frame of 4294967296 bytes",
        b"\x80\x04cos\nsystem\n.": "os.system",
    }
    for data, refused in cases.items():
        if refused is None:
            assert legacy.SafeUnpickler(io.BytesIO(data)).load() is None
            continue
        with pytest.raises(legacy.UnsafePickle, match=refused):
            legacy.SafeUnpickler(io.BytesIO(data)).load()
    assert str(pathlib.Path("/a/b").parent) == "/a"


def test_a_conversion_that_asks_for_too_much_memory_stops_in_its_child(
    trained, tmp_path, capsys, monkeypatch, old_formats
):
    """The conversion's child runs under an address-space cap: a format-2 shard whose metadata
    declares a tensor larger than its bytes is refused before allocation, and a reader that
    does allocate past the cap dies in the child, one line in the parent."""
    cfg, run_dir = trained
    ckpt = list_checkpoints(run_dir)[-1]
    old_formats.to_format2(ckpt)
    manifest = json.loads((ckpt / "checkpoint.json").read_text())
    (ckpt / "checkpoint.json").write_text(json.dumps({**manifest, "files": None}))
    md = legacy.SafeUnpickler(io.BytesIO((ckpt / "rank_000/.metadata").read_bytes())).load()
    key = next(iter(md.state_dict_metadata))
    md.state_dict_metadata[key].size = torch.Size([10**6, 10**6])
    (ckpt / "rank_000/.metadata").write_bytes(pickle.dumps(md))
    rc, err = _cli(capsys, "checkpoint", "convert", str(ckpt), str(tmp_path / "a"))
    assert rc == 2 and "more than its bytes" in err and err.count("\n") == 1, err
    monkeypatch.setenv("STALEPIPE_CONVERT_MEMORY", str(600 << 20))  # below torch's own needs
    rc, err = _cli(capsys, "checkpoint", "convert", str(ckpt), str(tmp_path / "b"))
    assert rc == 2 and "could not convert" in err and err.count("\n") == 1, err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_damage_of_the_same_size_is_found_and_the_previous_checkpoint_resumes(
    trained, dist_utils, capsys, run_dist
):
    cfg, run_dir = trained
    want = dist_utils["final_model"](cfg)
    ckpt = list_checkpoints(run_dir)[-1]
    data = ckpt / "rank_001" / DATA
    size = data.stat().st_size
    with open(data, "r+b") as f:  # 4 KB of other bytes inside the file, its size unchanged
        f.seek(size - 4096 - 100)
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
    # the runtime's resume: rank 1 refuses while rank 0, its own shard sound, waits for it in
    # a group being made (a rendezvous that hears of no failure); the launcher stops it
    # GRACE_S after rank 1's own failure, not after the peer timeout (130 s at 120 s here)
    slow = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, timeout_s=120))
    start = time.monotonic()
    with pytest.raises(UserError, match="does not match the digest"):
        launch_train(slow, StartUp(resume=True), verbose=False)
    assert time.monotonic() - start < 60
    assert [p.name for p in list_checkpoints(run_dir)] == ["ckpt_00000002", "ckpt_00000004"]
    # the fix as the message words it: move it aside, resume from the previous one
    ckpt.rename(f"{ckpt}.damaged")
    run_dist(cfg, resume=True)  # the ranks of the launch refused above, on the test pool
    dist_utils["assert_bitwise"](dist_utils["final_model"](cfg), want)
    assert Path(f"{ckpt}.damaged").is_dir()  # nothing deleted


def test_a_checkpoint_without_digests_is_refused(trained):
    cfg, run_dir = trained
    ckpt = list_checkpoints(run_dir)[-1]
    manifest = json.loads((ckpt / "checkpoint.json").read_text())
    manifest.pop("files")
    (ckpt / "checkpoint.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="checkpoint.json records no file digests"):
        load_checkpoint(ckpt)


class _FullDisk:
    """A file opened for writing on a disk that fills after its first 16 bytes or characters:
    the first write lands partly, then ENOSPC, as a real full disk behaves."""

    def __init__(self, f) -> None:
        self._f = f

    def write(self, data):
        self._f.write(data[:16])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._f.name)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()


def test_a_full_disk_loses_nothing_and_says_so(tiny_config, monkeypatch):
    """ENOSPC injected into every file written for the second checkpoint (the safetensors
    stream, DCP's index, state.json): one line (what filled, how much was needed), no staging
    directory left, the first checkpoint kept; once space is back, --resume and eval work."""
    import builtins

    tc = dataclasses.replace(tiny_config.train, ckpt_every=4, keep_last=3, num_steps=8)
    cfg = dataclasses.replace(tiny_config, train=tc)
    real = builtins.open
    calls = {"n": 0}

    def full(file, mode="r", *args, **kwargs):
        f = real(file, mode, *args, **kwargs)
        if any(m in mode for m in "wax") and "ckpt_00000008" in str(file):
            calls["n"] += 1
            return _FullDisk(f)
        return f

    monkeypatch.setattr(builtins, "open", full)
    with pytest.raises(TrainingError) as err:
        train(cfg, verbose=False)
    run = Path(cfg.out_dir) / cfg.name
    msg = str(err.value)
    assert calls["n"] and "\n" not in msg, msg
    assert f"no space left on the device of {run}" in msg and "MB are free" in msg, msg
    assert "ckpt_00000004 is the newest: free space, then --resume" in msg, msg
    assert not list(run.glob(".ckpt_*")), list(run.iterdir())
    assert [p.name for p in list_checkpoints(run)] == ["ckpt_00000004"]
    monkeypatch.setattr(builtins, "open", real)  # space is back
    result = train(cfg, resume=True, verbose=False)
    assert torch.isfinite(torch.tensor(result.final_val_loss))
    assert load_checkpoint(list_checkpoints(run)[-1])["step"] == 8


def _poisoned(tiny_config) -> tuple:
    """A tiny emulator run with checkpoints at steps 4 and 8 (12 removed), the one of step 8
    rewritten by the run's own save path with a NaN weight: its digests are valid, its state
    is not (a checkpoint written just as the run diverged, or damaged before it was hashed)."""
    from stalepipe.training.train.distributed import SINGLE_PROCESS
    from stalepipe.training.train.emulated import EmulatorEngine
    from stalepipe.training.train.loop import with_resolved_optim

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
    digests; the small files' digests and the header checks stay."""
    from stalepipe.training.rundir.sharded import ShardedCheckpoint

    cfg, run_dir = trained
    ckpt = list_checkpoints(run_dir)[-1]
    monkeypatch.setenv("STALEPIPE_VERIFY", "0")
    flat = ShardedCheckpoint(ckpt)
    assert flat.verifier.chunks(f"rank_000/{DATA}") is None
    state = (ckpt / "rank_001" / "state.json").read_text()
    assert state.endswith("\n")
    (ckpt / "rank_001" / "state.json").write_text(" " + state[:-1])  # same JSON, same size
    with pytest.raises(CheckpointError, match="state.json does not match the digest"):
        ShardedCheckpoint(ckpt)
