"""Pipeline schedules as data: one ordered list of actions per rank (docs/design.md, 'Style',
rule 8).

The runtime executes these lists, the timing simulator times them, the tests diff them.

Vocabulary (docs/design.md, 'Style', rule 10):
    rank       a process / device of one pipeline replica, by its rank in the replica's pipeline
               group, 0..R-1 (`comm.Topology` gives the torch.distributed rank of pipeline rank r
               in replica d; with one replica the two are the same number, and without chunks
               pipeline rank == stage, which is how the runtime runs).
    stage      a contiguous model partition, 0..S-1 (0 = embedding side). S = R * num_chunks;
               stage s is chunk `c = s // R` of the rank its `placement` names:
               "interleaved" (Megatron's loop): rank `s % R`, so rank r holds r, r+R, ...;
               "v" (zig-zag, ZB-V / DualPipeV): rank `s % R` on even chunks and `R-1 - s % R`
               on odd ones, so with two chunks rank r holds stages r and 2R-1-r (the first and
               last stage share rank 0, stages R-1 and R share rank R-1 and hand over locally).
               Without chunks (num_chunks = 1) both give stage == rank.
    step k     one optimizer update over m microbatches (docs/design.md, 'Steps and stages').
    version v  the weights of a stage after v updates. The version every action reads comes from
               the schedule's `delay.DelaySchedule` (the one definition of staleness); a STEP
               makes the next one.

Action kinds and the communication they imply:
    F     forward of microbatch j of step k on stage s with version v. Receives the activation of
          F on stage s-1 (from rank (s-1) % R, none on stage 0, which reads tokens); sends its
          output to rank (s+1) % R (none on the last stage, which computes the loss). Stashes
          what the backward needs.
    B     full backward (input grad + weight grad) with the SAME version as its F (weight
          stashing). Receives the output gradient from the backward (B or BI) of stage s+1 (none
          on the last stage); sends the input gradient to rank (s-1) % R (none on stage 0).
          Adds the weight gradient to step k's accumulator (microbatches in ascending order).
    BI    input-gradient half of B (zero-bubble schedules): same communication as B.
    BW    weight-gradient half of B: no communication; frees the stash.
    STEP  optimizer update k of stage s: needs all m backwards of step k on s; turns the newest
          weights W_k into W_{k+1}. It reads no version (`reads` is -1) and `makes` k + 1;
          every other kind `reads` the version it computes with and makes none.
A stage in a rank's list with both s and s+1 hands over locally (no send).

Execution rule for the runtime: sends are asynchronous (isend, buffered); a rank blocks only on
its receives and on nothing else. Running each rank's list in order under this rule never
deadlocks for a schedule that passes `validate` (the validator executes it abstractly). A stage
may free weight version v after the last action in its rank's list that uses it (see
`version_last_use`), except the newest version.

Text form, one line per rank (`PipelineSchedule.to_text` / `PipelineSchedule.from_text`):
    # stalepipe-schedule name=2bw ranks=2 chunks=1 placement=interleaved microbatches=2 ...
    rank 0: F0.0@v0 F0.1@v0 B0.0@v0 ... STEP0@v1 ...
(a header without `placement=` reads as interleaved, the only placement before it existed).
Token: KIND step.microbatch @v version (STEP: KIND step @v created version), plus `:s<stage>`
when a rank holds several stages.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from stalepipe.config import DelayConfig
from stalepipe.errors import UserError
from stalepipe.training.delay.policies import DelaySchedule

KINDS = ("F", "B", "BI", "BW", "STEP")
COMPUTE_KINDS = ("F", "B", "BI", "BW")

Key = tuple[str, int, int, int]  # (kind, stage, step, microbatch); microbatch -1 for STEP
PLACEMENTS = ("interleaved", "v")  # how stages map to ranks (module docstring)


def stage_rank(placement: str, stage: int, num_ranks: int) -> int:
    """The rank that holds `stage` under `placement` (see the module docstring)."""
    chunk, i = divmod(stage, num_ranks)
    if placement == "v" and chunk % 2 == 1:
        return num_ranks - 1 - i  # odd chunks run back up the ranks
    assert placement in PLACEMENTS, placement
    return i


class ScheduleError(UserError):
    """A schedule violates the IR's rules (missing/duplicate action, dependency, version)."""


