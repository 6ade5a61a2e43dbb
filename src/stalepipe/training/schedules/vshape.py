"""V-shape schedules: ZB-V and DualPipeV, two chunks per rank in the "v" placement.

Rank r of R holds stage `lo = r` (chunk 0, on the way down) and stage `hi = 2R-1-r` (chunk 1,
on the way back up), so a microbatch runs down the ranks and back: rank 0 holds the embedding
and the loss, rank R-1 hands stage R-1 to stage R without a message. Both schedules split the
backward (BI, then a deferred BW) and flush every step: they are synchronous (policy `sync`).
Each step's op list is written per rank from counters (the next microbatch of each kind on each
stage); a STEP goes right after its stage's last op of the step.

Not modelled here: DualPipe's overlap of a forward and a backward of two microbatches inside one
"F&B" cell (it hides the expert-parallel all-to-all of MoE models): here the pair is the forward
followed by the backward, so F&B = F + B. The cost of the pair and its order are what the action
order can express; the cluster model charges the overlap of the all-to-alls on top
(`lab.sim.hybrid.a2a_exposed`).
"""

from __future__ import annotations

from collections import defaultdict, deque

from stalepipe.config import ConfigError
from stalepipe.training.delay.policies import DelaySchedule
from stalepipe.training.schedules.build import Op, build_schedule, check_sizes
from stalepipe.training.schedules.schedule import PipelineSchedule


class _RankStep:
    """One rank's ops of one step, written in order; counts the next microbatch of each
    (kind, stage) so a phase only says which kind comes next on which stage. Microbatches at
    or past `num_microbatches` are skipped (ZB-V's order is written for at least 2R-1)."""

    def __init__(self, step: int, num_microbatches: int) -> None:
        self.step, self.m = step, num_microbatches
        self.ops: list[Op] = []
        self.count: defaultdict[tuple[str, int], int] = defaultdict(int)
        self.deferred: deque[tuple[int, int]] = deque()  # (stage, microbatch) awaiting BW

    def add(self, kind: str, stage: int) -> None:
        """The next F, B or BI of `stage` (B and BI share one counter: the stage's backward),
        or the next BW of `stage` in microbatch order."""
        key = (kind if kind in ("F", "BW") else "back", stage)
        j = self.count[key]
        self.count[key] += 1
        if kind == "BI":
            self.deferred.append((stage, j))
        if j < self.m:
            self.ops.append((kind, stage, self.step, j))

    def weight(self) -> None:
        """The oldest deferred weight gradient, whichever stage it belongs to (DualPipe's
        queue); nothing when none is deferred."""
        if self.deferred:
            stage, j = self.deferred.popleft()
            if j < self.m:
                self.ops.append(("BW", stage, self.step, j))

    def with_steps(self) -> list[Op]:
        """The ops with each stage's STEP right after that stage's last op of the step."""
        last = {op[1]: i for i, op in enumerate(self.ops)}
        out: list[Op] = []
        for i, op in enumerate(self.ops):
            out.append(op)
            if last[op[1]] == i:
                out.append(("STEP", op[1], self.step, -1))
        return out


def _zb_v_step(r: int, R: int, k: int, m: int) -> list[Op]:
    """Rank r's ZB-V order for step k (Qi et al., section 6; torch's ScheduleZBVZeroBubble):
    fill the V with forwards, run F/BI/BW of both chunks in turn, drain input gradients first
    and fill the tail with the deferred weight gradients."""
    lo, hi, n = r, 2 * R - 1 - r, max(m, 2 * R - 1)
    w = _RankStep(k, m)
    for _ in range(2 * (R - r) - 1):  # fill: the microbatches in flight below this rank
        w.add("F", lo)
    for _ in range(r):
        w.add("F", hi), w.add("F", lo)
    for _ in range(R - r):  # first backwards on the way up, weight gradients at once
        w.add("F", hi), w.add("BI", hi), w.add("BW", hi)
    while w.count[("F", hi)] < w.count[("F", lo)] or w.count[("F", lo)] < n:
        if w.count[("F", lo)] < n:
            w.add("F", lo)
        w.add("BI", lo), w.add("BW", lo)
        w.add("F", hi), w.add("BI", hi), w.add("BW", hi)
    for _ in range(r):  # drain: input gradients first, they are on the critical path
        w.add("BI", lo), w.add("BI", hi)
    for _ in range(R - r):
        w.add("BI", lo), w.add("BW", lo)
    for stage in (hi, lo):  # the deferred weight gradients fill the tail
        while w.count[("BW", stage)] < n:
            w.add("BW", stage)
    return w.with_steps()


