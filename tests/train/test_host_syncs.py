"""Host synchronisations on the GPU path (issue 18), checked on CPU: the emulator reads the
host once per step, whatever the number of microbatches, and the runtime reads nothing on the
host per microbatch."""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch

from stalepipe.config import apply_overrides
from stalepipe.presets import get_preset

# ---- host synchronisations: one per step, whatever the number of microbatches --------------------


def _syncs_per_step(cfg, num_microbatches: int) -> int:
    from torch.profiler import ProfilerActivity, profile

    from stalepipe.training.delay import DelayEmulator
    from stalepipe.training.models import build_model
    from stalepipe.training.optim import build_optimizer

    model = build_model(cfg.model, 0, torch.device("cpu"))
    opt = build_optimizer(cfg.optim, model.named_parameters())
    engine = DelayEmulator(model, opt, cfg.delay, num_stages=2, total_steps=4)
    x = torch.randint(0, cfg.model.vocab_size, (num_microbatches * 2, 16))
    micro = list(zip(x.chunk(num_microbatches), x.roll(1, 1).chunk(num_microbatches)))
    engine.forward_backward(0, micro)
    engine.step(0)
    with profile(activities=[ProfilerActivity.CPU]) as prof, _host_reads() as reads:
        engine.forward_backward(1, micro)
        engine.clip_grad_norm_(1.0)
        engine.step(1)
    scalars = sum(
        1 for e in prof.events() if e.name == "aten::_local_scalar_dense" and not _fused(e)
    )
    return scalars, sum(reads.values())


@contextlib.contextmanager
def _host_reads():
    """Count the calls that read a tensor on the host (a GPU synchronisation there; on CPU
    `.cpu()` is free and invisible to the profiler, so count the calls themselves)."""
    reads: collections.Counter = collections.Counter()
    names = ("cpu", "item", "tolist", "numpy", "__float__", "__int__", "__bool__")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def counting(name):
        def call(self, *args, **kwargs):
            reads[name] += 1
            return saved[name](self, *args, **kwargs)

        return call

    try:
        for n in names:
            setattr(torch.Tensor, n, counting(n))
        yield reads
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def _fused(event) -> bool:
    """Inside torch's fused AdamW: on CPU it reads its step counters (CPU tensors), on CUDA it
    keeps them on the device; not a host synchronisation of stalepipe's step."""
    while event is not None:
        if "_fused_" in event.name:
            return True
        event = event.cpu_parent
    return False


@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_the_emulator_syncs_with_the_host_per_step_not_per_microbatch(mode):
    cfg = apply_overrides(get_preset("cpu-tiny"), {"delay.policy": "2bw", "delay.mode": mode})
    one, four = _syncs_per_step(cfg, 1), _syncs_per_step(cfg, 4)
    assert one == four == (2, 2)  # the loss and the gradient norm


def _runtime_host_reads(tmp_path, num_microbatches: int, num_steps: int, monkeypatch) -> int:
    """Host reads of a whole one-stage runtime run in this process (gloo, world of 1)."""
    import socket

    from stalepipe.training.train.pipelined import run_worker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for k, v in {**env, "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    over = {
        "pipeline.engine": "distributed",
        "pipeline.schedule": "1f1b",
        "train.num_microbatches": str(num_microbatches),
        "train.batch_size": str(2 * num_microbatches),
        "train.num_steps": str(num_steps),
        "train.num_eval_batches": "1",
        "train.progress": "false",
        "train.ckpt_every_s": "0",
        "data.corpus": "excerpt",
        "name": f"m{num_microbatches}-s{num_steps}",
        "out_dir": str(tmp_path),
    }
    threads = torch.get_num_threads()
    try:
        with _host_reads() as reads:
            run_worker(apply_overrides(get_preset("cpu-tiny"), over), verbose=False)
    finally:
        torch.set_num_threads(threads)
    return sum(reads.values())


def test_the_runtime_reads_nothing_on_the_host_per_microbatch(tmp_path, monkeypatch):
    # More microbatches may cost host reads once (the final evaluation's chunks), never per step.
    extra = [
        _runtime_host_reads(tmp_path, 4, steps, monkeypatch)
        - _runtime_host_reads(tmp_path, 1, steps, monkeypatch)
        for steps in (4, 8)
    ]
    assert extra[0] == extra[1], extra
