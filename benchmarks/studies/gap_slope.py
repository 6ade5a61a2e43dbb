"""gap = sync slope x ln(token overhead), tested on sweeps with complete runs at several lengths
(issue 51, item 3; `analysis.lengths.slope_relations`, the table `stalepipe report` prints).

    python benchmarks/studies/gap_slope.py docs/results/lengths-regime docs/results/ladder-regime

Per delayed configuration: the overhead implied by its equal-token gap and sync's final slope
(least squares over sync's complete runs at 1-1.5x), beside the overhead measured where its
final losses cross sync's 1x final loss (mean and 95 % t-interval over the same seeds).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from stalepipe.lab.analysis import lengths
from stalepipe.lab.analysis.results import build_rows, load_runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweeps", nargs="+", help="sweep directories")
    for root in ap.parse_args().sweeps:
        for r in lengths.slope_relations(build_rows(load_runs(Path(root)))):
            print(f"{root}: {r.label}: {r.describe()}")


if __name__ == "__main__":
    main()
