"""A publish that fails (the bus down for a moment, found by bench/chaos.py): the round is applied in the
master's saved state but no global on the bus includes it yet. Its delta files must stay on the bus until
a published global does — a master that dies before then is replaced by one that adopts the older head
and applies them again — and the master publishes again at its next poll, without waiting for new deltas.
Before, the next poll counted the files as processed and deleted them, and the global waited for the next
round."""

from __future__ import annotations

import shutil
from typing import Any

import pytest

from speedtronic.errors import TransientBusError
from test_diloco_master import Run
from test_diloco_master_lease import leased, run  # noqa: F401 - the fixture


def on_bus(run: Run) -> set[str]:  # noqa: F811
    return {ref.id for ref in run.bus.list_deltas(None)}


def test_a_failed_publish_keeps_the_rounds_deltas_until_a_global_includes_them(
    run: Run,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    m = leased(run, "a")
    name = run.delta("w1", 0)
    delta_id = name  # "w1/w1--00000000.safetensors"
    real = run.bus.publish
    failing = {"left": 2}

    def publish(*args: Any, **kwargs: Any) -> Any:
        if failing["left"]:
            failing["left"] -= 1
            raise TransientBusError("the bus is down (test)")
        return real(*args, **kwargs)

    monkeypatch.setattr(run.bus, "publish", publish)
    with pytest.raises(TransientBusError):
        m.round()  # applied (the state says outer step 1), not published
    assert m.outer_step == 1 and run.bus.read_head()["outer_step"] == 0
    assert delta_id in on_bus(run)
    with pytest.raises(TransientBusError):
        m.round()  # the next poll publishes again (and fails again): the file stays
    assert delta_id in on_bus(run) and run.bus.read_head()["outer_step"] == 0
    m.round()  # the bus is back: the global of outer step 1 goes out, then the file goes
    head = run.bus.read_head()
    assert head["outer_step"] == 1 and head["hwm"] == {"w1": 0}
    assert delta_id not in on_bus(run) and m.applied == [delta_id]


def test_a_master_that_adopts_a_newer_global_reports_that_globals_loss(run: Run) -> None:  # noqa: F811
    """A standby's saved state knows the loss of an older global; after adopting the bus's newer one, the
    loss its status (and so its takeover head) reports is the adopted global's, evaluated."""
    from speedtronic.diloco import codec
    from speedtronic.diloco.master import Master

    def evaluate(weights: dict[str, Any]) -> float:  # falls as the weights grow: the step is kept
        return 1.0 / (1.0 + float(sum(float(t.double().abs().sum()) for t in weights.values())))

    def master(state: str) -> Master:
        m = Master(
            run.cfg,
            run.bus,
            run.manifest,
            codec.snapshot(run.model),
            state_dir=run.tmp_path / state,
            momentum=0.0,
            evaluate=evaluate,
        )
        m.take_over()
        return m

    b = master("b")  # evaluates the global of outer step 0, then leaves
    old = b.ledger.last_loss(0)
    b.save_state()  # with that loss
    b.fence.release()
    a = master("a")
    run.delta("w1", 0, scale=0.5)
    assert a.round() is True and a.outer_step == 1
    a.fence.release()
    shutil.copytree(run.tmp_path / "b", run.tmp_path / "b2")  # b's state, as a restart on another host
    b2 = master("b2")  # its state says outer step 0; the bus is at 1: adopted
    assert b2.outer_step == 1
    assert b2.ledger.last_loss(1) == pytest.approx(evaluate(b2.outer.weights))
    assert b2.status()["global_val_loss"] != old
