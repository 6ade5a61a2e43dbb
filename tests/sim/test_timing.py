"""Timing simulator: closed-form bubbles under uniform costs, communication, analytic costs."""

from __future__ import annotations

import pytest

from stalepipe.config import ConfigError
from stalepipe.config.shapes import flops_per_token, split_layers
from stalepipe.hardware import DEVICES, get_device
from stalepipe.lab.sim.balance import rank_balanced_layers
from stalepipe.lab.sim.timing import (
    analytic_costs,
    simulate,
    stage_params,
    summarize,
    uniform_costs,
)
from stalepipe.presets import smollm_360m
from stalepipe.training.schedules.generators import make_schedule


def run(name: str, P: int, m: int, N: int = 1, **kw):
    sched = make_schedule(name, P, m, N, **kw)
    v = sched.num_chunks  # a rank's work is the same however many chunks it holds
    return summarize(simulate(sched, uniform_costs(sched.num_stages, 1 / v, 1 / v, 1 / v)))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("P,m", [(1, 4), (2, 1), (4, 4), (4, 8), (8, 16), (5, 3)])
def test_gpipe_and_1f1b_bubble(name, P, m):
    for N in (1, 3):  # a flush every step: the bubble does not amortise
        r = run(name, P, m, N)
        assert r.bubble == pytest.approx((P - 1) / (m + P - 1))
        assert r.steady_bubble == pytest.approx(r.bubble)


@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("P,m", [(2, 2), (4, 4), (4, 8), (8, 16)])
def test_interleaved_bubble(P, m, v):
    r = run("interleaved-1f1b", P, m, 2, num_chunks=v)
    assert r.bubble == pytest.approx((P - 1) / (v * m + P - 1))


@pytest.mark.parametrize("name", ["2bw", "pipedream"])
@pytest.mark.parametrize("P,m", [(2, 1), (4, 4), (4, 8), (8, 7)])
def test_no_flush_fill_cost_and_steady_state(name, P, m):
    last = 1.0
    for N in (1, 2, 4, 8):
        r = run(name, P, m, N)
        # every microbatch of the run streams through one fill and one drain
        assert r.bubble == pytest.approx((P - 1) / (N * m + P - 1))
        assert r.bubble <= last
        last = r.bubble
        if N * (1 if name == "2bw" else m) >= 3:
            assert r.steady_bubble == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("P,m", [(2, 2), (4, 4), (4, 8), (8, 8), (8, 16), (4, 2)])
def test_zb_h1_beats_1f1b(P, m):
    zb, base = run("zb-h1", P, m), run("1f1b", P, m)
    assert zb.bubble < base.bubble
    if m >= P:  # the paper's (P-1)(F + BI - BW) with F = BI = BW
        assert zb.bubble == pytest.approx((P - 1) / (3 * m + P - 1))


def test_wpipe_amortises_like_2bw():
    assert run("wpipe", 4, 8, 8).bubble < run("1f1b", 4, 8, 8).bubble
    assert run("wpipe", 8, 16, 6).steady_bubble < 0.05


def test_transfer_time_adds_on_the_critical_path():
    sched = make_schedule("gpipe", 2, 1)
    c = 0.25
    r = summarize(simulate(sched, uniform_costs(2, p2p_latency=c)))
    # F on stage 0, send, F + B on stage 1, send, B on stage 0
    assert r.makespan == pytest.approx(1 + c + 3 + c + 2)


def test_inter_node_links_are_slower():
    sched = make_schedule("gpipe", 4, 1)
    kw = dict(message_bytes=1e9, intra_node_bandwidth=100e9, inter_node_bandwidth=10e9)
    one = summarize(simulate(sched, uniform_costs(4, ranks_per_node=8, **kw))).makespan
    two = summarize(simulate(sched, uniform_costs(4, ranks_per_node=2, **kw))).makespan
    assert two - one == pytest.approx(2 * (0.1 - 0.01))  # one hop crosses nodes, both ways


def test_optimizer_time_counts_per_step():
    sched = make_schedule("1f1b", 2, 2, 3)
    base = summarize(simulate(sched, uniform_costs(2))).makespan
    slow = summarize(simulate(sched, uniform_costs(2, optimizer=0.5))).makespan
    assert slow == pytest.approx(base + 3 * 0.5)


