"""`WrappedOptimizer`: a `torch.optim.Optimizer` that is a view of another optimizer.

Tools written against `torch.optim.Optimizer` read and write an optimizer's `param_groups`
(LR schedulers set `lr` and `initial_lr` there, `GradScaler` unscales the gradients of their
parameters, trainers read their LRs), its `state` and `defaults`, and call `step`,
`zero_grad`, `state_dict` and `load_state_dict`. A wrapper that changes what `step` does
(`DelayedOptimizer`) must hand them the wrapped optimizer's own objects, not copies: a
scheduler that set the wrapper's LR would otherwise change nothing. These are properties over
`self.optimizer`, so they follow even when the base replaces its lists (its own
`load_state_dict` does).

`torch.optim.Optimizer.__init__` is not called (it would build groups of its own); what else
it sets up (the hook tables of `register_step_pre_hook` and friends, the profiled `step`) is
set up here.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from stalepipe.config import ConfigError


class WrappedOptimizer(torch.optim.Optimizer):
    """A `torch.optim.Optimizer` whose `param_groups`, `state` and `defaults` are those of
    `optimizer` (the same objects). Subclasses define `step`, `zero_grad`, `state_dict` and
    `load_state_dict`; `add_param_group` is refused (a subclass that fixed its parameters at
    construction would not see the new ones).

    Not for: changing an optimizer's groups independently of the base (there is one set)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"{type(self).__name__} wraps a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}; build the base optimizer first, e.g. "
                f"torch.optim.AdamW(model.parameters())"
            )
        self.optimizer = optimizer
        self._init_hooks()

    def _init_hooks(self) -> None:
        """What `torch.optim.Optimizer.__init__` sets besides the groups and the state."""
        torch._C._log_api_usage_once("python.optimizer")
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()

    def __getstate__(self) -> dict[str, Any]:
        # all of it (torch's keeps only groups, state and defaults), but a `step` an LR
        # scheduler patched onto the instance (it refers to the scheduler)
        return {k: v for k, v in self.__dict__.items() if k != "step"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_hooks()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The base optimizer's param groups (one list: a scheduler's LR lands there)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self) -> Any:
        """The base optimizer's per-parameter state (momenta, second moments, ...)."""
        return self.optimizer.state

    @state.setter
    def state(self, state: Any) -> None:
        self.optimizer.state = state

    @property
    def defaults(self) -> dict[str, Any]:
        """The base optimizer's default hyperparameters."""
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.optimizer.defaults = defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused: the wrapper fixed its parameters when it was built."""
        raise ConfigError(
            f"{type(self).__name__} cannot take a new param group: add it to the base "
            f"optimizer (and its parameters to a stage) before wrapping"
        )
