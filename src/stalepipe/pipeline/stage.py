"""One pipeline stage in its own process: executes the schedule's actions for that stage.

What each action does (the schedule IR's contract, `pipeline.schedule`):
    F     receive the activation (stage 0: read tokens), run the stage with weight version v
          (fresh leaves over the stored tensors, so versions never mix), send the output (last
          stage: the loss / m), stash what the backward needs;
    B     receive the output gradient (last stage: none), `autograd.grad` for the weights and the
          input, send the input gradient, add the weight gradient to step k's accumulator;
    BI/BW the two halves of B (zero-bubble schedules);
    STEP  finish step k's gradient (tied-head sum, data-parallel all-reduce, one exchange of
          gradient norms, loss and, at logged steps, MoE router sums) and apply the update
          through `delay.DelayedOptimizer` -- the emulator's own version bookkeeping, Taylor
          and error-feedback code, so both engines share one implementation.
    EVAL  (not an IR action) after the update of an evaluation step: a forward-only pass of the
          validation batches at the newest weights, model in eval mode, on the `eval` channel;
          the last stage sends the mean loss to stage 0 (`evaluate`).

Exactness with the emulator's exact mode (GUIDE section 2): the same per-stage forward (RNG
seeded per (stage, step, microbatch)), the loss divided by m on the last stage, per-stage
gradients summed in microbatch order, the tied embedding's gradient = first stage's + last
stage's, the global grad norm from per-parameter norms in the model's order (as
`clip_grad_norm_` computes it), the same optimizer class and the same update code.

The update of step k is *posted* at STEP (gradients exchanged asynchronously) and *applied*
when first needed: before an action that uses version k+1, before the next STEP, or at the
end. This keeps the no-flush schedules free of bubbles even though gradient clipping needs
every stage's norm.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stalepipe.delay import DelayedOptimizer, microbatch_seed
from stalepipe.delay.rng import seeded
from stalepipe.models.moe import raw_stats_width, summarize_router_stats
from stalepipe.pipeline.comm import Comm, Pending
from stalepipe.pipeline.reparam import Reparametrized
from stalepipe.pipeline.schedule import Action, Schedule
from stalepipe.pipeline.stage_eval import StageEvaluation

TIED_NAME = "tok_emb.weight"  # owned by stage 0
TIED_HEAD = "lm_head.weight"  # read by the last stage


@dataclass
class StepResult:
    """What the update of one step reports (identical on every rank of the replica)."""

    step: int
    loss: float
    grad_norm: float
    tau: int
    router: dict[str, float] = field(default_factory=dict)  # MoE metrics at `stats_steps`


@dataclass
class _Posted:
    """A step whose gradient is complete and exchanged but whose update is not applied yet."""

    step: int
    work: Any
    gathered: list[torch.Tensor]
    grads: dict[str, torch.Tensor]


@dataclass
class _Stash:
    """What a forward leaves for its backward."""

    inp: torch.Tensor
    out: torch.Tensor
    leaves: dict[str, torch.Tensor]
    version: int
    aux: torch.Tensor | None = None  # this stage's MoE auxiliary loss / m (not the last stage)
    grad_out: torch.Tensor | None = None


@dataclass
class _Channel:
    """Receives of one channel, posted ahead in the order the schedule consumes them."""

    keys: deque = field(default_factory=deque)  # (step, microbatch) still to post
    posted: deque = field(default_factory=deque)  # (key, Pending)


class StageExecutor(StageEvaluation):
    """Runs one stage's part of a schedule. Build one per process; call `run(actions)`.

    Args:
        module: the stage (`models.PipelineStage`), on the device, its parameters = live W.
        delayed: a `DelayedOptimizer` over this stage's owned parameters (other stages empty).
        comm: this rank's communication.
        sched: the schedule being run (for the policy and the step count).
        get_batch: step -> (x, y) microbatch lists of this replica (first/last stage only).
        grad_clip, seed, lr_fn: as in the training loop (`lr_fn(step)` sets the LR).
        replica: the data-parallel replica (`microbatch_seed`: its own dropout masks).
        param_counts: number of owned parameters of every stage (for the norm exchange).
        tied: whether the embedding is tied to the head across the first and last stage.
        autocast: context manager factory for the forward (bf16 on GPU).
        val_batch, num_val_batches, eval_steps: validation (first/last stage: `val_batch(i)`
            gives batch i as a list of (x, y) chunks of `act_shape[0]` rows); after the update
            of every step in `eval_steps` all stages run `evaluate` and stage 0 records the
            loss in `val_losses`.
    """

    LOOKAHEAD = 4

    def __init__(
        self,
        *,
        module: nn.Module,
        stage: int,
        delayed: DelayedOptimizer,
        comm: Comm,
        sched: Schedule,
        get_batch: Callable[[int], tuple[list, list]],
        grad_clip: float,
        seed: int,
        lr_fn: Callable[[int], None],
        param_counts: list[int],
        tied: bool,
        act_shape: tuple[int, ...],
        act_dtype: torch.dtype,
        tied_versions: dict[int, torch.Tensor] | None = None,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        val_batch: Callable[[int], list[tuple[torch.Tensor, torch.Tensor]]] | None = None,
        num_val_batches: int = 0,
        eval_steps: set[int] | frozenset[int] = frozenset(),
        replica: int = 0,
        router_layers: list[list[tuple[int, int]]] | None = None,
        stats_steps: set[int] | frozenset[int] = frozenset(),
        per_expert: bool = True,
    ) -> None:
        self.module, self.stage, self.delayed, self.comm, self.sched = (
            module,
            stage,
            delayed,
            comm,
            sched,
        )
        self.P = sched.num_stages
        self.m = sched.num_microbatches
        self.first, self.last = stage == 0, stage == self.P - 1
        self.get_batch, self.grad_clip, self.seed, self.lr_fn = get_batch, grad_clip, seed, lr_fn
        self.replica = replica  # data-parallel replica: its own dropout masks
        self.param_counts = param_counts
        self.autocast = autocast
        self.act_shape, self.act_dtype = act_shape, act_dtype
        self.device = next(module.parameters()).device
        self._run_at = Reparametrized(module)
        self.val_batch, self.num_val_batches = val_batch, num_val_batches
        self.eval_steps = set(eval_steps)
        # MoE router statistics: every stage's (block, experts) layout; at `stats_steps` each
        # stage adds its raw sums to the STEP exchange and every rank gets the model's metrics.
        self.router_layers = router_layers or [[] for _ in range(self.P)]
        self.stats_steps, self.per_expert = set(stats_steps), per_expert
        self._norm_width = max(param_counts)
        self._stats_width = max(raw_stats_width(layers) for layers in self.router_layers)
        self.val_losses: dict[int, float] = {}
        names = delayed._names[stage]
        params = dict(module.named_parameters())
        self.owned = {n: params[n] for n in names}
        # A tied embedding is one matrix in two processes: stage 0 owns and updates it, the
        # last stage reads the versions stage 0 sends (never silently diverging).
        self.tied_head = tied and self.last and not self.first
        self.tied_owner = tied and self.first and not self.last
        self.tied_versions: dict[int, torch.Tensor] = {}
        if self.tied_head:
            # The newest version is the model's own head copy; older ones (resume) come in.
            self.tied_versions = dict(tied_versions or {})
            self.tied_versions[delayed.step_count] = params[TIED_HEAD].detach().clone()
        self._tied_reads = self._tied_read_versions() if self.tied_head else []
        self._owner_reads = self._all_tied_reads() if self.tied_owner else set()
        self._tied_recv: Pending | None = None
        self._tied_expect = -1
        # Per-step state.
        self._batches: dict[int, tuple[list, list]] = {}
        self._stash: dict[tuple[int, int], tuple] = {}
        self._grads: dict[int, dict[str, torch.Tensor]] = {}
        self._loss: dict[int, torch.Tensor] = {}
        self._posted: deque[_Posted] = deque()
        self._logged: deque[tuple[int, int, Any, list[torch.Tensor]]] = deque()
        self._live_inflight: Counter[int] = Counter()  # versions used by stashed graphs
        self.results: list[StepResult] = []
        self.peak_versions = len(self.delayed.kept_versions()[stage])
        self.on_step: Callable[[int], None] | None = None  # called after update k is applied
        self.eager_steps: set[int] = set()  # updates applied right at their STEP
        self._act = _Channel()
        self._grad = _Channel()

    # ---------------------------------------------------------------------------------------
    # Driving
    # ---------------------------------------------------------------------------------------

    def run(self, actions: list[Action]) -> None:
        """Execute `actions` (this stage's, in order), then apply the last posted update."""
        for a in actions:
            if a.kind == "F" and not self.first:
                self._act.keys.append((a.step, a.microbatch))
            if a.kind in ("B", "BI") and not self.last:
                self._grad.keys.append((a.step, a.microbatch))
        for a in actions:
            assert a.stage == self.stage, a
            self._prefetch()
            if a.kind == "F":
                self.forward(a.step, a.microbatch, a.reads)
            elif a.kind in ("B", "BI"):
                self.backward(a.step, a.microbatch, weights=a.kind == "B")
            elif a.kind == "BW":
                self.backward_weights(a.step, a.microbatch)
            elif a.kind == "STEP":
                self.post_step(a.step)
            else:  # pragma: no cover - validated schedules only
                raise AssertionError(a)
        self.apply_all()
        if self.tied_head:  # take the final version too: both copies end equal
            while self.sched.num_steps not in self.tied_versions:
                self._recv_tied_version()
            self._drop_tied()
        self._drain_logged(all_=True)
        self.comm.flush_sends()

    def _prefetch(self) -> None:
        for ch, src, name, shape in (
            (self._act, self.stage - 1, "act", self.act_shape),
            (self._grad, self.stage + 1, "grad", self.act_shape),
        ):
            while ch.keys and len(ch.posted) < self.LOOKAHEAD:
                key = ch.keys.popleft()
                buf = torch.empty(shape, dtype=self.act_dtype, device=self.device)
                what = f"the {'activation' if name == 'act' else 'gradient'} of step {key[0]} microbatch {key[1]}"
                ch.posted.append((key, self.comm.recv([buf], self.comm.peer_rank(src), name, what)))

    def _take(self, ch: _Channel, key: tuple[int, int]) -> torch.Tensor:
        got, pending = ch.posted.popleft()
        assert got == key, (got, key)
        return pending.wait()[0]

    # ---------------------------------------------------------------------------------------
    # Weights
    # ---------------------------------------------------------------------------------------

    def _read_version(self, step: int) -> int:
        """The version of the tied matrix the last stage's head reads at `step` (the version
        the last stage sees, as in the emulator)."""
        return self.sched.delay.version(self.P - 1, step)

    def _all_tied_reads(self) -> set[int]:
        """Every version the last stage needs from now on: those its steps read, and the
        final one (both copies end equal; evaluation and checkpoints read it)."""
        N, start = self.sched.num_steps, self.delayed.step_count
        reads = {self._read_version(k) for k in range(start, N)} | {N}
        return reads | {k + 1 for k in self.eval_steps if k >= start}

    def _tied_read_versions(self) -> list[int]:
        """Versions of the tied matrix the last stage will receive, ascending (newer than
        what it holds at start)."""
        start = self.delayed.step_count
        return sorted(v for v in self._all_tied_reads() if v > start)

    def _weights(self, version: int) -> dict[str, torch.Tensor]:
        """Fresh leaves over the tensors of `version` (live ones included)."""
        self._ensure_version(version)
        tensors = self.delayed.weights_at(self.stage, version)
        leaves = {
            n: t.detach().requires_grad_(p.requires_grad)
            for (n, p), t in zip(self.owned.items(), tensors, strict=True)
        }
        if self.tied_head:
            while version not in self.tied_versions:
                self._recv_tied_version()
            leaves[TIED_HEAD] = self.tied_versions[version].detach().requires_grad_()
        return leaves

    def _ensure_version(self, version: int) -> None:
        while self.delayed.step_count < version:
            if not self._posted:
                raise AssertionError(
                    f"stage {self.stage}: version {version} needed before update "
                    f"{self.delayed.step_count} was posted (schedule order)"
                )
            self.apply_next()

    def _recv_tied_version(self) -> None:
        if self._tied_recv is None:
            self._post_tied_recv()
        assert self._tied_recv is not None, "no more tied versions expected"
        v = self._tied_expect
        (t,) = self._tied_recv.wait()
        self.tied_versions[v] = t
        self._tied_recv = None
        self._post_tied_recv()

    def _post_tied_recv(self) -> None:
        if not self._tied_reads:
            return
        self._tied_expect = self._tied_reads.pop(0)
        buf = torch.empty_like(self.module.get_parameter(TIED_HEAD))
        self._tied_recv = self.comm.recv(
            [buf],
            self.comm.peer_rank(0),
            "tied_w",
            f"tied embedding version {self._tied_expect}",
        )

    # ---------------------------------------------------------------------------------------
    # Compute
    # ---------------------------------------------------------------------------------------

    def _batch(self, step: int) -> tuple[list, list]:
        if step not in self._batches:
            self._batches[step] = self.get_batch(step)
        return self._batches[step]

    def forward(self, step: int, microbatch: int, version: int) -> None:
        """F: run microbatch `microbatch` of step `step` through this stage at `version`."""
        xs, ys = self._batch(step) if (self.first or self.last) else ([], [])
        # Weights first: a pending update is applied while the activation is still on its
        # way, not after it arrived (at the start of a step the optimizer step of a later
        # stage then overlaps the earlier stages' work instead of adding to the critical path).
        weights = self._weights(version)
        if self.first:
            inp = xs[microbatch]
        else:
            inp = self._take(self._act, (step, microbatch)).requires_grad_()
        targets = ys[microbatch] if self.last else None
        seed = microbatch_seed(self.seed, self.stage, step, microbatch, self.replica)
        with seeded(seed, self.device):
            with self.autocast():
                out, aux = self._run_at(weights, inp, targets)
            if self.last:
                out = (out if aux is None else out + aux) / self.m
                aux = None
        if aux is not None:
            aux = aux / self.m
        # The logged loss adds every stage's auxiliary (MoE) loss, as the emulator's does.
        logged = out.detach() if self.last else aux.detach() if aux is not None else None
        if logged is not None:
            logged = logged.float()
            self._loss[step] = logged if step not in self._loss else self._loss[step] + logged
        if not self.last:
            if out.shape != self.act_shape or out.dtype != self.act_dtype:
                raise AssertionError(
                    f"stage {self.stage} output {tuple(out.shape)} {out.dtype}, expected "
                    f"{self.act_shape} {self.act_dtype}"
                )
            self.comm.send(
                [out],
                self.comm.peer_rank(self.stage + 1),
                "act",
                f"the activation of step {step} microbatch {microbatch}",
            )
        self._stash[(step, microbatch)] = _Stash(inp, out, weights, version, aux)
        self._live_inflight[version] += 1

    def backward(self, step: int, microbatch: int, weights: bool = True) -> None:
        """B (weights=True) or BI (input gradient only; BW follows)."""
        st = self._stash[(step, microbatch)]
        grad_out = None if self.last else self._take(self._grad, (step, microbatch))
        wants_input = not self.first
        targets = (list(st.leaves.values()) if weights else []) + ([st.inp] if wants_input else [])
        if not targets:  # BI on the first stage: no input gradient to send; BW does the work
            st.grad_out = grad_out
            return
        outs, gouts = _outputs(st, grad_out)
        grads = torch.autograd.grad(
            outs, targets, grad_outputs=gouts, allow_unused=True, retain_graph=not weights
        )
        if wants_input:
            self.comm.send(
                [grads[-1]],
                self.comm.peer_rank(self.stage - 1),
                "grad",
                f"the gradient of step {step} microbatch {microbatch}",
            )
        if weights:
            self._accumulate(step, st.leaves, grads[: len(st.leaves)])
            self._release(step, microbatch)
        else:
            st.grad_out = grad_out

    def backward_weights(self, step: int, microbatch: int) -> None:
        """BW: the weight half of a split backward."""
        st = self._stash[(step, microbatch)]
        outs, gouts = _outputs(st, st.grad_out)
        grads = torch.autograd.grad(
            outs, list(st.leaves.values()), grad_outputs=gouts, allow_unused=True
        )
        self._accumulate(step, st.leaves, grads)
        self._release(step, microbatch)

    def _release(self, step: int, microbatch: int) -> None:
        v = self._stash.pop((step, microbatch)).version
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
        """STEP: complete step `step`'s gradient and start the exchanges its update needs."""
        while self._posted:  # one update in flight at a time: updates apply in order
            self.apply_next()
        grads = self._grads.pop(step, {})
        self._batches.pop(step, None)
        if self.tied_head:
            head = grads.pop(TIED_HEAD)
            self.comm.send(
                [head], self.comm.peer_rank(0), "tied_grad", f"the head gradient of step {step}"
            )
        if self.tied_owner:
            buf = torch.empty_like(grads[TIED_NAME])
            (head,) = self.comm.recv(
                [buf],
                self.comm.peer_rank(self.P - 1),
                "tied_grad",
                f"the head gradient of step {step}",
            ).wait()
            grads[TIED_NAME] = grads[TIED_NAME] + head  # first stage's, then last stage's
        loss = self._loss.pop(step, torch.zeros((), device=self.device))
        if self.comm.dp_group is not None:
            self._all_reduce(grads, loss)
        # Per-parameter norms in the model's order (what clip_grad_norm_ stacks).
        # [per-parameter norms | raw router sums | loss]
        vec = torch.zeros(
            self._norm_width + self._stats_width + 1, device=self.device, dtype=torch.float32
        )
        names = [n for n in self.owned if n in grads]
        if self.grad_clip > 0 and names:
            norms = torch._foreach_norm([grads[n] for n in names], 2.0)
            vec[: len(names)] = torch.stack([n.float() for n in norms])
        if self._stats_width and step in self.stats_steps:
            _, raw = self.module.raw_router_stats(reset=True)
            vec[self._norm_width : self._norm_width + raw.numel()] = raw.to(vec)
        vec[-1] = loss
        work, gathered = self.comm.all_gather(vec)
        self._posted.append(_Posted(step, work, gathered, grads))
        # Apply at once where another rank waits for the result: checkpoints, and the tied
        # matrix the last stage reads next (it may need it before this stage needs W_{k+1}).
        if (
            step in self.eager_steps
            or step in self.eval_steps
            or (self.tied_owner and step + 1 in self._owner_reads)
        ):
            self.apply_all()

    def _all_reduce(self, grads: dict[str, torch.Tensor], loss: torch.Tensor) -> None:
        names = [n for n in self.owned if n in grads]
        flat = torch.cat([grads[n].reshape(-1) for n in names] + [loss.reshape(1)])
        self.comm.all_reduce_mean(flat)
        off = 0
        for n in names:
            k = grads[n].numel()
            grads[n] = flat[off : off + k].view_as(grads[n]).clone()
            off += k
        loss.copy_(flat[-1])

    @torch.no_grad()
    def apply_next(self) -> None:
        """Apply the oldest posted update (waits for the norm exchange if clipping)."""
        post = self._posted.popleft()
        k = post.step
        assert k == self.delayed.step_count, (k, self.delayed.step_count)
        grad_norm = math.nan
        if self.grad_clip > 0:
            self.comm.wait_work(post.work, f"the gradient-norm exchange of step {k}", None)
            norms = torch.cat(
                [g[:c] for g, c in zip(post.gathered, self.param_counts, strict=True)]
            )
            total = torch.linalg.vector_norm(norms, 2.0)
            grad_norm = total.item()
            params = [p for n, p in self.owned.items() if n in post.grads]
            for n, p in self.owned.items():
                p.grad = post.grads.get(n)
            torch.nn.utils.clip_grads_with_norm_(params, self.grad_clip, total)
        else:
            for n, p in self.owned.items():
                p.grad = post.grads.get(n)
        self.lr_fn(k)
        # Graphs still waiting for their backward hold the live tensors: the update must go
        # to new storage so that it cannot reach them.
        info = self.delayed.step(live_in_use=bool(self._live_inflight.get(k)))
        self.delayed.zero_grad(set_to_none=True)
        kept = len(self.delayed.kept_versions()[self.stage])
        self.peak_versions = max(self.peak_versions, kept)
        if self.tied_owner and (k + 1) in self._owner_reads:
            self.comm.send(
                [self.owned[TIED_NAME].detach().clone()],
                self.comm.peer_rank(self.P - 1),
                "tied_w",
                f"tied embedding version {k + 1}",
            )
        if self.tied_head:
            self._drop_tied()
        if k in self.eval_steps:
            val = self.evaluate()
            if val is not None:
                self.val_losses[k] = val
        tau = info["tau"][self.stage]
        if self.grad_clip > 0:
            self._result(k, post.gathered, grad_norm, tau)
        else:
            self._logged.append((k, tau, post.work, post.gathered))
            self._drain_logged(all_=False)
        if self.on_step is not None:
            self.on_step(k)

    def _drain_logged(self, all_: bool) -> None:
        """Collect losses of steps whose exchange was not needed for the update (no clipping):
        waited only when old enough not to stall the pipeline."""
        while self._logged and (all_ or len(self._logged) > self.P + 1):
            k, tau, work, gathered = self._logged.popleft()
            self.comm.wait_work(work, f"the loss exchange of step {k}", None)
            self._result(k, gathered, math.nan, tau)

    def _result(self, k: int, gathered: list[torch.Tensor], grad_norm: float, tau: int) -> None:
        router: dict[str, float] = {}
        if self._stats_width and k in self.stats_steps:
            lo = self._norm_width
            raws = [
                g[lo : lo + raw_stats_width(layers)]
                for g, layers in zip(gathered, self.router_layers, strict=True)
            ]
            layers = [layer for stage in self.router_layers for layer in stage]
            router = summarize_router_stats(layers, torch.cat(raws), per_expert=self.per_expert)
        self.results.append(StepResult(k, _loss_of(gathered), grad_norm, tau, router))

    def _drop_tied(self) -> None:
        """Forget tied versions no later step reads (stashed graphs keep their own leaves)."""
        k, N = self.delayed.step_count, self.sched.num_steps
        floor = max(self.tied_versions) if k >= N else self._read_version(k)
        for v in [v for v in self.tied_versions if v < floor]:
            del self.tied_versions[v]

    def apply_all(self) -> None:
        while self._posted:
            self.apply_next()

    def tied_live(self) -> torch.Tensor | None:
        """The last stage's copy of the newest tied matrix (tests compare it with stage 0's)."""
        if not self.tied_head or not self.tied_versions:
            return None
        return self.tied_versions[max(self.tied_versions)]


def _loss_of(gathered: list[torch.Tensor]) -> float:
    """The step's loss: the last stage's, plus the other stages' auxiliary losses."""
    return sum(float(g[-1]) for g in gathered[::-1])


def _outputs(st: _Stash, grad_out: torch.Tensor | None) -> tuple[list, list]:
    """(outputs, their gradients) of a stashed microbatch, aux loss included."""
    outs, gouts = [st.out], [grad_out]
    if st.aux is not None:
        outs.append(st.aux)
        gouts.append(None)
    return outs, gouts
