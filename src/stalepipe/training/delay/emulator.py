"""`DelayEmulator`: the single-process delay engine the training loop drives.

    engine = DelayEmulator(model, optimizer, delay_cfg, num_stages=P, total_steps=T)
    loss = engine.forward_backward(step, microbatches)   # grads of step `step` at the stale point
    engine.clip_grad_norm_(max_norm)                      # optional, on the stale gradient
    metrics = engine.step(step)                           # update the newest weights; {"tau": ...}

Two modes compute the same gradient:
- fast: one whole-model forward/backward per microbatch with each stage's stale weights swapped
  in (for sweeps);
- exact: per stage, per microbatch, activations detached at stage boundaries, RNG seeded per
  (stage, step, microbatch), tied weights used as separate per-stage copies whose gradients are
  summed (first stage's, then last stage's): the order the real pipeline runtime reproduces, so
  its weights match this mode bit for bit.

Shared parameters (a tied embedding: owned by stage 0, read by the last stage's head) follow
`delay.tied`'s one rule: the reading stage gets the version *it* would see, and its gradient is
added to the owner's after all microbatches. In fast mode the head is untied for the step only
when that version differs from the owner's (pipedream, wpipe).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from stalepipe.config import ConfigError, DelayConfig
from stalepipe.training.delay import tied
from stalepipe.training.delay.delayed_optimizer import DelayedOptimizer
from stalepipe.training.delay.policies import DelaySchedule
from stalepipe.training.delay.rng import seeded
from stalepipe.training.models import Transformer, partition

Microbatches = Sequence[tuple[torch.Tensor, torch.Tensor]]


WHOLE_MODEL = -1  # the `stage` of the fast mode's seeds: all stages in one forward


def microbatch_seed(seed: int, stage: int, step: int, microbatch: int, replica: int = 0) -> int:
    """The RNG seed (dropout masks) of (stage, step, microbatch) on data-parallel `replica`: a
    pure function shared with the runtime, so randomness matches across engines whatever the
    schedule's order, and a resumed run needs no RNG state. Replicas draw different masks for
    their different rows."""
    mixed = (((seed * 1_000_003 + step) * 1_009 + stage) * 65_537 + microbatch) * 257 + replica
    return mixed % (2**63 - 1)


class DelayEmulator:
    """Trains `model` with `optimizer` exactly as a `num_stages`-stage asynchronous pipeline
    under `delay_cfg` would, in one process (docs/design.md, 'The delay contract').

    Args:
        model: a `Transformer` (split with `models.partition`), or any module whose
            `model(x, y)` returns the loss, together with `stages`.
        optimizer: any `torch.optim.Optimizer` over the model's parameters.
        delay_cfg: policy, mitigations and mode (resolve WSD-aligned cooldowns first with
            `resolve_delay_config`).
        num_stages, total_steps: P and T (or `delay`, the run's `DelaySchedule`, built once
            by the caller and shared with the rest of the run).
        stages: for non-Transformer models, the pipeline stages as modules sharing the model's
            parameters; stage s>0 takes stage s-1's output, the last `stage(h, y)` returns the
            loss. A parameter listed by several stages is owned by the first.
        seq_len: the sequence length the Transformer split balances for; pass what the
            pipeline runtime uses so both engines assign layers to stages identically.
        seed: base seed of the per-(stage, step, microbatch) RNG (`microbatch_seed`; the
            fast mode seeds per (step, microbatch), its stage being `WHOLE_MODEL`).
        replica: this process's data-parallel replica (its rows get their own masks).
        split: how a stalepipe Transformer is split into stages (`pipeline.partition`).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        delay_cfg: DelayConfig,
        num_stages: int | None = None,
        total_steps: int | None = None,
        *,
        delay: DelaySchedule | None = None,
        stages: Sequence[nn.Module] | None = None,
        seq_len: int | None = None,
        seed: int = 0,
        replica: int = 0,
        split: str = "balanced",
    ) -> None:
        if delay is None:
            if num_stages is None:
                raise ConfigError("DelayEmulator needs num_stages (or a DelaySchedule)")
            delay = DelaySchedule.build(delay_cfg, num_stages, total_steps)
        num_stages = delay.num_stages
        if stages is None:
            stages = _split_transformer(model, num_stages, delay_cfg.policy, seq_len, split)
        if len(stages) != num_stages:
            raise ConfigError(f"got {len(stages)} stage modules for num_stages={num_stages}")
        self.model = model
        self.cfg = delay_cfg
        self.num_stages = num_stages
        self.stages = list(stages)
        self.seed, self.replica = seed, replica
        owned, self._shared = tied.find_shared(self.stages)
        covered = {id(p) for ps in owned for p in ps.values()}
        for name, p in model.named_parameters():
            if id(p) not in covered:
                raise ConfigError(f"model parameter {name} belongs to no stage")
        self.delayed = DelayedOptimizer(
            optimizer, owned, delay_cfg, delay=delay, shared_with=tied.readers(self._shared)
        )
        self._params = list(model.parameters())  # clip in the model's order, like a bare loop

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The base optimizer (set learning rates on its `param_groups`)."""
        return self.delayed.optimizer

    @property
    def step_count(self) -> int:
        return self.delayed.step_count

    # ---------------------------------------------------------------------------------------

    def forward_backward(self, step: int, microbatches: Microbatches) -> float:
        """Gradients of step `step` at its stale point, summed over the microbatches in order
        (each loss divided by their count). Returns the mean loss at the stale point, which is
        what a real asynchronous pipeline observes."""
        if step != self.delayed.step_count:
            raise ValueError(
                f"the engine is at step {self.delayed.step_count}, got forward_backward({step})"
            )
        if not microbatches:
            raise ValueError("forward_backward needs at least one microbatch")
        self.delayed.zero_grad(set_to_none=True)
        versions = self.delayed.versions(step)
        untie = [
            u
            for u in self._shared
            if self.cfg.mode == "exact" or versions[u.stage] != versions[u.owner]
        ]
        read = functools.partial(self.delayed.read_shared, step=step)
        with tied.untied(untie, read) as copies, self.delayed.stale_weights(step):
            if self.cfg.mode == "exact":
                loss = self._exact(step, microbatches)
            else:
                loss = self._fast(step, microbatches)
        for use, copy in zip(untie, copies, strict=True):  # first stage's, then the reader's
            use.param.grad = tied.add_head_grad(use.param.grad, copy.grad)
        return loss

    def _fast(self, step: int, microbatches: Microbatches) -> float:
        # The loss stays on the device until the step's end: one host sync per step, not one
        # per microbatch (the same fp32 sum in the same order, so the same number).
        total = torch.zeros((), device=microbatches[0][0].device)
        for j, (x, y) in enumerate(microbatches):
            seed = microbatch_seed(self.seed, WHOLE_MODEL, step, j, self.replica)
            with seeded(seed, x.device):
                loss = self.model(x, y) / len(microbatches)
                loss.backward()
            total = total + loss.detach().float()
        return total.item()

    def _exact(self, step: int, microbatches: Microbatches) -> float:
        """GPipe order per microbatch: forward stage 0..P-1, backward P-1..0; each stage's
        parameters accumulate their gradients in microbatch order, as in every schedule.
        A stage's MoE auxiliary loss (`forward_with_aux`) is backpropagated with that stage."""
        m = len(microbatches)
        last = self.num_stages - 1
        total = torch.zeros((), device=microbatches[0][0].device)  # one host sync per step
        for j, (x, y) in enumerate(microbatches):
            inputs: list[torch.Tensor] = []
            outputs: list[torch.Tensor] = []
            auxes: list[torch.Tensor | None] = []
            h = x
            for s, stage in enumerate(self.stages):
                inp = h if s == 0 else h.detach().requires_grad_(h.is_floating_point())
                targets = y if s == last else None
                with seeded(microbatch_seed(self.seed, s, step, j, self.replica), x.device):
                    if hasattr(stage, "forward_with_aux"):
                        out, aux = stage.forward_with_aux(inp, targets)
                    else:
                        out, aux = (stage(inp, y) if s == last else stage(inp)), None
                if s == last:
                    out = (out if aux is None else out + aux) / m
                    aux = None
                inputs.append(inp)
                outputs.append(out)
                auxes.append(None if aux is None else aux / m)
                h = out
            outputs[last].backward()
            for s in range(last - 1, -1, -1):
                grad = inputs[s + 1].grad
                tensors = [outputs[s]] if grad is not None else []
                grads = [grad] if grad is not None else []
                if auxes[s] is not None:
                    tensors.append(auxes[s])
                    grads.append(None)
                if tensors:
                    torch.autograd.backward(tensors, grads)
            loss = outputs[last].detach()
            for aux in auxes:  # the training loss includes every stage's aux, as the bare loop's
                if aux is not None:
                    loss = loss + aux.detach()
            total = total + loss.float()
        return total.item()

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the stale gradient's global norm (as the bare loop would); returns the norm."""
        return torch.nn.utils.clip_grad_norm_(self._params, max_norm).item()

    def step(self, step: int) -> dict[str, Any]:
        """Update the newest weights with step `step`'s stale gradient (Taylor, optimizer, EF,
        versions), zero the gradients, and return {"tau": [staleness per stage]}."""
        if step != self.delayed.step_count:
            raise ValueError(f"the engine is at step {self.delayed.step_count}, got step({step})")
        metrics = self.delayed.step()
        self.delayed.zero_grad(set_to_none=True)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """Optimizer state, kept weight versions, EF buffer, Taylor EMA and step counter; the
        live weights are `model.state_dict()`."""
        return {"mode": self.cfg.mode, "delayed": self.delayed.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.delayed.load_state_dict(state["delayed"])


# -------------------------------------------------------------------------------------------


def _split_transformer(
    model: nn.Module, num_stages: int, policy: str, seq_len: int | None, split: str
) -> list[nn.Module]:
    if not isinstance(model, Transformer):
        raise ConfigError(
            f"DelayEmulator splits only stalepipe Transformers by itself; for a "
            f"{type(model).__name__} pass stages=[...] (one module per pipeline stage)"
        )
    num_layers = model.cfg.num_layers
    if not 1 <= num_stages <= num_layers:
        raise ConfigError(
            f"delay.policy {policy} with pipeline.num_stages={num_stages} needs 1 <= num_stages "
            f"<= model.num_layers={num_layers} (each stage holds at least one block); lower "
            f"--pipeline.num_stages"
        )
    return partition(model, num_stages, seq_len, split)
