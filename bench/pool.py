"""Pool `bench/diloco.py --json` results over seeds: each arm's share of the single → DP gap closed.

    python bench/pool.py bench/results/diloco-*.json [--json]

Runs are grouped by their cell (model n_layer × d_model, steps S, H, workers k); within a cell, each
arm is named by what it ran — outer lr, momentum, warm-up, codec, H, workers, inner optimizer — read
from its row label, so that the "defaults" row of one run pools with the same settings run as a sweep
arm in another (the shipped defaults change; the settings do not). Pooled gap closed, per corpus:

    (mean single − mean arm) / (mean single − mean DP)     over the seeds that ran that arm

which weighs each seed by its own gap (a seed with a 0.1-nat gap does not swing the pool as a ratio
would). Beside it: the per-seed gap of the worst corpus, and the seeds pooled. A corpus or arm missing
from some seeds is pooled over the seeds that have it, and the seed count is printed.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import defaultdict
from pathlib import Path
from statistics import mean
from typing import Any

LABEL_RE = re.compile(
    r"lr (?P<lr>[\d.]+) mu (?P<mu>[\d.]+)(?: warm(?P<warm0>\d+))? H (?P<h>\d+)(?P<ramp> ramp)? (?P<codec>\w+)"
    r"(?P<rest>.*)$"
)


def arm_name(label: str, workers: int) -> str | None:
    """A canonical name for a DiLoCo row (None for the single / DP rows and anything unparsed)."""
    if label.startswith("(a')"):
        return "control k=1"
    if label.startswith("(f)"):
        return label.removeprefix("(f) ")  # streaming rows are named by P, tau and layout
    found = LABEL_RE.search(label)
    if found is None:
        return None
    rest = found["rest"]
    warm = found["warm0"] or next(iter(re.findall(r"warm(\d+)", rest)), "0")
    k = next(iter(re.findall(r"k=(\d+)", rest)), str(workers))
    name = f"lr {float(found['lr']):g} mu {float(found['mu']):.2f} warm{warm} H {found['h']} {found['codec']}"
    name += " ramp" if found["ramp"] else ""
    name += " Muon" if "Muon" in rest or label.startswith("(e)") else ""
    name += f" k={k}" if int(k) != workers else ""
    return name


def cell_of(args: dict[str, Any]) -> str:
    return (
        f"{args['n_layer']}x{args['d_model']} S={args['steps']} H={args['inner_steps']} k={args['workers']}"
    )


def pool(files: list[Path]) -> dict[str, Any]:
    """{cell: {arm: {corpus: {pooled, seeds: {seed: gap}}}}, plus each cell's single / DP means."""
    runs: dict[str, dict[str, dict[int, dict[str, float]]]] = defaultdict(lambda: defaultdict(dict))
    for file in files:
        data = json.loads(file.read_text())
        args, cell = data["args"], cell_of(data["args"])
        for result in data["results"]:
            losses = {"single": result["single"], "dp": result["dp"]}
            for label, loss, _ in result["rows"]:
                name = arm_name(label, args["workers"])
                if name is not None and not math.isnan(loss):
                    losses[name] = loss
            # Another file of the same seed (a sweep run later against --known baselines) adds arms.
            runs[cell][result["corpus"]].setdefault(int(args["seed"]), {}).update(losses)
    out: dict[str, Any] = {}
    for cell, corpora in runs.items():
        arms = sorted({a for seeds in corpora.values() for r in seeds.values() for a in r} - {"single", "dp"})
        table: dict[str, Any] = {}
        for arm in arms:
            row: dict[str, Any] = {}
            for corpus, seeds in corpora.items():
                have = {s: r for s, r in seeds.items() if arm in r}
                if not have:
                    continue
                single = mean(r["single"] for r in have.values())
                dp = mean(r["dp"] for r in have.values())
                loss = mean(r[arm] for r in have.values())
                row[corpus] = {
                    "pooled": (single - loss) / (single - dp),
                    "seeds": {
                        s: (r["single"] - r[arm]) / (r["single"] - r["dp"]) for s, r in sorted(have.items())
                    },
                }
            table[arm] = row
        out[cell] = table
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--json", action="store_true", help="print the pooled table as one JSON object")
    args = parser.parse_args()
    pooled = pool(args.files)
    if args.json:
        print(json.dumps(pooled, indent=1))
        return
    for cell, table in pooled.items():
        corpora = sorted({c for row in table.values() for c in row})
        print(f"\n{cell}: pooled gap closed (seeds pooled)")
        print(
            f"{'arm':<40}"
            + "".join(f"{c[:15]:>18}" for c in corpora)
            + f"{'worst':>8}  worst corpus per seed"
        )
        for arm, row in table.items():
            cells, worst = [], math.inf
            for corpus in corpora:
                if corpus not in row:
                    cells.append(f"{'-':>18}")
                    continue
                value, n = row[corpus]["pooled"], len(row[corpus]["seeds"])
                worst = min(worst, value)
                cells.append(f"{value:>14.0%} ({n})")
            seeds = sorted({s for r in row.values() for s in r["seeds"]})
            per_seed = [min(r["seeds"][s] for r in row.values() if s in r["seeds"]) for s in seeds]
            spread = " / ".join(f"{v:.0%}" for v in per_seed)
            print(f"{arm:<40}" + "".join(cells) + f"{worst:>8.0%}  {spread} (seeds {seeds})")


if __name__ == "__main__":
    main()
