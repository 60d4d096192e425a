"""Uneven peers in one process: what do two slow workers add to two fast ones, by the master's rule?

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/uneven_rules.py [--seeds 0,1,2,3] [--rounds 35] [--json]

bench/uneven.py runs real processes: 2 fast + 2 slow workers (4x the step time) ended above 2 fast alone
(docs/guides/uneven-peers.md), whether the slow ones sync at H (a delta every 4 rounds, 4 steps stale) or at
H/4 (a short delta every round, stretched by the master). This bench takes the processes, the bus and the
timing out: every worker builds on the latest global and installs the next one at once, so what is left
is the master's arithmetic. bench/diloco.py's Setup (the soak's model, data and AdamW, each worker's own
LR schedule over `--schedule` x the fast workers' steps, as bench/chaos.py's config), the shipped outer
step (lr 0.7, Nesterov 0.8, warm-up 10). A round is H = `--inner-steps` steps of a fast worker. Arms:

  fast2        2 fast workers (the reference every other arm is scored against)
  fast4        4 fast workers (the ceiling)
  h:RULE       2 fast + 2 slow that sync every H/4 of their own steps: each round a delta of t = T/4 tokens
  stale:RULE   2 fast + 2 slow that sync every H of their own steps: a delta every 4 rounds, built 4 outer
               steps back (staleness weight 1/5 as shipped)
  rebase:RULE  as stale:, but the slow workers install every global as it comes, keeping their progress
               not sent yet (θ ← G − u, as the coordinator does between its syncs), so each delta is
               built on the latest global: staleness 0
  rebasespan:RULE  the same, each delta's staleness counted from the first global of its span (3)
  ...+wall     the slow workers' LR schedule runs in wall time (4 schedule steps per inner step)

Rules, for how a round's deltas become its mean:

  shipped      the master's: a short delta beside full ones stretched x T/t (master/pipeline.py
               `stretches`), weights tokens x staleness, `distributed.defences.aggregation` (clipped_mean)
  mean         the same weights and stretch, the plain weighted mean (no norm clip)
  unstretched  short deltas not stretched, clipped_mean (the master before 2026-12-07)

Reported per arm, pooled over seeds: the final global's val loss minus fast2's, and the mean of that over
the last 5 rounds.
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

RULES = ("shipped", "mean", "unstretched")
# Rules for stale deltas only (arms stale:RULE), beside the shipped weight 1/(1+s):
STALE_RULES = ("flat", "sqrt", "proj", "projflat")
DEFAULTS = DistributedConfig()  # the shipped max_staleness and aggregation
SLOW = 4  # a slow worker's step time, in fast step times
Tensors = dict[str, torch.Tensor]


class Node:
    """One worker: its model, optimizer, schedule and data, the global it built on and its steps a round."""

    def __init__(self, setup: Setup, seed: int, steps: int, every: int, clock: int = 1) -> None:
        self.model, self.opt, self.sched, self.gen = setup.worker(seed=seed)
        self.steps = steps  # inner steps it trains per round
        self.every = every  # rounds between its syncs
        self.clock = clock  # schedule steps per inner step (SLOW: its LR schedule runs in wall time)
        self.anchor = codec.snapshot(self.model)
        self.accounted = {n: torch.zeros_like(t) for n, t in self.anchor.items()}  # sent since `anchor`
        self.base = 0  # the outer step its anchor is

    def train(self, setup: Setup) -> None:
        for _ in range(self.steps):
            inner_step(setup, self.model, self.opt, self.sched, self.gen, setup.args.batch)
            for _ in range(self.clock - 1):
                self.sched.step()

    def delta(self) -> Tensors:
        """What it has not sent yet (the coordinator's book: anchor − θ − accounted)."""
        local = codec.snapshot(self.model)
        x = {n: self.anchor[n] - local[n] - self.accounted[n] for n in local}
        for n in x:
            self.accounted[n] += x[n]
        return x

    def install(self, weights: Tensors, version: int) -> None:
        """θ ← G − u (the coordinator's merge, overlap.merge): u, the progress not sent yet, is kept."""
        with torch.no_grad():
            for name, p in codec.unique_params(self.model).items():
                p.copy_(weights[name] - (self.anchor[name] - p.detach() - self.accounted[name]))
        self.anchor = {n: t.clone() for n, t in weights.items()}
        self.accounted = {n: torch.zeros_like(t) for n, t in weights.items()}
        self.base = version


def nodes_of(setup: Setup, arm: str, h: int) -> list[Node]:
    fast = 4 if arm == "fast4" else 2
    clock = SLOW if arm.endswith("+wall") else 1
    nodes = [Node(setup, 100 + w, h, 1) for w in range(fast)]
    if arm.startswith("h:"):
        nodes += [Node(setup, 200 + w, max(1, h // SLOW), 1, clock) for w in range(2)]
    elif arm.startswith(("stale:", "rebase:", "rebasespan:")):
        nodes += [Node(setup, 200 + w, max(1, h // SLOW), SLOW, clock) for w in range(2)]
    return nodes


def stale_weight(stale: int, rule: str) -> float:
    if rule in ("flat", "projflat"):
        return 1.0
    if rule == "sqrt":
        return (1.0 + stale) ** -0.5
    return staleness_weight(stale, DEFAULTS.rounds.max_staleness) or 0.0


def projected(delta: Tensors, done: Tensors) -> Tensors:
    """Δ less its share along the progress made since its global (G_base − G_now), where positive."""
    dot = sum(float((delta[n] * done[n]).sum()) for n in delta)
    norm = sum(float((done[n] ** 2).sum()) for n in delta)
    c = min(1.0, dot / norm) if norm > 0 and dot > 0 else 0.0
    return {n: delta[n] - c * done[n] for n in delta}


def round_mean(
    items: list[tuple[Tensors, int, int]], full: int, rule: str, history: list[Tensors]
) -> Tensors:
    """Δ̄ of (Δ, tokens, staleness) items by `rule`; `history`: the globals, by outer step."""
    stretch = rule != "unstretched" and any(t >= full for _, t, _ in items)
    weighed = []
    for delta, tokens, stale in items:
        factor = full / tokens if stretch and tokens < full else 1.0
        weight = tokens * stale_weight(stale, rule)
        if stale and rule.startswith("proj"):
            base, now = history[-1 - stale], history[-1]
            delta = projected(delta, {n: base[n] - now[n] for n in delta})
        weighed.append(({n: v * factor for n, v in delta.items()}, weight))
    method = "mean" if rule == "mean" else DEFAULTS.defences.aggregation
    return aggregate(weighed, method)


def run(setup: Setup, args: argparse.Namespace, arm: str) -> list[float]:
    """The global's val loss after each round."""
    rule = arm.split(":", 1)[1].removesuffix("+wall") if ":" in arm else "shipped"
    nodes = nodes_of(setup, arm, args.inner_steps)
    outer = OuterOptimizer(codec.snapshot(nodes[0].model), 0.7, 0.8, 10)
    scorer = setup.worker(seed=0)[0]
    step_tokens = args.batch * args.block
    full = args.inner_steps * step_tokens
    losses: list[float] = []
    history = [{n: t.clone() for n, t in outer.weights.items()}]
    for index in range(args.rounds):
        items = []
        for node in nodes:
            node.train(setup)
            if (index + 1) % node.every == 0:
                tokens = node.steps * node.every * step_tokens
                # rebasespan: a rebased delta's staleness counted from its span's first global
                stale = node.every - 1 if arm.startswith("rebasespan") else index - node.base
                items.append((node.delta(), tokens, stale))
        outer.step(round_mean(items, full, rule, history))
        weights = {n: t.clone() for n, t in outer.weights.items()}
        history.append(weights)
        for node in nodes:
            if (index + 1) % node.every == 0 or arm.startswith("rebase"):
                node.install(weights, index + 1)
        with torch.no_grad():
            for name, p in codec.unique_params(scorer).items():
                p.copy_(weights[name])
        losses.append(setup.evaluate(scorer))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=35)
    parser.add_argument("--schedule", type=int, default=3, help="LR schedule length, x a fast worker's steps")
    parser.add_argument("--seeds", default="0,1,2,3")
    parser.add_argument(
        "--arms", default="fast4," + ",".join(f"{k}:{r}" for k in ("h", "stale") for r in RULES)
    )
    add_soak_model_args(parser)
    args = parser.parse_args()
    for arm in args.arms.split(","):
        kind, _, rule = arm.removesuffix("+wall").partition(":")
        slow_arm = kind in ("h", "stale", "rebase", "rebasespan") and rule in RULES + STALE_RULES
        if not (slow_arm or (kind == "fast4" and not rule)):
            parser.exit(2, f"uneven_rules: unknown arm {arm!r} in --arms (see --help)\n")
    torch.set_num_threads(1)
    rows: dict[str, list[tuple[float, float]]] = {}
    for seed in map(int, args.seeds.split(",")):
        steps = args.rounds * args.inner_steps * args.schedule
        setup = Setup(argparse.Namespace(**vars(args), steps=steps, seed=seed, text=None))
        ref = run(setup, args, "fast2")
        for arm in args.arms.split(","):
            diff = [x - y for x, y in zip(run(setup, args, arm), ref, strict=True)]
            rows.setdefault(arm, []).append((diff[-1], statistics.mean(diff[-5:])))
            print(
                f"seed {seed} {arm:<18} final {diff[-1]:+.4f} · last 5 {statistics.mean(diff[-5:]):+.4f} (fast2 {ref[-1]:.4f})",
                flush=True,
            )
    summary = {
        arm: {
            "final": statistics.mean(a for a, _ in v),
            "last5": statistics.mean(b for _, b in v),
            "per_seed": [round(a, 4) for a, _ in v],
        }
        for arm, v in rows.items()
    }
    for arm, v in summary.items():
        print(f"{arm:<18} vs fast2: final {v['final']:+.4f} · last 5 rounds {v['last5']:+.4f}")
    if args.json:
        print(json.dumps({"args": vars(args), "summary": summary}))


if __name__ == "__main__":
    main()
