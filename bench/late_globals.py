"""DiLoCo with late globals, in one process: what the delay between a delta and the global that answers it
does to the outer step.

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/late_globals.py [--lags 0,12,25,40,60] [--rules shipped,mu0,damped]

On a real link the workers do not stop at a sync point: they queue their delta, train on, and install
the next global when it comes (diloco/worker/coordinator.py: θ ← G − u, u = the local progress not yet queued).
If the master is slower than a round of inner steps (a slow link, a loss probe, shared cores), every
worker installs each global L inner steps after the sync it answers, and its next deltas are built on a
global L/H rounds old. bench/wan.py found the shipped outer momentum diverging there (val loss 3.0 →
10.8 at 30 Mbit/s), where this bench's synchronous arms (bench/diloco.py) never do.

This script reproduces that without a link: k workers in lockstep, each delta sent at its sync point
(int8 with error feedback, as shipped), the master's round closed at once (the staleness weight
1/(1+s) and the shipped aggregation, as master.py), and each global installed exactly `lag` inner
steps after the sync it answers, with the worker's own book-keeping (anchor, accounted) as the
coordinator keeps it. Arms (--rules):

  shipped  the shipped outer optimizer: lr 0.7, Nesterov 0.9 grown over 10 rounds
  mu0      the same without momentum
  damped   the shipped one, with its momentum cut by the round's lag (lag_damped_momentum below)

It prints the global's val loss after S steps per worker for every (lag, rule), and the single worker
and synchronous-DP baselines of bench/diloco.py, so each cell reads as a share of the gap closed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diloco import Setup, inner_step, run_single

from speedtronic.config.schema import DistributedConfig
from speedtronic.diloco import codec
from speedtronic.diloco.outer import (
    OuterOptimizer,
    aggregate,
    staleness_weight,
)

RULES = ("shipped", "mu0", "damped")


def lag_damped_momentum(momentum: float, lag_rounds: float) -> float:
    """The outer momentum for deltas built on a global `lag_rounds` rounds old (asynchrony acts as
    momentum of its own, about d/(1+d) for a delay of d: Mitliagkas et al. 2016), so what is left
    to configure is the rest."""
    d = max(0.0, lag_rounds)
    return max(0.0, momentum - d / (1.0 + d))


def run_late(setup: Setup, k: int, H: int, lag: int, rule: str, wire: str = "int8") -> tuple[float, float]:
    """The global's val loss after S steps per worker with every global installed `lag` steps after
    the sync it answers; and the mean staleness (in outer steps) of the deltas applied."""
    defaults = DistributedConfig()
    momentum = 0.0 if rule == "mu0" else 0.9
    workers = [setup.worker(seed=100 + w) for w in range(k)]
    outer = OuterOptimizer(codec.snapshot(workers[0][0]), 0.7, momentum, defaults.sync.outer_momentum_warmup)
    version = 0
    anchor = [{n: t.clone() for n, t in outer.weights.items()} for _ in range(k)]
    accounted = [{n: torch.zeros_like(t) for n, t in outer.weights.items()} for _ in range(k)]
    residual = [{n: torch.zeros_like(t) for n, t in outer.weights.items()} for _ in range(k)]
    base = [0] * k
    published: list[tuple[int, int, dict[str, torch.Tensor]]] = []  # (due step, version, weights)
    stale_seen: list[int] = []
    for step in range(1, setup.args.steps + 1):
        for model, opt, sched, gen in workers:
            inner_step(setup, model, opt, sched, gen, setup.args.batch)
        due = [p for p in published if p[0] <= step]
        if due:  # the newest global due by now, merged as the coordinator installs it
            _, v, weights = due[-1]
            published = [p for p in published if p[0] > step]
            for w, (model, *_) in enumerate(workers):
                with torch.no_grad():
                    for name, p in codec.unique_params(model).items():
                        u = anchor[w][name] - p.detach() - accounted[w][name]
                        p.copy_(weights[name] - u)
                        anchor[w][name] = weights[name].clone()
                        accounted[w][name].zero_()
                base = [v] * k
        if step % H:
            continue
        deltas, stalenesses = [], []
        for w, (model, *_) in enumerate(workers):
            local = codec.snapshot(model)
            x = {n: anchor[w][n] - local[n] - accounted[w][n] for n in local}
            for n in x:
                accounted[w][n] += x[n]
            sent = {n: x[n] + residual[w][n] for n in x}
            received = codec.roundtrip(sent, wire)
            residual[w] = {n: sent[n] - received[n] for n in sent}
            s = version - base[w]
            weight = staleness_weight(s, defaults.rounds.max_staleness)
            if weight is None:
                continue
            stalenesses.append(s)
            deltas.append((received, weight))
        if not deltas:
            continue
        stale_seen.extend(stalenesses)
        if rule == "damped":
            outer.momentum = lag_damped_momentum(0.9, lag / H)
        outer.step(aggregate(deltas, defaults.defences.aggregation))
        version += 1
        published.append((step + lag, version, {n: t.clone() for n, t in outer.weights.items()}))
    with torch.no_grad():  # the global itself is what is scored
        model = workers[0][0]
        for name, p in codec.unique_params(model).items():
            p.copy_(outer.weights[name])
    return setup.evaluate(model), sum(stale_seen) / max(1, len(stale_seen))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lags", default="0,12,25,40,60", help="inner steps between a sync and its global")
    parser.add_argument("--rules", default=",".join(RULES))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=25)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--val-batches", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus", default="tinyshakespeare")
    parser.add_argument("--text", default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--known", type=float, nargs=2, default=None, metavar=("SINGLE", "DP"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    setup = Setup(args, args.corpus)
    if args.known:
        single, dp = args.known
    else:
        single, dp = run_single(setup, 1), run_single(setup, args.workers)
    print(f"single {single:.4f}  sync DP {dp:.4f}  (k={args.workers}, H={args.inner_steps}, S={args.steps})")
    for lag in (int(x) for x in args.lags.split(",")):
        for rule in args.rules.split(","):
            started = time.perf_counter()
            loss, stale = run_late(setup, args.workers, args.inner_steps, lag, rule)
            gap = (single - loss) / (single - dp) if single != dp else float("nan")
            print(
                f"lag {lag:3d} ({lag / args.inner_steps:.2f} rounds)  {rule:8s} val {loss:.4f}  gap closed "
                f"{gap:+.0%}  mean staleness {stale:.2f}  ({time.perf_counter() - started:.0f}s)",
                flush=True,
            )


if __name__ == "__main__":
    main()
