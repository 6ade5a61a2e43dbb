"""What one checkpoint costs to save and to load: today's format against the pickled one it
replaced, verified and unverified, side by side.

Run: OMP_NUM_THREADS=1 python benchmarks/speed/checkpoint_cost.py [--repeats 3] [--skip-smollm]

Each contender is the emulator engine a run trains with (`train.emulated.EmulatorEngine`, on
CPU, fp32) at `--stages` pipeline stages: `cpu-small`, and `smollm-135m` (the preset's model
shape, trained here on small batches of the packaged excerpt). After a few steps its state is
written `--repeats` times in each format, one shard per stage as the runtime's processes write
them (`flatten_part` of the stage's state; here one after the other in one process):

- `v3`: today's format (issue 50): `rundir.sharded.save_part` (DCP's
  `HuggingFaceStorageWriter`, safetensors, then every shard hashed) and the commit;
- `v2`: the format it replaced: the same state with DCP's `FileSystemWriter` (a pickled
  `.metadata` and `.distcp` files), no digests.

Loading is measured per rank, each load in a fresh spawned process (so its peak RSS is its
own): rank r re-splits the checkpoint for stage r (`checkpoint_parts.stage_state`).
- `v3`: as every load reads: headers parsed and bounded, every byte read checked against the
  SHA-256 the save recorded;
- `v3-nover`: the same with `STALEPIPE_VERIFY=0` (the tensors' digests skipped; the headers,
  sizes and small files' digests stay);
- `v2-torch`: the old format through torch's own `FileSystemReader` (plain `pickle.load` of
  `.metadata`, no checks): how loads read before issue 39, the cost floor.
`read MB` is the bytes the process read from files (`rchar` of /proc/self/io, page cache
included), `peak MB` its peak RSS above its RSS before the load. `hash s` is what hashing the
written shards by reading them back costs (`verified.shard_digests` without the writer's
digests); a v3 save hashes while it writes instead, and `save s` includes that. The median of
the repeats is reported, and verification's cost as the median of paired v3 / v3-nover loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from stalepipe.config import DataConfig, ExperimentConfig, apply_overrides
from stalepipe.presets import get_preset
from stalepipe.training.data import prepare_corpus
from stalepipe.training.rundir import verified
from stalepipe.training.rundir.checkpoint import commit_checkpoint, open_checkpoint
from stalepipe.training.rundir.checkpoint_parts import flatten_part, saved_split, stage_state
from stalepipe.training.rundir.sharded import save_part
from stalepipe.training.schedules.plan import StepPlan
from stalepipe.training.train.distributed import SINGLE_PROCESS
from stalepipe.training.train.emulated import EmulatorEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root: benchmarks.*
from benchmarks.common import parser, pin_threads, proc_status_kb, timing_args

POLICIES = {"sync": {"delay.policy": "sync"}, "2bw+ef": {"delay.policy": "2bw", "delay.ef": "true"}}


def contenders(args: argparse.Namespace) -> list[tuple[str, ExperimentConfig]]:
    """(label, config) per model and policy, each training `args.steps` steps on CPU."""
    models = [("cpu-small", {})]
    if not args.skip_smollm:
        smollm = {  # the preset's model; CPU, fp32, a batch that fits a two-core machine
            "train.device": "cpu",
            "train.dtype": "float32",
            "data.tokenizer": "byte",
            "data.seq_len": str(args.smollm_seq),
            "train.batch_size": str(args.smollm_batch),
            "train.num_microbatches": "1",
        }
        models.append(("smollm-135m", smollm))
    out = []
    for preset, model_overrides in models:
        for policy, delay in POLICIES.items():
            cfg = apply_overrides(
                get_preset(preset),
                {
                    **model_overrides,
                    **delay,
                    "pipeline.num_stages": str(args.stages),
                    "train.num_steps": str(args.steps + 1),
                    "train.warmup_steps": "0",
                    "train.progress": "false",
                },
            )
            out.append((f"{preset} {policy}", cfg))
    return out


def _status_mb(field: str) -> float:
    """VmRSS (now) or VmHWM (peak) of this process, in MiB; ru_maxrss would carry the
    spawning parent's peak across exec."""
    return proc_status_kb(field) / 1024


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


