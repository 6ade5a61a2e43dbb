"""Split any `nn.Module` into pipeline stages for `DelayedOptimizer`.

    split = split_stages(model, 4)                          # the model's block list, balanced
    split = split_stages(model, 2, blocks="model.layers", cost="blocks")
    split = split_stages(model, names=[["model.embed_tokens", "model.layers.0"], [""]])
    opt = DelayedOptimizer(torch.optim.AdamW(model.parameters()), split, cfg, steps)

By a count of blocks: the blocks are the children of one `nn.ModuleList` / `nn.Sequential`
(`blocks`, by default the one holding the most parameters: a transformer's layers); each stage
gets a contiguous run of them, balanced by `cost` (`models.partition.balance_blocks`, the DP
that splits our Transformer); what comes before the blocks (embeddings) joins the first stage,
what comes after (final norm, output head) the last. By names: each stage lists module names;
a module belongs to the stage listing the longest prefix of its name ("" matches everything).

Parameters are assigned as the emulator assigns them (`delay.tied.find_shared`): the first
stage holding a parameter owns it, and a later stage that reads it (a tied output head) is a
`SharedUse`: `DelayedOptimizer` then keeps the versions that stage reads and gives it its own
leaf at its own version while the two differ (pipedream, wpipe), as `DelayEmulator` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from stalepipe.config import ConfigError
from stalepipe.config.shapes import balance_blocks
from stalepipe.training.delay import tied


@dataclass(frozen=True)
class StageSplit:
    """A model split into pipeline stages: pass it to `DelayedOptimizer` as its `stages`.

    params: per stage, the parameters it owns by their names in the model, in model order.
    modules: per stage, the names of the modules whose parameters it holds.
    shared: where a later stage reads a parameter an earlier one owns (`tied.SharedUse`).
    blocks: per stage, the indices of its blocks (a split by count; None by names)."""

    params: list[dict[str, nn.Parameter]]
    modules: list[list[str]]
    shared: list[tied.SharedUse]
    blocks: list[range] | None = None

    @property
    def num_stages(self) -> int:
        return len(self.params)

    @property
    def shared_with(self) -> dict[int, set[int]]:
        """Owning stage -> the stages that read its weights (`DelayedOptimizer`'s)."""
        return tied.readers(self.shared)

    def stage_of(self, name: str) -> int:
        """The stage that owns parameter `name`."""
        for s, params in enumerate(self.params):
            if name in params:
                return s
        raise KeyError(f"no stage owns a parameter named {name!r}")


def split_stages(
    model: nn.Module,
    num_stages: int | None = None,
    *,
    blocks: str | None = None,
    cost: str | Sequence[float] = "params",
    extra: tuple[float, float] | None = None,
    counts: Sequence[int] | None = None,
    names: Sequence[Sequence[str]] | None = None,
) -> StageSplit:
    """Split `model` into pipeline stages (module docstring).

    Args:
        num_stages: the number of stages (with `names`: len(names), or omit it).
        blocks: the dotted name of the block list (default: the `nn.ModuleList` or
            `nn.Sequential` holding the most parameters).
        cost: how blocks are balanced: "params" (each block's parameter count; the first and
            last stage also count what they hold outside the blocks), "blocks" (each block
            costs 1), or one cost per block (a FLOP count, a measured time).
        extra: the (first stage, last stage) costs of what lies outside the blocks; default:
            their parameter counts with "params", else (0, 0).
        counts: the blocks of each stage instead of a balance, e.g. [3, 2, 2, 1].
        names: the module names of each stage instead of blocks (module docstring).

    Not for: a model whose stages are not contiguous in its forward (each stage's activations
    must feed the next one for the delay to be a pipeline's)."""
    if names is not None:
        if num_stages is not None and num_stages != len(names):
            raise ConfigError(f"num_stages={num_stages} but names lists {len(names)} stages")
        stage_of = _by_names(model, names)
        num_stages, block_ranges = len(names), None
    else:
        if num_stages is None:
            raise ConfigError("split_stages needs num_stages (or names=[[...], ...])")
        block_ranges, stage_of = _by_blocks(model, num_stages, blocks, cost, extra, counts)
    per_stage: list[list[tuple[str, nn.Module]]] = [[] for _ in range(num_stages)]
    for name, module in _holders(model):
        per_stage[stage_of(name)].append((name, module))
    owned, shared = tied.find_shared_in(per_stage)
    for s, params in enumerate(owned):
        if not params:
            raise ConfigError(f"stage {s} holds no parameters; use fewer stages")
    modules = [[n for n, _ in pairs] for pairs in per_stage]
    return StageSplit(owned, modules, shared, block_ranges)


def _holders(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module holding parameters directly, in model order."""
    return [
        (n, m)
        for n, m in model.named_modules()
        if any(p is not None for p in m._parameters.values())
    ]


def _within(name: str, prefix: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def _by_names(model: nn.Module, names: Sequence[Sequence[str]]):
    """Module name -> stage: the stage listing the longest prefix of the name."""
    listed: dict[str, int] = {}
    modules = dict(model.named_modules())
    for s, stage in enumerate(names):
        for prefix in stage:
            if prefix in listed:
                raise ConfigError(f"module {prefix!r} is listed in stages {listed[prefix]} and {s}")
            if prefix and prefix not in modules:
                raise ConfigError(
                    f"{type(model).__name__} has no module {prefix!r}; print(model) lists them"
                )
            listed[prefix] = s

    def stage_of(name: str) -> int:
        hits = [p for p in listed if _within(name, p)]
        if not hits:
            raise ConfigError(
                f"the parameters of module {name!r} are in no stage; list it (or a module above "
                f"it) in names"
            )
        return listed[max(hits, key=len)]

    return stage_of


def _block_list(model: nn.Module, blocks: str | None) -> tuple[str, list[str]]:
    """The block list's name and its blocks' names."""
    if blocks is None:
        lists = [
            (sum(p.numel() for p in m.parameters()), n)
            for n, m in model.named_modules()
            if isinstance(m, nn.ModuleList | nn.Sequential)
        ]
        if not lists:
            raise ConfigError(
                f"found no nn.ModuleList of blocks in {type(model).__name__}; pass "
                f"blocks='name.of.list' or names=[[...], ...]"
            )
        blocks = max(lists, key=lambda c: c[0])[1]  # the first of the largest
    container = model.get_submodule(blocks)
    if not isinstance(container, nn.ModuleList | nn.Sequential):
        raise ConfigError(
            f"blocks={blocks!r} is a {type(container).__name__}, not an nn.ModuleList or "
            f"nn.Sequential; name the list of layers"
        )
    prefix = f"{blocks}." if blocks else ""  # "": the model itself (an nn.Sequential)
    return blocks, [prefix + c for c, _ in container.named_children()]


def _by_blocks(model, num_stages, blocks, cost, extra, counts):
    """(block ranges per stage, module name -> stage) of a split by a count of blocks."""
    container, names = _block_list(model, blocks)
    L = len(names)
    if not 1 <= num_stages <= L:
        raise ConfigError(f"num_stages={num_stages} needs 1 <= num_stages <= {L} blocks")
    block_of = {}  # holder name -> block index; others: before / after the blocks
    seen_block, position = False, {}
    for name, _ in _holders(model):
        i = next((i for i, b in enumerate(names) if _within(name, b)), None)
        if i is not None:
            block_of[name], seen_block = i, True
        elif container and _within(name, container):
            raise ConfigError(f"module {name!r} is in the block list but in no block")
        else:
            position[name] = "after" if seen_block else "before"
    ranges = _ranges(model, names, num_stages, cost, extra, counts, position)
    stage_by_block = {i: s for s, r in enumerate(ranges) for i in r}

    def stage_of(name: str) -> int:
        if name in block_of:
            return stage_by_block[block_of[name]]
        return 0 if position[name] == "before" else num_stages - 1

    return ranges, stage_of


def _ranges(model, names, num_stages, cost, extra, counts, position) -> list[range]:
    L = len(names)
    if counts is not None:
        if len(counts) != num_stages or sum(counts) != L or min(counts) < 1:
            raise ConfigError(
                f"counts={list(counts)} needs {num_stages} counts >= 1 adding up to {L}"
            )
        starts = [sum(counts[:s]) for s in range(num_stages + 1)]
        return [range(starts[s], starts[s + 1]) for s in range(num_stages)]
    if isinstance(cost, str):
        if cost not in ("params", "blocks"):
            raise ConfigError(f"cost={cost!r}: use 'params', 'blocks' or one number per block")
        costs = [_numel(model.get_submodule(n)) if cost == "params" else 1 for n in names]
    else:
        costs = list(cost)
        if len(costs) != L:
            raise ConfigError(f"cost has {len(costs)} numbers for {L} blocks; give one per block")
    if extra is None:
        extra = (0, 0)
        if cost == "params":
            seen = {id(p) for n in names for p in model.get_submodule(n).parameters()}
            extra = _outside(model, position, seen)
    return balance_blocks(costs, num_stages, first_extra=extra[0], last_extra=extra[1])


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _outside(model: nn.Module, position: dict[str, str], seen: set[int]) -> tuple[int, int]:
    """The parameters before and after the blocks (each counted once: a tied one where it
    first appears)."""
    total = {"before": 0, "after": 0}
    for name, module in _holders(model):
        for p in module._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                if name in position:
                    total[position[name]] += p.numel()
    return total["before"], total["after"]
