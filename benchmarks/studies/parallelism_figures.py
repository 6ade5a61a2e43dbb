"""The figures docs/verdict.md quotes for context parallelism, expert parallelism in pipelines
and DualPipeV's overlap (issue 52, item 1; 'The cluster model'), from the cluster model.

    OMP_NUM_THREADS=1 python benchmarks/studies/parallelism_figures.py

Prints: Llama 3 405B's CP traffic a layer at 131,072 tokens (TP 8, CP 16 across nodes)
beside its forward; Llama 3 8B at 131,072 tokens under FSDP at each CP degree searched; the
10B MoE in a 2-stage pipeline with and without EP 8, under 1F1B, ZB-V and DualPipeV, and its
best synchronous and 2BW configurations. Seconds a step, GB a GPU; h100-ib unless said.
"""

from __future__ import annotations

from dataclasses import replace

from stalepipe.lab.sim import replicas as rp
from stalepipe.lab.sim.cluster import CLUSTERS, ROCE_EFFICIENCY
from stalepipe.lab.sim.hybrid import _blocks_flops
from stalepipe.lab.sim.models import model_config
from stalepipe.lab.sim.parallel import Workload, all_options, best, layout
from stalepipe.lab.verdict.throughput import model_shape

IB = CLUSTERS["h100-ib"]


def main() -> None:
    roce = replace(IB, name="meta-roce", link_efficiency=ROCE_EFFICIENCY)  # Llama 3's RoCE
    cfg = model_config("llama3-405b")
    w = Workload(cfg, 131072, 128, 16384, None)
    tokens = 131072 / 16  # a GPU's share of one sequence
    mfu = w.mfu_at(tokens, 8)
    forward = (
        tokens * _blocks_flops(cfg, 131072) / cfg.num_layers / (8 * roce.peak_tflops * 1e12 * mfu)
    )
    cp = rp.cp_time(roce, cfg, 131072, 16, 8, 1)
    print(
        f"405B, 131,072 tokens, TP 8, CP 16 one a node (meta-roce): CP traffic {cp * 1e3:.1f} ms "
        f"a layer and microbatch (forward + backward), its forward {forward * 1e3:.1f} ms "
        f"(MFU {mfu:.2f} by shape)"
    )
    w8 = Workload(model_config("llama3-8b"), 131072, 64, 64, None)
    for o in rp.flat_options(w8, IB, ("fsdp",)):
        print(
            f"8B, 131,072 tokens, 64 H100: {o.label()}: {o.peak_memory / 1e9:.1f} GB, fits {o.fits}"
        )
    print("  best:", best(rp.flat_options(w8, IB, ("fsdp",))).label())
    mcfg, seq, batch = model_shape("moe-10b")
    wm = Workload(mcfg, seq, batch, 64, None)
    for name, mb in (("1f1b", 4), ("zb-v", 1), ("dualpipev", 1)):
        for ep in (1, 8):
            o = layout(wm, IB, tp=1, stages=2, schedule=name, microbatch=mb, ep=ep)
            print(
                f"moe-10b, 64 H100: {o.label()}: step {o.step_time:.3f} s, exposed "
                f"{o.exposed_comm:.3f} s, {o.peak_memory / 1e9:.1f} GB"
            )
    opts = all_options(wm, IB, ("2bw",))
    for policy in ("sync", "2bw"):
        o = best(opts, policy)
        print(f"moe-10b, 64 H100, best {policy}: {o.label()}, {o.tokens_per_s / 1e6:.3f}M tok/s")


if __name__ == "__main__":
    main()
