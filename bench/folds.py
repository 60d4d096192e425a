"""A folded round's outer step: what the master should do with deltas that each carry r sync points' work.

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/folds.py [--folds 3,11] [--seeds 0,1] [--rules feed,...]

When the master does not answer (a takeover, a bus outage) a worker folds its deltas into one that stands
for r sync points (diloco/outer.py). The chaos soaks (docs/guides/chaos.md) saw the global's loss rise
right after such a round. This bench isolates the outer rule from the swarm: k workers in one process
(bench/diloco.py's Setup: the same model, data and inner optimizer as the CLI), R normal rounds, then r
sync points with no outer step (each worker trains r·H steps on), then the folded round, then normal
rounds again. Each rule below takes the folded round; a twin with no outage runs beside them. Reported
per rule and r, pooled over seeds: the largest excess of the global's val loss over the twin's at the
same inner step after the fold, and the excess 5 and 20 rounds later.

Rules (the folded round only; every other round is the shipped outer step):
  full   the whole mean delta, fed whole into the momentum (the rule before 2026-12-06)
  feed   the whole mean delta; the momentum takes c(r) of it (outer.momentum_feed; shipped 2026-12-06)
  split  r outer steps of mean/r each (as if the rounds had happened, on one global)
  share  one outer step of mean/r (the folded work beyond one round is dropped)
  decay  `feed` after the momentum aged r−1 rounds (μ^(r−1)): the workers travelled along it meanwhile
  trustX `feed`, its update's norm capped at X × the median of the last 8 rounds' update norms
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diloco import Setup, inner_step

from speedtronic.diloco import codec
from speedtronic.diloco.outer import OuterOptimizer


def _step(outer: OuterOptimizer, mean: dict[str, torch.Tensor], r: int, rule: str) -> None:
    """The folded round's outer step under `rule`."""
    if rule == "full":
        outer.step(mean)
    elif rule == "feed":
        outer.step(mean, spans=[(r, 1.0)])
    elif rule == "split":
        for _ in range(r):
            outer.step({n: t / r for n, t in mean.items()})
    elif rule == "share":
        outer.step({n: t / r for n, t in mean.items()})
    elif rule == "decay":
        for m in outer.momentum_buffers.values():
            m.mul_(outer.momentum ** (r - 1))
        outer.step(mean, spans=[(r, 1.0)])
    elif rule.startswith("trust"):
        before = {n: t.clone() for n, t in outer.weights.items()}
        momentum = {n: t.clone() for n, t in outer.momentum_buffers.items()}
        mu = outer.momentum
        outer.step(mean, spans=[(r, 1.0)])
        update = {n: before[n] - outer.weights[n] for n in before}
        ratio = outer.update_ratio()  # against the median of the last 8 (normal) rounds' updates
        if ratio is not None and ratio > float(rule[5:]):
            s = float(rule[5:]) / ratio
            for n in before:
                outer.weights[n].copy_(before[n] - s * update[n])
                fed = outer.momentum_buffers[n] - mu * momentum[n]  # what this round fed it
                outer.momentum_buffers[n].copy_(mu * momentum[n] + s * fed)
    else:
        raise SystemExit(f"--rules: unknown rule {rule!r}")


def run(setup: Setup, args: argparse.Namespace, rule: str | None, r: int) -> dict[int, float]:
    """Val loss of the global after each outer step, by inner step (rule None: the twin, no outage)."""
    workers = [setup.worker(seed=100 + w) for w in range(args.workers)]
    outer = OuterOptimizer(codec.snapshot(workers[0][0]), 0.7, 0.8, 10)
    H, losses = args.inner_steps, {}
    rounds = args.before + r + args.after
    fold = range(args.before, args.before + r)  # these sync points get no outer step (rule set)
    for index in range(rounds):
        deltas = []
        for model, opt, sched, gen in workers:
            for _ in range(H):
                inner_step(setup, model, opt, sched, gen, setup.args.batch)
            if rule is not None and index in fold and index != fold[-1]:
                continue
            local = codec.snapshot(model)
            deltas.append({n: outer.weights[n] - local[n] for n in local})
        if not deltas:
            continue
        mean = {n: sum(d[n] for d in deltas) / len(deltas) for n in deltas[0]}
        if rule is not None and index == fold[-1]:
            _step(outer, mean, r, rule)
        else:
            outer.step(mean)
        for model, *_ in workers:
            with torch.no_grad():
                for name, p in codec.unique_params(model).items():
                    p.copy_(outer.weights[name])
        losses[(index + 1) * H] = setup.evaluate(workers[0][0])
    return losses


