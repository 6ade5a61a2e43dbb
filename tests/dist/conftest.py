"""Multi-process fixtures: the session's pool of workers (`pool`, tests/conftest.py) and
a tiny config builder. Every run has a short `pipeline.timeout_s`, so a broken
run fails fast instead of hanging."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from stalepipe.config import (
    PIPELINE_SCHEDULES,
    DataConfig,
    DelayConfig,
    ExperimentConfig,
    ModelConfig,
    OptimConfig,
    PipelineConfig,
    TrainConfig,
)
from stalepipe.training.launch.pooled import worker_entry
from stalepipe.training.rundir.checkpoint import latest_checkpoint, load_checkpoint
from stalepipe.training.rundir.metrics import read_metrics
from stalepipe.training.train.loop import train


def tiny_cfg(
    out_dir: str,
    data_dir: str,
    schedule: str = "1f1b",
    P: int = 2,
    m: int = 2,
    *,
    steps: int = 4,
    tied: bool = True,
    optim: str = "adamw",
    dp: int = 1,
    chunks: int = 1,
    dropout: float = 0.0,
    name: str = "dist",
    **train_kw,
) -> ExperimentConfig:
    """The tests' tiny pipeline config (`make_cfg` with the directories given: a module-scoped
    fixture builds one too)."""
    train_kw = {
        "batch_size": 2 * m * dp,
        "warmup_steps": 1,
        "eval_every": 0,
        "num_eval_batches": 1,
        "log_every": 1,
        "progress": False,
        "grad_clip": 1.0,
        **train_kw,
    }
    return ExperimentConfig(
        name=name,
        out_dir=out_dir,
        model=ModelConfig(
            vocab_size=256,
            dim=32,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            ffn_dim=64,
            max_seq_len=16,
            tie_embeddings=tied,
            dropout=dropout,
        ),
        data=DataConfig(corpus="excerpt", data_dir=data_dir, seq_len=16),
        optim=OptimConfig(name=optim),
        delay=DelayConfig(policy=PIPELINE_SCHEDULES[schedule].policy, mode="exact"),
        pipeline=PipelineConfig(
            num_stages=P,
            engine="distributed",
            schedule=schedule,
            num_replicas=dp,
            num_chunks=chunks,
            timeout_s=20,
        ),
        train=TrainConfig(num_steps=steps, num_microbatches=m, **train_kw),
    )


@pytest.fixture
def make_cfg(tmp_path, excerpt_data_dir):
    def make(*args, **kwargs) -> ExperimentConfig:
        return tiny_cfg(str(tmp_path / "runs"), excerpt_data_dir, *args, **kwargs)

    return make


@pytest.fixture
def run_dist(pool):
    def run(cfg: ExperimentConfig, resume: bool = False) -> list[dict]:
        """Run `cfg` on the pool; returns every rank's report."""
        world = cfg.pipeline.num_processes
        return pool.run(worker_entry, (cfg, resume, not resume), world, timeout_s=180)

    return run


@pytest.fixture
def dist_utils():
    return dict(
        reference=reference,
        final_model=final_model,
        assert_bitwise=assert_bitwise,
        val_losses=val_losses,
    )


def reference(cfg: ExperimentConfig, mode: str = "exact", name: str = "ref") -> dict:
    """The single-process run of `cfg` (delay emulator in `mode`); returns its final weights."""
    ref = dataclasses.replace(
        cfg,
        name=name,
        pipeline=dataclasses.replace(
            cfg.pipeline, engine="emulate", schedule="1f1b", num_replicas=1, num_chunks=1
        ),
        delay=dataclasses.replace(cfg.delay, mode=mode),
    )
    torch.set_num_threads(1)
    result = train(ref, overwrite=True, verbose=False)
    return load_checkpoint(latest_checkpoint(result.run_dir))["model"]


def final_model(cfg: ExperimentConfig) -> dict:
    return load_checkpoint(latest_checkpoint(f"{cfg.out_dir}/{cfg.name}"))["model"]


def val_losses(cfg: ExperimentConfig, name: str | None = None) -> dict[int, float]:
    """step -> val_loss of the records of run `name` (default: cfg's) in metrics.jsonl."""
    rows = read_metrics(Path(cfg.out_dir) / (name or cfg.name))
    return {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"{len(bad)} tensors differ, e.g. {bad[0]}: max |diff| " + str(
        (a[bad[0]] - b[bad[0]]).abs().max().item()
    )