@dataclass(frozen=True, slots=True)
class Action:
    """One unit of work of a rank: see the module docstring for what each kind does."""

    kind: str
    stage: int
    step: int
    microbatch: int  # -1 for STEP
    reads: int = -1  # the weight version F/B/BI/BW compute with; -1 for STEP
    makes: int = -1  # the weight version STEP creates (step + 1); -1 for the other kinds

    @classmethod
    def step_of(cls, stage: int, step: int) -> Action:
        """STEP `step` on `stage`: makes version step + 1."""
        return cls("STEP", stage, step, -1, makes=step + 1)

    @property
    def key(self) -> Key:
        return (self.kind, self.stage, self.step, self.microbatch)

    @property
    def shown(self) -> int:
        """The version the text and CSV forms show: made by a STEP, read by the others."""
        return self.makes if self.kind == "STEP" else self.reads

    def token(self, with_stage: bool = False) -> str:
        """Compact text, e.g. `F0.3@v2` (reads v2), `STEP1@v2` (makes v2), `B2.0@v1:s5`."""
        mid = f"{self.step}" if self.kind == "STEP" else f"{self.step}.{self.microbatch}"
        tail = f":s{self.stage}" if with_stage else ""
        return f"{self.kind}{mid}@v{self.shown}{tail}"


_TOKEN = re.compile(r"^(F|BI|BW|B)(\d+)\.(\d+)@v(\d+)(?::s(\d+))?$")
_STEP_TOKEN = re.compile(r"^STEP(\d+)@v(\d+)(?::s(\d+))?$")


@dataclass(frozen=True)
class PipelineSchedule:
    """Per-rank ordered action lists plus what is needed to check and time them."""

    name: str
    num_ranks: int
    num_chunks: int
    num_microbatches: int
    num_steps: int
    delay: DelaySchedule  # the staleness the versions follow (num_stages, num_steps its own)
    ranks: tuple[tuple[Action, ...], ...]
    placement: str = "interleaved"  # stage -> rank map, one of PLACEMENTS
    _index: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        d = self.delay
        assert (d.num_stages, d.total_steps) == (self.num_stages, self.num_steps), (d, self.name)
        assert self.placement in PLACEMENTS, self.placement

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.num_chunks

    @property
    def policy(self) -> str:
        return self.delay.policy

    def rank_of(self, stage: int) -> int:
        """The rank holding `stage` (its placement's map)."""
        return stage_rank(self.placement, stage, self.num_ranks)

    def stages_of(self, rank: int) -> list[int]:
        """The stages `rank` holds, by chunk (chunk 0 first)."""
        return [s for s in range(self.num_stages) if self.rank_of(s) == rank]

    def chunk_of(self, stage: int) -> int:
        return stage // self.num_ranks

    def actions(self) -> Iterator[tuple[int, int, Action]]:
        """(rank, position in the rank's list, action) for every action."""
        for r, acts in enumerate(self.ranks):
            for i, a in enumerate(acts):
                yield r, i, a

    def expected_version(self, stage: int, step: int) -> int:
        """The version step `step` reads on `stage`, from the delay policy (docs/design.md,
        'The delay contract')."""
        return self.delay.version(stage, step)

    def backward_kind(self, stage: int, step: int, microbatch: int) -> str:
        """'BI' if this microbatch's backward on `stage` is split, else 'B'."""
        if not self._index:
            self._index.update({a.key: (r, i) for r, i, a in self.actions()})
        return "BI" if ("BI", stage, step, microbatch) in self._index else "B"

    # ---- text and CSV ------------------------------------------------------------------------

    def header(self) -> str:
        return (
            f"# stalepipe-schedule name={self.name} ranks={self.num_ranks} "
            f"chunks={self.num_chunks} placement={self.placement} "
            f"microbatches={self.num_microbatches} "
            f"steps={self.num_steps} policy={self.policy} sync_start={self.delay.sync_start} "
            f"sync_cooldown={self.delay.sync_cooldown}"
        )

    def to_text(self) -> str:
        """The compact text form (module docstring); `from_text` reads it back."""
        many = self.num_chunks > 1
        lines = [self.header()]
        for r, acts in enumerate(self.ranks):
            lines.append(f"rank {r}: " + " ".join(a.token(many) for a in acts))
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> PipelineSchedule:
        """Parse `to_text` output; raises ScheduleError naming the bad line or token."""
        lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
        if not lines or not lines[0].startswith("# stalepipe-schedule "):
            raise ScheduleError("schedule text must start with '# stalepipe-schedule ...'")
        meta = dict(kv.split("=", 1) for kv in lines[0].split()[2:])
        try:
            num_ranks, num_chunks = int(meta["ranks"]), int(meta["chunks"])
            num_steps = int(meta["steps"])
            placement = meta.get("placement", "interleaved")
            if placement not in PLACEMENTS:
                raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}")
            sched_meta = dict(
                name=meta["name"],
                num_ranks=num_ranks,
                num_chunks=num_chunks,
                placement=placement,
                num_microbatches=int(meta["microbatches"]),
                num_steps=num_steps,
                delay=DelaySchedule.build(
                    DelayConfig(
                        policy=meta["policy"],
                        sync_start=int(meta.get("sync_start", 0)),
                        sync_cooldown=float(meta.get("sync_cooldown", 0.0)),
                    ),
                    num_ranks * num_chunks,
                    num_steps,
                ),
            )
        except (KeyError, ValueError) as e:
            raise ScheduleError(f"bad schedule header {lines[0]!r}: {e}") from None
        ranks: list[tuple[Action, ...]] = []
        for r, line in enumerate(lines[1:]):
            prefix = f"rank {r}:"
            if not line.startswith(prefix):
                raise ScheduleError(f"expected line starting with {prefix!r}, got {line[:30]!r}")
            ranks.append(tuple(_parse_token(t, r, num_ranks) for t in line[len(prefix) :].split()))
        if len(ranks) != num_ranks:
            raise ScheduleError(f"header says {num_ranks} ranks but {len(ranks)} rank lines")
        return cls(ranks=tuple(ranks), **sched_meta)

    def to_csv(self, path: str | None = None) -> str:
        """One row per action: rank, index, kind, stage, chunk, step, microbatch, version (the
        one it reads; for STEP the one it makes, as in the text form)."""
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["rank", "index", "kind", "stage", "chunk", "step", "microbatch", "version"])
        for r, i, a in self.actions():
            w.writerow(
                [r, i, a.kind, a.stage, self.chunk_of(a.stage), a.step, a.microbatch, a.shown]
            )
        if path is not None:
            with open(path, "w") as f:
                f.write(buf.getvalue())
        return buf.getvalue()


