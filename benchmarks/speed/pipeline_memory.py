"""Peak memory per rank of `pipeline_throughput.py`'s contenders: the schedule IR's order
(`sim.memory`) with the sizes measured on the benchmark's model, and our executors' held
stashes and weight versions beside the IR's count."""

from __future__ import annotations

import torch

from stalepipe.config import ModelConfig
from stalepipe.lab.sim.memory import rank_memory
from stalepipe.training.models import build_model, partition
from stalepipe.training.schedules.generators import make_schedule

P = 2  # processes, as in pipeline_throughput.py

# The schedule IR's name of each contender's schedule (torch's: the same schedule family).
IR_NAME = {
    "gpipe": "gpipe",
    "1f1b": "1f1b",
    "2bw": "2bw",
    "interleaved-1f1b": "interleaved-1f1b",
    "zb-v": "zb-v",
    "torch-gpipe": "gpipe",
    "torch-1f1b": "1f1b",
    "torch-interleaved": "interleaved-1f1b",
    "torch-zbv": "zb-v",
}


def _stash_bytes(stage, mb: int, T: int, dim: int, V: int) -> int:
    """Bytes one microbatch leaves on `stage` for its backward: the tensors autograd saves
    (parameters excluded, each storage once) and the output sent on."""
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = s.nbytes()
        return t

    first, last = stage.spec.is_first, stage.spec.is_last
    x = torch.randint(V, (mb, T)) if first else torch.randn(mb, T, dim, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage(x, torch.randint(V, (mb, T))) if last else stage(x)
    return sum(saved.values()) + (0 if last else out.untyped_storage().nbytes())


def stage_sizes(cfg: ModelConfig, mb: int, T: int) -> dict[int, tuple[tuple, tuple, tuple]]:
    """Per stage count (P, 2P) -> per stage (one weight version, its gradient + AdamW state,
    one microbatch's stash) in bytes, measured on the benchmark's model."""
    torch.set_num_threads(1)
    full = build_model(cfg, seed=0)
    out = {}
    for S in (P, 2 * P):
        parts = partition(full, S)
        weight = tuple(sum(p.nbytes for p in s.owned_parameters().values()) for s in parts)
        out[S] = (
            weight,
            tuple(3 * w for w in weight),  # fp32 gradient accumulator, exp_avg, exp_avg_sq
            tuple(_stash_bytes(s, mb, T, cfg.dim, cfg.vocab_size) for s in parts),
        )
    return out


def print_memory(
    m: int, steps: int, sizes: dict, rounds: list[dict], contenders: tuple, ours: dict
) -> None:
    """Peak bytes per rank of every contender (the schedule's order, `sim.memory`, with
    the measured sizes), and ours checked against what the executor actually held."""
    print(
        "  peak memory per rank, MB (max over ranks; weight versions + gradient + AdamW "
        "state + stashed microbatches x measured stash; torch's from the IR of the same schedule):"
    )
    for name in contenders:
        sched = make_schedule(IR_NAME[name], P, m, steps)
        mem = rank_memory(sched, *sizes[sched.num_stages])
        worst = max(mem, key=lambda r: r.total)
        line = (
            f"    {name:<18}{worst.total / 2**20:>8.1f}  (weights {worst.weights / 2**20:.1f}, "
            f"activations {worst.activations / 2**20:.1f}; {worst.stashed} stashed)"
        )
        if name in ours:  # ours: what the executor held, against the IR's count
            reports = rounds[-1][name]
            held = max(r["marks"]["stashed"] for r in reports)
            versions = max(r["marks"]["versions"] for r in reports)
            ir = max(r.stashed for r in mem)
            line += f"; executor held {held} stashes (IR: {ir}), {versions} weight versions"
        print(line)
