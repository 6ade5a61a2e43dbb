"""Per-schedule throughput and memory for `stalepipe verdict`: simulated or measured.

Simulated (`simulated`): every schedule of the timing simulator timed on the analytic costs of a
model on a device (`sim.simulate.compare_schedules`), steady state over `SIM_STEPS` steps
(fill and drain of an asynchronous schedule are paid once per run, so the per-step rate is the
run's). Peak memory per rank and whether it fits the device: as the simulator counts them
(sim/memory.py). All calls to the simulator go through `simulate_all`.

Measured (`load_costs`): a JSON or CSV file (docs/verdict.md), for example tokens/s read off
`benchmarks/speed/pipeline_throughput.py`'s table:

    {"source": "benchmarks/speed/pipeline_throughput.py, P=2, m=8, CPU", "num_stages": 2,
     "schedules": [{"name": "1f1b", "tokens_per_s": 5200},
                   {"name": "2bw", "tokens_per_s": 6100, "peak_memory_gb": [1.2, 1.1]},
                   {"name": "torch-zbv", "policy": "sync", "tokens_per_s": 5600}]}

    name,policy,tokens_per_s,peak_memory_gb
    1f1b,,5200,
    2bw,,6100,1.2 1.1

`policy` is needed only for a name the simulator does not know; `peak_memory_gb` (one number, or
one per rank) and `bubble` (a share) are optional.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalepipe.config.registry import PIPELINE_SCHEDULES
from stalepipe.config.shapes import count_params
from stalepipe.errors import UserError
from stalepipe.hardware import get_device
from stalepipe.lab.sim.models import model_config
from stalepipe.presets import PRESETS
from stalepipe.training.delay.policies import PAPER_ASYNC, never_delays, same_delay_at_any_depth

SIM_STEPS = 8


@dataclass(frozen=True)
class ScheduleThroughput:
    """One schedule's rate, bubble and memory; `refused` says why the sizes do not fit it."""

    name: str
    policy: str
    tokens_per_s: float
    bubble: float = math.nan
    peak_memory: tuple[float, ...] = ()  # bytes per rank; () = unknown
    fits: bool | None = None  # None: the device's capacity is not known
    source: str = "simulated"
    refused: str = ""
    config: str = ""  # the configuration behind the rate (cluster model: P, D, m, placement)
    stages: int | None = None  # P behind the rate where rows differ in it (cluster model)
    flushed_tokens_per_s: float = math.nan  # an async row's steps in a sync window (a flush)
    update: float = math.nan  # seconds a step its optimizer takes (cluster model, `sim.optimizer`)

    def shown(self) -> str:
        """The configuration, else the schedule's name."""
        return self.config or self.name

    def rate_text(self, rate: float | None = None) -> str:
        x = self.tokens_per_s if rate is None else rate
        return f"{x / 1e6:.3f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"

    def bubble_text(self) -> str:
        return f"{self.bubble:.1%}" if math.isfinite(self.bubble) else "-"

    def memory_text(self) -> str:
        """min-max over ranks, GB."""
        if not self.peak_memory:
            return "-"
        lo, hi = min(self.peak_memory) / 1e9, max(self.peak_memory) / 1e9
        return f"{hi:.2f}" if abs(hi - lo) < 5e-3 else f"{lo:.2f}-{hi:.2f}"

    def memory_list(self) -> str:
        return " ".join(f"{b / 1e9:.3f}" for b in self.peak_memory)

    def fits_text(self) -> str:
        return "?" if self.fits is None else "yes" if self.fits else "no"


