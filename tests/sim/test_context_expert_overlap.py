"""The parallelisms issue 52 (item 1) still missed: context parallelism for long sequences in
both families, expert parallelism inside pipelines, and DualPipeV's forward/backward overlap of
the all-to-alls (sim.replicas, sim.hybrid; docs/verdict.md, 'The cluster model')."""

from __future__ import annotations

import pytest

from stalepipe.lab.sim import hybrid
from stalepipe.lab.sim import replicas as rp
from stalepipe.lab.sim.cluster import CLUSTERS, collective_time
from stalepipe.lab.sim.models import model_config
from stalepipe.lab.sim.parallel import Workload, best, layout
from stalepipe.lab.verdict.throughput import model_shape

IB = CLUSTERS["h100-ib"]


def test_cp_traffic_is_an_all_gather_of_k_and_v_and_a_reduce_scatter_growing_with_c():
    """Llama 3's CP: per layer the whole sequence's K and V (8 kv heads of 128, bf16) gathered
    in forward and their gradients reduce-scattered in backward; more of them cross with c."""
    cfg = model_config("llama3-405b")
    tokens = 131072
    size = 2.0 * 2 * tokens * 8 * 128 / 8  # K and V, a TP rank's one kv head of eight
    want = collective_time(IB, "all-gather", size, 4, 4)
    want += collective_time(IB, "reduce-scatter", size, 4, 4)
    assert rp.cp_time(IB, cfg, tokens, 4, tp=8) == pytest.approx(want)
    assert rp.cp_time(IB, cfg, tokens, 1, tp=8) == 0.0
    inside = [rp.cp_time(IB, cfg, tokens, c, tp=1) for c in (2, 4, 8)]
    assert inside == sorted(inside) and inside[0] > 0
    # the same group spread one a node (TP 8 fills the node) crosses the slower rails
    assert rp.cp_time(IB, cfg, tokens, 8, tp=8, per_node=1) > rp.cp_time(IB, cfg, tokens, 8, tp=8)


def test_cp_is_chosen_where_a_long_sequence_does_not_fit_without_it():
    """Llama 3 8B at 131,072 tokens on 64 H100s under FSDP: one sequence's logits alone are
    201 GB, so no CP 1 configuration fits; CP splits the sequence and is what the search
    keeps, its activations a c-th of CP 1's."""
    w = Workload(model_config("llama3-8b"), 131072, 64, 64, None)
    opts = rp.flat_options(w, IB, ("fsdp",))
    assert opts and not any(o.fits for o in opts if o.cp == 1)
    chosen = best(opts)
    assert chosen is not None and chosen.cp > 1 and chosen.replicas * chosen.cp * chosen.tp == 64
    one = rp.flat_memory(w, IB, "fsdp", 1, 1, "full")
    four = rp.flat_memory(w, IB, "fsdp", 1, 1, "full", cp=4)
    assert four < one / 3
    # CP's traffic is on the critical path: 4 microbatches (16 replicas) x 32 layers of it
    _, exposed4, _ = rp.flat_step(w, IB, "fsdp", 1, 1, "full", cp=4)
    assert exposed4 >= 4 * 32 * rp.cp_time(IB, w.cfg, 131072, 4, 1, 4) > 0


def test_cp_is_not_tried_at_short_sequences():
    """Where CP 1 fits without recomputation no larger degree is tried (TP's rule)."""
    w = Workload(model_config("llama3-8b"), 8192, 64, 8, None)
    flat = rp.flat_options(w, IB, ("fsdp",))
    assert flat and all(o.cp == 1 for o in flat) and best(flat) is not None
    cfg, seq, batch = model_shape("smollm-360m")
    assert all(o.cp == 1 for o in rp.flat_options(Workload(cfg, seq, batch, 32), IB))


def test_pipelines_take_cp_at_a_long_sequence_and_not_at_a_short_one():
    """Llama 3 8B on 64 H100s: at 131,072 tokens every CP 1 pipeline needs recomputation
    (the logits alone are 25 GB at TP 8), so CP is searched at TP 8 and a CP 2 pipeline without
    recomputation is the fastest; at 8,192 tokens CP is never tried."""
    cfg = model_config("llama3-8b")
    long = hybrid.pipelines(Workload(cfg, 131072, 16, 64, None), IB, ("1f1b",))
    assert all(o.recompute != "none" for o in long if o.cp == 1)
    top = best(long)
    assert top is not None and top.cp > 1 and top.tp == 8 and top.recompute == "none"
    assert top.stages * top.replicas * top.tp * top.cp == 64
    short = hybrid.pipelines(Workload(cfg, 8192, 64, 64, None), IB, ("1f1b",))
    assert short and all(o.cp == 1 for o in short)


