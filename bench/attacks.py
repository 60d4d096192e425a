"""Issue 24's attack suite through real processes: a master and 8 workers on a directory bus, 2 hostile.

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/attacks.py [--json out.json] [--set KEY=VALUE ...]

One run per arm, each a fresh directory bus: `speedtronic master --no-train` (it evaluates every global
on its validation batches) and `speedtronic worker` subprocesses; the hostile ones are
bench/hostile_worker.py (the same worker CLI, its deltas transformed before upload). Arms:

  clean6         6 honest workers, the shipped defaults: the reference every attacked run is compared with
  clean6-mean    the same with the plain mean of before: aggregation=mean, no probe, no quarantine (what
                 the defenses cost a clean run)
  clean8         8 honest workers
  <attack>       6 honest + 2 hostile workers (h1, h2), one run per attack in hostile_worker.ATTACKS

Settings (the defaults; the whole suite is 11 runs of 9 processes): a 2-layer, 64-wide byte-level model,
block 64, batch 8, 30 inner steps per worker at H=5 (6 outer rounds), int8 deltas, every round waiting
for one delta of every worker (`min_deltas` = the workers, `max_rounds_ahead` 1: nearly synchronous
DiLoCo, so rounds have the same members in every arm), `max_consecutive_rejections` off (a rejected
worker trains on, so that every arm has the same rounds). `--set` is passed to the master and every
worker, e.g. `--set distributed.defences.quarantine_below=0` or `--set distributed.defences.loss_probe=true`.

The table: the loss of the global after the last round (the master's final pick, the best recent
global, is in the JSON), its ratio to clean6, honest deltas rejected, and the hostile nodes' deltas
rejected / applied (applied ones may still weigh 0: quarantined or failed the loss probe — the
"zeroed" column counts them from the master's log) and their agreement score. Every honest delta a
worker reports as uploaded must be applied exactly once (checked; a failure is reported in the row).
The goal (issue 24): every attacked arm within 2% of clean6, no honest delta rejected in the clean
arms, clean6 no worse than clean6-mean by more than 1%. Issue 36: the loss probe's false positives —
honest deltas it weighed 0, from the master's log, per arm (`honest_zeroed_by_probe`,
`honest_probe_false_positive` in the JSON) and over the suite (the last line) — under 5%.
Measured 2026-12-05 (2 shared cores, `OMP_NUM_THREADS=1 python bench/attacks.py --arms
clean6,collude,tokens`, min_deltas = the honest workers, deltas weighed 0 not counting toward it):
clean6 3.3389, collude 3.2963 (0.987), tokens 3.2987 (0.988); probe false positives 0 of 108 honest
deltas; no honest delta rejected; 329 s.

Measured (2026-12-02, 2 CPU cores shared with other work, 1012 s for the suite; last-round val loss /
clean6). Shipped defaults now: clipped_mean, loss_probe auto (on: the master has validation batches),
quarantine_below 0. The "before" column is the previous defaults (no probe, no quarantine), same suite:

  arm          shipped defaults (now)                  before (no probe, no quarantine)
  clean6       3.3755  1.000                           3.3472  1.000
  clean6-mean  3.3554  0.994  (plain mean, no probe)   3.3454  0.999
  clean8       3.3699  0.998                           3.3495  1.001
  reverse      3.3794  1.001  (10 of 12 weighed 0)     3.6493  1.090
  random       3.3827  1.002  (8 of 12)                3.4292  1.025
  scale5       3.3771  1.001                           3.3529  1.002
  tokens       3.3794  1.001  (10 of 12)               3.7751  1.129 *
  tiny         3.3925  1.005                           3.3856  1.011
  replay       3.3754  1.000  (every copy rejected or counted once)   3.3497  1.001
  collude      3.3794  1.001  (10 of 12)               3.6830  1.100
  drift        3.3770  1.000                           3.3484  1.000

Goal met with the shipped defaults: every attacked arm within 2% of clean6 (worst: tiny, +0.5%), no
honest delta rejected in any arm, every honest delta applied exactly once, and clean6 0.6% above the
plain mean of before (within the 1% allowed). Hostile agreement scores: reverse/tokens −0.87,
collude −0.77, random +0.03, the others +0.85 (they follow the honest direction). * tokens before the
master clipped claims to the round's median: 6.2262 (1.860; the plan's bound leaves room for 8 ranks,
so two one-rank attackers outweighed six honest peers). The 2 hostile deltas the probe lets through
are the first round's: at the initial plateau a reversed delta alone barely moves the loss. The
defended clean arm is 0.6% above the plain mean with nothing weighed 0: the probe's evaluations delay
every global, and the workers install it later in their inner loop. The "before" column ran
earlier the same day: its clean6 is 0.8% below today's (the defenses' cost measured across runs),
and its plain-mean arm 0.3% below today's (the same settings: that much is timing between runs).

Re-run (2026-12-02, 2 idle CPU cores, 300 s) after `overlap_steps` 1 (each global installed the step
after its sync, waiting for it) and `wait_poll_interval` became the defaults,
bench/results/attacks-overlap1.json; last-round val loss / clean6:

  clean6 3.3246 1.000 · clean6-mean 3.3230 1.000 · clean8 3.3305 1.002 · reverse 3.3135 0.997
  (10 of 12 weighed 0) · random 3.3588 1.010 (8 of 12) · scale5 3.3347 1.003 · tokens 3.3136 0.997
  (10 of 12) · tiny 3.3882 1.019 · replay 3.3238 1.000 · collude 3.3135 0.997 (10 of 12) · drift
  3.3364 1.004

Goal met again: every attacked arm within 2% of clean6 (worst: tiny, +1.9%), no honest delta rejected,
every honest delta applied exactly once, clean6 at +0.05% of the plain mean.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
sys.path.insert(0, str(HERE))
from hostile_worker import ATTACKS  # noqa: E402

TEXT = HERE.parents[2] / "shared" / "data" / "tinyshakespeare.txt"


def write_config(folder: Path, args: argparse.Namespace, workers: int, honest: int | None = None) -> Path:
    """`min_deltas`: the honest workers (deltas the defences weigh 0 do not count toward it: a round
    waits for the honest deltas, and takes the hostile ones that came with them)."""
    cfg = {
        "run": {"name": "attacks", "max_steps": args.steps, "log_every": 5, "eval_every": 0, "device": "cpu"},
        "model": {"n_layer": args.n_layer, "n_head": 2, "d_model": args.d_model},
        "data": {"block_size": args.block, "micro_batch_size": args.batch, "val_batches": args.val_batches}
        | ({"text_path": str(TEXT)} if TEXT.exists() else {}),
        "optimizer": {"lr": 3.0e-3},
        "checkpoint": {"every_steps": 1000, "keep_last": 1},
        "logging": {"hooks": []},
        "distributed": {
            "enabled": True,
            "sync": {"inner_steps": args.inner_steps, "ramp": False},
            "node": {"poll_interval": 0.2},
            "rounds": {"max_wait": 300.0, "min_deltas": honest or workers, "late_join_wait": 0.0},
            "bus": {"retry_initial": 0.2, "retry_max": 1.0},
            "worker": {"max_rounds_ahead": 1, "max_consecutive_rejections": None},
        },
    }
    path = folder / "attacks.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


class Run:
    """One arm: its processes, their logs and results."""

    def __init__(self, folder: Path, args: argparse.Namespace, honest: int, hostile: int, attack: str, sets):
        self.folder, self.args, self.attack = folder, args, attack
        self.honest = [f"w{i + 1}" for i in range(honest)]
        self.hostile = [f"h{i + 1}" for i in range(hostile)]
        self.cfg = write_config(folder, args, honest + hostile, honest)
        self.bus = folder / "bus"
        self.sets = [a for s in sets for a in ("--set", s)]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str]) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
        env.update(PYTHONPATH=str(SRC), OMP_NUM_THREADS="1", COLUMNS="1000", HF_HOME=str(self.folder / "hf"))
        with open(self.folder / f"{name}.out", "wb") as out, open(self.folder / f"{name}.err", "wb") as err:
            self.procs[name] = subprocess.Popen(argv, cwd=self.folder, env=env, stdout=out, stderr=err)

    def launch(self) -> None:
        repo = f"file://{self.bus}"
        py = sys.executable
        self.start(
            "master",
            [
                py,
                "-m",
                "speedtronic",
                "master",
                str(self.cfg),
                "--repo",
                repo,
                "--no-train",
                "--json",
                *self.sets,
            ],
        )
        deadline = time.monotonic() + 120
        while not (self.bus / "head.json").exists():  # workers need the manifest and the first global
            if self.procs["master"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the master did not start:\n{self.log('master')[-3000:]}")
            time.sleep(0.1)
        worker = ["worker", str(self.cfg), "--repo", repo, "--json", *self.sets]
        for node in self.honest:
            self.start(node, [py, "-m", "speedtronic", *worker, "--node-id", node])
        for node in self.hostile:
            extra = ["--victim", self.honest[0], "--bus", str(self.bus)] if self.attack == "replay" else []
            self.start(
                node,
                [
                    py,
                    str(HERE / "hostile_worker.py"),
                    "--attack",
                    self.attack,
                    *extra,
                    "--",
                    *worker,
                    "--node-id",
                    node,
                ],
            )

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.err").read_text(errors="replace")

    def result(self, name: str, timeout: float) -> dict[str, Any]:
        rc = self.procs[name].wait(timeout)
        if rc != 0:
            raise RuntimeError(f"{self.attack}: {name} exited {rc}:\n{self.log(name)[-3000:]}")
        return json.loads((self.folder / f"{name}.out").read_text().strip().splitlines()[-1])

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def summarize(run: Run, master: dict[str, Any], workers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    applied, rejected = master["applied"], master["rejected"]
    node_of = lambda delta_id: delta_id.split("/", 1)[0]  # noqa: E731
    honest_uploaded = {f"{n}/{f}" for n in run.honest for f in workers[n]["uploaded"]}
    honest_rejected = [r for r in rejected if node_of(r["id"]) in run.honest]
    honest_applied = [a for a in applied if node_of(a) in run.honest]
    problems = []
    if len(applied) != len(set(applied)):
        problems.append("a delta applied twice")
    if set(honest_applied) | {r["id"] for r in honest_rejected} != honest_uploaded:
        problems.append("honest uploads != applied + rejected")
    log = run.log("master")
    zeroed = len(re.findall(r"loss probe: delta h\d+/", log))
    # The probe's false positives: honest deltas it weighed 0 (issue 36: under 5% of honest deltas).
    honest_zeroed = len(re.findall(r"loss probe: delta w\d+/", log))
    zeroed_rounds = [
        int(m) for m in re.findall(r"\((\d+) quarantined, probed worse or duplicates, weighing 0\)", log)
    ]
    status_path = run.folder / master["metrics"]  # relative to the master's cwd
    peers = {}
    if status_path.exists():
        status = json.loads(status_path.read_text())
        peers = {n: v.get("score") for n, v in (status.get("nodes") or {}).items() if isinstance(v, dict)}
    losses = [v["val_loss"] for v in master["global_val_loss"]]
    final = master.get("final") or {}
    last = final.get("last_val_loss", losses[-1] if losses else float("nan"))
    return {
        "arm": run.attack,
        "workers": len(run.honest) + len(run.hostile),
        "hostile": len(run.hostile),
        "outer_step": master["outer_step"],
        "last_val_loss": last,
        "final_val_loss": final.get("val_loss", last),
        "final_chosen": final.get("chosen"),
        "val_losses": losses,
        "honest_rejected": len(honest_rejected),
        "honest_rejected_reasons": [r["reason"] for r in honest_rejected][:5],
        "honest_applied": len(honest_applied),
        "hostile_rejected": sum(node_of(r["id"]) in run.hostile for r in rejected),
        "hostile_applied": sum(node_of(a) in run.hostile for a in applied),
        "hostile_rejected_reasons": sorted(
            {
                re.sub(r"\d[\d.e+-]*", "#", r["reason"])[:60]
                for r in rejected
                if node_of(r["id"]) in run.hostile
            }
        ),
        "hostile_rejections": [r["reason"] for r in rejected if node_of(r["id"]) in run.hostile],
        "zeroed_by_probe": zeroed,
        "honest_zeroed_by_probe": honest_zeroed,
        "honest_probe_false_positive": honest_zeroed / max(1, len(honest_applied)),
        "zeroed_total": sum(zeroed_rounds),  # quarantined or probed worse, all nodes
        "quarantined": sorted(n for n, s in peers.items() if s and s.get("quarantined")),
        "agreement": {n: (s or {}).get("agreement") for n, s in peers.items()},
        "exactly_once": not problems,
        "problems": problems,
        "end_reason": master.get("end_reason"),
    }


def run_arm(args: argparse.Namespace, root: Path, arm: str, sets: list[str]) -> dict[str, Any]:
    honest, hostile = {"clean6": (6, 0), "clean6-mean": (6, 0), "clean8": (8, 0)}.get(arm, (6, 2))
    attack = arm
    if arm == "clean6-mean":  # the plain mean of before the defenses: no probe, no quarantine
        sets = [
            *sets,
            "distributed.defences.aggregation=mean",
            "distributed.defences.loss_probe=false",
            "distributed.defences.quarantine_below=null",
        ]
    folder = root / arm
    folder.mkdir(parents=True)
    run = Run(folder, args, honest, hostile, attack, sets)
    started = time.perf_counter()
    try:
        run.launch()
        workers = {n: run.result(n, args.timeout) for n in run.honest + run.hostile}
        master = run.result("master", args.timeout)
    finally:
        run.kill()
    row = summarize(run, master, workers)
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--arms",
        default="clean6,clean6-mean,clean8," + ",".join(ATTACKS),
        help="comma-separated arms (clean6 is always run first: the reference)",
    )
    parser.add_argument("--steps", type=int, default=30, help="inner steps per worker")
    parser.add_argument("--inner-steps", type=int, default=5, help="H")
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        dest="sets",
        metavar="KEY=VALUE",
        help="a config override for the master and every worker (repeatable)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one process may run")
    parser.add_argument("--keep", default=None, help="keep the runs' folders (logs, buses) under this folder")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args()
    arms = ["clean6", *(a for a in args.arms.split(",") if a and a != "clean6")]
    unknown = [a for a in arms if a not in ("clean6", "clean6-mean", "clean8", *ATTACKS)]
    if unknown:
        parser.error(f"unknown arm {unknown[0]!r}")
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="speedtronic-attacks-"))
    started = time.perf_counter()
    rows = []
    try:
        for arm in arms:
            row = run_arm(args, root, arm, args.sets)
            rows.append(row)
            print(f"  {arm}: last val loss {row['last_val_loss']:.4f} ({row['seconds']:.0f}s)", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    clean = rows[0]["last_val_loss"]
    print(
        f"\nsettings: {args.steps} inner steps, H={args.inner_steps}, model {args.n_layer}x{args.d_model}, "
        f"block {args.block}, batch {args.batch}; --set {' '.join(args.sets) or '(none)'}"
    )
    print(
        f"{'arm':<12} {'val loss':>8} {'/clean6':>8} {'honest rej':>10} {'hostile rej/appl':>16} "
        f"{'zeroed':>6} {'once':>5}  hostile agreement / rejected because"
    )
    for row in rows:
        row["ratio"] = row["last_val_loss"] / clean
        agreement = " ".join(
            f"{n}={v:.2f}" for n, v in sorted(row["agreement"].items()) if n.startswith("h") and v is not None
        )
        print(
            f"{row['arm']:<12} {row['last_val_loss']:>8.4f} {row['ratio']:>8.3f} {row['honest_rejected']:>10} "
            f"{row['hostile_rejected']:>7}/{row['hostile_applied']:<8} {row['zeroed_total']:>6} "
            f"{'yes' if row['exactly_once'] else 'NO':>5}  {agreement} {'; '.join(row['hostile_rejected_reasons'])}"
        )
    attacked = [r for r in rows if r["hostile"]]
    fp = sum(r["honest_zeroed_by_probe"] for r in rows)
    honest = sum(r["honest_applied"] for r in rows)
    print(
        f"loss probe false positives: {fp} of {honest} honest deltas weighed 0 ({fp / max(1, honest):.1%}; goal < 5%)"
    )
    mean = next((r for r in rows if r["arm"] == "clean6-mean"), None)
    print(
        f"\ngoal: attacked within 2% of clean6: {sum(r['ratio'] <= 1.02 for r in attacked)}/{len(attacked)}; "
        f"honest rejected in clean arms: {sum(r['honest_rejected'] for r in rows if not r['hostile'])}; "
        + (f"clean6 / clean6-mean {clean / mean['last_val_loss']:.4f}" if mean else "")
        + f" · {time.perf_counter() - started:.0f}s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