class _PlainV2:
    """A format-2 directory read as loads read before issue 39: torch's `FileSystemReader`
    (plain `pickle.load` of each `.metadata`), no checks; the `FlatState` `stage_state` asks."""

    def __init__(self, path: Path) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        self.shards = sorted(p for p in path.iterdir() if p.name.startswith("rank_"))
        self.metas = [json.loads((d / "state.json").read_text()) for d in self.shards]
        for meta in self.metas:
            for g in meta["param_groups"]:
                g.update(
                    {
                        k: tuple(v)
                        for k, v in g.items()
                        if isinstance(v, list) and k != "param_names"
                    }
                )
        self.md = {d: FileSystemReader(d).read_metadata() for d in self.shards}
        self.where = {k: d for d, md in self.md.items() for k in md.state_dict_metadata}

    def stored_keys(self) -> set[str]:
        return set(self.where)

    def read(self, keys) -> dict:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        out: dict[Path, dict] = {}
        for k in keys:
            e = self.md[self.where[k]].state_dict_metadata[k]
            out.setdefault(self.where[k], {})[k] = torch.empty(e.size, dtype=e.properties.dtype)
        for d, want in out.items():
            dcp.load(want, storage_reader=FileSystemReader(d), no_dist=True)
        return {k: t for want in out.values() for k, t in want.items()}


def _load_rank(path: str, stage: int, threads: int, fmt: str) -> dict:
    """One rank's load, in its own process: what `PipelineEngine._resume` reads for `stage`."""
    import warnings

    import torch.distributed.checkpoint  # noqa: F401 - imported before the clock starts

    warnings.filterwarnings("ignore")
    if fmt == "v3-nover":
        os.environ[verified.VERIFY_ENV] = "0"
    pin_threads(threads)
    base_rss, base_read, t = _status_mb("VmRSS"), _rchar(), time.perf_counter()
    flat = _PlainV2(Path(path)) if fmt == "v2-torch" else open_checkpoint(Path(path))
    _, _, names = saved_split(flat)
    stage_state(
        flat, [stage], names, {"state": {}, "param_groups": []}, [set()] * len(names)
    )  # reads every kept version
    seconds = time.perf_counter() - t
    peak = _status_mb("VmHWM") - base_rss
    return {"s": seconds, "read": (_rchar() - base_read) / 2**20, "peak": peak}


def _save_both(engine: EmulatorEngine, cfg: ExperimentConfig, run_dir: Path, step: int) -> dict:
    """Write the state at `step` in both formats; seconds each."""
    import warnings

    import torch.distributed.checkpoint as dcp

    delayed = engine.emulator.delayed.state_dict()
    weights = dict(engine.model.named_parameters())  # a tied head once, as its owner
    parts = []
    for s, names in enumerate(delayed["names"]):
        own = {n: weights[n].detach() for n in names}
        parts.append(flatten_part(delayed, [s], own, torch.get_rng_state() if s == 0 else None))
    t = time.perf_counter()
    shards = [save_part(run_dir, step, s, tensors, meta) for s, (tensors, meta) in enumerate(parts)]
    manifest = {"config": cfg.to_dict(), "ranks": list(range(len(parts)))}
    final = commit_checkpoint(run_dir, step, manifest, keep_last=10**6)
    new = time.perf_counter() - t
    t = time.perf_counter()
    for shard in shards:  # the hashing save_part did, again on the same files
        verified.shard_digests(final / shard.name)
    hashed = time.perf_counter() - t
    t = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s, (tensors, meta) in enumerate(parts):
            where = run_dir / "v2" / f"rank_{s:03d}"
            where.mkdir(parents=True)
            (where / "state.json").write_text(json.dumps(meta))
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(where), no_dist=True)
    old = time.perf_counter() - t
    return {"v2": old, "v3": new, "hash": hashed}