@dataclass
class Throughputs:
    """The schedules compared, the rate of a synchronous window inside an asynchronous run,
    and where the numbers come from."""

    rows: list[ScheduleThroughput]
    window_tokens_per_s: float  # the async schedule's steps inside a sync window (a flush)
    num_stages: int | None
    lines: list[str]  # the 'inputs' lines of the output
    short: str  # a title for the plot
    # 2BW's throughput edge over the best synchronous option at the assumptions' ends, over its
    # central value (`verdict.cluster.edge_range`); (1, 1) where no model's assumption moves it
    edge_factors: tuple[float, float] = (1.0, 1.0)
    # non-embedding parameters of the model the throughputs are for (0: not known, as for a
    # measured costs file): the size the token overhead must transfer to
    target_params: float = 0.0
    # the throughput model's held-out error folded into `edge_factors` (`sim.efficiency`
    # MODEL_ERROR; 0: none, as for measured costs): printed as a named term of the interval
    model_error: float = 0.0
    # the arm whose optimizer these are costed with (`sim.optimizer.Arm`; None: not per arm,
    # as for measured costs and one simulated pipeline)
    arm: Any = None

    def get(self, name: str) -> ScheduleThroughput:
        return next(s for s in self.rows if s.name == name)

    def has(self, name: str) -> bool:
        return any(s.name == name and not s.refused for s in self.rows)

    def why(self, name: str) -> str:
        refused = [s.refused for s in self.rows if s.name == name and s.refused]
        return refused[0] if refused else "not in the comparison"

    def async_row(self, name: str, policy: str, stages: int) -> ScheduleThroughput | str:
        """The row of asynchronous schedule `name` that a delayed run with delay `policy` at P =
        `stages` is judged on, or why there is none. 2BW's delay is one step at any P; every
        other policy's delay grows with P, so its row must have the run's P."""
        mine = [s for s in self.rows if s.name == name and not s.refused]
        if not mine:
            return f"no throughput for schedule {name} ({self.why(name)})"
        if same_delay_at_any_depth(policy):
            return mine[0]
        same = [s for s in mine if (s.stages or self.num_stages) == stages]
        if same:
            return same[0]
        have = sorted({s.stages or self.num_stages or 0 for s in mine})
        return (
            f"{policy}'s delay depends on P; its runs have P={stages}, the throughputs "
            f"P={'/'.join(map(str, have))}"
        )

    def sync(self) -> list[ScheduleThroughput]:
        """The synchronous schedules that run at these sizes."""
        return [s for s in self.rows if never_delays(s.policy) and not s.refused]

    def best_sync(self) -> ScheduleThroughput | None:
        """The fastest synchronous schedule that fits in memory (unknown fit counts as fits)."""
        fitting = [s for s in self.sync() if s.fits is not False]
        return max(fitting, key=lambda s: s.tokens_per_s, default=None)

    def describe(self) -> list[str]:
        return list(self.lines)

    def title(self) -> str:
        return self.short


def arm_of(config: dict[str, Any]) -> Any:
    """The arm a run trains, as the cluster model costs it (`sim.optimizer.Arm`): its
    optimizer (AdamW or Muon; any other is costed as AdamW, `costed_as` says so), error
    feedback and Muon's Newton-Schulz steps, from its flattened config."""
    from stalepipe.lab.sim.optimizer import NS_STEPS, OPTIMIZERS, Arm  # torch-free

    name = str(config.get("optim.name") or "adamw")
    steps = config.get("optim.ns_steps") or NS_STEPS
    ef = bool(config.get("delay.ef", False))
    return Arm(name if name in OPTIMIZERS else "adamw", ef, int(steps))


def costed_as(config: dict[str, Any]) -> str:
    """'' where the cluster model has the run's optimizer's own costs, else why not (its
    optimizer is costed as AdamW's)."""
    from stalepipe.lab.sim.optimizer import OPTIMIZERS

    name = str(config.get("optim.name") or "adamw")
    return "" if name in OPTIMIZERS else f"{name} costed as AdamW (no cost model of its own)"


def async_schedule(policy: str) -> str | None:
    """The simulator's schedule that realises delay policy `policy` (None: none does)."""
    named = [(n, spec.policy) for n, spec in PIPELINE_SCHEDULES.items()]
    return next((n for n, p in named if p == policy and not never_delays(p)), None)


def model_shape(name: str) -> tuple[Any, int, int]:
    """The model shape of `name`, its sequence length and global batch in sequences (a
    training preset's own; a simulator shape's context and 512)."""
    cfg = model_config(name)
    if name in PRESETS:
        preset = PRESETS[name]()
        return cfg, preset.data.seq_len, preset.train.batch_size
    return cfg, cfg.max_seq_len, 512


def simulate_all(
    cfg: Any,
    device: Any,
    num_stages: int,
    num_microbatches: int,
    *,
    microbatch_size: int,
    seq_len: int,
    mfu: float,
    schedules: list[str] | None = None,
    sync_steps: int = 0,
) -> list[ScheduleThroughput]:
    """The simulator's `compare_schedules` (sim/simulate.py) for `cfg` on `device`: steady
    tokens/s and bubble, peak memory per rank, whether it fits the device's memory; with
    `sync_steps` the first steps of an asynchronous schedule run synchronously."""
    # here, not at the top: every verdict imports this module, and one on measured costs
    # (--costs) loads no simulator
    from stalepipe.lab.sim.simulate import compare_schedules

    rows = compare_schedules(
        cfg,
        device,
        num_stages,
        num_microbatches,
        microbatch_size,
        seq_len,
        schedules,
        mfu=mfu,
        num_steps=SIM_STEPS,
        sync_start=sync_steps,
    )
    return [
        ScheduleThroughput(
            r.name,
            r.policy,
            r.tokens_per_s if not r.refused else math.nan,
            r.bubble,
            tuple(r.peak_memory),
            r.fits,
            "simulated",
            r.refused or "",
        )
        for r in rows
    ]


