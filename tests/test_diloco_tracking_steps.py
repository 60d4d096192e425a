"""diloco/master/tracking.py in process: a real Master on a directory bus with the jsonl hook. One
`outer_step` event per outer step, with the global val loss, the round and the per-node counts; a
restarted master (a new Tracking on the same state directory) does not log a step twice; a tracker that
raises is switched off and the master goes on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from speedtronic.builtin.hooks import JsonlHook
from speedtronic.diloco import codec
from speedtronic.diloco.master import Master
from speedtronic.diloco.master.tracking import Tracking
from speedtronic.engine.events import EventBus
from speedtronic.runs import summarize
from test_diloco_master import Run

# The loss probe judges deltas by the evaluator; this test's evaluator is a stand-in, not a model's loss.
NO_PROBE = ["distributed.defences.loss_probe=false"]


def loss(weights: dict[str, torch.Tensor]) -> float:
    """A real function of the weights (the master also probes deltas with it, so not a fixed list) that
    any small random delta lowers, so no probe weighs an honest test delta at zero."""
    return 10.0 - float(sum(t.float().abs().mean() for t in weights.values()))


def master(run: Run) -> Master:
    m = Master(
        run.cfg,
        run.bus,
        run.manifest,
        codec.snapshot(run.model),
        state_dir=run.tmp_path / "state",
        momentum=0.0,
        evaluate=loss,
    )
    m.start_state()
    return m


def track(m: Master, metrics: Path) -> Tracking:
    tracking = Tracking(EventBus({"jsonl": JsonlHook(metrics)}), m.store.path.parent)
    m.report.watchers.append(tracking)
    return tracking


def outer_steps(metrics: Path) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [e for e in events if e["event"] == "outer_step"]


def test_one_event_per_outer_step_with_the_round_and_the_nodes(tmp_path: Path) -> None:
    run = Run(tmp_path, "distributed.rounds.min_deltas=2", *NO_PROBE)
    metrics = tmp_path / "state" / "metrics.jsonl"
    m = master(run)
    tracking = track(m, metrics)
    m.write_metrics()  # the first poll: outer step 0 and its val loss
    run.delta("w1", 0), run.delta("w2", 0)
    assert m.round() is True
    m.write_metrics()
    m.write_metrics()  # nothing new: nothing logged
    tracking.close()
    events = outer_steps(metrics)
    assert [(e["step"], e["val_loss"]) for e in events] == [tuple(v) for v in m.val_losses] and len(
        events
    ) == 2
    one = events[1]
    assert one["applied"] == 2 and one["rejected"] == 0 and one["closed_by"] == "min_deltas", one
    assert one["node/w1/tokens"] == one["node/w2/tokens"] == 64 and one["tokens"] == 128, one
    assert one["bytes_in"] == one["node/w1/bytes"] + one["node/w2/bytes"] > 0, one

    # A restart: the same state directory, a new master and tracker; step 1 is not logged again.
    again = master(run)
    track(again, metrics)
    run.delta("w1", 1, base=1), run.delta("w2", 1, base=1)
    assert again.round() is True
    again.write_metrics()
    assert [e["step"] for e in outer_steps(metrics)] == [0, 1, 2]
    # `speedtronic runs` reads the swarm's file as a run: the global val loss by outer step.
    swarm = summarize("diloco-master", metrics)
    assert swarm.val == [tuple(v) for v in again.val_losses] and swarm.finished


def test_a_tracker_that_fails_is_switched_off_and_the_master_goes_on(tmp_path: Path) -> None:
    run = Run(tmp_path, "distributed.rounds.min_deltas=1", *NO_PROBE)
    m = master(run)
    tracking = track(m, tmp_path / "state" / "metrics.jsonl")
    (tmp_path / "a-file").write_text("")
    tracking.path = tmp_path / "a-file" / "tracking.json"  # its own file cannot be written
    run.delta("w1", 0)
    assert m.round() is True
    m.write_metrics()
    assert tracking.broken
    run.delta("w1", 1)
    assert m.round() is True and m.outer_step == 2
    m.write_metrics()  # a switched-off tracker is skipped: the master's loop goes on
    assert torch.isfinite(next(iter(m.outer.weights.values()))).all()


def test_eval_tasks_and_a_nodes_own_eval_become_numbers_and_nothing_else() -> None:
    from speedtronic.diloco.master.tracking import _eval, _node

    tasks = {"core": 0.25, "tasks": {"arc": {"accuracy": 0.5, "n": 10}, "odd": {"accuracy": True}, "x": "y"}}
    assert _eval(tasks) == {"eval/core": 0.25, "eval/arc": 0.5}
    assert _eval(None) == {} and _eval({"tasks": ["not", "a", "mapping"]}) == {}
    entry = {"tokens": 64, "applied": 1, "rejected": 2, "bytes": 9, "eval": {"val_loss": 3.5}}
    assert _node("w1", entry) == {
        "node/w1/tokens": 64,
        "node/w1/applied": 1,
        "node/w1/rejected": 2,
        "node/w1/bytes": 9,
        "node/w1/val_loss": 3.5,
    }
