"""The check that a delayed step's gradient was taken at its stale weights.

`DelayedOptimizer.stale_weights()` swaps each stage's stale version into the parameters; a
forward and backward run outside that block compute the gradient at the live weights instead,
which trains a synchronous model under the delayed optimizer's name. Autograd alone does not
always notice (an `nn.Sequential` MLP whose saved tensors do not include the swapped weights
trains on silently), and where it does, it names an in-place operation, not the fix.

The guard is one post-accumulate-grad hook per trained parameter (`Tensor.
register_post_accumulate_grad_hook`): a gradient that reaches a parameter's `.grad` through
autograd while no `stale_weights()` block of its optimizer is open raises `StaleWeightsError`
from that backward. It only observes (no tensor is changed, so results are bitwise those of
an unguarded run), and costs one Python call per parameter and backward. Gradients assigned
to `.grad` directly (the pipeline runtime's own accumulation) and `torch.autograd.grad` calls
are not `.grad` accumulations, so they pass. The hooks hold the optimizer weakly and are
removed when it is garbage-collected; a parameter wrapped again is guarded by its newest
optimizer only.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Protocol

import torch
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

# parameter -> (a weak reference to) the optimizer guarding it: a model wrapped again (a new
# policy in the same session) is guarded by its newest optimizer only
# (by identity: tensors compare elementwise)
_OWNER: WeakIdKeyDictionary = WeakIdKeyDictionary()


class StaleWeightsError(RuntimeError):
    """A gradient of a delayed optimizer's parameters was computed outside its
    `stale_weights()` block, so it is not the gradient the delay policy prescribes."""


def outside_message(policy: str, step: int) -> str:
    """The one line `StaleWeightsError` says: what happened and the fix."""
    return (
        f"DelayedOptimizer (delay.policy {policy}, step {step}): a backward ran outside `with "
        f"opt.stale_weights():`, so its gradient is not taken at the stale weights; run the "
        f"forward AND the backward inside that block, or pass them as a closure to "
        f"`opt.step(closure)`"
    )


class Guarded(Protocol):
    """What the guard asks its owner (`DelayedOptimizer`)."""

    @property
    def stale_block_open(self) -> bool: ...

    def guard_message(self) -> str: ...


def install(owner: Guarded, params: Iterable[torch.Tensor], active: bool = True) -> int:
    """Hook every parameter of `params` that requires a gradient: while `owner` lives, is
    the newest optimizer installed over it, and its `stale_weights()` block is closed, a
    gradient accumulated into it raises `StaleWeightsError` (`owner.guard_message()`).
    Inactive (a policy without delay): only claim the parameters, so that an older guard
    stands down. Returns the number of parameters hooked."""
    ref = weakref.ref(owner)

    def check(param: torch.Tensor) -> None:
        opt = ref()
        if opt is not None and _OWNER.get(param) is ref and not opt.stale_block_open:
            raise StaleWeightsError(opt.guard_message())

    trained = [p for p in params if p.requires_grad]
    for p in trained:
        _OWNER[p] = ref  # the newest optimizer over a parameter is the one that guards it
    if not active:
        return 0
    handles = [p.register_post_accumulate_grad_hook(check) for p in trained]
    weakref.finalize(owner, _remove, handles)
    return len(trained)


def _remove(handles: list[RemovableHandle]) -> None:
    for h in handles:
        h.remove()
