"""One node id is one worker, through real `speedtronic` processes on a directory bus: a second worker
with a live node id exits 2 naming --node-id while the first finishes normally, and a worker killed
with kill -9 is restarted (with its default id: the same host and output directory) once its lease has
expired and numbers its deltas after everything it sent before, so no delta id repeats; a worker
suspended past its lease while another process took the id over stops with an error when it resumes,
uploading nothing more."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from speedtronic.diloco import codec
from swarm_harness import suspend_outside_flock
from test_diloco_multiprocess import TEXT, Procs, assert_exactly_once, wait_until, write_config

pytestmark = pytest.mark.slow


@pytest.fixture
def procs(tmp_path: Path):
    p = Procs(tmp_path)
    yield p
    p.kill_all()


@pytest.fixture
def text() -> Path | None:
    """tinyshakespeare from ../shared when it is there; else None: the embedded copy of the same corpus."""
    return TEXT if TEXT.exists() else None


def init_run(runner: Procs, cfg: Path, bus: str) -> None:
    """The run's manifest and global model of outer step 0, as `hub init` writes them (no master yet)."""
    init = runner.start("init", "hub", "init", bus, "--config", cfg, "--json")
    assert init.wait(240) == 0, runner.log("init")


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def test_a_second_worker_with_a_live_node_id_exits_2(tmp_path: Path, text: Path | None, procs: Procs) -> None:
    # max_rounds_ahead=1 and no master yet: after two deltas w1 waits (up to max_wait) for a global,
    # so it is certainly alive, holding its lease, while the second worker starts.
    cfg = write_config(tmp_path, text, min_deltas=1, master_trains=False, node_lease_s=30, max_wait=300)
    bus_dir = tmp_path / "bus"
    bus = f"file://{bus_dir}"
    init_run(procs, cfg, bus)
    w1 = procs.start("w1", "worker", cfg, "--repo", bus, "--node-id", "w1", "--json")
    wait_until(
        lambda: "ahead of the global model; waiting" in procs.log("w1"), 240, "w1 to wait for a global"
    )
    lease = read_json(bus_dir / "leases" / "w1.json")
    assert lease is not None and lease["holder"].split("/")[1] == str(w1.pid)

    # Another output directory, as on another machine (the same one on this machine is refused by its
    # directory's lock: test_diloco_node_restart.py): the bus's lease refuses it.
    elsewhere = ["--set", f"run.output_dir={tmp_path / 'elsewhere'}"]
    dup = procs.start("dup", "worker", cfg, "--repo", bus, "--node-id", "w1", *elsewhere, "--json")
    assert dup.wait(240) == 2, procs.log("dup")[-4000:]
    errors = [line for line in procs.log("dup").splitlines() if line.startswith("error:")]
    host, pid, secret = lease["holder"].split("/")
    assert len(errors) == 1, procs.log("dup")[-4000:]
    assert "--node-id w1" in errors[0] and f"{host}/{pid}" in errors[0] and "expires in" in errors[0], errors
    assert secret not in procs.log("dup") + (tmp_path / "dup.out").read_text()
    assert json.loads((tmp_path / "dup.out").read_text().strip().splitlines()[-1])["exit_code"] == 2
    assert read_json(bus_dir / "leases" / "w1.json")["holder"] == lease["holder"]  # still w1's

    master = procs.start("master", "master", cfg, "--repo", bus, "--no-train", "--json")
    r1, rm = procs.result("w1", w1), procs.result("master", master)
    assert r1["node"] == "w1" and r1["steps"] == 20
    assert_exactly_once(rm, r1)  # every delta w1 sent applied once; the refused worker sent none
    assert not (bus_dir / "leases" / "w1.json").exists()  # released at w1's clean end


def test_a_killed_worker_restarts_after_its_lease_expires_without_repeating_a_delta_id(
    tmp_path: Path, text: Path | None, procs: Procs
) -> None:
    cfg = write_config(tmp_path, text, max_steps=30, min_deltas=1, master_trains=False, node_lease_s=5)
    settings = yaml.safe_load(cfg.read_text())
    settings["checkpoint"] = {"enabled": False}  # the restart is a newcomer: it knows only the bus
    cfg.write_text(yaml.safe_dump(settings))
    bus_dir = tmp_path / "bus"
    bus = f"file://{bus_dir}"
    init_run(procs, cfg, bus)
    master = procs.start("master", "master", cfg, "--repo", bus, "--no-train", "--json")
    first = procs.start("first", "worker", cfg, "--repo", bus, "--json")  # the default node id

    def hwm() -> dict[str, int]:
        return (read_json(bus_dir / "head.json") or {}).get("hwm") or {}

    wait_until(lambda: max(hwm().values(), default=-1) >= 1, 240, "two of the first worker's deltas applied")
    first.send_signal(signal.SIGKILL)
    first.wait()
    (node,) = (p.name for p in (bus_dir / "deltas").iterdir())
    assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*-[0-9a-f]{8}", node), node  # <host>-<hash>
    # Listed before the mark is read: a file processed (and deleted) meanwhile is at or below the mark.
    on_bus = sorted(p.name for p in (bus_dir / "deltas" / node).iterdir() if not p.name.startswith("."))
    sent_before = {codec.delta_name(node, s) for s in range(hwm()[node] + 1)} | set(on_bus)
    last_before = max(codec.parse_delta_name(n)[1] for n in sent_before)
    lease = read_json(bus_dir / "leases" / f"{node}.json")
    assert lease is not None and lease["holder"].split("/")[1] == str(first.pid)  # kill -9: not released
    wait_until(lambda: lease["expires_at"] < time.time(), 60, "the killed worker's lease to expire")

    again = procs.start("again", "worker", cfg, "--repo", bus, "--json")  # same host and output dir
    ra, rm = procs.result("again", again), procs.result("master", master)
    assert ra["node"] == node, (ra["node"], node)  # the default id is stable across restarts
    assert "holds its lease" in procs.log("again")
    new = [codec.parse_delta_name(n)[1] for n in ra["uploaded"]]
    lists = f"before the kill: {sorted(sent_before)}\nafter: {ra['uploaded']}\napplied: {rm['applied']}"
    assert new and min(new) > last_before and len(set(new)) == len(new), lists
    applied = rm["applied"]
    assert len(applied) == len(set(applied)), f"a delta was applied twice\n{lists}"
    # Exactly once: applied, or refused by name as after the run's end. The restart has no checkpoint,
    # so it trains the whole run again: what it sends past its share (the run's outer steps and the
    # syncs a restart may redo, master/checks.py AfterEndCheck) is refused, and nothing before that.
    refused = {r["id"]: r for r in rm["rejected"]}
    lists += f"\nrefused: {sorted(refused)}"
    for n in ra["uploaded"]:
        ref = f"{node}/{n}"
        assert (ref in applied) != (ref in refused), f"{ref} neither or both applied and refused\n{lists}"
        assert ref in applied or refused[ref]["check"] == "after_end", f"{refused[ref]}\n{lists}"
    late = sorted(codec.parse_delta_name(r.split("/")[1])[1] for r in refused)
    assert all(s > max(codec.parse_delta_name(a.split("/")[1])[1] for a in applied) for s in late), lists
    assert set(applied) <= {f"{node}/{n}" for n in sent_before | set(ra["uploaded"])}, lists
    assert all(r["check"] == "after_end" for r in rm["rejected"]), f"{rm['rejected']}\n{lists}"
    assert not (bus_dir / "leases" / f"{node}.json").exists()  # released at the clean end


