"""Uneven peers: does a slow DiLoCo worker help or hurt? Real processes on the directory bus.

    PYTHONPATH=src python bench/uneven.py --seeds 2 --seconds 120 --json > uneven.json

Arms of the same wall-clock budget (`--seconds`, from the fast workers' first steps), each a master that does
not train (it aggregates, evaluates each global on the validation batches and publishes) and workers paced
by bench/_paced.py: fast workers take `--step-s` per training step, slow ones 4x that.

  fast2       2 fast workers
  fast2slow2  2 fast + 2 slow workers (the shipped rules: token-weighted, staleness-weighted deltas)
  fast4       4 fast workers (the ceiling: what the slow peers' slots would give at full speed)
  fast2slow2h 2 fast + 2 slow workers, the slow ones syncing every H/4 of their own steps
              (`--set distributed.sync.inner_steps` on those workers): one delta per round, as the fast
              ones, built on the latest global, of a quarter of the tokens
  fast2slow2hs as fast2slow2h, the slow workers' LR schedule also in wall time (their run.max_steps and
              warm-up divided by the pace): the test of the warm-up suspect, 2026-12-08

Each arm runs once per seed (`--seeds N`: seeds F..F+N-1, F = `--first-seed`, the runs' `run.seed`). Per run: the global
validation loss of the last head the master published inside the budget (from head.json, read by the
bench, never through the processes), the outer steps, and per node the deltas the master applied and
rejected (from its log: "outer step N from …" and "rejected delta …"). Pooled per arm: mean ± sd of the
final loss over seeds. The machinery (processes, logs, the head watcher, the master's ledger) is
bench/chaos.py's; this bench only chooses the paces and reads the figures.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import chaos  # noqa: E402
from _servers import open_bus  # noqa: E402

from speedtronic.plan import choose_warmup  # noqa: E402

SLOW = 4.0  # a slow worker's step time, in fast step times
DEFERS = "takes the globals that come between its syncs at its next sync"  # worker/defer.py, logged once
FIRST_STEP_RE = re.compile(r"speedtronic\.train: step \d+/")  # a worker's first training step (always logged)
START_LIMIT_S = 300.0
LAST = 5  # globals in `last_val_loss`, the mean of the last ones inside the budget  # at most this long for the fast workers' first steps before the budget runs anyway
PROBED_RE = re.compile(r"loss probe: delta ([A-Za-z0-9._-]+)/\S+ from \S+ alone raises .* weighs 0")
ARMS: dict[str, list[tuple[str, float]]] = {
    "fast2": [("f0", 1.0), ("f1", 1.0)],
    "fast2slow2": [("f0", 1.0), ("f1", 1.0), ("s0", SLOW), ("s1", SLOW)],
    "fast4": [("f0", 1.0), ("f1", 1.0), ("f2", 1.0), ("f3", 1.0)],
    "fast2slow2h": [("f0", 1.0), ("f1", 1.0), ("s0", SLOW), ("s1", SLOW)],
    "fast2slow2hs": [("f0", 1.0), ("f1", 1.0), ("s0", SLOW), ("s1", SLOW)],
}
# Arms whose slow workers sync every H / pace of their own steps (distributed.sync.inner_steps set on the
# worker alone): a delta per round like the fast ones', built on the latest global, of fewer tokens.
SYNC_BY_TIME = {"fast2slow2h", "fast2slow2hs"}
# Arms whose slow workers also run their LR schedule in wall time: max_steps and warm-up divided by the pace.
SCHEDULE_BY_TIME = {"fast2slow2hs"}


def worker_settings(arm: str, pace: float, inner_steps: int, max_steps: int = 0) -> list[str]:
    """The extra `--set`s of a worker of `arm` at `pace` (its step time in fast step times)."""
    if arm not in SYNC_BY_TIME or pace == 1.0:
        return []
    own = max(1, round(inner_steps / pace))
    sets = ["--set", f"distributed.sync.inner_steps={own}"]
    if arm in SCHEDULE_BY_TIME and max_steps:
        steps = int(max_steps / pace) // own * own
        warmup = max(1, choose_warmup(None, max_steps)[0] // round(pace))  # the default: 5%, at most 1000
        sets += ["--set", f"run.max_steps={steps}", "--set", f"scheduler.warmup_steps={warmup}"]
    return sets


def settings(args: argparse.Namespace, folder: Path) -> chaos.Settings:
    return chaos.Settings(
        minutes=args.seconds / 60,
        every=1e9,
        workers=0,
        bus="file",
        seed=0,
        out=folder,
        step_s=args.step_s,
        inner_steps=args.inner_steps,
        restart_delay=0.0,
        outage_s=0.0,
        node_lease_s=30.0,
        master_lease_s=30.0,
        twin=False,
    )


def seeded(swarm: chaos.Swarm, seed: int) -> None:
    """The run's seed into the config all the swarm's processes read."""
    import yaml

    cfg = yaml.safe_load(swarm.cfg.read_text(encoding="utf-8"))
    cfg["run"]["seed"] = seed
    swarm.cfg.write_text(yaml.safe_dump(cfg), encoding="utf-8")


def stop_all(swarm: chaos.Swarm, role: str) -> None:
    for life in swarm.live(role):
        swarm.signal(life, signal.SIGTERM)
    for life in swarm.live(role):
        try:
            life.proc.wait(60)
        except subprocess.TimeoutExpired:
            swarm.kill(life)


def per_node(swarm: chaos.Swarm, heads: list[chaos.HeadSeen], nodes: list[str]) -> dict[str, dict[str, int]]:
    """Per node: deltas the master applied and rejected, of the applied ones how many the loss probe
    weighed 0 (its "loss probe: delta NODE/NAME … weighs 0" lines), and whether the worker called itself
    slow and took the globals between its syncs at its next sync (1) or not (0)."""
    record = chaos.master_record(swarm, heads)
    out = {n: {"applied": 0, "rejected": 0, "probed_out": 0, "defers": 0} for n in nodes}
    for life in swarm.lives.values():
        if life.role == "worker" and life.node in out and DEFERS in swarm.log(life):
            out[life.node]["defers"] = 1
    masters = "".join(swarm.log(life) for life in swarm.lives.values() if life.role == "master")
    for node in PROBED_RE.findall(masters):
        if node in out:
            out[node]["probed_out"] += 1
    for delta in set(record["applied"]):
        if (node := delta.split("/", 1)[0]) in out:
            out[node]["applied"] += 1
    for delta in record["rejected"]:
        if (node := delta.split("/", 1)[0]) in out:
            out[node]["rejected"] += 1
    return out


def wait_for_first_steps(swarm: chaos.Swarm, nodes: list[str]) -> None:
    """Until every worker of `nodes` has logged a training step (at most START_LIMIT_S)."""
    deadline = time.monotonic() + START_LIMIT_S
    lives = [x for x in swarm.lives.values() if x.role == "worker" and x.node in nodes]
    while time.monotonic() < deadline and not all(FIRST_STEP_RE.search(swarm.log(x)) for x in lives):
        time.sleep(0.2)


def one_run(args: argparse.Namespace, arm: str, seed: int, folder: Path) -> dict[str, Any]:
    """One arm at one seed: the swarm for `--seconds`, then its figures."""
    folder.mkdir(parents=True, exist_ok=True)
    s = settings(args, folder)
    bus = open_bus("file", folder)
    swarm = chaos.Swarm(s, bus, folder, time.time())
    seeded(swarm, seed)
    watcher = chaos.Watcher(bus, swarm.now)
    try:
        chaos.start_master(swarm)
        steps = chaos.max_steps(s)  # the config's, at the fast pace
        for node, pace in ARMS[arm]:
            s.step_s = args.step_s * pace  # Swarm.start reads the pace of the worker it starts
            swarm.start("worker", node, *worker_settings(arm, pace, args.inner_steps, steps))
        s.step_s = args.step_s
        # The budget runs from the fast workers' first steps. Counted from the master's first global, it
        # held their start-up, which the slow workers' compiles stretched on a shared 2-core machine (a fast
        # worker's first step came 9-14 s after the first global with 4 workers, 6 s with 2: 1-1.5 rounds
        # less training in the same budget), where separate machines would not.
        started = swarm.now()
        wait_for_first_steps(swarm, [n for n, pace in ARMS[arm] if pace == 1.0])
        start_s = swarm.now() - started
        end = swarm.now() + args.seconds
        while swarm.now() < end:
            time.sleep(0.2)
        heads = [h for h in watcher.snapshot()[0] if h.t <= end]
        stop_all(swarm, "worker")
        stop_all(swarm, "master")
        time.sleep(0.5)
        losses = [h.val_loss for h in heads if h.val_loss is not None]
        return {
            "arm": arm,
            "seed": seed,
            "final_val_loss": losses[-1] if losses else None,
            # The master scores each global on 16 batches (2,048 tokens): one global's loss moves by
            # ±0.02 from round to round; the mean of the last LAST globals moves less.
            "last_val_loss": statistics.fmean(losses[-LAST:]) if losses else None,
            "outer_steps": heads[-1].outer_step if heads else 0,
            "tokens_applied": heads[-1].tokens if heads else 0,
            "fast_start_s": round(start_s, 1),
            "nodes": per_node(swarm, watcher.snapshot()[0], [n for n, _ in ARMS[arm]]),
        }
    finally:
        watcher.stop()
        swarm.close()
        bus.close()


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    losses = [r["final_val_loss"] for r in runs if r["final_val_loss"] is not None]
    last = [r["last_val_loss"] for r in runs if r.get("last_val_loss") is not None]
    slow = [v for r in runs for n, v in r["nodes"].items() if n.startswith("s")]
    return {
        "final_val_loss_mean": statistics.fmean(losses) if losses else None,
        "final_val_loss_sd": statistics.stdev(losses) if len(losses) > 1 else 0.0 if losses else None,
        "last_val_loss_mean": statistics.fmean(last) if last else None,
        "last_val_loss_sd": statistics.stdev(last) if len(last) > 1 else 0.0 if last else None,
        "runs": len(runs),
        "runs_with_loss": len(losses),
        "slow_deltas_applied": sum(v["applied"] for v in slow) if slow else None,
        "slow_deltas_rejected": sum(v["rejected"] for v in slow) if slow else None,
        "slow_deltas_probed_out": sum(v.get("probed_out", 0) for v in slow) if slow else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=4, help="runs per arm, seeds F..F+N-1")
    parser.add_argument("--first-seed", type=int, default=0, help="F: the first seed (default 0)")
    parser.add_argument("--seconds", type=float, default=180.0, help="wall-clock budget of every run")
    parser.add_argument("--step-s", type=float, default=0.25, help="a fast worker's seconds per step")
    parser.add_argument("--inner-steps", type=int, default=20, help="distributed.sync.inner_steps")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated: " + ", ".join(ARMS))
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs' folders under this one")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = parser.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    if bad := [a for a in arms if a not in ARMS]:
        parser.exit(2, f"uneven: unknown arm {bad[0]!r} in --arms; choose from {', '.join(ARMS)}\n")
    if args.seeds < 1 or args.seconds <= 0 or args.step_s <= 0 or args.first_seed < 0:
        parser.exit(
            2, "uneven: --seeds, --seconds and --step-s must be positive, --first-seed not negative\n"
        )
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="uneven-", dir=args.keep))
    runs: list[dict[str, Any]] = []
    try:
        # Arms interleaved per seed: a drift in the machine's load hits all of them.
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for arm in arms:
                runs.append(one_run(args, arm, seed, root / f"{arm}-{seed}"))
                print(f"uneven: {json.dumps(runs[-1])}", file=sys.stderr, flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    result = {
        "seconds": args.seconds,
        "step_s": args.step_s,
        "slow_factor": SLOW,
        "inner_steps": args.inner_steps,
        "seeds": args.seeds,
        "first_seed": args.first_seed,
        "arms": {a: pooled([r for r in runs if r["arm"] == a]) for a in arms},
        "runs": runs,
    }
    if args.json:
        print(json.dumps(result))
    else:
        for arm, p in result["arms"].items():
            print(
                f"{arm:<11} val {p['final_val_loss_mean']} ± {p['final_val_loss_sd']}  slow applied/rejected "
                f"{p['slow_deltas_applied']}/{p['slow_deltas_rejected']}"
            )


if __name__ == "__main__":
    main()
