"""The validation pass of a pipeline stage: forward-only, newest weights, eval mode.

Its own concern and its own message flow (the "eval" channel): every process of every replica
calls `evaluate_stages` at the same point of the run (right after a sync point's update).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from stalepipe.training.runtime.comm import (  # receives posted ahead, sends in flight
    LOOKAHEAD,
    Pending,
)


@dataclass(frozen=True)
class EvalData:
    """The validation batches: `batch(i)` gives batch i (first and last stage only) as a list
    of (x, y) chunks of one microbatch's rows; `num_batches` of them are evaluated."""

    batch: Callable[[int], list[tuple[torch.Tensor, torch.Tensor]]] | None
    num_batches: int


@dataclass
class EvalStage:
    """One stage this process evaluates: its `StageIO`, its `Reparametrized` forward and the
    weights to evaluate at (the newest)."""

    io: Any
    run_at: Callable
    weights: dict[str, torch.Tensor]


@torch.no_grad()
def evaluate_stages(stages: list[EvalStage], data: EvalData, m: int) -> float | None:
    """Mean validation loss over `data.num_batches` batches at every stage's newest weights,
    model in eval mode (an MoE model's loss is then cross-entropy only), as
    `train.emulated.evaluate` computes it; replicas split the batches. Returns the loss on the
    process that runs stage 0, None elsewhere.

    `stages`: this process's stages, first stage first (several with chunks). `m`: the
    microbatches per training batch. Each batch runs as m x num_replicas pieces of the
    microbatch's size (bounded memory, the same receive buffers' shape); a batch's loss is the
    mean of its pieces' (equal-sized) means, equal to the whole batch's up to fp32 rounding.
    A process runs piece by piece, each through all of its stages in order: piece x on stage s
    needs only piece x on stage s - 1, which every process runs before (x, s), so no process
    waits on one that waits on it (a stage-by-stage order would: stage R on rank 0 waits for
    rank R-1, whose sends wait for rank 0 to reach stage R)."""
    comm = stages[0].io.comm
    num_stages, D, replica = comm.topo.num_stages, comm.topo.num_replicas, comm.replica
    pieces = m * D  # an eval batch holds train.batch_size rows, like a training batch
    keys = [(i, c) for i in range(replica, data.num_batches, D) for c in range(pieces)]
    flows = [_Flow(st, keys) for st in stages]
    holds_data = any(f.first or f.last for f in flows)
    modes = [(f.module, f.module.training) for f in flows]
    for module, _ in modes:
        module.eval()
    total, batch_sum = 0.0, 0.0
    try:
        for i, c in keys:
            if holds_data and c == 0:
                batch = data.batch(i)
                assert len(batch) == pieces, (len(batch), pieces)
            x, y = batch[c] if holds_data else (None, None)
            for f in flows:
                loss = f.run(i, c, x, y)
                if loss is not None:
                    batch_sum += loss
                    if c == pieces - 1:
                        total += batch_sum / pieces
                        batch_sum = 0.0
    finally:
        for module, was_training in modes:
            module.train(was_training)
    for f in flows:
        f.finish()
    return _loss_exchange(flows[0], flows[-1], total, num_stages, data.num_batches)


class _Flow:
    """The validation messages of one stage: receives posted ahead, sends bounded."""

    def __init__(self, st: EvalStage, keys: list[tuple[int, int]]) -> None:
        self.st, self.io, self.comm = st, st.io, st.io.comm
        self.module = st.io.module
        self.stage, num_stages = st.io.stage, self.comm.topo.num_stages
        self.first, self.last = self.stage == 0, self.stage == num_stages - 1
        self.device = next(self.module.parameters()).device
        self.recvs: deque[Pending] = deque()
        self.sends: deque[Pending] = deque()
        self.todo = iter(keys)

    def _post_recvs(self) -> None:
        while not self.first and len(self.recvs) < LOOKAHEAD:
            key = next(self.todo, None)
            if key is None:
                return
            buf = torch.empty(self.io.act_shape, dtype=self.io.act_dtype, device=self.device)
            what = f"the validation activation of batch {key[0]} chunk {key[1]}"
            link = (self.stage - 1, self.stage)
            self.recvs.append(self.comm.recv([buf], link, "eval", what))

    def run(self, i: int, c: int, x, y) -> float | None:
        """Piece c of batch i through this stage; the last stage returns its loss."""
        self._post_recvs()
        inp = x if self.first else self.recvs.popleft().wait()[0]
        with self.io.autocast():
            out, _ = self.st.run_at(self.st.weights, inp, y if self.last else None)
        if self.last:
            return out.float().item()
        self.sends.append(
            self.comm.send(
                [out.to(self.io.act_dtype)],
                (self.stage, self.stage + 1),
                "eval",
                f"the validation activation of batch {i} chunk {c}",
            )
        )
        while len(self.sends) > LOOKAHEAD:  # bounded memory for long evaluations
            self.sends.popleft().wait()
        return None

    def finish(self) -> None:
        for p in self.sends:
            p.wait()


def _loss_exchange(
    first: _Flow, last: _Flow, total: float, num_stages: int, num_batches: int
) -> float | None:
    """The last stage's sum to stage 0, the replicas' mean: the loss on stage 0's process."""
    comm = first.comm
    if not (first.first or last.last):
        return None
    result = torch.tensor([total], dtype=torch.float64, device=first.device)
    if last.last and not first.first:
        comm.send([result], (num_stages - 1, 0), "eval_loss", "the validation loss")
        return None
    if not last.last:
        (result,) = comm.recv(
            [result], (num_stages - 1, 0), "eval_loss", "the validation loss"
        ).wait()
    comm.all_reduce_mean(result)  # data parallel: mean of the replicas' sums
    return result.item() * comm.topo.num_replicas / num_batches
