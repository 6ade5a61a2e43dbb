"""Copy the records of a sweep's finished runs into docs/results (no checkpoints, no machine
paths), so a sweep still running elsewhere can be committed as it goes.

    python benchmarks/records/collect.py /work/ol/runs/overhead-ladder docs/results/overhead-ladder

A run is finished when its metrics.jsonl holds the final whole-split evaluation
(`val_loss_full`) and no process holds its lease (`.claim.json`). Its config.json, meta.json,
metrics.jsonl and sweep.json are copied once (a run already collected is left as it is), then
`portable_meta.py` rewrites the copies' paths.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

RECORDS = ("config.json", "meta.json", "metrics.jsonl", "sweep.json")


def finished(run: Path) -> bool:
    metrics = run / "metrics.jsonl"
    return (
        metrics.is_file()
        and "val_loss_full" in metrics.read_text()
        and not (run / ".claim.json").exists()
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path, help="the sweep directory (where it runs)")
    ap.add_argument("dst", type=Path, help="its records' directory under docs/results")
    args = ap.parse_args()
    new = 0
    for run in sorted(p for p in args.src.iterdir() if p.is_dir() and not p.is_symlink()):
        if (args.dst / run.name).exists() or not finished(run):
            continue
        (args.dst / run.name).mkdir(parents=True)
        for name in RECORDS:
            if (run / name).is_file() and not (run / name).is_symlink():
                shutil.copyfile(run / name, args.dst / run.name / name)
        new += 1
    here = Path(__file__).with_name("portable_meta.py")
    subprocess.run([sys.executable, str(here), str(args.dst)], check=True)
    print(f"{new} run(s) collected into {args.dst}")


if __name__ == "__main__":
    main()
