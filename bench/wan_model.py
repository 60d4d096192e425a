"""The calibrated model behind `bench/wan.py --simulate`: measured WAN runs in, goodput at scale out.

Inputs: one or more `bench/wan.py --json` outputs (each one link rate). From them:

  c_ddp    DDP seconds per step when the link is not the bottleneck: the median measured seconds
           per step of the runs whose step took over 1.15 × its link time (bytes per step × 8 / rate);
           if every run was link-bound, the fastest link's (an upper bound)
  b_ddp    link bytes per DDP step (the qdisc's count ÷ steps): gloo's ring all-reduce plus TCP/IP
           headers; per node per step that is g = b_ddp / (2 (N−1)), the fp32 gradient with overhead
  r_comp   DiLoCo seconds per round without the link, from the rounds' spacing (the master's
           outer-step log lines) of the runs whose round took over 1.15 × its link time, each solved
           for it from the round model below (the median of them)
  b_round  link bytes per DiLoCo round (all workers' int8 deltas up, the globals down, polls)
  e        token efficiency: DDP steps to the target ÷ DiLoCo worker steps to the target (< 1: DiLoCo
           needs more steps per worker for DDP's loss; taken from the measured runs, assumed to hold;
           unknown when no DiLoCo run reached the target, and then no time-to-target ratio is given)

DDP's communication overlaps its compute (gloo's all-reduce of one bucket runs while backward computes
the next), so a step takes the longer of the two, not their sum — the measurements say so: DDP at
10 Mbit/s took its link time to within 1%, and at 100 Mbit/s, where the two were equal, the longer of
them to within 1%. A DiLoCo round overlaps only in part: its polls and uploads run in the background,
but with the shipped `overlap_steps: 1` a worker waits for the global that answers its delta, so the
last delta up and the global down are on the round's path. Where compute and link time are far apart
the round takes the longer (as before); where they are about equal it takes longer than either. The
round is the smooth maximum (r_comp^p + link^p)^(1/p) with p = ROUND_P (6): chosen on the measured run
sets of two machines (a 2-core Xeon: bench/results/wan-{10,30,100}-{poll,mu08-all,overlap1}.json; a
2-core AMD EPYC: wan-*-amd.json), where the plain max was 18% short on the AMD's 10 Mbit/s round
(compute 1.59 s, link 1.57 s, measured 1.96 s) and p = 6 is within 12% on every run of every set.
The link term is not fitted at all: it is bytes ÷ rate. The check: the model predicts every measured
arm's seconds per DDP step and per DiLoCo round on every link measured, as one shared link of that
rate (what the bench measures):
    DDP step     = max(c_ddp, b_ddp · 8 / rate)
    DiLoCo round = smax(r_comp, b_round · 8 / rate),    smax(a, b) = (a^p + b^p)^(1/p)
and prints measured vs predicted; a prediction more than 15% off fails the check (exit 1), and the
extrapolation is not printed. With one link rate only, the check is in-sample and says so.

The extrapolation: N nodes, each with its own link of `rate` both ways, a round-trip time `rtt`
(the measured runs had none: netem is missing), the DiLoCo Hub/bucket side not the bottleneck:
    DDP step     = max(c_ddp, 2 (N−1)/N · g · 8 / rate) + (N−1) · rtt      (ring all-reduce)
    DiLoCo round = smax(r_comp, (b_round / N_m) · 8 / rate) + 2 rtt          (one delta up, one global down)
with N_m the measured node count, and the compute per step held at the measured one (the same model
and per-node batch at any N). Goodput = the share of wall-clock spent computing, times
the share not lost to failures at `fail` failures per node-day, a restart costing `restart` seconds:
    DDP:    any node's failure stops all N; each costs the restart plus half a checkpoint interval
            of everyone's work:  1 − N · fail/86400 · (restart + ckpt/2)
    DiLoCo: a failed node loses its own round in progress and its restart; the others go on:
            1 − fail/86400 · (restart + round/2)
Time to target: DDP S steps, DiLoCo S/e steps per worker, each at its goodput.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOLERANCE = 0.15
NODES = (8, 32, 128, 1000)
RATES_MBIT = (10.0, 100.0, 1000.0, 10000.0)
FAILS_PER_NODE_DAY = (0.0, 0.1, 1.0)
RTT_S = 0.05
RESTART_S = 120.0
CHECKPOINT_S = 1800.0
ROUND_P = 6.0  # the DiLoCo round's smooth maximum of compute and link (module doc)


@dataclass
class Measured:
    """What one --json file says about each arm, reduced to what the model needs."""

    mbit: float
    workers: int
    ddp_step_s: float
    ddp_bytes_per_step: float
    ddp_steps: int
    round_s: float | None
    round_bytes: float | None
    inner_steps: int | None
    rounds_to_target: int | None
    # bench/wan.py's time to target from each arm's first step, and its start-up (absent in older runs)
    ddp_steady_s: float | None = None
    diloco_steady_s: float | None = None
    ddp_startup_s: float | None = None
    diloco_startup_s: float | None = None


def ddp_step_seconds(arm: dict[str, Any], eval_every: int) -> float:
    """Seconds per step from the spacing of the validation losses (eval every `eval_every` steps), so
    process start and the first step's set-up are not counted."""
    times = [t for t, _ in arm["val_losses"]]
    if len(times) < 2:
        raise ValueError("DDP arm: fewer than two validation losses, cannot time a step")
    return (times[-1] - times[0]) / ((len(times) - 1) * eval_every)


