"""Mixture-of-Experts MLP: a drop-in for `SwiGLU` inside a `Block` (x (B, T, D) -> (B, T, D)).

Top-k token routing with a softmax router and renormalised top-k gates (Mixtral; Jiang et al.
2024), SwiGLU experts, dropless dispatch (every token reaches all of its k experts: tokens are
grouped per expert by a stable sort, never dropped for capacity), an optional shared expert that
sees every token (DeepSeekMoE; Dai et al. 2024), and two auxiliary losses: the Switch Transformer
load-balancing loss and the ST-MoE router z-loss.

Shape legend:
    N  tokens in the microbatch (B * T)      D  model width
    E  routed experts                        K  experts per token (top_k)
    Fe hidden width of one expert

The math is in pure functions (`route`, `load_balancing_loss`, `router_z_loss`, `dispatch`), with
`dispatch_reference` the slow, obvious loop over tokens it is tested against. `MoE` only owns the
weights, the auxiliary loss of its latest forward (taken by the model with `take_aux_loss`) and
running router statistics (read with `router_stats`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from stalepipe.config import ModelConfig
from stalepipe.training.models.layers import SwiGLU

# --------------------------------------------------------------------------------------------
# Pure functions
# --------------------------------------------------------------------------------------------


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits (N, E) -> (probs (N, E), gates (N, K), experts (N, K)), all gates in fp32.

    probs = softmax(logits); the K largest are chosen and renormalised to sum to 1 per token
    (Mixtral eq. 1: softmax over the top-k logits). Ties go to the lower expert index (a stable
    sort), so routing is deterministic on every device.
    """
    probs = F.softmax(logits.float(), dim=-1)
    top, experts = torch.sort(probs, dim=-1, descending=True, stable=True)
    top, experts = top[:, :top_k], experts[:, :top_k]
    return probs, top / top.sum(dim=-1, keepdim=True), experts


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert (E,), int64: how many of the N * K (token, slot) pairs chose e."""
    return torch.bincount(experts.flatten(), minlength=num_experts)


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Switch Transformer balance loss (Fedus et al. 2021, eq. 4): E * sum_e f_e * P_e.

    f_e: share of the N * K assignments routed to expert e (no gradient); P_e: mean router
    probability of e. Equals 1 when routing is perfectly uniform, E when one expert takes all.
    (HF Mixtral's `load_balancing_loss_func` is K times this: it normalises f by N, not N * K.)
    """
    E = probs.shape[-1]
    f = expert_counts(experts, E).float() / experts.numel()
    return E * torch.sum(f * probs.mean(dim=0))


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss (Zoph et al. 2022, eq. 5): mean over tokens of logsumexp(logits)^2."""
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


def dispatch(
    x: torch.Tensor, gates: torch.Tensor, experts: torch.Tensor, expert_fns: nn.ModuleList
) -> torch.Tensor:
    """sum_k gates[n, k] * expert_fns[experts[n, k]](x[n]) for every token n, fast: (N, D).

    The N * K assignments are sorted by expert (stable, so tokens keep their order inside an
    expert's group); each expert runs once on its contiguous group; outputs are put back in
    (token, slot) order and summed over the K slots in slot order. Only gathers through
    permutations and fixed-order sums: no atomics, so it is deterministic on CPU and GPU.
    """
    N, K = experts.shape
    flat = experts.flatten()  # (N*K,) expert of each (token, slot), token-major
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert
    counts = expert_counts(flat, len(expert_fns)).tolist()
    xs = x.repeat_interleave(K, dim=0)[order]  # (N*K, D) expert inputs, grouped
    ys = torch.cat([fn(chunk) for fn, chunk in zip(expert_fns, xs.split(counts), strict=True)])
    y = ys[torch.argsort(order)].view(N, K, -1)  # back to (token, slot) order
    return (y * gates.to(y.dtype).unsqueeze(-1)).sum(dim=1)


def dispatch_reference(
    x: torch.Tensor, gates: torch.Tensor, experts: torch.Tensor, expert_fns: nn.ModuleList
) -> torch.Tensor:
    """The slow, obvious `dispatch`: loop over tokens and their K experts. For tests only."""
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for k in range(experts.shape[1]):
            expert = expert_fns[int(experts[n, k])]
            out[n] += gates[n, k].to(x.dtype) * expert(x[n : n + 1])[0]
    return out


# --------------------------------------------------------------------------------------------
# The layer
# --------------------------------------------------------------------------------------------


class MoE(nn.Module):
    """Routed SwiGLU experts (+ an optional shared expert): a drop-in for the dense MLP.

    Parameters: `router.weight` (E, D), `experts.{e}.w1/w2/w3.weight` as in `SwiGLU` (the names
    Mixtral checkpoints use), `shared.w1/w2/w3.weight` when num_shared_experts > 0 (the shared
    experts fused into one SwiGLU of width num_shared_experts * Fe).

    Each forward in training mode stores `aux_loss`: aux_loss_weight * balance + z_loss_weight *
    z, divided by the number of MoE layers so the model's total is the weighted *mean* over
    layers (None in eval mode). The model adds it to the training loss via `take_aux_loss`; the
    layer never sees targets or the optimizer.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.num_experts >= 1, "MoE needs model.num_experts >= 1"
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        num_moe_layers = cfg.num_layers - cfg.num_dense_layers
        self.aux_loss_weight = cfg.aux_loss_weight / num_moe_layers
        self.z_loss_weight = cfg.z_loss_weight / num_moe_layers
        self.router = nn.Linear(cfg.dim, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(
            SwiGLU(cfg.dim, cfg.expert_hidden_dim) for _ in range(cfg.num_experts)
        )
        self.shared = (
            SwiGLU(cfg.dim, cfg.num_shared_experts * cfg.expert_hidden_dim)
            if cfg.num_shared_experts
            else None
        )
        self.aux_loss: torch.Tensor | None = None  # weighted aux loss of the latest forward
        self.stats = RouterStats(cfg.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        h = x.reshape(B * T, D)
        logits = self.router(h)  # (N, E)
        probs, gates, experts = route(logits, self.top_k)
        y = dispatch(h, gates, experts, self.experts)
        if self.shared is not None:
            y = y + self.shared(h)
        balance, z = load_balancing_loss(probs, experts), router_z_loss(logits)
        aux = self.aux_loss_weight * balance + self.z_loss_weight * z
        self.aux_loss = aux if self.training else None  # eval: validation loss is CE only
        self.stats.record(experts, balance, z, aux)
        return y.view(B, T, D)


class RouterStats:
    """Running router statistics of one MoE layer since the last `read` (plain tensors, not
    buffers: they are metrics, not model state, and stay out of checkpoints)."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.reset()

    def reset(self) -> None:
        # On the CPU even when the model is built on the meta device (`record` moves it).
        self.counts = torch.zeros(self.num_experts, dtype=torch.long, device="cpu")
        self.balance = self.z = self.aux = 0.0
        self.num_forwards = 0

    @torch.no_grad()
    def record(
        self, experts: torch.Tensor, balance: torch.Tensor, z: torch.Tensor, aux: torch.Tensor
    ) -> None:
        # Tensors stay on their device until `read`, so recording never syncs a GPU.
        self.counts = self.counts.to(experts.device) + expert_counts(experts, self.num_experts)
        self.balance = self.balance + balance.detach()
        self.z = self.z + z.detach()
        self.aux = self.aux + aux.detach()
        self.num_forwards += 1


def moe_layers(blocks: Iterable[nn.Module]) -> list[MoE]:
    """The MoE MLPs among `blocks` (transformer blocks with an `mlp`), in order."""
    return [b.mlp for b in blocks if isinstance(getattr(b, "mlp", None), MoE)]


def take_aux_loss(blocks: Iterable[nn.Module]) -> torch.Tensor | None:
    """Sum the weighted auxiliary losses the MoE layers among `blocks` stored in their latest
    forward, and clear them (so a loss is never added twice, and no graph is kept alive).
    None when there is no MoE layer or none has run since the last take."""
    total = None
    for moe in moe_layers(blocks):
        if moe.aux_loss is not None:
            total = moe.aux_loss if total is None else total + moe.aux_loss
            moe.aux_loss = None
    return total


def router_stats(
    indexed_blocks: Iterable[tuple[int, nn.Module]], *, per_expert: bool = True, reset: bool = True
) -> dict[str, float]:
    """Router statistics of the MoE layers among `(block index, block)` pairs, averaged over the
    forwards since the last reset, as flat metric names:

    moe/aux_loss      weighted auxiliary loss per forward (the part of the train loss it adds)
    moe/balance_loss  mean balance loss over layers (1 = perfectly balanced, E = collapsed)
    moe/z_loss        mean router z-loss over layers
    moe/load_max      largest expert load / uniform load, over layers (1 = balanced)
    moe/load_min      smallest expert load / uniform load, over layers
    moe/dropped       share of assignments dropped: always 0 (dropless dispatch)
    moe/load/L{layer}/E{e}  share of layer's assignments routed to expert e (per_expert=True)

    Empty for a dense model or before the first forward.
    """
    layers, raw = raw_router_stats(indexed_blocks, reset=reset)
    return summarize_router_stats(layers, raw, per_expert=per_expert)


def raw_router_stats(
    indexed_blocks: Iterable[tuple[int, nn.Module]], *, reset: bool = True
) -> tuple[list[tuple[int, int]], torch.Tensor]:
    """The running sums behind `router_stats`, flat, so that pipeline stages can send them to
    one rank: the (block index, number of experts) of each MoE layer among the blocks, and one
    float64 CPU vector holding, per layer, [forwards, aux, balance, z, count of each expert]
    (`raw_stats_width` numbers). Concatenate several stages' layers and vectors, in order, and
    `summarize_router_stats` gives the whole model's metrics."""
    layers = _moe_blocks(indexed_blocks)
    parts = []
    for _, moe in layers:
        s = moe.stats
        sums = [s.num_forwards, float(s.aux), float(s.balance), float(s.z)]
        parts += [torch.tensor(sums, dtype=torch.float64), s.counts.double().cpu()]
        if reset:
            s.reset()
    raw = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)
    return [(i, moe.num_experts) for i, moe in layers], raw


def router_layers(indexed_blocks: Iterable[tuple[int, nn.Module]]) -> list[tuple[int, int]]:
    """The (block index, number of experts) of the MoE layers among the blocks: the layout of
    `raw_router_stats`' vector (any device, meta included)."""
    return [(i, moe.num_experts) for i, moe in _moe_blocks(indexed_blocks)]


def _moe_blocks(indexed_blocks: Iterable[tuple[int, nn.Module]]) -> list[tuple[int, MoE]]:
    return [(i, b.mlp) for i, b in indexed_blocks if isinstance(getattr(b, "mlp", None), MoE)]


def raw_stats_width(layers: Iterable[tuple[int, int]]) -> int:
    """Length of `raw_router_stats`' vector for these (block index, number of experts)."""
    return sum(4 + num_experts for _, num_experts in layers)


def summarize_router_stats(
    layers: list[tuple[int, int]], raw: torch.Tensor, *, per_expert: bool = True
) -> dict[str, float]:
    """The metrics of `router_stats` from `raw_router_stats`' output (layers without a forward
    since the last reset are left out; {} when none has one)."""
    raw = raw.double().cpu()
    out: dict[str, float] = {"moe/aux_loss": 0.0}
    balance, z, load_max, load_min = [], [], [], []
    off = 0
    for i, num_experts in layers:
        n, aux, bal, zl = raw[off : off + 4].tolist()
        counts = raw[off + 4 : off + 4 + num_experts]
        off += 4 + num_experts
        if n <= 0:
            continue
        out["moe/aux_loss"] += aux / n
        balance.append(bal / n)
        z.append(zl / n)
        share = counts / max(float(counts.sum()), 1.0)
        load_max.append(float(share.max()) * num_experts)
        load_min.append(float(share.min()) * num_experts)
        if per_expert:
            for e, v in enumerate(share.tolist()):
                out[f"moe/load/L{i}/E{e}"] = v
    assert off == raw.numel(), (off, raw.numel())
    if not balance:
        return {}
    out["moe/balance_loss"] = sum(balance) / len(balance)
    out["moe/z_loss"] = sum(z) / len(z)
    out["moe/load_max"] = max(load_max)
    out["moe/load_min"] = min(load_min)
    out["moe/dropped"] = 0.0
    return out
