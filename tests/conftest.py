"""Shared fixtures: a prepared excerpt corpus (byte tokenizer) and a tiny experiment config."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from stalepipe.config import DataConfig, ExperimentConfig, ModelConfig, TrainConfig

# trackio reads its directory once, at import: keep the tests' runs out of the home directory
os.environ.setdefault("TRACKIO_DIR", tempfile.mkdtemp(prefix="trackio-tests-"))

# Several processes share 2 cores in CI: one thread each keeps runs fast and deterministic.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def excerpt_data_dir(tmp_path_factory) -> str:
    """Token shards of the packaged Shakespeare excerpt, byte tokenizer (prepared once)."""
    from stalepipe.training.data import prepare_corpus

    out = tmp_path_factory.mktemp("data") / "excerpt-byte"
    cfg = DataConfig(corpus="excerpt", tokenizer="byte", data_dir=str(out))
    return str(prepare_corpus(cfg, progress=False))


@pytest.fixture
def tiny_config(tmp_path, excerpt_data_dir) -> ExperimentConfig:
    """A 2-layer, dim-64 model on the excerpt: a step takes a few milliseconds."""
    return ExperimentConfig(
        name="tiny",
        out_dir=str(tmp_path / "runs"),
        model=ModelConfig(
            vocab_size=256,
            dim=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            ffn_dim=128,
            max_seq_len=32,
        ),
        data=DataConfig(corpus="excerpt", data_dir=excerpt_data_dir, seq_len=32),
        train=TrainConfig(
            num_steps=12,
            batch_size=4,
            num_microbatches=2,
            warmup_steps=2,
            eval_every=6,
            num_eval_batches=2,
            log_every=1,
            progress=False,
        ),
    )


@pytest.fixture(scope="session")
def pool():
    """Up to 4 workers (gloo, one thread each) for the whole session, each started by the first
    run that needs it, forked from the launcher's forkserver (torch and the training code
    imported once): a run on 2-4 ranks that needs no launcher of its own pays for a process
    group, not for 2-4 interpreters."""
    from stalepipe.training.launch.pool import WorkerPool

    p = WorkerPool(4)
    yield p
    p.close()


def _shared_dir(tmp_path_factory) -> Path:
    """A directory all of this run's pytest processes share (pytest-xdist's workers each have
    a base directory of their own, under one they share), for a set-up made once per run."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def ladder_fit(tmp_path_factory) -> tuple[str, Path]:
    """benchmarks/studies/ladder_fit.py on the committed ladder records with `--plot`, run once
    per test run (whichever pytest process asks first runs it, under a lock; the others read
    its output) for the tests that read it (its table and fits; the README's and RESULTS.md's
    quotes of them): its stdout without the plot's 'wrote' line, and the PNG it drew."""
    import subprocess
    import sys

    from filelock import FileLock  # torch's own dependency

    shared = _shared_dir(tmp_path_factory) / "ladder-fit"
    png, text = shared / "ladder.png", shared / "stdout.txt"
    with FileLock(f"{shared}.lock"):
        if text.is_file():
            return text.read_text(), png
        shared.mkdir(exist_ok=True)
        root = Path(__file__).resolve().parents[1]
        script = root / "benchmarks" / "studies" / "ladder_fit.py"
        args = [sys.executable, str(script), "docs/results/ladder-regime", "--plot", str(png)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        out = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=root, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        wrote = f"wrote {png}\n"
        assert out.stdout.endswith(f"\n{wrote}"), out.stdout[-300:]
        text.write_text(out.stdout.removesuffix(wrote))
        return text.read_text(), png


class OldFormats:
    """What older versions wrote, made by tests: format 1 (one `ckpt_<step>.pt`) and format 2
    (DCP shards with a pickled `.metadata`, digests as issue 39 recorded them)."""

    @staticmethod
    def write_format1(run_dir, step: int, state: dict):
        from pathlib import Path

        path = Path(run_dir) / f"ckpt_{step:08d}.pt"
        torch.save({"format": 1, "step": step, **state}, path)
        return path

    @staticmethod
    def to_format2(ckpt) -> None:
        """Rewrite a format-3 checkpoint directory in place as format 2."""
        import io
        import json
        import shutil
        import warnings
        from pathlib import Path

        import torch.distributed.checkpoint as dcp

        from stalepipe.training.rundir import legacy
        from stalepipe.training.rundir.sharded import ShardedCheckpoint

        ckpt = Path(ckpt)
        flat = ShardedCheckpoint(ckpt)
        files = {}
        for d in sorted(p for p in ckpt.iterdir() if p.name.startswith("rank_")):
            tensors = flat.read(k for k in flat.stored_keys() if flat._where[k] == d.name)
            state = (d / "state.json").read_bytes()
            shutil.rmtree(d)
            d.mkdir()
            (d / "state.json").write_bytes(state)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.save(tensors, storage_writer=dcp.FileSystemWriter(d), no_dist=True)
            md = legacy.SafeUnpickler(io.BytesIO((d / ".metadata").read_bytes())).load()
            ranges: dict = {}
            for info in md.storage_data.values():
                ranges.setdefault(info.relative_path, []).append((info.offset, info.length))
            digests = legacy.shard_digests(d, ranges)
            files.update({f"{d.name}/{k}": v for k, v in digests.items()})
        manifest = json.loads((ckpt / "checkpoint.json").read_text())
        manifest.update(format=2, files=files)
        (ckpt / "checkpoint.json").write_text(json.dumps(manifest))


@pytest.fixture
def old_formats() -> OldFormats:
    return OldFormats()
