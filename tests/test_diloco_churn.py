"""Churn through real processes (issue 23): a DiLoCo swarm run as an operator would see it, on the
directory bus and on the loopback Hub with the Hub's request and commit windows enforced.

The run (`test_churn`, both buses): nine collaborators listed at `hub init`, of which one never
starts; six workers from the start, two joining late (after the first global), one added with `hub
add-collaborator` while the master runs and started then; one worker SIGKILLed after its first
delta counted and restarted (same id, same output directory: it resumes from its checkpoint); the
master SIGKILLed after outer step 2 and restarted from its state. Nine worker processes in all.

Asserted there (what main promises today): exactly-once on delta ids (none applied twice, none lost,
none applied that no one sent, nothing valid left on the bus), duplicates applied 0, the run's end
reached and said, the global model better than at the start. Printed: deltas sent / applied /
rejected / left per node, duplicates applied, the longest round wait against the slowest live
node's round time, the final global val loss against each node's.

In the same run: a duplicate of a live node id (another output directory) is refused with exit 2
naming --node-id, and a second master on the live run is refused with exit 2; no round waits longer
than max(60 s, 3 × the slowest live node's round time) although one listed node never starts.

A smaller test below checks rounds that wait only for live nodes (max_wait 600 s, so waiting for the
never-started node cannot pass by luck) and a collaborator added while the master runs counting
without a restart. A duplicate id alone: tests/test_diloco_identity_cli.py; a second master and
`master --standby` taking over from a SIGKILLed one: tests/test_diloco_master_standby.py.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import pytest

from swarm_harness import (
    OWNER,
    Swarm,
    assert_exactly_once,
    round_figures,
    supported,
    text_path,
    token,
    wait_until,
    write_config,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("restore_secrets", "isolated_env")]

# A model and data small enough that nine training processes fit on two cores: most of a process's
# time is importing torch. 12 steps at H=3: four deltas per node.
MODEL = {"n_layer": 1, "n_head": 2, "d_model": 32}
DATA = {"block_size": 32, "micro_batch_size": 4, "val_batches": 2}
STEPS, H = 12, 3
# The loopback Hub's limits (per token, per repo) and the same budgets on the clients.
WINDOW, REQUESTS = 5.0, 200
COMMIT_WINDOW, COMMITS = 10.0, 40


def churn_config(tmp_path: Path, bus: str, **distributed: Any) -> Path:
    hub = (
        {
            "hub_request_budget": REQUESTS,
            "hub_request_window": WINDOW,
            "hub_commit_budget": COMMITS,
            "hub_commit_window": COMMIT_WINDOW,
            "request_timeout": 10.0,
        }
        if bus == "hub"
        else {}
    )
    values = {
        "inner_steps": H,
        "poll_interval": 0.2,
        "retry_initial": 0.2,
        "retry_max": 1.0,
        # Also the master's idle timeout and a worker's wait for a global: generous, since nine
        # processes start on two cores; rounds do not wait for it here (min_deltas).
        "max_wait": 90.0,
        "max_rounds_ahead": 1,
        "overlap_steps": 0,  # churn with workers running ahead of the master (see swarm_harness.py)
        # How long the run's end waits (from the master's start) for a listed node it has not heard
        # from, instead of max_wait: as long as the late joiners' window (late_join_wait, which the
        # tests set), so a late joiner is as safe as before, and the never-started node costs the end
        # no more than that window (max_wait 600 made it wait 10 minutes). Rounds do not use this
        # window: master/rounds.py has its own rule for joiners.
        "never_heard_wait": distributed.get("late_join_wait", 45.0),
        # Short leases where this tree has them (branches identity, mlease): a SIGKILLed node's id is
        # free again soon, a standby takes over soon.
        **supported(node_lease_s=15.0, master_lease_s=10.0),
        **hub,
        **distributed,
    }
    cfg = write_config(tmp_path / "churn.yaml", text_path(), STEPS, MODEL, DATA, **values)
    text = cfg.read_text().replace("every_steps: 5", "every_steps: 3")  # a killed worker resumes close by
    cfg.write_text(text)
    return cfg


def print_figures(swarm: Swarm, report: Any, elapsed: float) -> dict[str, Any]:
    rounds = round_figures(swarm, report)
    losses = [v["val_loss"] for v in report.master["global_val_loss"]]
    nodes = {w["node"]: name for name, w in report.workers.items()}
    node_loss = {
        node: swarm.result(name).get("val_loss") for node, name in nodes.items() if name in swarm.lives
    }
    print(f"\n--- churn on the {swarm.kind} bus: {elapsed:.0f}s, {len(swarm.lives)} processes ---")
    print(report.table())
    print(
        f"outer steps {report.master['outer_step']}; longest round wait {rounds['longest_wait']:.1f}s "
        f"(outer step {rounds['longest_wait_round']}); slowest live node {rounds['slowest_node']} "
        f"{rounds['slowest_round_s']:.1f}s per round; median node round "
        f"{statistics.median(rounds['node_round_s'].values()):.1f}s"
    )
    print("round waits: " + ", ".join(f"{k}: {v:.1f}s" for k, v in sorted(rounds["waits"].items())))
    print(
        f"global val loss: start {losses[0]:.3f}, final {losses[-1]:.3f}; nodes' own: "
        + ", ".join(f"{n} {v:.3f}" for n, v in sorted(node_loss.items()) if v is not None)
    )
    if swarm.server is not None:
        print(f"Hub 429s answered: {len(swarm.server.state.throttled)}")
    return {"rounds": rounds, "losses": losses, "node_loss": node_loss}


@pytest.mark.parametrize("swarm", ["directory", "hub"], indirect=True)
def test_churn(tmp_path: Path, swarm: Swarm) -> None:
    if swarm.server is not None:  # the Hub's request and commit windows, before any node starts
        swarm.server.limit_requests(REQUESTS, WINDOW)
        swarm.server.limit_commits(COMMITS, COMMIT_WINDOW)
    started = time.monotonic()
    # No min_deltas: the round rule waits for live nodes only (master/rounds.py); a short initial
    # grace, so the never-started node costs the first round seconds, not the default two minutes.
    cfg = churn_config(tmp_path, swarm.kind, late_join_wait=45.0, **supported(initial_grace=10.0))
    early = [f"w{i}" for i in range(6)]
    late, added, ghost, victim = ["w6", "w7"], "w9", "w8", "w1"
    swarm.init(cfg, [*early, *late, ghost])  # w8 is listed and never started
    master = swarm.master(cfg, "--no-train")
    for node in early:
        swarm.worker(cfg, node)
    # A duplicate of a live node id (another machine: its own output directory), started with it: one
    # of the two claims the id, the other is refused with exit 2 naming --node-id.
    twin = swarm.worker(cfg, "w0", "--set", f"run.output_dir={tmp_path / 'twin'}", name="w0-twin")
    # A second master (its own state directory) on the live run is refused with exit 2.
    swarm.wait_log(master, r"holds the run's lease")
    rival = swarm.master(cfg, "--no-train", "--set", f"run.output_dir={tmp_path / 'rival'}", name="rival")
    assert swarm.wait_exit(rival, 600) == 2 and "another master" in swarm.log(rival), swarm.log(rival)[-2000:]
    assert master.proc.poll() is None, swarm.log(master)[-2000:]  # the first one runs on
    wait_until(lambda: swarm.outer_step() >= 1, what="the first outer step")
    for node in late:
        swarm.worker(cfg, node)
    swarm.add_collaborator(added)  # while the master runs
    swarm.worker(cfg, added)
    # A worker SIGKILLed once its first delta counted, then restarted under the same id.
    wait_until(lambda: swarm.hwm(victim) >= 0, what=f"{victim}'s first delta applied")
    restarted = swarm.restart(swarm.kill(victim), until_accepted=300)
    # The master SIGKILLed mid-run and restarted from its saved state.
    wait_until(lambda: swarm.outer_step() >= 2, what="outer step 2")
    swarm.kill(master)
    master = swarm.restart(master)
    report = swarm.report(master, timeout=900)
    figures = print_figures(swarm, report, time.monotonic() - started)
    w0_lives = [swarm.lives["w0"], twin]
    refused = [life for life in w0_lives if life.rc == 2]
    assert sorted(life.rc for life in w0_lives) == [0, 2], [(life.name, life.rc) for life in w0_lives]
    assert "--node-id" in swarm.log(refused[0]), swarm.log(refused[0])[-2000:]

    assert_exactly_once(report, allow_left=False)
    assert report.duplicates == []
    assert report.rejected == [], report.lists()  # honest nodes only
    rm = report.master
    nodes = report.nodes()
    started_nodes = {*early, *late, added}
    assert set(nodes) == started_nodes, report.table()  # the never-started one sent nothing
    # A worker trains to its last step unless the run's end is published first (it then stops:
    # `ended_early`). Never killed and not stopped: its four deltas (12 / H), each applied. The killed
    # one resumed from its checkpoint and may send one delta more.
    last = {w["node"]: w for w in report.workers.values()}  # each node's last life
    for node in started_nodes - {victim}:
        if not last[node]["ended_early"]:
            assert nodes[node]["applied"] == STEPS // H, report.table()
    assert any(not w["ended_early"] for w in last.values()), last  # someone trained to the end
    assert set(rm["finished"]) >= started_nodes, rm["finished"]
    assert "resumed state at outer step" in swarm.log(master) and "run complete at outer step" in swarm.log(
        master
    )
    assert "resumed from" in swarm.log(restarted)
    assert STEPS // H <= rm["outer_step"] <= len(rm["applied"])
    losses = figures["losses"]
    assert losses[-1] < losses[0], losses
    rounds = figures["rounds"]  # no round waits for nobody: bounded by the live nodes' own pace
    assert rounds["longest_wait"] <= max(60.0, 3 * rounds["slowest_round_s"]), rounds
    secrets = [token(user) for user in (OWNER, *started_nodes)]
    for life in swarm.lives:
        assert not any(t in swarm.log(life) for t in secrets), f"a token in {life}'s log"


# -- each behaviour alone (directory bus) ------------------------------------------------------------


def test_rounds_wait_only_for_live_nodes(tmp_path: Path, swarm: Swarm) -> None:
    """No min_deltas: a listed node that never starts does not hold rounds until max_wait (600 s, far
    beyond the test's deadlines, so waiting for it cannot pass by luck); a collaborator added while
    the master runs counts without a restart; no round waits anywhere near max_wait (the longest wait
    is printed against the slowest live node's round time)."""
    cfg = churn_config(tmp_path, "directory", max_wait=600.0, late_join_wait=60.0)
    swarm.init(cfg, ["w0", "w1", "ghost"])
    master = swarm.master(cfg, "--no-train")
    swarm.worker(cfg, "w0")
    swarm.worker(cfg, "w1")
    wait_until(lambda: swarm.outer_step() >= 0 and master.proc.poll() is None, what="the master running")
    swarm.add_collaborator("w2")  # while the master runs
    swarm.worker(cfg, "w2")
    wait_until(lambda: swarm.outer_step() >= 1, timeout=240, what="a first round without the ghost")
    wait_until(lambda: swarm.hwm("w2") >= 0, timeout=240, what="w2's delta applied by the same master")
    report = swarm.report(master)
    rounds = round_figures(swarm, report)
    print("\n" + report.table())
    print(
        f"longest round wait {rounds['longest_wait']:.1f}s; slowest live node {rounds['slowest_node']} "
        f"{rounds['slowest_round_s']:.1f}s per round; waits {rounds['waits']}"
    )
    assert_exactly_once(report, allow_left=False)
    assert len(swarm.lives) == 4  # the same master throughout
    assert rounds["longest_wait"] <= max(60.0, 3 * rounds["slowest_round_s"]), rounds
