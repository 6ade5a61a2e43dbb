"""The stages of one pipeline process: executes the schedule's actions of that process.

A process runs one stage, or several with chunks (interleaved 1F1B: rank r runs stages r, r+R,
...). Each stage has its own module, forward and receives (`Chunk`); the process has one
`DelayedOptimizer` over all of its stages' parameters and posts one update per step, at its
last STEP of that step, so the gradient-norm exchange happens once per process and step.

What each action does (the schedule IR's contract, `pipeline.schedule`):
    F     receive the activation (stage 0: read tokens), run the stage with the weight version
          it reads (fresh leaves over the stored tensors, so versions never mix), send the
          output (last stage: the loss / m), stash what the backward needs;
    B     receive the output gradient (last stage: none), `autograd.grad` for the weights and the
          input, send the input gradient, add the weight gradient to step k's accumulator;
    BI/BW the two halves of B (zero-bubble schedules);
    STEP  finish step k's gradient and post its update (`runtime.stage_update`), applied when
          first needed.

The executor is a generator: `run(actions)` yields each update's `UpdateReport` once it is
applied, in step order. At a sync point of the run's plan (an eval or checkpoint step) the
update is applied at its STEP and reported right after it, so the caller -- the training loop,
through `train.pipelined.PipelineEngine` -- can evaluate (`evaluate`) or checkpoint at exactly
W_{k+1} before the executor moves on.

Exactness with the emulator's exact mode (docs/design.md, 'Exactness'): the same per-stage forward (RNG
seeded per (stage, step, microbatch)), the loss divided by m on the last stage, per-stage
gradients summed in microbatch order, a tied embedding's versions and gradient by `delay.tied`'s
rule (carried by `runtime.tied`), the global grad norm from per-parameter norms in the model's
order (as `clip_grad_norm_` computes it), the same optimizer class and the same update code.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from stalepipe.training.delay import DelayedOptimizer, microbatch_seed
from stalepipe.training.delay.rng import seeded
from stalepipe.training.optim.lr_schedule import lr_multiplier
from stalepipe.training.peers.interrupts import agreement
from stalepipe.training.runtime.split_backward import (
    WeightBranches,
    backward_input,
    backward_weights,
)
from stalepipe.training.runtime.stage_eval import EvalData, EvalStage, evaluate_stages
from stalepipe.training.runtime.stage_io import Batches, Chunk, ModelLayout, StageIO
from stalepipe.training.runtime.stage_update import StageUpdates, StepVotes, UpdateReport, lookahead
from stalepipe.training.runtime.tied import TiedWeights
from stalepipe.training.schedules.plan import StepPlan
from stalepipe.training.schedules.schedule import Action, PipelineSchedule


@dataclass
class _Stash:
    """What a forward leaves for its backward."""

    inp: torch.Tensor
    out: torch.Tensor
    leaves: dict[str, torch.Tensor]
    version: int
    aux: torch.Tensor | None = None  # this stage's MoE auxiliary loss / m (not the last stage)
    grad_out: torch.Tensor | None = None
    branches: WeightBranches | None = None  # what BI kept for BW (runtime.split_backward)


class StageExecutor:
    """Runs one process's part of a schedule: build one per process, iterate `run(actions)`.

    Args:
        ios: this process's stages, first stage first (one without chunks), each with its
            communication and inputs.
        layout: what the stages need to know of the whole model.
        delayed: a `DelayedOptimizer` over these stages' owned parameters (other stages empty).
        sched: the schedule being run (its `delay` gives every version read).
        plan: the run's LR schedule and its log / eval / checkpoint steps.
        evaluation: the validation batches (`evaluate`), or None for a run that never evaluates.
        tied_versions: older versions of a tied matrix the last stage still reads (resume).
        votes: how the processes agree on a step to checkpoint or stop at (`runtime.stage_update`);
            None: the plan's own steps only.
        requests: this process's pending requests (STOP, CHECKPOINT bits), cast in each vote.

    `plan` is the plan as agreed so far: each agreement replaces it (`StepPlan.with_agreed`).
    """

    def __init__(
        self,
        ios: StageIO | list[StageIO],
        layout: ModelLayout,
        delayed: DelayedOptimizer,
        sched: PipelineSchedule,
        plan: StepPlan,
        evaluation: EvalData | None = None,
        tied_versions: dict[int, torch.Tensor] | None = None,
        votes: StepVotes | None = None,
        requests: Callable[[], int] = lambda: 0,
    ) -> None:
        ios = [ios] if isinstance(ios, StageIO) else list(ios)
        self.layout, self.delayed, self.sched, self.plan = layout, delayed, sched, plan
        self.evaluation, self.votes, self.requests = evaluation, votes, requests
        self.comm = ios[0].comm
        self.P, self.m = sched.num_stages, sched.num_microbatches
        self.chunks = {
            io.stage: Chunk(io, delayed.stage_param_names(io.stage), self.P) for io in ios
        }  # first stage first
        assert list(self.chunks) == sorted(self.chunks), list(self.chunks)
        self.stages = list(self.chunks)
        self.device = next(ios[0].module.parameters()).device
        self.first, self.last = 0 in self.chunks, self.P - 1 in self.chunks
        self.owned = {n: p for c in self.chunks.values() for n, p in c.owned.items()}
        self.updates = StageUpdates(
            self.comm,
            delayed,
            self.owned,
            param_counts=layout.param_counts,
            router_layers=layout.router_layers,
            grad_clip=layout.grad_clip,
            lr_multiplier=functools.partial(lr_multiplier, cfg=plan.train),
            logs=plan.logs,
            per_expert=layout.per_expert,
        )
        self.tied = TiedWeights(
            self.comm, layout.tied, self.chunks, delayed, plan.evaluates, tied_versions
        )
        # Per-step state.
        self._batches: dict[int, Batches] = {}
        self._stash: dict[tuple[int, int, int], _Stash] = {}  # (stage, step, microbatch)
        self._grads: dict[int, dict[str, torch.Tensor]] = {}  # all stages' (names are global)
        self._loss: dict[int, torch.Tensor] = {}
        self._sent_by: dict[int, int] = {}  # step -> comm.sends_posted at its STEP
        self._ahead = 0  # this process's lookahead (runtime.stage_update), set by `run`
        self._steps_seen: Counter[int] = Counter()  # STEPs of each step run (one per stage)
        self._live_inflight: Counter[int] = Counter()  # versions used by stashed graphs
        self.peak_versions = self._versions_kept()

    def _versions_kept(self) -> int:
        kept = self.delayed.kept_versions()
        return max(len(kept[s]) for s in self.stages)

    # ---------------------------------------------------------------------------------------
    # Driving
    # ---------------------------------------------------------------------------------------

    def run(self, actions: list[Action]) -> Iterator[UpdateReport]:
        """Execute `actions` (this process's, in order), yielding each update's report once it
        is applied; a sync point's report comes right after its STEP (module docstring)."""
        for s, c in self.chunks.items():
            c.inbox.expect(a for a in actions if a.stage == s)
        self._ahead = lookahead(actions)
        for a in actions:
            chunk = self.chunks[a.stage]
            if (stop := self.plan.stop_step) is not None and a.step > stop:
                continue  # the run ends after update `stop` (runtime.stage_update)
            for c in self.chunks.values():
                c.inbox.prefetch()
            if a.kind == "F":
                self.forward(chunk, a.step, a.microbatch, a.reads)
            elif a.kind in ("B", "BI"):
                self.backward(chunk, a.step, a.microbatch, weights=a.kind == "B")
            elif a.kind == "BW":
                self.backward_weights(chunk, a.step, a.microbatch)
            elif a.kind == "STEP":
                self._steps_seen[a.step] += 1
                if self._steps_seen[a.step] == len(self.chunks):  # this process's last
                    del self._steps_seen[a.step]
                    self.post_step(a.step)
            else:  # pragma: no cover - validated schedules only
                raise AssertionError(a)
            yield from self._take_reports()
        self.apply_all()
        self.tied.finish()
        self.updates.drain(all_=True)
        yield from self._take_reports()
        self.settle()

    def _take_reports(self) -> Iterator[UpdateReport]:
        while self.updates.reports:
            yield self.updates.reports.popleft()

    # ---------------------------------------------------------------------------------------
    # Weights
    # ---------------------------------------------------------------------------------------

    def _weights(
        self, chunk: Chunk, version: int, step: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Fresh leaves over the tensors of `chunk`'s `version` (live ones included); for the
        forward of `step`, the weights that step computes at (`DelayedOptimizer.read_weights`:
        the predicted point under delay.weight_pred)."""
        self._ensure_version(version)
        s = chunk.stage
        if step is None:
            tensors = self.delayed.weights_at(s, version)
        else:
            assert self.sched.delay.version(s, step) == version, (step, version)
            tensors = self.delayed.read_weights(s, step)
        leaves = {
            n: t.detach().requires_grad_(p.requires_grad)
            for (n, p), t in zip(chunk.owned.items(), tensors, strict=True)
        }
        if chunk.last:  # a tied head reads the owner's matrix at its own version
            leaves.update(self.tied.head_leaves(version, step))
        return leaves

    def _ensure_version(self, version: int) -> None:
        while self.delayed.step_count < version:
            if not self.updates.pending:
                raise AssertionError(
                    f"stages {self.stages}: version {version} needed before update "
                    f"{self.delayed.step_count} was posted (schedule order)"
                )
            self.apply_next()

    def tied_live(self) -> torch.Tensor | None:
        """The last stage's copy of the newest tied matrix (tests compare it with stage 0's)."""
        return self.tied.newest()

    # ---------------------------------------------------------------------------------------
    # Compute
    # ---------------------------------------------------------------------------------------

    def _batch(self, chunk: Chunk, step: int) -> Batches:
        if step not in self._batches:
            assert chunk.io.get_batch is not None, "only the first and last stage read data"
            self._batches[step] = chunk.io.get_batch(step)
        return self._batches[step]

    def forward(self, chunk: Chunk, step: int, microbatch: int, version: int) -> None:
        """F: run microbatch `microbatch` of step `step` through `chunk` at `version`."""
        s, io = chunk.stage, chunk.io
        xs, ys = self._batch(chunk, step) if (chunk.first or chunk.last) else ([], [])
        # Weights first: a pending update is applied while the activation is still on its
        # way, not after it arrived (at the start of a step the optimizer step of a later
        # stage then overlaps the earlier stages' work instead of adding to the critical path).
        weights = self._weights(chunk, version, step)
        if chunk.first:
            inp = xs[microbatch]
        else:
            inp = chunk.inbox.activation(step, microbatch).requires_grad_()
        targets = ys[microbatch] if chunk.last else None
        seed = microbatch_seed(io.seed, s, step, microbatch, self.comm.replica)
        with seeded(seed, self.device):
            with io.autocast():
                out, aux = chunk.run_at(weights, inp, targets)
            if chunk.last:
                out = (out if aux is None else out + aux) / self.m
                aux = None
        if aux is not None:
            aux = aux / self.m
        # The logged loss adds every stage's auxiliary (MoE) loss, as the emulator's does.
        logged = out.detach() if chunk.last else aux.detach() if aux is not None else None
        if logged is not None:
            logged = logged.float()
            self._loss[step] = logged if step not in self._loss else self._loss[step] + logged
        if not chunk.last:
            if out.shape != io.act_shape or out.dtype != io.act_dtype:
                raise AssertionError(
                    f"stage {s} output {tuple(out.shape)} {out.dtype}, expected "
                    f"{io.act_shape} {io.act_dtype}"
                )
            self.comm.send(
                [out], (s, s + 1), "act", f"the activation of step {step} microbatch {microbatch}"
            )
        self._stash[(s, step, microbatch)] = _Stash(inp, out, weights, version, aux)
        self._live_inflight[version] += 1

    def backward(self, chunk: Chunk, step: int, microbatch: int, weights: bool = True) -> None:
        """B (weights=True) or BI (input gradient only; BW follows)."""
        s = chunk.stage
        st = self._stash[(s, step, microbatch)]
        grad_out = None if chunk.last else chunk.inbox.gradient(step, microbatch)
        wants_input = not chunk.first
        outs, gouts = _outputs(st, grad_out)
        if not weights:  # BI: the input gradient now, the weights' at BW
            st.grad_out = grad_out
            if not wants_input:  # the first stage has none to send: BW does all the work
                return
            grad_inp, st.branches = backward_input(outs, gouts, st.inp, list(st.leaves.values()))
            self._send_grad(s, step, microbatch, grad_inp)
            return
        targets = list(st.leaves.values()) + ([st.inp] if wants_input else [])
        grads = torch.autograd.grad(outs, targets, grad_outputs=gouts, allow_unused=True)
        if wants_input:
            self._send_grad(s, step, microbatch, grads[-1])
        self._accumulate(step, st.leaves, grads[: len(st.leaves)])
        self._release(s, step, microbatch)

    def _send_grad(self, stage: int, step: int, microbatch: int, grad: torch.Tensor) -> None:
        what = f"the gradient of step {step} microbatch {microbatch}"
        self.comm.send([grad], (stage, stage - 1), "grad", what)

    def backward_weights(self, chunk: Chunk, step: int, microbatch: int) -> None:
        """BW: the weight half of a split backward."""
        st = self._stash[(chunk.stage, step, microbatch)]
        weights = list(st.leaves.values())
        if st.branches is not None:  # only the weight branches BI left (split_backward)
            grads = backward_weights(st.branches, weights)
        else:  # the first stage: the whole backward, now
            outs, gouts = _outputs(st, st.grad_out)
            grads = torch.autograd.grad(outs, weights, grad_outputs=gouts, allow_unused=True)
        self._accumulate(step, st.leaves, grads)
        self._release(chunk.stage, step, microbatch)

    def _release(self, stage: int, step: int, microbatch: int) -> None:
        v = self._stash.pop((stage, step, microbatch)).version
        self._live_inflight[v] -= 1
        if not self._live_inflight[v]:
            del self._live_inflight[v]

    def _accumulate(self, step: int, leaves: dict, grads) -> None:
        acc = self._grads.setdefault(step, {})
        # Same arithmetic as autograd's AccumulateGrad: first gradient kept, then += (one
        # foreach call: elementwise, so bit for bit the per-tensor +=).
        into, add = [], []
        for name, g in zip(leaves, grads, strict=True):
            if g is None:
                continue
            if name in acc:
                into.append(acc[name])
                add.append(g)
            else:
                acc[name] = g
        if into:
            torch._foreach_add_(into, add)

    # ---------------------------------------------------------------------------------------
    # The update
    # ---------------------------------------------------------------------------------------

    def post_step(self, step: int) -> None:
        """This process's last STEP of `step`: complete the step's gradient (all of its
        stages') and start the exchanges its update needs."""
        if self.votes is not None and (outcome := self.votes.decide(step)) is not None:
            self._agree(*outcome)
        while self.updates.pending:  # one update in flight at a time: updates apply in order
            self.apply_next()
        grads = self._grads.pop(step, {})
        self._batches.pop(step, None)
        self.tied.exchange_grad(grads, step)  # the head's gradient joins the owner's
        loss = self._loss.pop(step, torch.zeros((), device=self.device))
        self.updates.post(step, grads, loss, [c.module for c in self.chunks.values()])
        self._sent_by[step] = self.comm.sends_posted
        # Apply at once where someone waits for the result: a sync point (eval, checkpoint),
        # and the tied matrix the last stage reads next (it may need it before this stage
        # needs W_{k+1}).
        if self.plan.is_sync_point(step) or self.tied.owner_must_send(step + 1):
            self.apply_all()
            if self.plan.is_sync_point(step):
                self.updates.drain(all_=True)
        if self.votes is not None:
            self.votes.start(step, self.requests())
        self._retire_sends()

    def _retire_sends(self) -> None:
        """Release the sends every receiver has taken. Once the exchange of step j completed,
        every process has run its STEP j, so it consumed every message of steps <= j; what
        this process sent before its STEP k belongs to steps <= k + lookahead."""
        done = [k for k in self._sent_by if k <= self.updates.exchanged - self._ahead]
        if done:
            self.comm.retire_sends(max(self._sent_by.pop(k) for k in done))

    def _agree(self, step: int, bits: int) -> None:
        """Every process agreed on `bits` after update `step`; drop the receives of later
        steps not posted yet when the run ends there."""
        self.plan = self.plan.with_agreed(agreement(step, bits))
        if (stop := self.plan.stop_step) is not None:
            for c in self.chunks.values():
                c.inbox.forget_after(stop)

    def settle(self) -> None:
        """Finish this process's part of the communication of the steps run so far (before
        the run ends early): sends delivered, votes completed."""
        if (stop := self.plan.stop_step) is not None:
            self.tied.settle(stop)  # the owner sent W_{stop+1} if the head reads it
        self.comm.flush_sends()
        if self.votes is not None:
            self.votes.close()

    def apply_next(self) -> None:
        """Apply the oldest posted update, then send a tied version the last stage reads."""
        k = self.delayed.step_count
        self.updates.apply_next(live_in_use=bool(self._live_inflight.get(k)))
        self.peak_versions = max(self.peak_versions, self._versions_kept())
        self.tied.updated()

    def apply_all(self) -> None:
        while self.updates.pending:
            self.apply_next()

    def evaluate(self) -> float | None:
        """Validation loss at the newest weights (all stages together; see
        `stage_eval.evaluate_stages`): the loss on stage 0's process, None elsewhere."""
        assert self.evaluation is not None, "no validation data was given"
        assert not self.updates.pending, "evaluate only at a sync point"
        k = self.delayed.step_count
        stages = [EvalStage(c.io, c.run_at, self._weights(c, k)) for c in self.chunks.values()]
        return evaluate_stages(stages, self.evaluation, self.m)


def _outputs(st: _Stash, grad_out: torch.Tensor | None) -> tuple[list, list]:
    """(outputs, their gradients) of a stashed microbatch, aux loss included."""
    outs, gouts = [st.out], [grad_out]
    if st.aux is not None:
        outs.append(st.aux)
        gouts.append(None)
    return outs, gouts
