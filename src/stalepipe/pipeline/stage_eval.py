"""The validation pass of a pipeline stage: forward-only, newest weights, eval mode.

Its own concern and its own message flow (the "eval" channel): every stage of every replica
calls `evaluate_stage` at the same point of the run (right after a sync point's update).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from stalepipe.pipeline.comm import Pending
from stalepipe.pipeline.inbox import LOOKAHEAD  # receives posted ahead, sends in flight


@dataclass(frozen=True)
class EvalData:
    """The validation batches: `batch(i)` gives batch i (first and last stage only) as a list
    of (x, y) chunks of one microbatch's rows; `num_batches` of them are evaluated."""

    batch: Callable[[int], list[tuple[torch.Tensor, torch.Tensor]]] | None
    num_batches: int


@torch.no_grad()
def evaluate_stage(io, run_at, weights: dict[str, torch.Tensor], data: EvalData, m: int):
    """Mean validation loss over `data.num_batches` batches at `weights` (this stage's newest),
    model in eval mode (an MoE model's loss is then cross-entropy only), as
    `train.emulated.evaluate` computes it; replicas split the batches. Returns the loss on
    stage 0, None elsewhere.

    `io` is the stage's `StageIO`, `run_at` its `Reparametrized` forward, `m` the microbatches
    per training batch. Each batch runs as m x num_replicas chunks of the microbatch's size
    (bounded memory, the same receive buffers' shape); a batch's loss is the mean of its
    chunks' (equal-sized) means, equal to the whole batch's up to fp32 rounding."""
    comm, module, stage = io.comm, io.module, io.stage
    num_stages = comm.topo.num_stages
    first, last = stage == 0, stage == num_stages - 1
    device = next(module.parameters()).device
    D, replica = comm.topo.num_replicas, comm.replica
    chunks = m * D  # an eval batch holds train.batch_size rows, like a training batch
    keys = [(i, c) for i in range(replica, data.num_batches, D) for c in range(chunks)]
    recvs: deque[Pending] = deque()
    sends: deque[Pending] = deque()
    todo = iter(keys)

    def post_recvs() -> None:
        while not first and len(recvs) < LOOKAHEAD:
            key = next(todo, None)
            if key is None:
                return
            buf = torch.empty(io.act_shape, dtype=io.act_dtype, device=device)
            what = f"the validation activation of batch {key[0]} chunk {key[1]}"
            recvs.append(comm.recv([buf], comm.peer_rank(stage - 1), "eval", what))

    was_training = module.training
    module.eval()
    total, batch_sum = 0.0, 0.0
    try:
        for i, c in keys:
            post_recvs()
            x = y = None
            if first or last:
                if c == 0:
                    batch = data.batch(i)
                    assert len(batch) == chunks, (len(batch), chunks)
                x, y = batch[c]
            inp = x if first else recvs.popleft().wait()[0]
            with io.autocast():
                out, _ = run_at(weights, inp, y if last else None)
            if last:
                batch_sum += out.float().item()
                if c == chunks - 1:
                    total += batch_sum / chunks
                    batch_sum = 0.0
            else:
                sends.append(
                    comm.send(
                        [out.to(io.act_dtype)],
                        comm.peer_rank(stage + 1),
                        "eval",
                        f"the validation activation of batch {i} chunk {c}",
                    )
                )
                while len(sends) > LOOKAHEAD:  # bounded memory for long evaluations
                    sends.popleft().wait()
    finally:
        module.train(was_training)
    for p in sends:
        p.wait()
    if not (first or last):
        return None
    result = torch.tensor([total], dtype=torch.float64, device=device)
    if last and not first:
        comm.send([result], comm.peer_rank(0), "eval_loss", "the validation loss")
        return None
    if not last:
        (result,) = comm.recv(
            [result], comm.peer_rank(num_stages - 1), "eval_loss", "the validation loss"
        ).wait()
    comm.all_reduce_mean(result)  # data parallel: mean of the replicas' sums
    return result.item() * D / data.num_batches