def simulated(
    model: str,
    device: str,
    num_stages: int,
    num_microbatches: int,
    *,
    mfu: float = 0.4,
    seq_len: int | None = None,
    microbatch_size: int = 1,
) -> Throughputs:
    """Every schedule of the simulator for `model` on `device` at P = `num_stages`,
    m = `num_microbatches`; bad names or sizes raise UserError (ConfigError)."""
    if num_stages < 1 or num_microbatches < 1 or microbatch_size < 1:
        raise UserError("--stages, --microbatches and --microbatch-size must be >= 1")
    cfg, own_len, _ = model_shape(model)
    dev = get_device(device)
    seq = seq_len or own_len
    kw = dict(microbatch_size=microbatch_size, seq_len=seq, mfu=mfu)
    rows = simulate_all(cfg, dev, num_stages, num_microbatches, **kw)  # type: ignore[arg-type]
    window = simulate_all(
        cfg, dev, num_stages, num_microbatches, schedules=[PAPER_ASYNC], sync_steps=SIM_STEPS, **kw
    )[0]  # type: ignore[arg-type]
    if not any(never_delays(s.policy) and not s.refused for s in rows):
        raise UserError(
            f"no synchronous schedule runs {model} at P={num_stages}, "
            f"m={num_microbatches}: " + "; ".join(s.refused for s in rows)
        )
    tokens = microbatch_size * seq
    lines = [
        f"throughput and memory: simulated, {model} on {dev.name} ({device}, "
        f"{dev.memory_bytes / 1e9:.0f} GB, {dev.gpus_per_node} per node) at MFU {mfu:.2f}, "
        f"P={num_stages}, m={num_microbatches}, microbatch {microbatch_size} x {seq} = {tokens} "
        f"tokens, steady state over {SIM_STEPS} steps (sim/simulate.py compare_schedules: "
        "no compute/communication overlap beyond the schedule's order, no data-parallel "
        "all-reduce, BI = BW = F, memory = weight versions + optimizer state + stashed "
        "activations per rank; fits = the largest rank within the device's memory; the "
        "update and its state AdamW's for every arm: --cluster costs each arm's own "
        "optimizer)",
    ]
    short = f"{model} on {device}, P={num_stages}, m={num_microbatches} (simulated)"
    rate = window.tokens_per_s if not window.refused else math.nan
    target = count_params(cfg)["non_embedding"]
    return Throughputs(rows, rate, num_stages, lines, short, target_params=target)


def load_costs(path: str | Path) -> Throughputs:
    """Measured throughputs from a .json or .csv file (module docstring)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--costs {p}: no such file; write one as docs/verdict.md shows")
    try:
        if p.suffix.lower() == ".json":
            doc = json.loads(p.read_text())
            entries, source = list(doc.get("schedules", [])), str(doc.get("source", p))
            stages = doc.get("num_stages")
        elif p.suffix.lower() == ".csv":
            with open(p, newline="") as f:
                entries, source, stages = list(csv.DictReader(f)), str(p), None
        else:
            raise UserError(f"--costs {p}: use a .json or .csv file")
        rows = [_measured(e) for e in entries]
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise UserError(
            f"--costs {p}: cannot read it ({e}); see docs/verdict.md for the format"
        ) from None
    policies = [s.policy for s in rows]
    if all(map(never_delays, policies)) or not any(map(never_delays, policies)):
        raise UserError(
            f"--costs {p}: needs an asynchronous schedule (e.g. 2bw) and at least "
            "one synchronous one (e.g. 1f1b)"
        )
    sync = {s.name: s for s in rows if never_delays(s.policy)}
    flushed = {PIPELINE_SCHEDULES[s.name].flushed for s in rows if s.name in PIPELINE_SCHEDULES}
    named = [sync[n] for n in sorted(flushed) if n in sync]  # the async schedules' flushed order
    window = named[0] if named else max(sync.values(), key=lambda s: s.tokens_per_s)
    lines = [
        f"throughput and memory: measured, {p} ({source}); steps in a sync window run at "
        f"the measured {window.name} rate"
    ]
    return Throughputs(rows, window.tokens_per_s, stages, lines, f"{source} (measured)")


def _measured(e: dict[str, Any]) -> ScheduleThroughput:
    """One entry of a costs file; ValueError names what is wrong."""
    name = str(e["name"]).strip()
    policy = str(
        e.get("policy") or (PIPELINE_SCHEDULES[name].policy if name in PIPELINE_SCHEDULES else "")
    ).strip()
    if not policy:
        raise ValueError(f"schedule {name!r} is not one of the simulator's; give its policy")
    rate = float(e["tokens_per_s"])
    if not rate > 0:
        raise ValueError(f"{name}: tokens_per_s must be > 0, got {rate}")
    mem = e.get("peak_memory_gb") or ()
    if isinstance(mem, str):
        mem = [float(x) for x in mem.replace(";", " ").split()]
    elif isinstance(mem, int | float):
        mem = [mem]
    bubble = e.get("bubble")
    return ScheduleThroughput(
        name,
        policy,
        rate,
        float(bubble) if bubble not in (None, "") else math.nan,
        tuple(float(x) * 1e9 for x in mem),
        True,
        "measured",  # it ran, so it fit
    )
