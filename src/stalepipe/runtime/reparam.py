"""Call a module with given tensors in place of its parameters (the runtime's hot path)."""

from __future__ import annotations

import torch
from torch import nn


class Reparametrized:
    """Calls a stage with given tensors in place of its parameters, by global name, as the
    emulator calls it (`forward_with_aux` when the stage has one: MoE), returning (output,
    auxiliary loss or None).

    What `torch.func.functional_call` does, minus its per-call generality (name parsing,
    tie detection, buffer handling): the slots are resolved once, and a call sets and restores
    one dict entry per parameter. The runtime calls it for every microbatch. A parameter that
    appears under several names (a tied embedding when one stage holds both ends) is swapped
    everywhere under its first name, as `functional_call`'s `tie_weights` does."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.slots: dict[str, list[tuple[nn.Module, str]]] = {}
        first: dict[int, str] = {}
        seen: set[tuple[int, str]] = set()
        for mod_name, mod in module.named_modules(remove_duplicate=False):
            for attr, p in mod._parameters.items():
                if p is None or (id(mod), attr) in seen:
                    continue
                seen.add((id(mod), attr))
                name = first.setdefault(id(p), f"{mod_name}.{attr}" if mod_name else attr)
                self.slots.setdefault(name, []).append((mod, attr))
        self.fn = getattr(module, "forward_with_aux", None)

    def __call__(self, weights: dict[str, torch.Tensor], x: torch.Tensor, targets=None):
        saved = []
        try:
            for name, t in weights.items():
                for mod, attr in self.slots[name]:
                    saved.append((mod, attr, mod._parameters[attr]))
                    mod._parameters[attr] = t
            if self.fn is not None:
                return self.fn(x, targets)
            m = self.module
            return (m(x, targets) if targets is not None else m(x)), None
        finally:
            for mod, attr, p in reversed(saved):
                mod._parameters[attr] = p
