"""Issue 36's scale bench: the swarm against its size on the S3 bus — the master's requests and CPU per
round, the round time, every delta applied once — and the simulator's scale assumption checked.

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/scale.py [--nodes 4,8,16,32] [--minutes 10] \
        [--largest-minutes M] [--step-s 0.4] [--inner-steps 10] [--out DIR] [--json]

For each N in `--nodes`: a master (`master --no-train`: it evaluates every global and probes every
delta), a hot standby and N workers paced to one step per `--step-s` (bench/_paced.py), real processes
on moto's S3 server on 127.0.0.1 (bench/_servers.py), no faults, for `--minutes` — bench/chaos.py's
soak with the fault schedule off (its supervisor, watcher and exactly-once accounting). Every node signs
with its own access key, so the server counts each node's requests. Measured over the steady window,
`--minutes` from the first outer step (start-up is not counted, and a slow one does not shorten it):

  round_s                    median seconds between outer steps (the watcher's view of head.json)
  deltas_per_round           deltas applied ÷ outer steps
  master_requests_per_round  the master's S3 requests ÷ outer steps (lists, gets, puts, its lease),
                             also by method and by what they touched ("LIST deltas", "GET leases": the
                             server's request_target), and the first worker's by what they touched
  worker_requests_per_round  one worker's requests ÷ outer steps (the median worker)
  master_cpu_s_per_round     the master's CPU seconds (/proc/PID/stat) ÷ outer steps
  active_master              which master ran the window's rounds ("ma", or the standby "mb" after a
                             takeover); the figures above are its
  goodput_tokens_per_s, deltas_lost, deltas_applied_twice (bench/chaos.py's exactly-once)

Then the check of bench/wan_model.py's extrapolation, which takes the DiLoCo round at any N to be the
measured one (the bucket side and the master are not the bottleneck): the master's CPU per round is fitted
as a + b·N (least squares over the sizes run), the round at N nodes is at least that, and the table's
DiLoCo goodput at N is scaled by round_compute ÷ max(round_compute, a + b·N), round_compute being the
measured round at the smallest N. Printed: the fit, N* (the size where the master becomes the round's
bottleneck on this machine) and the goodput at 8, 32, 128 and 1,000 nodes against the table's.

The nodes share this machine's cores: a master starved of CPU by 32 workers is part of what is measured
(the load average is reported). moto answers one request at a time, so the bucket side here is a single
server, slower than S3. The method and the figures: docs/guides/chaos.md ("Scale").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import chaos  # noqa: E402
from _servers import S3Bus  # noqa: E402

TABLE_GOODPUT = 0.90  # bench/wan_model.py's DiLoCo goodput at every size (docs/guides/diloco.md's table)
STARTUP_S = 600.0  # the longest the swarm may take to its first outer step
SIZES = (8, 32, 128, 1000)


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process, from /proc (None once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Steady:
    """The steady window's start and end: requests per node, each master life's CPU and the outer step.
    The figures are the active master's, whichever of "ma" and "mb" ran the rounds: at 32 nodes on 2
    cores the workers took over 120 s to start, "ma" stopped idle at max_wait before the first delta and
    the standby ran the whole window (2026-12-07: the first master's figures read 1.7 requests a round)."""

    def __init__(self, bus: S3Bus, swarm: chaos.Swarm, watcher: chaos.Watcher) -> None:
        self.bus, self.swarm, self.watcher = bus, swarm, watcher
        self.marks: list[dict[str, Any]] = []
        self.cpu: dict[str, float] = {}  # master life name -> its last CPU reading while it lived

    def outer_step(self) -> int:
        heads = self.watcher.snapshot()[0]
        return max((h.outer_step for h in heads), default=0)

    def sample_cpu(self) -> None:
        for life in self.swarm.live("master"):
            value = cpu_seconds(life.proc.pid)
            if value is not None:
                self.cpu[life.name] = value

    def mark(self, t: float) -> None:
        self.sample_cpu()
        self.marks.append(
            {
                "t": t,
                "step": self.outer_step(),
                "requests": self.bus.requests(),
                "targets": self.bus.targets(),
                "cpu": dict(self.cpu),
            }
        )

    def figures(self, workers: list[str]) -> dict[str, Any]:
        first, last = self.marks[0], self.marks[-1]
        steps = max(1, last["step"] - first["step"])

        def spent(node: str) -> int:
            before, after = first["requests"].get(node, {}), last["requests"].get(node, {})
            return sum(after.values()) - sum(before.values())

        def per_round(counts: str, node: str) -> dict[str, float]:
            before, after = first[counts].get(node, {}), last[counts].get(node, {})
            return {k: round((after[k] - before.get(k, 0)) / steps, 2) for k in sorted(after)}

        active, standby = sorted(("ma", "mb"), key=spent, reverse=True)
        return {
            "steady_s": round(last["t"] - first["t"], 1),
            "steady_outer_steps": last["step"] - first["step"],
            "active_master": active,
            "master_requests_per_round": round(spent(active) / steps, 2),
            "master_requests_by_method_per_round": per_round("requests", active),
            "master_requests_by_target_per_round": per_round("targets", active),
            "worker_requests_by_target_per_round": per_round("targets", workers[0]),
            "standby_requests_per_round": round(spent(standby) / steps, 2),
            "worker_requests_per_round": round(statistics.median(spent(w) for w in workers) / steps, 2),
            "master_cpu_s_per_round": round(cpu_spent(first["cpu"], last["cpu"], active) / steps, 4),
        }


def cpu_spent(before: dict[str, float], after: dict[str, float], node: str) -> float:
    """CPU seconds the lives of master `node` ("ma", "ma.2", …) used between two marks (a life started
    after the first counts from 0)."""
    lives = [name for name in after if name.split(".")[0] == node]
    return sum(after[name] - before.get(name, 0.0) for name in lives)


def run_size(s: chaos.Settings, folder: Path) -> dict[str, Any]:
    """One swarm of `s.workers` workers for `s.minutes`, no faults: its figures."""
    folder.mkdir(parents=True, exist_ok=True)
    window = s.minutes * 60
    bus = S3Bus(folder)
    swarm = chaos.Swarm(s, bus, folder, time.time())
    chaos.OPEN.append((swarm, bus))
    watcher = chaos.Watcher(bus, swarm.now)
    quiet = chaos.Chaos(swarm, s, watcher)  # no faults: only its supervisor runs
    workers = [f"w{i}" for i in range(s.workers)]
    try:
        chaos.start_master(swarm)
        swarm.start("master", "mb", "--standby")
        for node in workers:
            swarm.start("worker", node)
        threading.Thread(target=quiet.supervise, daemon=True).start()
        steady = Steady(bus, swarm, watcher)
        # The window is `minutes` of steady state from the first outer step: start-up is not measured,
        # and a slow one (the first step's torch.compile with a cold cache under CI's load: 58 s) must
        # not eat the window (a 1-minute CI run then sent no delta at all).
        chaos._wait(lambda: steady.outer_step() >= 1, STARTUP_S, "the first outer step")
        quiet.steady_at = swarm.now()
        end = quiet.steady_at + window
        steady.mark(swarm.now())
        while swarm.now() < end:
            steady.sample_cpu()
            time.sleep(1.0)
        steady.mark(swarm.now())
        quiet.keeping.set()
        run = chaos.finish(swarm, watcher, quiet, end)
    finally:
        quiet.keeping.set()
        watcher.stop()
        swarm.close()
        bus.close()
    return size_row(s, run, steady.figures(workers))


def size_row(s: chaos.Settings, run: dict[str, Any], steady: dict[str, Any]) -> dict[str, Any]:
    steps = max(1, steady["steady_outer_steps"])
    return {
        "nodes": s.workers,
        "round_s": run["round_s_median"],
        "outer_steps": run["outer_steps"],
        "deltas_per_round": round(run["deltas_applied"] / max(1, run["outer_steps"]), 2),
        **steady,
        "goodput_tokens_per_s": run["goodput_tokens_per_s"],
        "deltas_sent": run["deltas_sent"],
        "deltas_applied": run["deltas_applied"],
        "deltas_rejected": run["deltas_rejected"],
        "deltas_left_on_bus": run["deltas_left_on_bus"],
        "deltas_lost": run["deltas_lost"],
        "deltas_applied_twice": run["deltas_applied_twice"],
        "lost_ids": run["lost_ids"],
        "applied_twice_ids": run["applied_twice_ids"],
        "unplanned_exits": run["unplanned_exits"],
        "first_outer_step_s": run["first_outer_step_s"],
        "final_val_loss": run["final_val_loss"],
        "load_avg": run["load_avg"],
        "rounds_per_minute": round(steps / max(1e-9, steady["steady_s"]) * 60, 2),
    }


def fit(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Master CPU s per round = a + b·N (least squares), and the simulator's DiLoCo goodput at scale
    with the master as a possible bottleneck (module doc)."""
    xs = [float(r["nodes"]) for r in rows]
    ys = [float(r["master_cpu_s_per_round"]) for r in rows]
    if len(rows) >= 2 and len(set(xs)) >= 2:
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
        a = my - b * mx
    else:
        a, b = (ys[0] if ys else 0.0), 0.0
    smallest = min(rows, key=lambda r: r["nodes"])
    compute = float(smallest["round_s"] or 0.0)
    at = {}
    for n in SIZES:
        master = a + b * n
        share = compute / max(compute, master) if compute > 0 else None
        at[str(n)] = {
            "master_s_per_round": round(master, 3),
            "goodput": None if share is None else round(TABLE_GOODPUT * share, 4),
        }
    bottleneck = (compute - a) / b if b > 0 and compute > a else None
    return {
        "master_cpu_s_per_round": {"a": round(a, 4), "b_per_node": round(b, 5)},
        "round_compute_s": compute,
        "master_bound_from_nodes": None if bottleneck is None else round(bottleneck, 1),
        "table_goodput": TABLE_GOODPUT,
        "goodput_at": at,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", default="4,8,16,32", help="the swarm sizes, comma-separated")
    p.add_argument("--minutes", type=float, default=10.0, help="each size's window")
    p.add_argument(
        "--largest-minutes", type=float, default=None, help="the largest size's window (default --minutes)"
    )
    p.add_argument("--step-s", type=float, default=0.4, help="each worker's pace: seconds per step at least")
    p.add_argument("--inner-steps", type=int, default=10, help="H")
    p.add_argument("--out", type=Path, default=None, help="where runs, logs and scale.json go")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    a = p.parse_args()
    sizes = [int(x) for x in a.nodes.split(",") if x.strip()]
    if not sizes or min(sizes) < 1:
        p.error("--nodes: give sizes of at least 1, e.g. 4,8,16,32")
    out = a.out or Path(f"/tmp/scale-{int(time.time())}")
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in sizes:
        minutes = a.largest_minutes if a.largest_minutes and n == max(sizes) else a.minutes
        s = chaos.Settings(
            minutes,
            1e9,
            n,
            "s3",
            0,
            out,
            a.step_s,
            a.inner_steps,
            5.0,
            20.0,
            60.0,
            10.0,
            False,
            val_batches=2,  # as the figures in docs/guides/chaos.md were measured (the master's CPU per round)
        )
        rows.append(run_size(s, out / f"n{n}"))
        print(json.dumps({k: v for k, v in rows[-1].items() if not k.endswith("_ids")}), file=sys.stderr)
    result = {
        "minutes": a.minutes,
        "largest_minutes": a.largest_minutes or a.minutes,
        "step_s": a.step_s,
        "inner_steps": a.inner_steps,
        "sizes": rows,
    }
    result["simulator_check"] = fit(rows)
    (out / "scale.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=None if a.json else 1))


if __name__ == "__main__":
    main()