def measure(cfg: ExperimentConfig, data_dir: Path, run_dir: Path, args) -> dict:
    """Train, then save `args.repeats` times in both formats and load each rank's part."""
    run_dir.mkdir(parents=True)
    engine = EmulatorEngine(cfg, SINGLE_PROCESS, torch.device("cpu"), data_dir, run_dir, None)
    for _ in engine.steps(StepPlan(cfg.train)):
        pass
    step = cfg.train.num_steps
    for i in range(args.repeats):
        (run_dir / f"r{i}").mkdir()
    saves = [_save_both(engine, cfg, run_dir / f"r{i}", step) for i in range(args.repeats)]
    pool = mp.get_context("spawn")
    out = {"save": saves, "load": {}}
    for fmt, name in (
        ("v3", f"ckpt_{step:08d}"),
        ("v3-nover", f"ckpt_{step:08d}"),
        ("v2-torch", "v2"),
    ):
        for r in range(cfg.pipeline.num_stages):
            runs = []
            for i in range(args.repeats):
                with pool.Pool(1) as p:
                    where = str(run_dir / f"r{i}" / name)
                    runs.append(p.apply(_load_rank, (where, r, 1, fmt)))
            out["load"][fmt, r] = runs
        files = [p for p in (run_dir / "r0" / name).rglob("*") if p.is_file()]
        out[fmt + "_mb"] = sum(p.stat().st_size for p in (files or [run_dir / "r0" / name]))
    return out


def _print(label: str, m: dict, stages: int) -> None:
    med = statistics.median
    for fmt in ("v3", "v3-nover", "v2-torch"):
        save = med(s[fmt.split("-")[0]] for s in m["save"])
        hashed = f"{med(s['hash'] for s in m['save']):.2f}" if fmt == "v3" else ""
        for r in range(stages):
            runs = m["load"][fmt, r]
            print(
                f"{label:<20}{fmt:>10}{m[fmt + '_mb'] / 2**20:>9.1f}{save:>8.2f}{hashed:>8}"
                f"{r:>6}{med(x['s'] for x in runs):>8.2f}{med(x['read'] for x in runs):>9.1f}"
                f"{med(x['peak'] for x in runs):>9.1f}",
                flush=True,
            )
    for r in range(stages):  # verification's share of one rank's load, paired by repeat
        ratio = [a["s"] / b["s"] for a, b in zip(m["load"]["v3", r], m["load"]["v3-nover", r])]
        print(
            f"{label:<20}  rank {r}: verified / unverified load {med(ratio):.3f} (median of pairs)"
        )


def main() -> None:
    ap = parser(__doc__)
    timing_args(ap, repeats=3, threads=1)  # repeats: saves and loads per contender
    ap.add_argument("--steps", type=int, default=2, help="training steps before the saves")
    ap.add_argument("--stages", type=int, default=2, help="pipeline stages (= runtime ranks)")
    ap.add_argument("--smollm-batch", type=int, default=2, help="sequences per smollm step")
    ap.add_argument("--smollm-seq", type=int, default=256, help="tokens per smollm sequence")
    ap.add_argument("--skip-smollm", action="store_true", help="only cpu-small (fast)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary dir)")
    args = ap.parse_args()
    pin_threads(args.threads)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        data_dir = prepare_corpus(
            DataConfig(corpus="excerpt", data_dir=f"{tmp}/data"), progress=False
        )
        print(
            f"{args.stages} stages, {args.threads} thread(s), median of {args.repeats}; load = "
            f"one rank's load in a fresh process (read: bytes read, peak: RSS above its start)"
        )
        print(
            f"{'contender':<20}{'fmt':>10}{'ckpt MB':>9}{'save s':>8}{'hash s':>8}{'rank':>6}"
            f"{'load s':>8}"
            f"{'read MB':>9}{'peak MB':>9}"
        )
        for i, (label, cfg) in enumerate(contenders(args)):
            cfg = dataclasses.replace(cfg, name=f"c{i}", out_dir=tmp)
            _print(label, measure(cfg, Path(data_dir), Path(tmp) / f"c{i}", args), args.stages)
            shutil.rmtree(Path(tmp) / f"c{i}")  # free the disk before the next contender


if __name__ == "__main__":
    main()