def add_soak_model_args(parser: argparse.ArgumentParser) -> None:
    """The chaos soak's model and inner training (bench/chaos.py's config), and --json."""
    parser.add_argument("--n-layer", type=int, default=1)
    parser.add_argument("--n-head", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=32)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--val-batches", type=int, default=32)
    parser.add_argument("--json", action="store_true")


def against_twin(
    args: argparse.Namespace,
    run: Callable[[Setup, argparse.Namespace, str | None], list[float]],
    score: Callable[[list[float]], tuple[float, float]],
    names: tuple[str, str],
) -> dict[str, list[tuple[float, float]]]:
    """Per rule of `--rules`, one (a, b) per seed of `--seeds`: `score` of the arm's val losses minus the
    twin's (`run` with rule None) round by round, each printed as `names`. The in-process benches'
    common loop (bench/joiners.py, bench/stale_rounds.py)."""
    rows: dict[str, list[tuple[float, float]]] = {}
    for seed in map(int, args.seeds.split(",")):
        steps = args.rounds * args.inner_steps
        setup = Setup(argparse.Namespace(**vars(args), steps=steps, seed=seed, text=None))
        twin = run(setup, args, None)
        for rule in args.rules.split(","):
            a, b = score([x - y for x, y in zip(run(setup, args, rule), twin, strict=True)])
            rows.setdefault(rule, []).append((a, b))
            print(
                f"seed {seed} {rule:<10} {names[0]} {a:+.4f} · {names[1]} {b:+.4f} (twin {twin[-1]:.4f})",
                flush=True,
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--before", type=int, default=35, help="normal rounds before the outage")
    parser.add_argument("--after", type=int, default=25, help="normal rounds after the folded one")
    parser.add_argument("--folds", default="3,11", help="r: sync points folded, comma-separated")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--rules", default="full,feed,split,share,decay,trust1.5,trust2")
    add_soak_model_args(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rules = args.rules.split(",")
    rows: dict[str, list[tuple[float, float, float]]] = {}
    for seed in map(int, args.seeds.split(",")):
        setup_args = argparse.Namespace(**vars(args), steps=20_000, seed=seed, text=None)
        setup = Setup(setup_args)
        for r in map(int, args.folds.split(",")):
            twin = run(setup, args, None, r)
            start = (args.before + r) * args.inner_steps
            for rule in rules:
                arm = run(setup, args, rule, r)
                after = sorted(s for s in arm if s >= start)
                excess = [arm[s] - twin[s] for s in after]
                five, twenty = excess[min(5, len(excess) - 1)], excess[min(20, len(excess) - 1)]
                rows.setdefault(f"{rule} r={r}", []).append((max(excess), five, twenty))
                print(
                    f"seed {seed} r={r:<3} {rule:<9} peak excess {max(excess):+.4f} · +5 rounds {five:+.4f} · "
                    f"+20 rounds {twenty:+.4f} (twin {twin[after[0]]:.4f} at the fold)",
                    flush=True,
                )
    summary = {
        k: {name: statistics.mean(v[i] for v in vals) for i, name in enumerate(("peak", "plus5", "plus20"))}
        for k, vals in rows.items()
    }
    for k, v in summary.items():
        print(f"{k:<16} peak {v['peak']:+.4f} · +5 {v['plus5']:+.4f} · +20 {v['plus20']:+.4f}")
    if args.json:
        print(json.dumps({"args": vars(args), "summary": summary}))


if __name__ == "__main__":
    main()
