"""Joiners and the learning-rate schedule: where a worker that joins a run late starts its own.

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/joiners.py [--rounds 200] [--every 10] [--seeds 0,1] \
        [--rules fresh,aligned,aligned40] [--json]

A worker's learning-rate schedule (a linear warm-up, then a cosine decay over run.max_steps) counts the
worker's own steps. A worker that joins a run at outer step s with no checkpoint of its own starts at
its step 0: a warm-up from nothing over `scheduler.warmup_steps`, then the cosine from its top, while
the workers there since the start are s × H steps down the same cosine. Early in a run its deltas are
small beside theirs (its share of each round is diluted); late in a run the others anneal and it
trains near the peak rate. The rules compared, for a joiner's schedule:

  fresh      its own step 0 (the shipped rule)
  aligned    the run's step (s × H), its rate ramped from 0 over the run's warm-up
  aligned40  the run's step, ramped over 2 / (1 − β2) steps (40 for AdamW's β2 = 0.95: RAdam's rule of
             thumb for how long a fresh Adam's second moment takes to settle)

8 workers in one process (bench/diloco.py's Setup: the chaos soak's model, data and AdamW), H = 10,
the shipped outer step (0.7, Nesterov 0.8, warm-up 10) and aggregation, the schedule spanning the run
(--rounds × H steps, warm-up 5%). From round --start on, every --every rounds the next worker in turn
leaves and a fresh one takes its id: the global's weights, a fresh AdamW, a schedule by the rule. A
twin where nobody is replaced runs beside. Reported per rule, pooled over seeds: the global's val loss
minus the twin's at the end and its mean over the last 20 rounds.
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
from folds import add_soak_model_args, against_twin

from speedtronic.config.distributed import DistributedConfig
from speedtronic.diloco import codec
from speedtronic.diloco.outer import OuterOptimizer, aggregate
from speedtronic.engine.build import build_optimizer
from speedtronic.engine.schedule import lr_multiplier
from speedtronic.plan import DataFacts, DeviceFacts, plan_run

RULES = ("fresh", "aligned", "aligned40")


def joiner_factor(rule: str, run: Callable[[int], float], at: int, warmup: int) -> Callable[[int], float]:
    """A joiner's step j → factor of the peak rate, joining at the run's step `at`."""
    if rule == "fresh":
        return run
    ramp = warmup if rule == "aligned" else 40
    return lambda j: run(at + j) * min(1.0, (j + 1) / ramp)


def run(setup: Setup, args: argparse.Namespace, rule: str | None) -> list[float]:
    """The global's val loss after each round (rule None: the twin, nobody replaced)."""
    plan = plan_run(setup.config, data=DataFacts(256), device=DeviceFacts("cpu"))
    factor = lr_multiplier(plan.schedule, plan.warmup_steps, plan.schedule_steps, plan.min_lr_ratio)
    workers = [list(setup.worker(seed=100 + w)) for w in range(args.workers)]
    outer = OuterOptimizer(codec.snapshot(workers[0][0]), 0.7, 0.8, 10)
    method = DistributedConfig().defences.aggregation
    losses, joined = [], 0
    for index in range(args.rounds):
        if rule is not None and index >= args.start and (index - args.start) % args.every == 0:
            w = joined % args.workers
            joined += 1
            model, _, _, _ = setup.worker(seed=10_000 + joined)
            with torch.no_grad():
                for name, p in codec.unique_params(model).items():
                    p.copy_(outer.weights[name])
            opt = build_optimizer(setup.config, model)
            sched = torch.optim.lr_scheduler.LambdaLR(
                opt, joiner_factor(rule, factor, index * args.inner_steps, plan.warmup_steps)
            )
            workers[w] = [model, opt, sched, torch.Generator().manual_seed(10_000 + joined)]
        base = {n: t.clone() for n, t in outer.weights.items()}
        items = []
        for model, opt, sched, gen in workers:
            for _ in range(args.inner_steps):
                inner_step(setup, model, opt, sched, gen, setup.args.batch)
            local = codec.snapshot(model)
            items.append(({n: base[n] - local[n] for n in local}, 1.0))
        outer.step(aggregate(items, method))
        for model, *_ in workers:
            with torch.no_grad():
                for name, p in codec.unique_params(model).items():
                    p.copy_(outer.weights[name])
        losses.append(setup.evaluate(workers[0][0]))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--start", type=int, default=20, help="the first round a worker is replaced in")
    parser.add_argument("--every", type=int, default=10, help="rounds between replacements")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--rules", default=",".join(RULES))
    add_soak_model_args(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = against_twin(
        args, run, lambda excess: (excess[-1], statistics.mean(excess[-20:])), ("end", "last 20 rounds")
    )
    summary = {
        k: {
            "end": statistics.mean(v[0] for v in vals),
            "last20": statistics.mean(v[1] for v in vals),
            "last20_sd": statistics.stdev(v[1] for v in vals) if len(vals) > 1 else None,
            "seeds": len(vals),
        }
        for k, vals in rows.items()
    }
    for k, v in summary.items():
        print(f"{k:<10} end {v['end']:+.4f} · last 20 rounds {v['last20']:+.4f}")
    if args.json:
        print(json.dumps({"args": vars(args), "summary": summary}))


if __name__ == "__main__":
    main()
