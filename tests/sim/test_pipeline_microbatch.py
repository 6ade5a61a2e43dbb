"""The pipelines' microbatch size is searched (issue 52): it answers the efficiency curve (a flat
MFU keeps the smallest bubble, the calibrated one buys bigger matmuls with bigger microbatches)
and memory (a size over the GPU's memory is never chosen), and synchronous schedules and 2BW
search the same sizes (like with like)."""

from __future__ import annotations

import dataclasses

import pytest

from stalepipe.lab.sim import hybrid
from stalepipe.lab.sim import parallel as par
from stalepipe.lab.sim.cluster import CLUSTERS
from stalepipe.lab.sim.models import model_config

CFG = model_config("smollm-360m")
C = CLUSTERS["h100-ib"]  # 8 GPUs: one node, one placement


def _chosen(w: par.Workload, c=C, name: str = "1f1b") -> par.Option:
    (o,) = [o for o in par.pipelines(w, c, (name,)) if (o.stages, o.across) == (4, "dp")]
    return o


def _each_size(w: par.Workload, name: str = "1f1b") -> dict[int, par.Option]:
    """The same pipeline (P=4 x dp 2) timed at every searched size, as `layout` times it."""
    return {
        b: par.layout(w, C, tp=1, stages=4, schedule=name, microbatch=b)
        for b in hybrid.microbatch_sizes(w.global_batch // 2, 4)
    }


def test_the_searched_sizes_keep_m_at_least_p():
    # up to the sequences per GPU (64 over P = 4: 16), as the data-parallel family's largest
    assert hybrid.microbatch_sizes(64, 4) == [1, 2, 4, 8, 16]
    assert hybrid.microbatch_sizes(16, 4) == [1, 2, 4]  # 8 would leave m = 2 < P
    assert hybrid.microbatch_sizes(12, 4) == [1, 2]  # 4 leaves m = 3 < P; 8 does not divide
    assert hybrid.microbatch_sizes(3, 4) == []


@pytest.mark.parametrize("name", ["1f1b", "2bw"])
def test_a_flat_mfu_keeps_the_smallest_bubble_the_curve_bigger_microbatches(name):
    flat = par.Workload(CFG, 1024, 128, 8, mfu=0.4)
    sizes = _each_size(flat, name)
    o = _chosen(flat, name=name)
    least = min(sizes.values(), key=lambda x: x.bubble)
    assert o.microbatch_size == least.microbatch_size
    # 1F1B's flush costs (P - 1) microbatches a step: the most microbatches, the least bubble;
    # 2BW has no flush, and its bubble (p2p latency) shrinks as microbatches grow
    assert o.microbatch_size == (1 if name == "1f1b" else max(sizes))
    assert o.tokens_per_s == pytest.approx(max(x.tokens_per_s for x in sizes.values()))
    # the calibrated curve: smollm's block on one 1024-token sequence is a small GEMM (MFU 0.14),
    # on 8 of them 0.47; the search buys that with fewer microbatches (1F1B: a larger bubble)
    steep = dataclasses.replace(flat, mfu=None)
    sizes = _each_size(steep, name)
    o = _chosen(steep, name=name)
    assert o.microbatch_size > 1
    assert o.bubble > sizes[1].bubble if name == "1f1b" else True
    assert o.tokens_per_s == pytest.approx(max(x.tokens_per_s for x in sizes.values()))
    assert o.tokens_per_s > 1.5 * sizes[1].tokens_per_s
    assert o.label().endswith(f"m={o.microbatches} (microbatch {o.microbatch_size})")


def test_a_microbatch_over_the_gpu_s_memory_is_never_chosen():
    w = par.Workload(CFG, 1024, 128, 8, mfu=None)
    free = _chosen(w)
    assert free.microbatch_size > 1 and free.recompute == "none" and free.fits
    # a GPU just too small for that choice: a smaller microbatch or recomputation instead
    small = dataclasses.replace(C, memory_gb=free.peak_memory / 1e9 * 0.99)
    o = _chosen(w, small)
    assert o.fits and o.peak_memory <= small.memory_gb * 1e9
    assert (o.microbatch_size, o.recompute) != (free.microbatch_size, "none")
    assert o.tokens_per_s <= free.tokens_per_s
    # the bigger microbatches' stashes are what does not fit
    b = free.microbatch_size
    one, big = (par.layout(w, small, tp=1, stages=4, schedule="1f1b", microbatch=x) for x in (1, b))
    assert one.fits and not big.fits and big.peak_memory > one.peak_memory


def test_sync_schedules_and_2bw_search_the_same_microbatch_sizes(monkeypatch):
    seen: dict[str, set] = {}
    timed = hybrid._timed

    def spy(w, c, dev, name, stages, m_sim, tp, mode, mb=1, *rest):
        seen.setdefault(name, set()).add((stages, tp, mb))
        return timed(w, c, dev, name, stages, m_sim, tp, mode, mb, *rest)

    monkeypatch.setattr(hybrid, "_timed", spy)
    # one MFU for every shape: no size can be ruled out by its compute alone, so every
    # candidate is timed (`hybrid._compute_bound`)
    w = par.Workload(CFG, 1024, 256, 32, mfu=0.4)
    sync = par.cluster_schedules(sync=True)
    par.pipelines(w, C, (*sync, "2bw", "pipedream"))
    assert set(seen) == {*sync, "2bw", "pipedream"}
    assert {mb for *_, mb in seen["2bw"]} == {1, 2, 4, 8}
    for name in (*sync, "pipedream"):
        assert seen[name] == seen["2bw"], name


@pytest.mark.parametrize("preset", ["h100-ib", "h100-eth25"])
def test_the_map_s_pruned_search_picks_what_the_full_one_does(preset):
    """`best_only` (the map and the corners) skips what cannot beat the fastest fitting option
    of its policy found so far; `best` must come out the same."""
    from stalepipe.lab.sim.cluster import assumption_corners

    for gpus, batch in ((16, 64), (32, 256)):
        w, c = par.Workload(CFG, 1024, batch, gpus, mfu=None), CLUSTERS[preset]
        for wc, cc in [(w, c), *list(assumption_corners(w, c))[:2]]:
            full, fast = par.all_options(wc, cc), par.all_options(wc, cc, best_only=True)
            assert len(fast) <= len(full)
            for policy in ("sync", "2bw"):
                assert par.best(fast, policy) == par.best(full, policy), (gpus, batch, policy)
