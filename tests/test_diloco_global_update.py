"""Globals sent as an int8 update from the previous one (distributed.sync.global_codec: int8,
diloco/global_update.py): the rebuild is bit-exact and checksum-verified, the published global tracks the
master's weights within one round's rounding (the error is carried, not accumulated), every bus stores
and prunes the update files, a worker rebuilds each global from its update and reads the whole file
whenever it cannot (a skipped step, a tampered update), and a real master-and-workers run over a
directory bus downloads updates instead of globals."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml

from speedtronic.config import load_config
from speedtronic.diloco import codec, global_update
from speedtronic.diloco.bus.base import Bus, GlobalTooLarge
from speedtronic.diloco.global_update import Published
from speedtronic.diloco.worker.coordinator import Coordinator
from speedtronic.errors import ConfigError
from swarm_harness import Swarm, write_config
from test_diloco_bus_protocol import any_bus  # noqa: F401 (the three buses, with their stored files)
from test_diloco_master import Run
from test_diloco_multiprocess import assert_loss_went_down
from test_diloco_rounds import NO_SLOW, POLL, Clock, master

INT8 = "distributed.sync.global_codec=int8"


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(129, 33, generator=g), "b": torch.randn(5, generator=g)}


def _specs(tensors: dict[str, torch.Tensor]) -> dict[str, codec.ParamSpec]:
    return {n: codec.ParamSpec(tuple(t.shape), "float32") for n, t in tensors.items()}


def _meta(step: int) -> dict[str, str]:
    return {"kind": "global", "outer_step": str(step), "node": "master", "epoch": "1"}


def test_the_rebuilt_global_is_bit_exact_and_tracks_the_weights_without_drift() -> None:
    """30 outer steps of a random walk: every worker-side rebuild equals the published full file bit for
    bit, and the published global stays within one round's rounding of the master's weights (the
    rounding is carried into the next update, so it never adds up)."""
    g = torch.Generator().manual_seed(0)
    theta = _weights(1)
    specs = _specs(theta)
    first = global_update.encode(theta, 0, _meta(0), None, keep=True)
    assert first.update is None and first.published is not None
    base, held = first.published, first.published  # the master's base, and the worker's copy
    worst = 0.0
    for step in range(1, 31):
        moves = {n: torch.randn(t.shape, generator=g) * 0.01 + 0.003 for n, t in theta.items()}
        theta = {n: t - moves[n] for n, t in theta.items()}
        sent = global_update.encode(theta, step, _meta(step), base, keep=True)
        assert sent.update is not None and sent.published is not None
        rebuilt, _ = global_update.apply(sent.update, held, specs, step, 1 << 20)
        full = codec.decode(sent.full, specs, kind="global").tensors
        for name in theta:
            assert torch.equal(rebuilt[name], full[name]) and torch.equal(
                full[name], sent.published.tensors[name]
            )
            # Blockwise absmax int8: at most half a step of the largest change in a block (one round's).
            bound = float(moves[name].abs().max()) * 2 / 254 * 1.01
            gap = float((full[name] - theta[name]).abs().max())
            assert gap <= bound, (step, name, gap, bound)
            worst = max(worst, gap)
        base, held = sent.published, Published(step, rebuilt)
    assert worst > 0  # the rounding is real, and bounded above every step
    assert len(sent.update) < len(sent.full) / 3  # ~1.06 bytes a value instead of 4


def test_an_update_that_is_not_exactly_the_next_global_is_refused() -> None:
    """From another base, to another step, re-signed with other values, or not int8: codec.Rejected."""
    theta0, theta1 = _weights(1), _weights(2)
    specs = _specs(theta0)
    first = global_update.encode(theta0, 4, _meta(4), None, keep=True)
    assert first.published is not None
    sent = global_update.encode(theta1, 5, _meta(5), first.published, keep=True)
    assert sent.update is not None
    with pytest.raises(codec.Rejected, match="not from 3 to 5"):
        global_update.apply(sent.update, Published(3, first.published.tensors), specs, 5, 1 << 20)
    with pytest.raises(codec.Rejected, match="not from 4 to 6"):
        global_update.apply(sent.update, first.published, specs, 6, 1 << 20)
    # A file whose own checksum is right but whose values are not the master's: the target catches it.
    meta, wire = codec.parse(sent.update)
    forged = {k: (v.clone() if k.endswith(":q") else v) for k, v in wire.items()}
    forged["w:q"][0] = 100 if int(forged["w:q"][0]) != 100 else -100
    meta = {k: v for k, v in meta.items() if k not in ("format", "codec", "checksum")}
    with pytest.raises(codec.Rejected, match="does not match the checksum"):
        global_update.apply(codec.encode_wire(forged, "int8", meta), first.published, specs, 5, 1 << 20)
    as_fp32 = codec.encode({n: t - first.published.tensors[n] for n, t in theta1.items()}, "fp32", meta)
    with pytest.raises(codec.Rejected, match="must be int8"):
        global_update.apply(as_fp32, first.published, specs, 5, 1 << 20)
    with pytest.raises(codec.Rejected, match="over the size limit"):
        global_update.apply(sent.update, first.published, specs, 5, 100)


def test_every_bus_stores_reads_and_prunes_updates(
    any_bus: tuple[Bus, Callable[[], set[str]], Callable[[str, bytes], None]],  # noqa: F811
) -> None:
    """publish(update=) names the update in the head, read_update_capped reads it at that head (never a
    newer one) and refuses it past the cap, and prune deletes the update files named like globals."""
    bus, stored, _ = any_bus
    assert bus.supports_updates
    bus.write_manifest({"format": 1})
    head = bus.publish(b"g0", {"outer_step": 0})
    assert "update" not in head
    named: list[str] = [head["global"]]
    for step in range(1, 6):
        prune = named[:-2] if step >= 3 else []
        head = bus.publish(
            b"g%d" % step,
            {"outer_step": step, "update_from": step - 1},
            expected=head,
            prune=prune,
            update=b"u%d" % step,
        )
        named = [p for p in named if p not in prune] + [head["global"], head["update"]]
        read = bus.read_head()
        assert read is not None and read["update"] == head["update"] and read["update_from"] == step - 1
        assert bus.read_update_capped(read, 100) == b"u%d" % step and bus.read_global(read) == b"g%d" % step
        if step == 3:
            old = read
    if bus.scheme == "hub":  # one path each, overwritten: an older head reads its own commit's update
        assert bus.read_update_capped(old, 100) == b"u3"
        assert {"global/model.safetensors", "global/update.safetensors"} <= stored()
    else:
        assert stored() == set(named), (stored(), named)
        assert {f"global/update_{s:08d}.safetensors" for s in (4, 5)} <= stored()
    with pytest.raises(GlobalTooLarge, match="more than this run's model"):
        bus.read_update_capped(bus.read_head(), 1)
    head = bus.publish(b"g6", {"outer_step": 6}, expected=head)  # a full global alone names no update
    assert "update" not in bus.read_head()


def _master_rounds(run: Run, clock: Clock, m, rounds: int) -> None:
    for _ in range(rounds):
        clock.t += 5
        for node in "ab":
            run.delta(node, m.outer_step, base=m.outer_step)
        assert m.round() is True


def test_a_worker_rebuilds_globals_from_updates_and_falls_back_to_the_whole_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Real master rounds on a directory bus with global_codec int8; a worker's poller fetches each
    head: the first global whole, the next ones from their updates, each equal to the full file; a
    skipped step and a tampered update are read whole (the tampered one logged), never installed."""
    run = Run(tmp_path, *POLL, NO_SLOW, INT8, "distributed.sync.overlap_steps=0")
    clock = Clock()
    m = master(run, clock, momentum=0.8)
    worker = Coordinator(run.cfg, run.bus, "w1", run.manifest)
    poller = worker.poller

    def fetch_and_compare() -> None:
        head = run.bus.read_head()
        assert head is not None
        got = poller.fetch_global(head)
        full = codec.decode(run.bus.read_global(head), run.specs, kind="global").tensors
        assert got.outer_step == head["outer_step"] and all(
            torch.equal(got.tensors[n], full[n]) for n in full
        )

    fetch_and_compare()
    for _ in range(3):
        _master_rounds(run, clock, m, 1)
        head = run.bus.read_head()
        assert head is not None and head["update_from"] == head["outer_step"] - 1 and head["global_updates"]
        fetch_and_compare()
    assert poller.reads["full"] == 1 and poller.reads["update"] == 3 and poller.reads["skipped"] == 0
    full_bytes = run.bus.read_global(run.bus.read_head())
    assert poller.reads["bytes"] < len(full_bytes) * (1 + 3 / 3)  # three updates cost less than one global

    _master_rounds(run, clock, m, 2)  # the worker missed a step: its global is not the update's base
    fetch_and_compare()
    assert poller.reads["full"] == 2 and poller.reads["update"] == 3 and poller.reads["skipped"] == 1

    _master_rounds(run, clock, m, 1)
    head = run.bus.read_head()
    assert head is not None
    path = run.bus.root / head["update"]
    meta, wire = codec.parse(path.read_bytes())
    wire = {k: v.clone() for k, v in wire.items()}
    key = next(k for k in wire if k.endswith(":scale"))
    wire[key] = wire[key] * 2  # re-signed: the file's own checksum passes, the target does not
    path.write_bytes(codec.encode_wire(wire, "int8", {k: v for k, v in meta.items() if k != "checksum"}))
    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        fetch_and_compare()
    assert "did not apply (the rebuilt global does not match" in caplog.text
    assert poller.reads["full"] == 3 and poller.reads["update"] == 3 and poller.reads["skipped"] == 1


