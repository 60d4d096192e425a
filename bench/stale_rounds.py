"""Rounds of stale deltas after a storm: what the outer step should do when every delta is behind.

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/stale_rounds.py [--seeds 0,1] [--rules full,scaled,cut,freeze] \
        [--lag 15] [--window 8] [--json]

In the 30-minute S3 soaks (docs/guides/chaos.md), once a 429/500 storm ended the workers installed each
global late for 7-8 rounds: every delta of a round was built on a global 1-2 outer steps old, and the
global's loss climbed 0.08-0.14 over those rounds while its twin's did not. Since 2026-12-07 such a round
steps 1/(1+k) of the outer lr (k the freshest delta's staleness; master/pipeline.py `freshness`), but the
outer momentum still feeds on it and carries its direction on.

This bench isolates that from the swarm: 8 workers in one process (bench/diloco.py's Setup: the soak's
model, data and AdamW), H = 10, the shipped outer step (lr 0.7, Nesterov 0.8, warm-up 10), aggregation
and staleness weights. Each global is installed with the coordinator's merge (θ ← G − u: the local
progress not yet sent is kept; bench/late_globals.py), one inner step after its sync (`overlap_steps: 1`,
the default) — except in windows of `--window` rounds, every `--every` rounds from `--start`, where it is
installed `--lag` inner steps after its sync (15 at H = 10: deltas 1-2 steps behind, as in the soaks).
With `--probe` the master's loss probe weighs deltas 0 as shipped (master/checks.py: each delta alone at
its share of the step on the master's validation batches; at most half when all fail). A twin with no
window runs beside. Rules, for rounds whose every delta is behind (the others step as shipped):

  full    Δ̄ stepped whole, the momentum fed whole (before 2026-12-07)
  scaled  Δ̄ × 1/(1+k) (shipped 2026-12-07), the momentum fed the scaled Δ̄
  cut     scaled, and the round's momentum μ − k/(1+k) (asynchrony acts as momentum of its own:
          Mitliagkas et al. 2016; bench/late_globals.py's `damped`)
  freeze  scaled, stepped without the momentum, which is neither fed nor decayed (it resumes as it was
          once the deltas are fresh again)

Reported per rule, pooled over seeds: the largest excess of the global's val loss over the twin's within
each window and the 10 rounds after it (mean over windows), and the mean excess over the last 20 rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diloco import Setup, forward_loss, inner_step
from folds import add_soak_model_args, against_twin

from speedtronic.config.distributed import DistributedConfig
from speedtronic.diloco import codec
from speedtronic.diloco.outer import OuterOptimizer, aggregate, scaled, staleness_weight

RULES = ("full", "scaled", "cut", "freeze")
Tensors = dict[str, torch.Tensor]


class Swarm:
    """k workers whose globals come `lag` inner steps after their sync, merged as the coordinator does."""

    def __init__(self, setup: Setup, k: int) -> None:
        self.setup = setup
        self.workers = [setup.worker(seed=100 + w) for w in range(k)]
        start = codec.snapshot(self.workers[0][0])
        self.anchor = [{n: t.clone() for n, t in start.items()} for _ in range(k)]
        self.accounted = [{n: torch.zeros_like(t) for n, t in start.items()} for _ in range(k)]
        self.base = [0] * k
        self.queue: list[tuple[int, int, Tensors]] = []  # (due inner step, version, weights)

    def train_step(self, step: int) -> None:
        for model, opt, sched, gen in self.workers:
            inner_step(self.setup, model, opt, sched, gen, self.setup.args.batch)
        due = [q for q in self.queue if q[0] <= step]
        if not due:
            return
        _, version, weights = due[-1]
        self.queue = [q for q in self.queue if q[0] > step]
        for w, (model, *_) in enumerate(self.workers):
            with torch.no_grad():
                for name, p in codec.unique_params(model).items():
                    u = self.anchor[w][name] - p.detach() - self.accounted[w][name]
                    p.copy_(weights[name] - u)
                    self.anchor[w][name] = weights[name].clone()
                    self.accounted[w][name].zero_()
            self.base[w] = version

    def deltas(self) -> list[Tensors]:
        """Each worker's delta at its sync point (what it has not sent yet)."""
        out = []
        for w, (model, *_) in enumerate(self.workers):
            local = codec.snapshot(model)
            x = {n: self.anchor[w][n] - local[n] - self.accounted[w][n] for n in local}
            for n in x:
                self.accounted[w][n] += x[n]
            out.append(x)
        return out