def read(path: str | Path) -> Measured:
    data = json.loads(Path(path).read_text())
    arms = data["arms"]
    ddp = arms["ddp"]
    eval_every = int(data.get("eval_every", 10))
    diloco = arms.get("diloco")
    round_s = round_bytes = rounds_to_target = inner = None
    if diloco and len(diloco.get("round_times_s", [])) >= 2:
        times = diloco["round_times_s"]
        round_s = statistics.median(b - a for a, b in itertools.pairwise(times))
        round_bytes = diloco["link_bytes"] / max(1, diloco["rounds"])
        inner = int(diloco["inner_steps"])
        if diloco.get("s_to_target") is not None:
            rounds_to_target = sum(1 for t in times if t <= diloco["s_to_target"] + 1e-6)
    return Measured(
        mbit=float(data["link_mbit"]),
        workers=int(data["workers"]),
        ddp_step_s=ddp_step_seconds(ddp, eval_every),
        ddp_bytes_per_step=ddp["link_bytes"] / max(1, ddp["steps"]),
        ddp_steps=int(ddp["steps"]),
        round_s=round_s,
        round_bytes=round_bytes,
        inner_steps=inner,
        rounds_to_target=rounds_to_target,
        ddp_steady_s=data.get("ddp_steady_s_to_target"),
        diloco_steady_s=data.get("diloco_steady_s_to_target"),
        ddp_startup_s=data.get("ddp_startup_s"),
        diloco_startup_s=data.get("diloco_startup_s"),
    )


def link_s(nbytes: float, mbit: float) -> float:
    return nbytes * 8 / (mbit * 1e6)


def smooth_max(a: float, b: float, p: float = ROUND_P) -> float:
    """(a^p + b^p)^(1/p): the longer of a and b where they are far apart, longer than both where they
    are about equal (2^(1/p) × either when equal)."""
    return (a**p + b**p) ** (1 / p)


def without(total: float, part: float, p: float = ROUND_P) -> float:
    """The a in smooth_max(a, part) = total (total > part)."""
    return (total**p - part**p) ** (1 / p)


@dataclass
class Model:
    c_ddp: float
    b_ddp: float
    r_comp: float | None
    b_round: float | None
    inner_steps: int | None
    efficiency: float | None
    workers: int

    @classmethod
    def fit(cls, runs: list[Measured]) -> Model:
        fast = max(runs, key=lambda r: r.mbit)
        b_ddp = statistics.mean(r.ddp_bytes_per_step for r in runs)
        c_ddp = compute_term([(r.ddp_step_s, link_s(r.ddp_bytes_per_step, r.mbit), r.mbit) for r in runs])
        r_comp = b_round = efficiency = None
        with_rounds = [r for r in runs if r.round_s is not None]
        if with_rounds:
            b_round = statistics.mean(r.round_bytes for r in with_rounds)  # type: ignore[misc]
            r_comp = compute_term(
                [(r.round_s, link_s(r.round_bytes, r.mbit), r.mbit) for r in with_rounds],  # type: ignore[misc]
                without,
            )
            reached = [r for r in with_rounds if r.rounds_to_target]
            if reached:
                efficiency = statistics.mean(
                    r.ddp_steps / (r.rounds_to_target * r.inner_steps)  # type: ignore[operator]
                    for r in reached
                )
        return cls(c_ddp, b_ddp, r_comp, b_round, fast.inner_steps, efficiency, fast.workers)

    # the measured topology: all processes behind one shared link
    def shared_ddp_step(self, mbit: float) -> float:
        return max(self.c_ddp, link_s(self.b_ddp, mbit))

    def shared_round(self, mbit: float) -> float | None:
        if self.r_comp is None or self.b_round is None:
            return None
        return smooth_max(self.r_comp, link_s(self.b_round, mbit))

    # the extrapolated topology: a link per node
    def ddp_step(self, nodes: int, mbit: float, rtt: float) -> float:
        per_node = self.b_ddp / (2 * max(1, self.workers - 1))  # g: one gradient with overhead
        wire = link_s(2 * (nodes - 1) / nodes * per_node, mbit)
        return max(self.c_ddp, wire) + (nodes - 1) * rtt

    def round(self, mbit: float, rtt: float) -> float:
        assert self.r_comp is not None and self.b_round is not None
        return smooth_max(self.r_comp, link_s(self.b_round / self.workers, mbit)) + 2 * rtt