def test_the_final_global_and_a_takeover_are_full_globals(tmp_path: Path) -> None:
    """A master that adopts the bus's global publishes its first global whole (it holds no base), and
    the published globals stay readable as full files for joiners, `eval --global` and takeovers."""
    run = Run(tmp_path, *POLL, NO_SLOW, INT8)
    clock = Clock()
    first = master(run, clock, "first", momentum=0.8)
    _master_rounds(run, clock, first, 3)
    assert run.bus.read_head()["update_from"] == 2
    standby = master(run, clock, "standby", momentum=0.8)
    assert standby.outer_step == 3
    _master_rounds(run, clock, standby, 1)
    head = run.bus.read_head()
    assert head is not None and "update" not in head  # no base yet: the whole global only
    _master_rounds(run, clock, standby, 1)
    head = run.bus.read_head()
    assert head is not None and head["update_from"] == 4


def test_global_codec_is_validated_and_fp32_sends_no_update(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="global_codec"):
        load_config(None, ["distributed.sync.global_codec=int4"])
    run = Run(tmp_path, *POLL, NO_SLOW)
    clock = Clock()
    m = master(run, clock)
    _master_rounds(run, clock, m, 2)
    head = run.bus.read_head()
    assert head is not None and not {"update", "update_from", "global_updates"} & set(head)
    assert not list((run.bus.root / "global").glob("update_*"))
    poller = Coordinator(run.cfg, run.bus, "w1", run.manifest).poller
    assert poller.fetch_global(head).outer_step == 2
    assert poller.base is None  # no update will come: no copy of the model kept for one


@pytest.mark.slow
def test_master_and_two_workers_download_updates_over_a_directory_bus(tmp_path: Path, swarm: Swarm) -> None:
    """Real processes, the shipped overlap (each global installed one step after its sync): each worker
    reads the run's global whole once and every later one as an update, but for a global it skipped
    (two published between its polls, as under CI's load: its next update starts from one it never
    fetched); every delta applied once."""
    cfg = write_config(tmp_path, None, max_steps=30, min_deltas=2, master_trains=False, overlap_steps=1)
    written = yaml.safe_load(cfg.read_text())
    written["distributed"]["sync"]["global_codec"] = "int8"
    cfg.write_text(yaml.safe_dump(written))
    master_proc = swarm.master(cfg, "--no-train")
    workers = [swarm.worker(cfg, node) for node in ("w1", "w2")]
    report = swarm.report(master_proc)
    rm = report.master
    assert rm["rejected"] == [] and len(rm["applied"]) == len(set(rm["applied"])) == 12, report.lists()
    for proc in workers:
        reads = swarm.result(proc)["globals_read"]
        assert reads["full"] == 1 + reads["skipped"] and reads["update"] >= 4, reads
    assert_loss_went_down(rm)