def probe_zeroed(
    setup: Setup, model: torch.nn.Module, weights: Tensors, deltas: list[Tensors], share: float
) -> set[int]:
    """The loss probe as shipped (checks.py LossProbeCheck): the deltas that alone, at `share` of the
    step, raise the loss on the master's batches (the first half of the val batches); at most half
    (the most harmful first) when every one does. `model` is scratch: its weights are overwritten."""
    batches = setup.val[: max(1, len(setup.val) // 2)]

    @torch.no_grad()
    def loss(w: Tensors) -> float:
        for name, p in codec.unique_params(model).items():
            p.copy_(w[name])
        model.eval()
        return sum(forward_loss(model, b, True).item() for b in batches) / len(batches)

    base = loss(weights)
    alone = [loss({n: weights[n] - share * d[n] for n in weights}) for d in deltas]
    failed = sorted((i for i, v in enumerate(alone) if not v <= base), key=lambda i: -alone[i])
    if len(failed) == len(deltas) and len(deltas) >= 2:
        failed = failed[: len(deltas) // 2]
    return set(failed)


def outer_step(outer: OuterOptimizer, mean: Tensors, stale: int, rule: str) -> None:
    """One outer step of a round whose freshest delta is `stale` steps behind, by `rule`."""
    if stale == 0 or rule == "full":
        outer.step(mean)
        return
    mean = scaled(mean, 1.0 / (1.0 + stale))
    if rule == "scaled":
        outer.step(mean)
    elif rule == "cut":
        mu = outer.momentum
        outer.momentum = max(0.0, mu - stale / (1.0 + stale))
        outer.step(mean)
        outer.momentum = mu
    elif rule == "freeze":
        kept = {n: m.clone() for n, m in outer.momentum_buffers.items()}
        outer.step(mean, plain=True)
        for n, m in kept.items():
            outer.momentum_buffers[n].copy_(m)
    else:
        raise SystemExit(f"--rules: unknown rule {rule!r} (one of {', '.join(RULES)})")


def run(setup: Setup, args: argparse.Namespace, rule: str | None) -> list[float]:
    """The global's val loss after each round (rule None: the twin, no window)."""
    defaults = DistributedConfig()
    swarm = Swarm(setup, args.workers)
    outer = OuterOptimizer(codec.snapshot(swarm.workers[0][0]), 0.7, 0.8, 10)
    scorer = setup.worker(seed=0)[0]
    losses: list[float] = []
    for index in range(args.rounds):
        lagging = rule is not None and index >= args.start and (index - args.start) % args.every < args.window
        for i in range(1, args.inner_steps + 1):
            swarm.train_step(index * args.inner_steps + i)
        stale = [len(losses) - b for b in swarm.base]
        deltas = swarm.deltas()
        zeroed = (
            probe_zeroed(setup, scorer, outer.weights, deltas, 0.7 / len(deltas)) if args.probe else set()
        )
        items = [
            (d, staleness_weight(s, defaults.rounds.max_staleness) or 0.0)
            for i, (d, s) in enumerate(zip(deltas, stale, strict=True))
            if i not in zeroed
        ]
        freshest = min(s for i, s in enumerate(stale) if i not in zeroed)  # pipeline.freshness: live deltas
        outer_step(outer, aggregate(items, defaults.defences.aggregation), freshest, rule or "scaled")
        due = (index + 1) * args.inner_steps + (args.lag if lagging else 1)
        swarm.queue.append((due, len(losses) + 1, {n: t.clone() for n, t in outer.weights.items()}))
        with torch.no_grad():
            for name, p in codec.unique_params(scorer).items():
                p.copy_(outer.weights[name])
        losses.append(setup.evaluate(scorer))
    return losses


def summarise(excess: list[float], args: argparse.Namespace) -> tuple[float, float]:
    """(mean over windows of the largest excess in the window and the 10 rounds after it, cut at the
    run's end; the mean excess over the last 20 rounds)."""
    peaks = [max(excess[s : s + args.window + 10]) for s in range(args.start, len(excess), args.every)]
    return statistics.mean(peaks), statistics.mean(excess[-20:])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--start", type=int, default=30, help="the first window's first round")
    parser.add_argument("--every", type=int, default=30, help="rounds from one window's start to the next")
    parser.add_argument("--window", type=int, default=8, help="rounds whose globals come late")
    parser.add_argument(
        "--lag", type=int, default=15, help="inner steps from a sync to its global, in a window"
    )
    parser.add_argument("--probe", action="store_true", help="weigh deltas 0 by the loss probe, as shipped")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--rules", default=",".join(RULES))
    add_soak_model_args(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = against_twin(args, run, lambda excess: summarise(excess, args), ("rise", "last 20"))
    summary = {
        rule: {
            "rise": statistics.mean(v[0] for v in vals),
            "last20": statistics.mean(v[1] for v in vals),
            "per_seed": [{"rise": round(a, 4), "last20": round(b, 4)} for a, b in vals],
        }
        for rule, vals in rows.items()
    }
    for rule, v in summary.items():
        print(f"{rule:<7} rise {v['rise']:+.4f} · last 20 rounds {v['last20']:+.4f}")
    if args.json:
        print(json.dumps({"args": vars(args), "summary": summary}))


if __name__ == "__main__":
    main()