def compute_term(
    points: list[tuple[float, float, float]], remove: Callable[[float, float], float] | None = None
) -> float:
    """The compute side of the step or round model from (measured seconds, link seconds, rate) per run:
    the median over the runs where the link was not the bottleneck (measured > 1.15 × link time) of
    the measured time, or of `remove(measured, link)` (the compute the model's combination of the two
    leaves); when every run was link-bound, the fastest link's measured time (an upper bound)."""
    free = [
        remove(measured, wire) if remove else measured
        for measured, wire, _ in points
        if measured > 1.15 * wire
    ]
    if free:
        return statistics.median(free)
    return max(points, key=lambda p: p[2])[0]


def check(model: Model, runs: list[Measured]) -> list[tuple[str, float, float, bool]]:
    """(what, measured, predicted, within tolerance) for every measured arm."""
    rows = []
    for run in sorted(runs, key=lambda r: r.mbit):
        predicted = model.shared_ddp_step(run.mbit)
        rows.append(
            (f"DDP s/step @ {run.mbit:g} Mbit/s", run.ddp_step_s, predicted, ok(run.ddp_step_s, predicted))
        )
        shared = model.shared_round(run.mbit)
        if run.round_s is not None and shared is not None:
            rows.append(
                (f"DiLoCo s/round @ {run.mbit:g} Mbit/s", run.round_s, shared, ok(run.round_s, shared))
            )
    return rows


def to_target(model: Model, run: Measured) -> list[tuple[str, float, float, bool]]:
    """The model's time to target (DDP: its steps at the shared-link step time; DiLoCo: its rounds to
    target at the shared-link round time) against the measured time from the first step and, with the
    measured start-up added, from process start. Shown beside the check; the check is the step and round
    times, which these are made of (start-up is not something the model predicts)."""
    rows = []
    shared = model.shared_round(run.mbit)
    arms = [("DDP", run.ddp_steps * model.shared_ddp_step(run.mbit), run.ddp_steady_s, run.ddp_startup_s)]
    if shared is not None and run.rounds_to_target:
        arms.append(("DiLoCo", run.rounds_to_target * shared, run.diloco_steady_s, run.diloco_startup_s))
    for arm, predicted, steady, startup in arms:
        if steady is None or startup is None:
            continue
        at = f"@ {run.mbit:g} Mbit/s"
        rows.append((f"{arm} s to target, 1st step {at}", steady, predicted, ok(steady, predicted)))
        total = steady + startup
        rows.append(
            (f"{arm} s to target, start {at}", total, predicted + startup, ok(total, predicted + startup))
        )
    return rows


def ok(measured: float, predicted: float) -> bool:
    return abs(predicted - measured) <= TOLERANCE * measured


def goodput_ddp(
    model: Model, nodes: int, mbit: float, fail: float, rtt: float = RTT_S
) -> tuple[float, float]:
    step = model.ddp_step(nodes, mbit, rtt)
    survive = max(0.0, 1 - nodes * fail / 86400 * (RESTART_S + CHECKPOINT_S / 2))
    return model.c_ddp / step * survive, step / max(survive, 1e-9)


def goodput_diloco(model: Model, mbit: float, fail: float, rtt: float = RTT_S) -> tuple[float, float]:
    rnd = model.round(mbit, rtt)
    survive = max(0.0, 1 - fail / 86400 * (RESTART_S + rnd / 2))
    return model.r_comp / rnd * survive, rnd / max(survive, 1e-9)  # type: ignore[operator]