def test_analytic_costs_add_up_to_the_model_flops():
    cfg, dev = smollm_360m(), get_device("h100")
    c = analytic_costs(cfg, 4, dev, mfu=0.5, seq_len=1024, microbatch_size=2)
    fwd = flops_per_token(cfg, 1024)["forward"]
    assert sum(c.forward) == pytest.approx(2 * 1024 * fwd / (dev.peak_flops * 0.5))
    assert c.backward_input == c.forward == c.backward_weight
    assert c.tokens_per_microbatch == 2048
    assert c.message_bytes == 2048 * cfg.dim * 2
    assert all(t > 0 for t in c.optimizer)
    r = summarize(simulate(make_schedule("1f1b", 4, 8), c))
    bound = 4 * dev.peak_flops * 0.5 / (3 * fwd)  # 4 devices fully busy at this MFU
    assert (1 - r.bubble) * bound * 0.9 < r.throughput < bound


def test_device_table_and_errors():
    assert set(DEVICES) >= {"h100", "h200", "a100", "cpu"}
    with pytest.raises(ConfigError, match="did you mean 'h100'"):
        get_device("h10")
    with pytest.raises(ConfigError, match="cost model has 2 stages"):
        simulate(make_schedule("1f1b", 3, 3), uniform_costs(2))
    with pytest.raises(ConfigError, match="need 1 or 3 values"):
        uniform_costs(3, forward=[1.0, 2.0])


def test_timeline_csv_has_times():
    tl = simulate(make_schedule("gpipe", 2, 1), uniform_costs(2))
    rows = tl.to_csv().splitlines()
    assert rows[0].endswith("start,end,weight_mem,act_mem,mem_unit")
    assert rows[1] == "gpipe,0,0,F,0,0,0,0,0,0,1,1,1,unit"  # weights 1 unit, one stash
    assert len(rows) == 1 + sum(len(a) for a in tl.schedule.ranks)


def test_analytic_memory_counts_versions_state_and_stash():
    cfg, dev = smollm_360m(), get_device("h100")
    c = analytic_costs(cfg, 4, dev, seq_len=1024)
    layers = split_layers(cfg, 4, 1024)
    params = stage_params(cfg, layers)
    assert c.weight_bytes == tuple(2.0 * p for p in params)  # bf16, one version
    assert c.state_bytes == tuple(16.0 * p for p in params)  # fp32 grad + master + Adam m, v
    act0 = len(layers[0]) * 1024 * cfg.dim * 34
    assert c.activation_bytes[0] == act0
    one = summarize(simulate(make_schedule("1f1b", 4, 8, 2), c)).rank_memory[0]
    assert one.total == pytest.approx(18 * params[0] + 4 * act0)  # 1F1B: P stashed on rank 0
    two = summarize(simulate(make_schedule("2bw", 4, 8, 3), c)).rank_memory[0]
    assert two.weights == pytest.approx(20 * params[0])  # a second bf16 version
    assert DEVICES["h100"].memory_bytes == 80e9 and DEVICES["h200"].memory_bytes == 141e9


def test_rank_balanced_split_helps_the_v_rank_with_head_and_embedding():
    cfg = smollm_360m()
    sched = make_schedule("zb-v", 8, 16)
    ranks = tuple(sched.rank_of(s) for s in range(16))
    dev = get_device("h100")
    per_stage = analytic_costs(cfg, 16, dev, seq_len=2048)
    per_rank = analytic_costs(cfg, 16, dev, seq_len=2048, stage_ranks=ranks)

    def top(c):
        load = [0.0] * 8
        for s, f in enumerate(c.forward):
            load[ranks[s]] += f
        return max(load)

    assert top(per_rank) < top(per_stage)
    assert sum(per_rank.forward) == pytest.approx(sum(per_stage.forward))
    layers = rank_balanced_layers(cfg, 2048, ranks)
    assert [r.start for r in layers][0] == 0 and layers[-1].stop == cfg.num_layers
    assert all(len(r) >= 1 for r in layers)