def _parse_token(tok: str, rank: int, num_ranks: int) -> Action:
    if m := _TOKEN.match(tok):
        kind, k, j, v, s = m.groups()
        stage = int(s) if s is not None else rank
        return Action(kind, stage, int(k), int(j), reads=int(v))
    if m := _STEP_TOKEN.match(tok):
        k, v, s = m.groups()
        stage = int(s) if s is not None else rank
        return Action("STEP", stage, int(k), -1, makes=int(v))
    raise ScheduleError(f"bad action token {tok!r} on rank {rank} (e.g. F0.3@v2, STEP0@v1)")


# --------------------------------------------------------------------------------------------
# Dependencies, validation, order-based memory figures
# --------------------------------------------------------------------------------------------


def dependencies(sched: PipelineSchedule, a: Action) -> list[tuple[Key, str | None]]:
    """What `a` waits for besides its predecessor in its rank's list: (key, message) pairs where
    message is 'act' (activation received from another stage), 'grad' (gradient received), or
    None (local: stash, weight version, accumulated gradients)."""
    s, k, j = a.stage, a.step, a.microbatch
    if a.kind == "F":
        deps: list[tuple[Key, str | None]] = []
        if s > 0:
            deps.append((("F", s - 1, k, j), "act"))
        if a.reads > 0:  # the version it reads must exist: made by update `reads` - 1
            deps.append((("STEP", s, a.reads - 1, -1), None))
        return deps
    if a.kind in ("B", "BI"):
        deps = [(("F", s, k, j), None)]
        if s < sched.num_stages - 1:
            deps.append(((sched.backward_kind(s + 1, k, j), s + 1, k, j), "grad"))
        return deps
    if a.kind == "BW":
        return [(("BI", s, k, j), None)]
    assert a.kind == "STEP", a
    deps = [
        ((("BW" if sched.backward_kind(s, k, jj) == "BI" else "B"), s, k, jj), None)
        for jj in range(sched.num_microbatches)
    ]
    if k > 0:
        deps.append((("STEP", s, k - 1, -1), None))
    return deps


def execution_order(sched: PipelineSchedule) -> list[tuple[int, Action]]:
    """Execute the rank lists abstractly (any timing): a rank runs its next action once all its
    dependencies ran. Returns the global order; raises ScheduleError on a deadlock, i.e. a
    dependency that comes later in its own rank's list or a cycle between ranks."""
    ptr = [0] * sched.num_ranks
    done: set[Key] = set()
    order: list[tuple[int, Action]] = []
    total = sum(len(acts) for acts in sched.ranks)
    while len(order) < total:
        progressed = False
        for r, acts in enumerate(sched.ranks):
            while ptr[r] < len(acts):
                a = acts[ptr[r]]
                if any(key not in done for key, _ in dependencies(sched, a)):
                    break
                done.add(a.key)
                order.append((r, a))
                ptr[r] += 1
                progressed = True
        if not progressed:
            stuck = []
            for r, acts in enumerate(sched.ranks):
                if ptr[r] < len(acts):
                    a = acts[ptr[r]]
                    miss = [key for key, _ in dependencies(sched, a) if key not in done]
                    stuck.append(f"rank {r} at {a.token(True)} waits for {miss[0]}")
            raise ScheduleError("deadlock: " + "; ".join(stuck[:3]))
    return order


