"""The crossover plot of issue 52, item 5: the best synchronous configuration's lost fraction
(its bubble plus its exposed communication, a share of its step) against the token overhead at
which 2BW would reach the target as soon (2BW's throughput edge over it), one point per
setting, with the edge's range over the assumptions and the model's held-out error as the
verdict states it (`verdict.cluster.edge_range`, `with_model_error`); the measured overheads at
0.43M as horizontal lines (async sooner below a point's edge, if the overhead carried over
unchanged). Every configuration is timed as `stalepipe verdict --cluster` times it (the
calibrated per-shape MFU, `sim.efficiency`) and costed with Muon+EF, the arm the decision
block's flip point names (Newton-Schulz and EF's buffer, `sim.optimizer`), so a point's edge
is the decision block's; the lines of the other arms are their overheads beside Muon+EF's edge
(each arm's own edge is in its verdict: within 1.5 % of Muon+EF's in the committed ones).

    OMP_NUM_THREADS=1 python benchmarks/studies/crossover_plot.py [OUT.png]

Settings: smollm-360m on 32 GPUs of each preset at the lengths study's batch (the committed
verdicts), and the 10B MoE on 64 H100s. Llama 3 70B / 405B take minutes each: pass --large to
add them (2,048 sequences of 8,192 tokens on 1,024 H100s with InfiniBand and with 100 Gb/s
Ethernet, and on 8,192 H100s with InfiniBand, the Llama 3 paper's 405B setting).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from matplotlib.ticker import NullFormatter, PercentFormatter

from stalepipe.lab.analysis.plots import png_bytes, pyplot
from stalepipe.lab.sim.optimizer import Arm
from stalepipe.lab.sim.parallel import all_options, best
from stalepipe.lab.verdict.cluster import edge_range, setting, with_model_error

# the lengths study's token overheads at sync's final loss (docs/verdict.md's table, 5 seeds)
OVERHEADS = {"Muon+EF": 1.10, "Muon": 1.27, "AdamW+EF": 1.38}
ARM = Arm("muon", ef=True)  # the arm the points are costed with (module docstring)


def settings(large: bool) -> list[tuple[str, str, int, int]]:
    out = [
        ("smollm-360m", p, 32, 256) for p in ("h100-ib", "h100-eth100", "h100-eth25", "h100-pcie")
    ]
    out.append(("moe-10b", "h100-ib", 64, 512))
    if large:
        out += [
            (m, p, 1024, 2048)
            for m in ("llama3-70b", "llama3-405b")
            for p in ("h100-ib", "h100-eth100")
        ]
        out += [(m, "h100-ib", 8192, 2048) for m in ("llama3-70b", "llama3-405b")]
    return out


def lost(o) -> float:
    """Bubble plus exposed communication, a share of the step."""
    busy = o.step_time - o.exposed_comm
    return (o.bubble * busy + o.exposed_comm) / o.step_time


def main(argv: list[str]) -> None:
    large = "--large" in argv
    out = Path(next((a for a in argv if not a.startswith("--")), "crossover.png"))
    points = []
    print("model, cluster, GPUs, batch: best sync (lost share), best 2bw, edge [range]")
    for model, preset, gpus, batch in settings(large):
        st = dataclasses.replace(setting(model, preset, gpus, batch), arm=ARM)
        opts = all_options(st.workload(), st.cluster, ("2bw",))
        s, a = best(opts), best(opts, "2bw")
        edge = a.tokens_per_s / s.tokens_per_s
        low, high = with_model_error(*edge_range(st.workload(), st.cluster, opts))
        where = f"{model} {preset} x{gpus}"
        points.append((where, lost(s), edge, edge * low, edge * high))
        print(
            f"{model}, {preset}, {gpus}, {batch}: {s.label()} ({lost(s):.1%}), {a.label()}, "
            f"{edge:.3f}x [{edge * low:.3f}, {edge * high:.3f}]"
        )
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9.5, 4.8))
    for i, (_, x, y, lo, hi) in enumerate(points):
        ax.errorbar([x], [y], yerr=[[y - lo], [hi - y]], fmt="o", color="#0072B2", capsize=3)
        shift = (4, -10 if i % 2 else 3)  # neighbours' numbers apart
        ax.annotate(str(i + 1), (x, y), fontsize=7, xytext=shift, textcoords="offset points")
    key = "\n".join(f"{i + 1}  {p[0]}  {p[2]:.3f}x" for i, p in enumerate(points))
    fig.text(0.74, 0.5, key, fontsize=7, va="center", family="monospace")
    fig.subplots_adjust(right=0.72)
    ax.set_xscale("log")  # lost shares run from ~1 % to ~60 %
    ax.xaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.xaxis.set_minor_formatter(NullFormatter())
    for name, o in OVERHEADS.items():
        ax.axhline(o, color="#E69F00", lw=0.8, ls="--")
        ax.text(ax.get_xlim()[0], o, f" {name} {o:.2f}x @ 0.43M", fontsize=7, va="bottom")
    ax.axhline(1.0, color="black", lw=0.6)
    ax.set_xlabel("best synchronous configuration: bubble + exposed communication (share of step)")
    ax.set_ylabel(f"2BW's throughput edge ({ARM.label()}) = overhead at the flip")
    ax.set_title(
        "async sooner where a token overhead lies below its setting's point\n"
        "(bars: the assumptions' corners and the model's held-out error, as the verdict)",
        fontsize=9,
    )
    out.write_bytes(png_bytes(fig))
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
