"""Mixed rounds: how much a folded, stale delta should weigh beside fresh ones.

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/mixed_folds.py [--folds 2,4] [--cut 2] [--seeds 0,1]

In the chaos soaks (docs/guides/chaos.md) some workers fold several sync points into one delta while
the others keep syncing: a wait for a global that gave up in a storm, an upload that retried. Their
delta arrives in a round of fresh ones, built on a global s outer steps old and standing for r sync
points of work. The master weighs each delta by its tokens × 1/(1+s) (outer.staleness_weight) and, with
`clipped_mean`, scales it to at most the round's median norm. What the tokens may claim is the rule
this bench compares (master/checks.py TokenCapCheck):

  spanned  r rounds' tokens (the claim cap per round spanned; shipped 2026-12-07)
  one      one round's tokens (the cap before: every claim capped at the round's median)
  drop     the folded delta is not applied (its work is lost; the baseline of an outage)

8 workers in one process (bench/diloco.py's Setup: the soak's model, data and inner optimizer), H = 10,
the shipped outer step (0.7, Nesterov 0.8, warm-up 10) and aggregation. From round --start on, every
--every rounds the next --cut workers (in turn) are cut off for r sync points: they train on from the
global they have, the master steps with the others, then their folded delta (staleness r − 1) joins a
round of fresh ones. A twin with no cut-off runs beside. Reported per rule and r, pooled over seeds:
the global's val loss minus the twin's at the end and its mean over the last 20 rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diloco import Setup, inner_step
from folds import add_soak_model_args

from speedtronic.config.distributed import DistributedConfig
from speedtronic.diloco import codec
from speedtronic.diloco.outer import OuterOptimizer, aggregate, staleness_weight

RULES = ("spanned", "one", "drop")


def claimed_rounds(rule: str, r: int) -> float:
    """The rounds of tokens a delta folded over r sync points may claim under `rule`."""
    return float(r) if rule == "spanned" else 1.0


def cut_off(args: argparse.Namespace, index: int, r: int) -> tuple[set[int], int | None]:
    """(the workers cut off at round `index`, the round they rejoin in, when this is one)."""
    if index < args.start:
        return set(), None
    phase, offset = divmod(index - args.start, args.every)
    if offset >= r:
        return set(), None
    first = (phase * args.cut) % args.workers
    workers = {(first + i) % args.workers for i in range(args.cut)}
    return workers, index - offset + r - 1


def run(setup: Setup, args: argparse.Namespace, rule: str | None, r: int) -> list[float]:
    """The global's val loss after each round (rule None: the twin, nobody cut off)."""
    workers = [setup.worker(seed=100 + w) for w in range(args.workers)]
    outer = OuterOptimizer(codec.snapshot(workers[0][0]), 0.7, 0.8, 10)
    method, limit = DistributedConfig().defences.aggregation, DistributedConfig().rounds.max_staleness
    base = {w: (0, codec.snapshot(workers[0][0])) for w in range(args.workers)}  # outer step, weights
    losses = []
    for index in range(args.rounds):
        cut, rejoin = cut_off(args, index, r) if rule is not None else (set(), None)
        items, spans = [], []
        for w, (model, opt, sched, gen) in enumerate(workers):
            for _ in range(args.inner_steps):
                inner_step(setup, model, opt, sched, gen, setup.args.batch)
            if w in cut and index != rejoin:
                continue  # cut off: no delta this round, no global
            step, weights = base[w]
            local = codec.snapshot(model)
            folded = r if w in cut else 1
            weight = staleness_weight(outer.steps - step, limit)
            if weight is None or (folded > 1 and rule == "drop"):
                continue
            items.append(
                ({n: weights[n] - local[n] for n in local}, claimed_rounds(rule or "", folded) * weight)
            )
            spans.append((folded, items[-1][1]))
        outer.step(aggregate(items, method), spans=spans)
        for w, (model, *_) in enumerate(workers):
            if w in cut and index != rejoin:
                continue
            with torch.no_grad():
                for name, p in codec.unique_params(model).items():
                    p.copy_(outer.weights[name])
            base[w] = (outer.steps, {n: t.clone() for n, t in outer.weights.items()})
        losses.append(setup.evaluate(workers[0][0]))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=90)
    parser.add_argument("--start", type=int, default=20, help="the first round with workers cut off")
    parser.add_argument("--every", type=int, default=8, help="rounds between cut-offs")
    parser.add_argument("--cut", type=int, default=2, help="workers cut off each time")
    parser.add_argument("--folds", default="2,4", help="r: sync points folded (at most max_staleness + 1)")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--rules", default=",".join(RULES))
    add_soak_model_args(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows: dict[str, list[tuple[float, float]]] = {}
    for seed in map(int, args.seeds.split(",")):
        setup = Setup(argparse.Namespace(**vars(args), steps=20_000, seed=seed, text=None))
        twin = run(setup, args, None, 1)
        for r in map(int, args.folds.split(",")):
            for rule in args.rules.split(","):
                arm = run(setup, args, rule, r)
                excess = [a - b for a, b in zip(arm, twin, strict=True)]
                end, tail = excess[-1], statistics.mean(excess[-20:])
                rows.setdefault(f"{rule} r={r}", []).append((end, tail))
                print(
                    f"seed {seed} r={r} {rule:<8} end {end:+.4f} · last 20 rounds {tail:+.4f} "
                    f"(twin {twin[-1]:.4f})",
                    flush=True,
                )
    summary = {
        k: {"end": statistics.mean(v[0] for v in vals), "last20": statistics.mean(v[1] for v in vals)}
        for k, vals in rows.items()
    }
    for k, v in summary.items():
        print(f"{k:<14} end {v['end']:+.4f} · last 20 rounds {v['last20']:+.4f}")
    if args.json:
        print(json.dumps({"args": vars(args), "summary": summary}))


if __name__ == "__main__":
    main()