def validate(sched: PipelineSchedule) -> None:
    """Raise ScheduleError unless: every (stage, step, microbatch) is forwarded once and
    backwarded once (B, or BI and BW) on the rank owning the stage; every (stage, step) updated
    once; versions are the delay policy's; the lists execute without deadlock (dependencies,
    versions created before use); no stage keeps more weight versions than the policy needs."""
    S, N, m = sched.num_stages, sched.num_steps, sched.num_microbatches
    if len(sched.ranks) != sched.num_ranks:
        raise ScheduleError(f"{len(sched.ranks)} rank lists for {sched.num_ranks} ranks")
    seen: dict[Key, int] = {}
    for r, _, a in sched.actions():
        if a.kind not in KINDS:
            raise ScheduleError(f"unknown action kind {a.kind!r}")
        if not (0 <= a.stage < S and 0 <= a.step < N):
            raise ScheduleError(f"{a.token(True)} out of range (stages {S}, steps {N})")
        if a.kind != "STEP" and not 0 <= a.microbatch < m:
            raise ScheduleError(f"{a.token(True)}: microbatch out of range ({m} per step)")
        if sched.rank_of(a.stage) != r:
            raise ScheduleError(
                f"{a.token(True)} on rank {r}, but stage {a.stage} lives on "
                f"rank {sched.rank_of(a.stage)}"
            )
        if a.key in seen:
            raise ScheduleError(f"{a.token(True)} appears twice")
        seen[a.key] = r
        if a.kind == "STEP":
            if (a.reads, a.makes) != (-1, a.step + 1):
                raise ScheduleError(f"{a.token(True)} must make version {a.step + 1}")
        elif a.makes != -1 or a.reads != sched.expected_version(a.stage, a.step):
            want = sched.expected_version(a.stage, a.step)
            raise ScheduleError(
                f"{a.token(True)} reads version {a.reads}; policy {sched.policy!r} says {want}"
            )
    for s in range(S):
        for k in range(N):
            if ("STEP", s, k, -1) not in seen:
                raise ScheduleError(f"missing STEP{k} on stage {s}")
            for j in range(m):
                tok = f"{k}.{j} on stage {s}"
                if ("F", s, k, j) not in seen:
                    raise ScheduleError(f"missing forward F{tok}")
                full, split = ("B", s, k, j) in seen, ("BI", s, k, j) in seen
                if full == split or split != (("BW", s, k, j) in seen):
                    raise ScheduleError(f"microbatch {tok} needs one B, or one BI and one BW")
    execution_order(sched)
    need = [t + 1 for t in sched.delay.max_tau]
    for s, have in enumerate(peak_versions(sched)):
        if have > need[s]:
            raise ScheduleError(f"stage {s} keeps {have} weight versions; policy needs {need[s]}")


def _stage_lists(sched: PipelineSchedule) -> dict[int, list[Action]]:
    out: dict[int, list[Action]] = {s: [] for s in range(sched.num_stages)}
    for _, _, a in sched.actions():
        out[a.stage].append(a)
    return out


def version_last_use(sched: PipelineSchedule) -> dict[tuple[int, int], int]:
    """(stage, version) -> position in the rank's list of the last action using that version;
    the runtime may free the version right after it (unless it is the newest)."""
    last: dict[tuple[int, int], int] = {}
    for _, i, a in sched.actions():
        if a.kind != "STEP":
            last[(a.stage, a.reads)] = i
    return last


def peak_versions(sched: PipelineSchedule) -> list[int]:
    """Per stage, the most weight versions alive at once. A version lives from the update that
    creates it until both its last use and the creation of the next version (the newest is
    always kept); it follows from each rank's order alone, not from timing."""
    out = []
    for acts in _stage_lists(sched).values():
        born: dict[int, int] = {0: -1}
        last: dict[int, int] = {}
        for i, a in enumerate(acts):
            if a.kind == "STEP":
                born[a.makes] = i
            else:
                last[a.reads] = i
        end = {v: max(last.get(v, b) + 1, born.get(v + 1, len(acts) + 1)) for v, b in born.items()}
        out.append(max(sum(born[v] <= p < end[v] for v in born) for p in born.values()))
    return out


def peak_activations(sched: PipelineSchedule) -> list[int]:
    """Per stage, the most microbatches stashed at once (forwarded, final backward not done)."""
    out = []
    for acts in _stage_lists(sched).values():
        live = peak = 0
        for a in acts:
            live += a.kind == "F"
            live -= a.kind in ("B", "BW")
            peak = max(peak, live)
        out.append(peak)
    return out


def observed_staleness(sched: PipelineSchedule) -> list[int]:
    """Per stage, the largest step - version over its forwards (clamping makes early steps
    fresher than the policy's nominal tau)."""
    out = [0] * sched.num_stages
    for _, _, a in sched.actions():
        if a.kind == "F":
            out[a.stage] = max(out[a.stage], a.step - a.reads)
    return out