@pytest.mark.slow
def test_llama3_405b_at_131k_tokens_fits_only_with_cp():
    """405B at 131,072 tokens on 512 H100s (64 sequences): no 1F1B pipeline at TP 8 fits
    without CP, at any depth or recomputation; with CP 2 some do."""
    w = Workload(model_config("llama3-405b"), 131072, 64, 512, None)
    without, _ = hybrid._depths(w, IB, ("1f1b",), None, 8, 1)
    with_cp, _ = hybrid._depths(w, IB, ("1f1b",), None, 8, 2)
    assert without and not any(o.fits for o in without)
    assert any(o.fits for o in with_cp)


def test_expert_parallelism_in_a_pipeline_shards_the_experts_and_pays_all_to_alls():
    """The 10B MoE (routed experts 95 % of its parameters) in a 1F1B pipeline of 2 stages x
    32 replicas, 4 of a stage's in a node: EP 8 holds an eighth of each stage's routed experts
    and adds the four all-to-alls a MoE layer and microbatch, here across two nodes; the
    search lists EP pipelines."""
    cfg, seq, batch = model_shape("moe-10b")
    w = Workload(cfg, seq, batch, 64, None)
    plain = layout(w, IB, tp=1, stages=2, schedule="1f1b", microbatch=4)
    ep = layout(w, IB, tp=1, stages=2, schedule="1f1b", microbatch=4, ep=8)
    assert ep.peak_memory < 0.6 * plain.peak_memory
    a2a = rp.a2a_time(IB, cfg, 4 * seq, 8, 4)
    assert a2a > rp.a2a_time(IB, cfg, 4 * seq, 8, 8) > 0  # two nodes' rails are slower
    m = batch // 32 // 4
    # each rank's 12 MoE layers, each microbatch: the all-to-alls on its critical path
    assert ep.exposed_comm >= m * 12 * a2a > plain.exposed_comm
    assert ep.step_time > plain.step_time
    labels = [o.label() for o in hybrid.pipelines(w, IB, ("1f1b",))]
    assert any(" x ep 8 " in label for label in labels), labels


def test_dualpipev_hides_the_all_to_alls_of_its_paired_chunks():
    """DeepSeek-V3's DualPipe overlap: the all-to-alls of a forward chunk and a backward chunk
    run under the pair's compute; on the chunks that run paired only what exceeds the compute
    (and the overlap cost) is exposed. Without the overlap the same schedule exposes more."""
    assert hybrid.paired_share(4, 8) == pytest.approx(5 / 16)  # rank 0: 2(8-8+1) + 3 pairs
    assert hybrid.paired_share(4, 1000) > 0.99
    assert hybrid.a2a_exposed(1.0, 3.0, 1.0, 0.0) == 0.0  # all hidden
    assert hybrid.a2a_exposed(4.0, 3.0, 1.0, 0.0) == 1.0  # the excess over the compute
    assert hybrid.a2a_exposed(1.0, 3.0, 0.0, 0.05) == 1.0  # nothing paired: all exposed
    cfg, seq, batch = model_shape("moe-10b")
    w = Workload(cfg, seq, batch, 64, None)
    kw = dict(tp=1, stages=2, schedule="dualpipev", microbatch=1, ep=8)
    overlapped = layout(w, IB, **kw)
    zbv = layout(w, IB, **{**kw, "schedule": "zb-v"})
    try:
        hybrid.FB_OVERLAP, saved = frozenset(), hybrid.FB_OVERLAP
        serial = layout(w, IB, **kw)
    finally:
        hybrid.FB_OVERLAP = saved
    assert overlapped.exposed_comm < 0.5 * serial.exposed_comm
    assert overlapped.step_time < serial.step_time
    assert overlapped.step_time < zbv.step_time  # ZB-V pays its all-to-alls in full
