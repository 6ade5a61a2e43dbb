"""`DelayedOptimizer`: any `torch.optim.Optimizer`, trained as an asynchronous pipeline would.

It owns the weight versions a delay policy needs (per stage), swaps the stale ones in while the
gradient is computed, and applies the base optimizer's update to the newest weights, followed by
the mitigations (docs/design.md, 'The delay contract'). Use it in a plain training loop:

    opt = DelayedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4),
                           [model.parameters()], DelayConfig(policy="2bw", ef=True), steps)
    for step in range(steps):
        with opt.stale_weights():          # forward AND backward inside
            model(x, y).backward()
        opt.step()                         # or opt.step(closure): the closure runs inside
        opt.zero_grad()

LR schedulers, `GradScaler`, `clip_grad_norm_` and trainers take it as they take the base
(`delay.wrapped`); under a delay, a backward outside `stale_weights()` raises (`delay.guard`).

Memory: a stage with staleness tau keeps tau stored copies besides its live weights (tau + 1
versions); EF adds one buffer (U_{k-1}); adaptive Taylor and DC-ASGD-EMA one (EMA of g^2);
weight prediction one stored version per stale stage (W_{v-1}) and the predicted point it
computes with. The PipeMare LR schedule and adaptive momentum store nothing (a pure function of
(step, tau) sets the stage's groups for one `optimizer.step()`), nor does a corrector registered
with a step of its own (`CorrectorSpec.apply`, config/registry.py: stateless, run in its phase).
The `sync` policy without mitigations stores nothing and calls `optimizer.step()` unchanged:
bitwise identical to the bare optimizer.

Weight prediction, per stage s at step k (`read_weights`): v = max(k - tau_s(k), 0); the
forward and backward of stage s run at W_hat = W_v + c tau_s(k) (W_v - W_{v-1}) (W_v itself
when tau_s(k) = 0 or v = 0, as W_{-1} = W_0); W_v - W_{v-1} is the change actually applied
to the stage (EF's correction included); Taylor compensation then corrects from W_hat, the
point the gradient was taken at; the optimizer's update U_k still lands on the live W_k. A
tied matrix read by another stage is predicted with the reading stage's tau (`delay.tied`).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar, cast

import torch
from torch import nn

from stalepipe.config import ConfigError, DelayConfig
from stalepipe.config.registry import CORRECTORS
from stalepipe.training.delay import correctors, guard, mitigations, tied
from stalepipe.training.delay.policies import DelaySchedule
from stalepipe.training.delay.stage_params import (
    StageParams,
    check_saved_state,
    checked_delay_schedule,
    owned_copies,
    owned_tensors,
    stage_parameters,
    unpack_split,
)
from stalepipe.training.delay.stages import StageSplit
from stalepipe.training.delay.wrapped import WrappedOptimizer

L = TypeVar("L")


class DelayedOptimizer(WrappedOptimizer):
    """Wraps `optimizer` so that step k's gradient is computed at the stale, per-stage weights
    `W_{max(k - tau_s(k), 0)}` and the update goes to the newest weights.

    Args:
        optimizer: the base optimizer; its `.grad` is the stale gradient, its state sees the
            stale sequence, `param_groups` are its own (set LRs there as usual).
        stages: the parameters of each pipeline stage, first to last, as iterables or
            name -> parameter mappings (names make checkpoints readable), or a `StageSplit`
            (`delay.stages.split_stages`: its tied reads are untied as the emulator does).
            Every parameter the optimizer updates must belong to exactly one stage.
        cfg: policy and mitigations. `cfg.mode` is ignored here (see `DelayEmulator`).
        total_steps: run length T (sync cooldown and the last needed versions depend on it);
            None when unknown, which forbids a cooldown.
        delay: the run's `DelaySchedule` instead of (cfg's windows, total_steps), when the
            caller built it already (the engines do); cfg then supplies the mitigations.
        shared_with: stage -> other stages that also read its weights (`delay.tied.readers`);
            the owner then keeps the versions those stages read too.

    A `torch.optim.Optimizer` over the base's own groups, state and defaults
    (`delay.wrapped`); `step(closure)` runs the closure inside `stale_weights()` and returns
    its loss. Under a delay, a backward outside `stale_weights()` raises (`delay.guard`).

    Not for: gradients that must be computed at weights other than the current step's stale
    point (only the versions the policy needs are kept).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        stages: Sequence[StageParams] | StageSplit,
        cfg: DelayConfig | None = None,
        total_steps: int | None = None,
        *,
        delay: DelaySchedule | None = None,
        shared_with: Mapping[int, Iterable[int]] | None = None,
    ) -> None:
        cfg = cfg or DelayConfig()
        stages, shared_with, self._shared = unpack_split(stages, shared_with)
        if not stages:
            raise ConfigError("DelayedOptimizer needs at least one stage of parameters")
        delay = checked_delay_schedule(cfg, len(stages), total_steps, delay)
        super().__init__(optimizer)
        self.cfg = cfg
        self.delay = delay
        self.num_stages = len(stages)
        self.total_steps = delay.total_steps
        self._names, self._params = stage_parameters(stages, optimizer)

        self._consumers = [{s} for s in range(self.num_stages)]
        for owner, users in (shared_with or {}).items():
            self._consumers[owner].update(users)
        if cfg.ef and not delay.delayed:
            warnings.warn(
                f"delay.ef is on but delay.policy {cfg.policy!r} has no delay with "
                f"{self.num_stages} stage(s): EF then only perturbs the optimizer's updates",
                stacklevel=2,
            )

        self._predict = cfg.weight_pred and delay.delayed
        # correctors registered with a step of their own that cfg turns on, in their order
        self._registered = [s for _, s in CORRECTORS.items() if s.apply and s.on(cfg)]
        # per-stage LR / momentum: per-stage param groups (None: not needed)
        self._group_stage = correctors.prepare_groups(optimizer, self._params, cfg, delay)
        # the last two predicted points per stage, (version, tau) -> tensors: a cache (the
        # runtime's 2bw reads two versions at a time, graphs in flight hold both anyway)
        self._predicted: list[dict[tuple[int, int], list[torch.Tensor]]]
        self._predicted = [{} for _ in stages]

        self._step = 0
        # history[s][v]: stored copy of stage s's weights W_v (v < current step); the live
        # weights (v = current step) are the parameters themselves.
        self._history: list[dict[int, list[torch.Tensor]]] = [{} for _ in stages]
        self._spare: list[list[torch.Tensor] | None] = [None for _ in stages]
        self._ef_prev: list[list[torch.Tensor]] | None = None  # U_{k-1}; None = U_{-1} = 0
        self._taylor_ms: list[list[torch.Tensor]] | None = None  # EMA of g^2 (adaptive)
        self._swapped: list[tuple[nn.Parameter, torch.Tensor]] | None = None
        guard.install(self, (p for ps in self._params for p in ps), active=delay.delayed)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        guard.install(self, (p for ps in self._params for p in ps), active=self.delay.delayed)

    @property
    def stale_block_open(self) -> bool:  # the guard's question
        return self._swapped is not None

    def guard_message(self) -> str:
        """What `StaleWeightsError` says at this step (`delay.guard`)."""
        return guard.outside_message(self.cfg.policy, self._step)

    # ---------------------------------------------------------------------------------------
    # The delay schedule
    # ---------------------------------------------------------------------------------------

    @property
    def step_count(self) -> int:
        """The step the next gradient belongs to (= number of updates applied so far)."""
        return self._step

    def staleness(self, step: int | None = None) -> list[int]:
        """tau_s(step) for every stage (default: the current step)."""
        return self.delay.taus(self._step if step is None else step)

    def versions(self, step: int | None = None) -> list[int]:
        """The weight version each stage's gradient sees at `step`: max(step - tau_s, 0)."""
        return self.delay.versions(self._step if step is None else step)

    def kept_versions(self) -> list[list[int]]:
        """Per stage, the versions held now: stored copies plus the live weights."""
        return [sorted(h) + [self._step] for h in self._history]

    def stage_param_names(self, stage: int) -> list[str]:
        """The names of `stage`'s parameters, in the order its weights are stored."""
        return list(self._names[stage])

    def versions_to_keep(self, step: int) -> list[set[int]]:
        """Per stage, the stored versions a state at `step` holds: the past versions that
        steps >= `step` read on the stage or on stages sharing its weights (what `step()`
        keeps; checkpoint re-splitting asks for exactly these)."""
        return [
            self.delay.versions_held_at(self._consumers[s], step, self._predict)
            for s in range(self.num_stages)
        ]

    def weights_at(self, stage: int, version: int) -> list[torch.Tensor]:
        """Stage `stage`'s weights W_version (the live tensors for the current step), in the
        stage's parameter order. Read-only by convention: do not modify them in place."""
        if version == self._step:
            if self._swapped is not None:
                live = {id(p): t for p, t in self._swapped}
                return [live.get(id(p), p.data) for p in self._params[stage]]
            return [p.data for p in self._params[stage]]
        if version not in self._history[stage]:
            raise KeyError(
                f"stage {stage} does not keep version {version} at step {self._step} "
                f"(kept: {sorted(self._history[stage])})"
            )
        return self._history[stage][version]

    def read_weights(self, stage: int, step: int) -> list[torch.Tensor]:
        """The weights of `stage` that step `step`'s gradient is computed at: W_v, v =
        max(step - tau, 0), or with weight prediction the predicted point (module docstring; a
        new tensor per parameter, the last two (version, tau) cached). Another stage reading
        a shared matrix reads it through `delay.tied.read_version`. Read-only."""
        tau = self.delay.tau(stage, step)
        v = max(step - tau, 0)
        scale = self.prediction_scale(stage, step)
        if not scale:
            return self.weights_at(stage, v)
        cache = self._predicted[stage]
        if (v, tau) in cache:
            return cache[(v, tau)]
        w = correctors.predict_weights(
            self.weights_at(stage, v), self.weights_at(stage, v - 1), scale
        )
        cache[(v, tau)] = w
        if len(cache) > 2:
            del cache[next(iter(cache))]
        return w

    def prediction_scale(self, reader: int, step: int) -> float:
        """c * tau when stage `reader`'s weights of step `step` are predicted from W_v and
        W_{v-1}; 0.0 when they are W_v itself (no prediction, tau = 0, or v = 0)."""
        tau = self.delay.tau(reader, step)
        if not self._predict or tau == 0 or step - tau <= 0:
            return 0.0
        return self.cfg.weight_pred_scale * tau

    def _check_step(self, step: int | None) -> int:
        if step is not None and step != self._step:
            raise ValueError(
                f"the delayed optimizer is at step {self._step}, got step {step}: steps must run "
                f"in order (resume through load_state_dict)"
            )
        if self._step >= self.total_steps:
            raise ValueError(f"all total_steps={self.total_steps} steps have been run")
        return self._step

    @contextlib.contextmanager
    def stale_weights(self, step: int | None = None) -> Iterator[list[int]]:
        """Within this block every stage's parameters hold the weights step `step` (default:
        the current one) reads; yields the version per stage. Run forward AND backward inside:
        the live weights come back on exit, and a graph built inside cannot be backpropagated
        afterwards (`StaleWeightsError` from the guard; autograd's error for a frozen
        parameter, whose version is bumped). A `StageSplit`'s tied reads at another version
        than the owner's get their own leaf, whose gradient joins the owner's on exit."""
        k = self._check_step(step)
        if self._swapped is not None:
            raise RuntimeError("stale_weights() blocks cannot be nested")
        versions = self.versions(k)
        untie = [u for u in self._shared if versions[u.stage] != versions[u.owner]]
        with tied.untied(untie, functools.partial(self.read_shared, step=k)) as copies:
            swapped: list[tuple[nn.Parameter, torch.Tensor]] = []
            for s, v in enumerate(versions):
                if v == k:
                    continue
                for param, old in zip(self._params[s], self.read_weights(s, k), strict=True):
                    swapped.append((param, param.data))
                    param.data = old
            self._swapped = swapped
            try:
                yield versions
            finally:
                for p, live in swapped:
                    p.data = live
                    if not p.requires_grad:  # trained ones: the guard speaks (delay.guard)
                        torch.autograd.graph.increment_version(p)
                self._swapped = None
        for use, copy in zip(untie, copies, strict=True):  # first stage's, then the reader's
            use.param.grad = tied.add_head_grad(use.param.grad, copy.grad)

    def read_shared(self, use: tied.SharedUse, step: int) -> torch.Tensor:
        """What stage `use.stage` computes step `step` at of a matrix another stage owns: its
        own version, predicted with its own tau (`delay.tied.read_version`)."""
        return tied.read_version(
            lambda v: self.weights_at(use.owner, v)[use.owner_index],
            self.delay.version(use.stage, step),
            self.prediction_scale(use.stage, step),
        )

    # ---------------------------------------------------------------------------------------
    # The update
    # ---------------------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(  # type: ignore[override]
        self, closure: Callable[[], L] | None = None, *, live_in_use: bool = False
    ) -> dict[str, Any] | L:
        """Apply step k's update: with a `closure` (torch's protocol: it zeroes the gradients,
        runs the forward and backward, returns the loss) first run it once inside
        `stale_weights()` and return what it returned; then Taylor compensation of the stale
        gradient (and registered gradient-phase correctors), version bookkeeping (W_k stored
        where a later step reads it), `optimizer.step()` on the newest weights, error feedback
        (and registered update-phase correctors). Returns {"tau": [per stage]}, the staleness
        of this step's gradient (without a closure; `staleness()` tells it too).

        `live_in_use`: autograd graphs still hold the live tensors (the pipeline runtime's
        forwards in flight), so they must not change: the parameters move to new storage and
        the old storage becomes the stored W_k (one copy, where clone-then-store makes two).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad(), self.stale_weights():
                loss = closure()
        k = self._check_step(None)
        taus = self.staleness(k)
        if self.cfg.taylor > 0:
            self._correct_gradients(k, taus)
        self._run_registered("gradient", k, taus)
        stored = self._retire_versions(k, live_in_use)
        w_k = self._weights_before_update(stored) if self.cfg.ef else None
        self._base_step(k, taus)
        if w_k is not None:
            self._apply_error_feedback(w_k)
        self._run_registered("update", k, taus)
        self._step += 1
        return {"tau": taus} if closure is None else cast(L, loss)

    def _run_registered(self, phase: str, k: int, taus: list[int]) -> None:
        """The registered correctors of `phase` that the config turns on (`CorrectorSpec`)."""
        for spec in self._registered:
            if spec.phase == phase and spec.apply is not None:  # all have one (__init__)
                spec.apply(self.cfg, self._params, taus, k)

    def _retire_versions(self, k: int, live_in_use: bool) -> list[list[torch.Tensor] | None]:
        """Store W_k where a later step reads it and recycle what nobody reads; W_k per stage."""
        w_k: list[list[torch.Tensor] | None] = [None] * self.num_stages
        for s in range(self.num_stages):
            needed = self.delay.versions_needed_after(self._consumers[s], k, self._predict)
            hist = self._history[s]
            for v in [v for v in hist if v not in needed]:
                self._spare[s] = hist.pop(v)
            if k in needed or live_in_use:
                buf = self._copy_live(s, live_in_use)
                if k in needed:
                    hist[k] = buf
                    w_k[s] = buf
            if not hist:
                self._spare[s] = None  # no delayed step ahead: free the memory
            cache = self._predicted[s]
            for key in [key for key in cache if key[0] - 1 not in hist]:
                del cache[key]  # no later step reads this prediction
        return w_k

    def _copy_live(self, s: int, live_in_use: bool) -> list[torch.Tensor]:
        """A copy of stage s's live weights (in the spare buffer when there is one)."""
        buf = self._spare[s]
        self._spare[s] = None
        if buf is None:
            buf = [p.detach().clone() for p in self._params[s]]
        else:
            for b, p in zip(buf, self._params[s], strict=True):
                b.copy_(p.detach())
        if live_in_use:  # the copy becomes the live weights; the original is W_k
            held = [p.data for p in self._params[s]]
            for b, p in zip(buf, self._params[s], strict=True):
                p.data = b
            buf = held
        return buf

    def _weights_before_update(
        self, stored: list[list[torch.Tensor] | None]
    ) -> list[list[torch.Tensor]]:
        """W_k of every stage, for error feedback: the stored copy, else a fresh clone."""
        return [
            w if w is not None else [p.detach().clone() for p in self._params[s]]
            for s, w in enumerate(stored)
        ]

    def _base_step(self, k: int, taus: list[int]) -> None:
        """The base optimizer's update on the live weights, with step k's per-stage groups."""
        with self._stage_hyperparameters(k, taus):
            self.optimizer.step()

    def _apply_error_feedback(self, w_k: list[list[torch.Tensor]]) -> None:
        """Error feedback: W+ = W - 2U_k + U_{k-1}, with U_k the update just applied to W_k."""
        if self._ef_prev is None:
            self._ef_prev = [[torch.zeros_like(p) for p in ps] for ps in self._params]
        for s, params in enumerate(self._params):
            for i, p in enumerate(params):
                self._ef_prev[s][i] = mitigations.error_feedback_(p, w_k[s][i], self._ef_prev[s][i])

    def _stage_hyperparameters(self, k: int, taus: list[int]):
        """The PipeMare LR factor and adaptive momentum of step k on every stage's groups."""
        cfg = self.cfg
        if self._group_stage is None:
            return contextlib.nullcontext()
        lr = None
        if cfg.lr_correction_steps > 0:
            lr = [correctors.pipemare_lr_factor(t, k, cfg.lr_correction_steps) for t in taus]
        momenta = taus if cfg.adaptive_momentum else None
        return correctors.stage_hyperparameters(
            self.optimizer, self._group_stage, lr, momenta, self.num_stages
        )

    def _correct_gradients(self, k: int, taus: list[int]) -> None:
        """Taylor / DC-ASGD: each stale gradient moved from the point it was taken at
        (`read_weights`') to W_k; adaptive lambda and / or DC-ASGD-EMA read one EMA of g^2."""
        cfg = self.cfg
        if (cfg.taylor_adaptive or cfg.taylor_curvature == "ema") and self._taylor_ms is None:
            self._taylor_ms = [[torch.zeros_like(p) for p in ps] for ps in self._params]
        # an empty stage is another process's (the runtime): nothing stored here
        stale = [
            self.read_weights(s, k) if params and max(k - t, 0) < k else None
            for s, (params, t) in enumerate(zip(self._params, taus, strict=True))
        ]
        mitigations.taylor_correct_stages_(self._params, stale, self._taylor_ms, self.cfg)

    # ---------------------------------------------------------------------------------------
    # Checkpointing
    # ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything but the live weights (those are the model's): the base optimizer's state,
        the stored weight versions, the EF buffer U_{k-1}, the Taylor EMA and the step."""
        return {
            "step": self._step,
            "policy": self.cfg.policy,
            "num_stages": self.num_stages,
            "names": [list(n) for n in self._names],
            "optimizer": self.optimizer.state_dict(),
            "history": [{v: list(ts) for v, ts in h.items()} for h in self._history],
            "ef_prev": self._ef_prev,
            "taylor_ms": self._taylor_ms,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore `state_dict()`'s output (load the model's weights separately)."""
        state = state_dict
        check_saved_state(state, self._names, self.cfg.policy)
        self.optimizer.load_state_dict(state["optimizer"])
        self._step = int(state["step"])
        self._history = [
            {int(v): owned_tensors(ts, ps) for v, ts in h.items()}
            for h, ps in zip(state["history"], self._params, strict=True)
        ]
        self._spare = [None] * self.num_stages
        self._predicted = [{} for _ in range(self.num_stages)]
        self._ef_prev = owned_copies(state["ef_prev"], self._params)
        self._taylor_ms = owned_copies(state["taylor_ms"], self._params)