def test_a_worker_whose_lease_was_taken_over_stops_without_uploading(
    tmp_path: Path, text: Path | None, procs: Procs
) -> None:
    """w1 is suspended (SIGSTOP) past its lease and another process takes the id over; resumed, w1
    finds the id gone and stops with an error instead of uploading under it."""
    cfg = write_config(tmp_path, text, min_deltas=1, master_trains=False, node_lease_s=3, max_wait=300)
    bus_dir = tmp_path / "bus"
    bus = f"file://{bus_dir}"
    init_run(procs, cfg, bus)
    w1 = procs.start("w1", "worker", cfg, "--repo", bus, "--node-id", "w1", "--json")
    wait_until(
        lambda: "ahead of the global model; waiting" in procs.log("w1"), 240, "w1 to wait for a global"
    )

    def landed() -> list[str]:
        return sorted(p.name for p in (bus_dir / "deltas" / "w1").iterdir() if not p.name.startswith("."))

    # The wait begins once its second delta is queued; its upload (a background thread) may still be
    # under way. Suspended mid-upload, w1 would finish that upload when resumed, after this listing was
    # taken (CI saw it): so w1 is suspended only once both of its deltas are on the bus (no master
    # runs yet, so nothing removes them).
    wait_until(lambda: len(landed()) >= 2, 240, "w1's two deltas on the bus")
    # Never inside the run lock (a lease renewal holds it for a moment every second): a frozen lock
    # holder blocks the newcomer's claim until it is resumed (CI saw that).
    suspend_outside_flock(w1, bus_dir / ".bus.lock")
    try:
        sent_by_w1 = landed()
        held = read_json(bus_dir / "leases" / "w1.json")
        assert held is not None and held["holder"].split("/")[1] == str(w1.pid)
        wait_until(lambda: held["expires_at"] < time.time(), 60, "w1's lease to expire")
        # A newcomer (its own output directory: it knows only the bus) takes the id over.
        other = ("--set", f"run.output_dir={tmp_path / 'elsewhere'}")
        w1b = procs.start("w1b", "worker", cfg, "--repo", bus, "--node-id", "w1", *other, "--json")
        try:
            wait_until(
                lambda: (
                    (read_json(bus_dir / "leases" / "w1.json") or {}).get("holder", "").split("/")[1:2]
                    == [str(w1b.pid)]
                ),
                240,
                "the newcomer to take the id over",
            )
        except AssertionError as error:
            raise AssertionError(f"{error}; the newcomer's log:\n{procs.log('w1b')[-3000:]}") from None
    finally:
        w1.send_signal(signal.SIGCONT)
    assert w1.wait(240) == 1, procs.log("w1")[-4000:]
    errors = [line for line in procs.log("w1").splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no longer owns" in errors[0], errors
    master = procs.start("master", "master", cfg, "--repo", bus, "--no-train", "--json")
    rb, rm = procs.result("w1b", w1b), procs.result("master", master)
    first = {"node": "w1", "uploaded": sent_by_w1}  # all w1 sent: nothing after it was suspended
    lists = f"w1 sent {sent_by_w1}, the newcomer {rb['uploaded']}; applied {rm['applied']}"
    assert not set(sent_by_w1) & set(rb["uploaded"]), lists  # no delta id repeats
    # Same id, so the same data order, from the same global: the newcomer's first deltas can be bit
    # for bit w1's, and the master rejects them as replays (under their new ids: that work counts once).
    replayed = {r["id"] for r in rm["rejected"] if r["reason"].startswith("replay: the same payload as w1/")}
    assert {r["id"] for r in rm["rejected"]} == replayed, f"{rm['rejected']}\n{lists}"
    newcomer = {"node": "w1", "uploaded": [n for n in rb["uploaded"] if f"w1/{n}" not in replayed]}
    assert_exactly_once({**rm, "rejected": []}, first, newcomer)