def table(model: Model, rtt: float = RTT_S) -> list[str]:
    fails = " ".join(f"{f'{f:g}/node-day':>17}" for f in FAILS_PER_NODE_DAY)
    lines = [
        f"extrapolation: a link per node both ways, rtt {rtt * 1000:g} ms, restart {RESTART_S:.0f} s, "
        f"DDP checkpoint every {CHECKPOINT_S:.0f} s",
        "goodput (share of wall-clock computing) DDP / DiLoCo at each failure rate; last column: DDP's time "
        "to target ÷ DiLoCo's at no failures (needs e)",
        f"{'nodes':>6} {'link':>11} {fails} {'DDP÷DiLoCo':>11}",
    ]
    for nodes in NODES:
        for mbit in RATES_MBIT:
            cells = []
            for fail in FAILS_PER_NODE_DAY:
                g_ddp, _ = goodput_ddp(model, nodes, mbit, fail, rtt)
                g_dil, _ = goodput_diloco(model, mbit, fail, rtt)
                cells.append(f"{f'{g_ddp:.0%} / {g_dil:.0%}':>17}")
            ratio = "-"
            if model.efficiency and model.inner_steps:
                step = goodput_ddp(model, nodes, mbit, 0.0, rtt)[1]  # seconds per DDP step
                per_step = goodput_diloco(model, mbit, 0.0, rtt)[1] / model.inner_steps / model.efficiency
                ratio = f"{step / per_step:.1f}x"
            rate = f"{mbit / 1000:g} Gbit/s" if mbit >= 1000 else f"{mbit:g} Mbit/s"
            lines.append(f"{nodes:>6} {rate:>11} {' '.join(cells)} {ratio:>11}")
    return lines


def plot(model: Model, path: str | Path, rtt: float = RTT_S) -> None:
    """The extrapolation as a figure: goodput against nodes, one panel per link rate, DDP and DiLoCo
    at each failure rate (matplotlib, the `plot` extra; imported here only)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # a file, never a window
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit('wan: --plot needs matplotlib: pip install -e ".[plot]"') from None
    fig, axes = plt.subplots(1, len(RATES_MBIT), figsize=(3.2 * len(RATES_MBIT), 3.2), sharey=True)
    styles = {0.0: "-", 0.1: "--", 1.0: ":"}
    for ax, mbit in zip(axes, RATES_MBIT, strict=True):
        for fail in FAILS_PER_NODE_DAY:
            style = styles.get(fail, "-.")
            ddp = [goodput_ddp(model, n, mbit, fail, rtt)[0] for n in NODES]
            dil = [goodput_diloco(model, mbit, fail, rtt)[0] for _ in NODES]
            ax.plot(NODES, ddp, style, color="tab:red", label=f"DDP, {fail:g} fail/node-day")
            ax.plot(NODES, dil, style, color="tab:blue", label=f"DiLoCo, {fail:g} fail/node-day")
        ax.set_xscale("log")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{mbit / 1000:g} Gbit/s per node" if mbit >= 1000 else f"{mbit:g} Mbit/s per node")
        ax.set_xlabel("nodes")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("goodput (share of wall-clock computing)")
    axes[-1].legend(fontsize=7, loc="center right")
    fig.suptitle(f"bench/wan.py --simulate: rtt {rtt * 1000:g} ms, restart {RESTART_S:.0f} s", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(paths: list[str], rtt: float = RTT_S, plot_path: str | None = None) -> int:
    runs = [read(p) for p in paths]
    model = Model.fit(runs)
    eff = f"{model.efficiency:.2f}" if model.efficiency else "not measured (DiLoCo did not reach the target)"
    print(
        f"fitted on {len(runs)} run(s) at {', '.join(f'{r.mbit:g}' for r in runs)} Mbit/s; compute from "
        f"the runs the link did not limit: DDP {model.c_ddp * 1000:.1f} ms/step, {model.b_ddp:,.0f} "
        f"link B/step; DiLoCo "
        + (
            f"{model.r_comp:.2f} s/round, {model.b_round:,.0f} link B/round (H={model.inner_steps})"
            if model.r_comp is not None
            else "not measured"
        )
        + f"; token efficiency e = {eff}"
    )
    rows = check(model, runs)
    in_sample = len({r.mbit for r in runs}) < 2
    print(
        "check: measured vs predicted on the measured (shared-link) runs"
        + (" — IN-SAMPLE: one link rate only, this is a fit, not a check" if in_sample else "")
    )
    for what, measured, predicted, good in rows:
        print(
            f"  {what:<32} measured {measured:8.3f}  predicted {predicted:8.3f}  "
            f"{(predicted - measured) / measured:+6.1%}  {'ok' if good else 'OFF BY MORE THAN 15%'}"
        )
    times = [row for run in sorted(runs, key=lambda r: r.mbit) for row in to_target(model, run)]
    if times:
        print("time to target (not part of the check; start-up is measured, not modelled):")
    for what, measured, predicted, good in times:
        print(
            f"  {what:<40} measured {measured:8.2f}  predicted {predicted:8.2f}  "
            f"{(predicted - measured) / measured:+6.1%}  {'ok' if good else 'off by more than 15%'}"
        )
    if not all(good for *_, good in rows):
        print("the model does not reproduce the measured runs within 15%: no extrapolation printed")
        return 1
    if model.r_comp is None:
        print("no DiLoCo rounds measured: nothing to extrapolate")
        return 1
    print("\n".join(table(model, rtt)))
    if plot_path:
        plot(model, plot_path, rtt)
        print(f"plot: {plot_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
