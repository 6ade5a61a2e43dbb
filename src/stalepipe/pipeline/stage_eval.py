"""The validation pass of a pipeline stage: forward-only, newest weights, eval mode.

A mixin of `pipeline.stage.StageExecutor` (it uses the executor's channels, weights and batches);
kept apart because evaluation is its own concern and its own message flow ("eval" channel).
"""

from __future__ import annotations

from collections import deque

import torch

from stalepipe.pipeline.comm import Pending


class StageEvaluation:
    """`evaluate()` for `StageExecutor`; see there for the attributes it reads."""

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean validation loss over `num_val_batches` batches at the newest weights, model in
        eval mode (an MoE model's loss is then cross-entropy only), as `train.loop.evaluate`
        computes it. Every stage of every replica calls it at the same point (right after an
        eager update, see `post_step`); replicas split the batches. Returns the loss on
        stage 0, None elsewhere.

        Each batch runs as chunks of the training microbatch's size (bounded memory, the same
        receive buffers' shape); a batch's loss is the mean of its chunks' (equal-sized) means,
        equal to the whole batch's up to fp32 rounding."""
        topo = self.comm.topo
        D, replica = topo.data_parallel, self.comm.replica
        chunks = self.m * D  # an eval batch holds train.batch_size rows, like a training batch
        keys = [(i, c) for i in range(replica, self.num_val_batches, D) for c in range(chunks)]
        weights = self._weights(self.delayed.step_count)
        recvs: deque[Pending] = deque()
        sends: deque[Pending] = deque()
        todo = iter(keys)

        def post_recvs() -> None:
            while not self.first and len(recvs) < self.LOOKAHEAD:
                key = next(todo, None)
                if key is None:
                    return
                buf = torch.empty(self.act_shape, dtype=self.act_dtype, device=self.device)
                what = f"the validation activation of batch {key[0]} chunk {key[1]}"
                recvs.append(
                    self.comm.recv([buf], self.comm.peer_rank(self.stage - 1), "eval", what)
                )

        was_training = self.module.training
        self.module.eval()
        total, batch_sum = 0.0, 0.0
        try:
            for i, c in keys:
                post_recvs()
                x = y = None
                if self.first or self.last:
                    if c == 0:
                        batch = self.val_batch(i)
                        assert len(batch) == chunks, (len(batch), chunks)
                    x, y = batch[c]
                inp = x if self.first else recvs.popleft().wait()[0]
                with self.autocast():
                    out, _ = self._run_at(weights, inp, y if self.last else None)
                if self.last:
                    batch_sum += out.float().item()
                    if c == chunks - 1:
                        total += batch_sum / chunks
                        batch_sum = 0.0
                else:
                    sends.append(
                        self.comm.send(
                            [out.to(self.act_dtype)],
                            self.comm.peer_rank(self.stage + 1),
                            "eval",
                            f"the validation activation of batch {i} chunk {c}",
                        )
                    )
                    while len(sends) > self.LOOKAHEAD:  # bounded memory for long evaluations
                        sends.popleft().wait()
        finally:
            self.module.train(was_training)
        for p in sends:
            p.wait()
        if not (self.first or self.last):
            return None
        result = torch.tensor([total], dtype=torch.float64, device=self.device)
        if self.last and not self.first:
            self.comm.send([result], self.comm.peer_rank(0), "eval_loss", "the validation loss")
            return None
        if not self.last:
            (result,) = self.comm.recv(
                [result], self.comm.peer_rank(self.P - 1), "eval_loss", "the validation loss"
            ).wait()
        self.comm.all_reduce_mean(result)  # data parallel: mean of the replicas' sums
        return result.item() * D / self.num_val_batches