def zb_v(delay: DelaySchedule, num_microbatches: int, **_: object) -> PipelineSchedule:
    """ZB-V (Qi et al. ICLR'24, "Zero Bubble Pipeline Parallelism", section 6): two chunks
    per rank in a V, split backward. With F = BI = BW its steady state has no bubble and every
    rank stashes at most 2R chunk-microbatches, i.e. R microbatches of one rank's share: 1F1B's
    peak. Any m (the order is written for max(m, 2R-1) and the missing microbatches dropped,
    as torch does). Synchronous: flush and update every step."""
    R, m = check_sizes(delay, num_microbatches, 2), num_microbatches
    orders = [
        [op for k in range(delay.total_steps) for op in _zb_v_step(r, R, k, m)] for r in range(R)
    ]
    return build_schedule("zb-v", delay, 2, m, orders, placement="v")


def _dualpipev_step(r: int, R: int, k: int, m: int) -> list[Op]:
    """Rank r's DualPipeV order for step k (deepseek-ai/DualPipe dualpipev.py; torch's
    ScheduleDualPipeV), in its eight phases. A forward/backward pair of the main phase is the
    forward, then the backward."""
    lo, hi, w = r, 2 * R - 1 - r, _RankStep(k, m)
    for _ in range(2 * (R - r - 1)):  # 1: forwards on the way down
        w.add("F", lo)
    for _ in range(r + 1):  # 2: down and back up
        w.add("F", lo), w.add("F", hi)
    for _ in range(R - r - 1):  # 3: first backwards of chunk 1, weight gradient at once
        w.add("BI", hi), w.weight(), w.add("F", hi)
    for _ in range(m - 2 * R + r + 1):  # 4: main phase, two F&B pairs
        w.add("F", lo), w.add("B", hi), w.add("F", hi), w.add("B", lo)
    for _ in range(R - r - 1):  # 5: chunk 1's forwards run out
        w.add("B", hi), w.add("F", hi), w.add("B", lo)
    for i in range(r + 1):  # 6: backwards only; the second half defers weight gradients
        split_hi = i > (r + 1) // 2 or (i == (r + 1) // 2 and r % 2 == 1)
        w.add("BI" if split_hi else "B", hi)
        w.add("BI" if i >= (r + 1) // 2 else "B", lo)
    for _ in range(R - r - 1):  # 7: weight gradients fill the wait for chunk 0's backwards
        w.weight(), w.add("BI", lo)
    while w.deferred:  # 8: the rest of the weight gradients
        w.weight()
    return w.with_steps()


def dualpipev(delay: DelaySchedule, num_microbatches: int, **_: object) -> PipelineSchedule:
    """DualPipeV (DeepSeek-V3's DualPipe cut in half, Sea AI Lab; deepseek-ai/DualPipe): two
    chunks per rank in a V, a main phase of forward/backward pairs of two microbatches, split
    backward at the ends. Bubble (PP/2-1)(F&B + B - 3W) with PP = 2R stages, each rank holds
    2 of the 2R stages (1x its share of the parameters) and stashes up to 2R+1 chunk-
    microbatches (PP+1). Needs m >= 2R, as the reference does. Synchronous."""
    R, m = check_sizes(delay, num_microbatches, 2), num_microbatches
    if m < 2 * R:
        raise ConfigError(
            f"dualpipev needs --microbatches >= 2 x stages = {2 * R} (got {m}); raise "
            f"--microbatches or use fewer --stages"
        )
    orders = [
        [op for k in range(delay.total_steps) for op in _dualpipev_step(r, R, k, m)]
        for r in range(R)
    ]
    return build_schedule("dualpipev", delay, 2, m, orders, placement="v")
