"""`delay.tied`, the one rule for a tied embedding: which end a process holds, what the head
reads (weight prediction with the head's tau), which versions it receives and keeps, and the
gradient sum (first stage's, then last stage's)."""

from __future__ import annotations

import pytest
import torch

from stalepipe.training.delay import DelaySchedule, tied
from stalepipe.training.delay.correctors import predict_weights
from stalepipe.training.models import build_model, partition

from .conftest import tiny_model_cfg


@pytest.mark.parametrize(
    ("is_tied", "P", "stages", "role"),
    [
        (True, 4, [0], "owner"),
        (True, 4, [3], "head"),
        (True, 4, [1, 2], None),
        (True, 4, [0, 3], "both"),
        (True, 1, [0], None),
        (False, 4, [0], None),
    ],
)
def test_tied_role(is_tied, P, stages, role):
    assert tied.tied_role(is_tied, P, stages) == role


def test_find_shared_names_the_head_as_a_reader_of_stage_0():
    model = build_model(tiny_model_cfg(tie=True), seed=0)
    owned, shared = tied.find_shared(partition(model, 3))
    assert tied.TIED_OWNER in owned[0] and tied.TIED_HEAD not in owned[2]
    (use,) = shared
    assert (use.owner, use.stage, use.attr) == (0, 2, "weight")
    assert list(owned[0])[use.owner_index] == tied.TIED_OWNER
    assert tied.readers(shared) == {0: {2}}
    assert tied.find_shared(partition(build_model(tiny_model_cfg(tie=False), 0), 3))[1] == []


def test_read_version_predicts_like_the_owner_does():
    versions = {v: torch.randn(5, 3, generator=torch.Generator().manual_seed(v)) for v in range(4)}
    assert tied.read_version(versions.__getitem__, 2, 0.0) is versions[2]
    (want,) = predict_weights([versions[2]], [versions[1]], 1.5)
    assert torch.equal(tied.read_version(versions.__getitem__, 2, 1.5), want)


def test_gradients_sum_first_stage_then_last():
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([0.5, -4.0])
    grads = {tied.TIED_OWNER: a, tied.TIED_HEAD: b, "x": torch.ones(1)}
    tied.combine_grads(grads)
    assert set(grads) == {tied.TIED_OWNER, "x"}
    assert torch.equal(grads[tied.TIED_OWNER], a + b)
    assert tied.add_head_grad(None, b) is b and tied.add_head_grad(a, None) is a
    grads = {tied.TIED_OWNER: a}
    tied.combine_grads(grads, b)  # the head's gradient from another process
    assert torch.equal(grads[tied.TIED_OWNER], a + b)


@pytest.mark.parametrize("policy", ["2bw", "pipedream", "sync"])
@pytest.mark.parametrize("predict", [False, True])
def test_head_reads_and_floor_cover_every_read(policy, predict):
    P, N = 3, 7
    sched = DelaySchedule.build(policy, P, N)
    last = P - 1

    def scale(stage: int, k: int) -> float:
        tau = sched.tau(stage, k)
        return 0.5 * tau if predict and tau and k - tau > 0 else 0.0

    for start in (0, 3):
        reads = tied.head_reads(sched, start, scale, evaluates=lambda k: k == 4)
        want = {sched.version(last, k) for k in range(start, N)} | {N, 5}
        want |= {sched.version(last, k) - 1 for k in range(start, N) if scale(last, k)}
        assert reads == want
    for k in range(N + 1):  # nothing read at step k or later lies below the floor
        floor = tied.head_floor(sched, k, N, scale)
        later = {sched.version(last, j) for j in range(k, N)}
        later |= {sched.version(last, j) - 1 for j in range(k, N) if scale(last, j)}
        assert all(v >= floor for v in later), (k, floor, later)


def test_aliases():
    assert tied.aliases(True) == {tied.TIED_HEAD: tied.TIED_OWNER}
    assert tied.aliases(False) == {}
