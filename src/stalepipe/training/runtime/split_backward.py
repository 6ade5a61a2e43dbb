"""The split backward of zero-bubble schedules (BI, then BW) without traversing the graph twice.

BI needs the gradient of the stage's input now (the previous stage waits for it); BW, the
weights' gradient, may come later. Two `autograd.grad` calls over the whole stage (input, then
weights) run the stage's backward twice. Instead (the idea of Qi et al.'s zero-bubble
pipelines, and of torch.distributed.pipelining's `stage_backward_input`):

- BI runs the backward to the input only, and on the way keeps, at every node where a weight's
  branch leaves the input's path (an "intermediate": a node on the path whose other inputs lead
  to weights), the gradient of that node's outputs (`Node.register_prehook`);
- BW starts at each intermediate with its kept gradient and runs only the weight branches.

Every weight gradient is the same computation as in a full backward (the same nodes with the
same incoming gradients), so the result is bit for bit that of one `autograd.grad` over the
weights; tests/pipeline/test_split_backward.py checks it against the two-call reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class WeightBranches:
    """What BI keeps for BW: each intermediate node, the gradients of its outputs, and the
    indices (into BW's weight list) of the weights its branches lead to."""

    nodes: list[Node]
    grads: list[tuple[torch.Tensor | None, ...]]
    weights: list[list[int]]


def backward_input(
    outputs: list[torch.Tensor],
    grad_outputs: list[torch.Tensor | None],
    inp: torch.Tensor,
    weights: list[torch.Tensor],
) -> tuple[torch.Tensor, WeightBranches]:
    """BI: the gradient of `inp` (a leaf), and what `backward_weights` needs. The graph is
    retained for BW."""
    roots = [o.grad_fn for o in outputs if o.grad_fn is not None]
    branches = _weight_branches(roots, get_gradient_edge(inp).node, weights)
    kept: dict[Node, tuple] = {}
    handles = [n.register_prehook(lambda grads, n=n: kept.__setitem__(n, grads)) for n in branches]
    try:
        (grad_inp,) = torch.autograd.grad(
            outputs, [inp], grad_outputs=grad_outputs, retain_graph=True
        )
    finally:
        for h in handles:
            h.remove()
    nodes = [n for n in branches if n in kept]
    return grad_inp, WeightBranches(nodes, [kept[n] for n in nodes], [branches[n] for n in nodes])


def backward_weights(
    state: WeightBranches, weights: list[torch.Tensor]
) -> list[torch.Tensor | None]:
    """BW: the gradient of every weight (None where unused), from the intermediates' kept
    gradients; frees the graph."""
    out: list[torch.Tensor | None] = [None] * len(weights)
    for node, grads, idx in zip(state.nodes, state.grads, state.weights, strict=True):
        edges = [GradientEdge(node, i) for i, g in enumerate(grads) if g is not None]
        given = [g for g in grads if g is not None]
        got = torch.autograd.grad(
            edges, [weights[i] for i in idx], grad_outputs=given, allow_unused=True,
            retain_graph=True,
        )  # fmt: skip
        for i, g in zip(idx, got, strict=True):
            if g is not None:  # a weight under two intermediates: their sum
                out[i] = g if out[i] is None else out[i] + g
    return out


def _weight_branches(
    roots: list[Node], inp_node: Node, weights: list[torch.Tensor]
) -> dict[Node, list[int]]:
    """Every node on a path from `roots` to `inp_node` with a child off that path that leads
    to a weight -> the weights (indices) reachable through such children. Nodes in the order
    of a depth-first walk from the roots."""
    leaf = {get_gradient_edge(w).node: i for i, w in enumerate(weights) if w.requires_grad}
    on_path: dict[Node, bool] = {}
    below: dict[Node, frozenset[int]] = {}  # the weights under each node
    order: list[Node] = []  # children before parents
    seen: set[Node] = set()
    stack: list[tuple[Node, bool]] = [(r, False) for r in reversed(roots)]
    while stack:  # post-order walk of the graph (a DAG: a node's children never reach it)
        n, expanded = stack.pop()
        kids = [c for c, _ in n.next_functions if c is not None]
        if expanded:
            on_path[n] = n is inp_node or any(on_path[c] for c in kids)
            below[n] = frozenset([leaf[n]] if n in leaf else []).union(*(below[c] for c in kids))
            order.append(n)
        elif n not in seen:
            seen.add(n)
            stack.append((n, True))
            stack.extend((c, False) for c in kids if c not in seen)
    branches: dict[Node, list[int]] = {}
    for n in reversed(order):  # roots first
        if on_path[n]:
            off = [below[c] for c, _ in n.next_functions if c is not None and not on_path[c]]
            if off := frozenset().union(*off):
                branches[n] = sorted(off)
    return branches
