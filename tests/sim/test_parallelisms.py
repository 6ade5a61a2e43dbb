"""The parallelisms a large run uses (issue 52, item 1): tensor parallelism inside a node
(sequence parallel), recomputation with its compute cost, ZeRO-1/2 and HSDP beside DP and FSDP,
deeper pipelines, and Llama 3 presets."""

from __future__ import annotations

import dataclasses

import pytest

from stalepipe.config.shapes import count_params
from stalepipe.lab.sim import replicas as rp
from stalepipe.lab.sim.cluster import CLUSTERS, collective_time
from stalepipe.lab.sim.hybrid import effective_mfu, tp_cluster
from stalepipe.lab.sim.models import model_config
from stalepipe.lab.sim.parallel import Workload, all_options, best, layout
from stalepipe.lab.verdict.throughput import model_shape


def test_selective_recomputation_redoes_every_second_matmul():
    cfg = model_config("llama3-8b")  # K 4.2M, O 16.8M, up 58.7M of 218M matmul weights
    assert rp.recompute_share(cfg, "selective") == pytest.approx(79.69 / 218.10, rel=1e-3)
    assert rp.recompute_share(cfg, "full") == 1.0 and rp.recompute_share(cfg, "none") == 0.0


def test_tensor_parallel_traffic_is_two_gathers_and_two_scatters_of_the_layer_input():
    c, cfg = CLUSTERS["h100-ib"], model_config("llama3-70b")
    size = 2.0 * 8192 * cfg.dim
    want = 2 * (
        collective_time(c, "all-gather", size, 8, 8)
        + collective_time(c, "reduce-scatter", size, 8, 8)
    )
    assert rp.tp_time(c, cfg, 8192, 8) == pytest.approx(want) and rp.tp_time(c, cfg, 8192, 1) == 0
    # a TP group is one faster rank of a virtual cluster, at an MFU its traffic lowers
    v = tp_cluster(c, 8)
    assert (v.gpus_per_node, v.peak_tflops) == (1, 8 * c.peak_tflops)
    w = Workload(cfg, 8192, 256, 256)
    assert effective_mfu(w, c, 8, "none") < w.mfu == effective_mfu(w, c, 1, "none")
    assert effective_mfu(w, c, 1, "full") == pytest.approx(w.mfu * 3 / 4)


def test_zero1_shards_the_state_at_dp_s_traffic():
    cfg, seq, batch = model_shape("smollm-360m")
    w, c = Workload(cfg, seq, batch, 32), CLUSTERS["h100-ib"]
    opts = {o.schedule: o for o in rp.flat_options(w, c)}
    assert {"dp", "zero1", "zero2", "fsdp", "hsdp"} <= set(opts)
    assert opts["zero1"].peak_memory < opts["dp"].peak_memory
    assert opts["zero1"].tokens_per_s >= opts["dp"].tokens_per_s
    assert opts["hsdp"].peak_memory > opts["fsdp"].peak_memory  # sharded over 8, not 32


def test_llama3_70b_fits_on_256_h100s_with_tensor_parallelism():
    """Issue 52: 0 of 74 configurations of Llama 3 70B at 8,192 tokens fitted on 256 H100s
    (FSDP alone 191-195 GB a GPU). With TP and recomputation the FSDP family fits."""
    cfg = model_config("llama3-70b")
    w, c = Workload(cfg, 8192, 256, 256), CLUSTERS["h100-ib"]
    flat = rp.flat_options(w, c, ("fsdp",))
    chosen = best(flat)
    assert chosen is not None and chosen.fits, [o.label() for o in flat]
    plain = rp.flat_step(w, c, "fsdp", 1, 1, "none")
    assert plain[2] > 80e9  # no TP, no recomputation: over memory


@pytest.mark.slow
def test_llama3_70b_pipelines_fit_too():
    cfg = model_config("llama3-70b")
    opts = all_options(Workload(cfg, 8192, 256, 256), CLUSTERS["h100-ib"], ("2bw",))
    assert best(opts) is not None and best(opts, "2bw") is not None


def test_llama3_presets_have_the_papers_shapes():
    for name, layers, dim, ffn, heads in [
        ("llama3-8b", 32, 4096, 14336, 32),
        ("llama3-70b", 80, 8192, 28672, 64),
        ("llama3-405b", 126, 16384, 53248, 128),
    ]:
        cfg = model_config(name)
        assert (cfg.num_layers, cfg.dim, cfg.ffn_dim, cfg.num_heads, cfg.num_kv_heads) == (
            layers, dim, ffn, heads, 8
        )  # fmt: skip


def test_deepseek_v3_has_its_papers_shape_and_counts():
    """DeepSeek-V3's shape (arXiv 2412.19437, Section 4.2): 671B parameters, 37B active; ours
    within 1 % and 5 % (MLA costed as multi-head attention, the MTP module left out), and the
    cluster model times an expert-parallel pipeline of it."""
    cfg = model_config("deepseek-v3")
    assert (cfg.num_layers, cfg.dim, cfg.num_experts, cfg.top_k, cfg.num_dense_layers) == (
        61, 7168, 256, 8, 3
    )  # fmt: skip
    n = count_params(cfg)
    assert abs(n["total"] / 671e9 - 1) < 0.01 and abs(n["active"] / 37e9 - 1) < 0.05, n
    opt = layout(Workload(cfg, 4096, 512, 256), CLUSTERS["h100-ib"], tp=1, stages=16,
                 schedule="1f1b", microbatch=1, recompute="full", ep=8)  # fmt: skip
    assert opt.ep == 8 and opt.step_time > 0 and opt.tokens_per_s > 0


def test_a_configuration_over_memory_is_never_chosen():
    cfg = dataclasses.replace(model_config("llama3-8b"), num_layers=4)
    w, c = Workload(cfg, 8192, 64, 16), dataclasses.replace(CLUSTERS["h100-ib"], memory_gb=8.0)
    opts = all_options(w, c)
    chosen = best(opts)
    assert all(o.fits for o in [chosen] if o is not None)
    assert any(not o.fits for o in opts)


def test_expert_parallelism_gathers_a_share_of_the_experts_and_pays_all_to_alls():
    """An MoE model under FSDP: with EP over a node each GPU gathers 1/8 of a unit's routed
    experts (the issue: FSDP gathered all 10.2B parameters, 6x the active ones, every
    microbatch), and each MoE layer adds four all-to-alls of its routed tokens."""
    cfg, seq, batch = model_shape("moe-10b")
    w, c = Workload(cfg, seq, batch, 64), CLUSTERS["h100-eth25"]
    plain = rp.flat_step(w, c, "fsdp", 1, 8, "selective")
    ep = rp.flat_step(w, c, "fsdp", 1, 8, "selective", ep=8)
    a2a = cfg.num_layers * rp.a2a_time(c, cfg, 8 * seq, 8)
    assert a2a > 0 and rp.a2a_time(c, cfg, 8 * seq, 1) == 0
    assert ep[1] - a2a * (batch // 64 // 8) < plain[1]  # less gather traffic exposed
    assert rp.experts(cfg, 0) == 64 * 3 * cfg.dim * cfg.expert_hidden_dim
    labels = [o.label() for o in rp.flat_options(w, c, ("fsdp",))]
    assert any(" x ep 8 " in label for label in labels), labels
