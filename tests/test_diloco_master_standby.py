"""One master per run through real processes on a directory bus: a second `speedtronic master` on a live
run exits 2 with one line naming the first (host, pid) and `--standby`; a `--standby` master waits, takes
over when the first is killed with kill -9 (its lease lapses), and the run completes with every delta
applied exactly once across both masters (the first's published rounds plus the standby's)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from safetensors import safe_open

from speedtronic.diloco import codec
from test_diloco_multiprocess import Procs, procs, text, wait_until, write_config  # noqa: F401

pytestmark = pytest.mark.slow


def test_a_second_master_is_refused_and_a_standby_takes_over_after_kill_9(
    tmp_path: Path,
    text: Path | None,  # noqa: F811
    procs: Procs,  # noqa: F811
) -> None:
    cfg = write_config(tmp_path, text, min_deltas=2, master_trains=False, master_lease_s=3.0)
    bus_dir = tmp_path / "bus"
    bus = f"file://{bus_dir}"

    def head() -> dict:
        try:
            return json.loads((bus_dir / "head.json").read_text())
        except (OSError, ValueError):
            return {}

    def master(name: str, *extra: str):
        out = f"run.output_dir={tmp_path / name}"
        return procs.start(name, "master", cfg, "--repo", bus, "--set", out, "--json", *extra)

    first = master("first")
    wait_until(lambda: head().get("epoch") == 1, 240, "the first master's head (epoch 1)")
    # A second master while the first one lives: refused at once, one line naming it and --standby;
    # a third one, --standby, waits. The workers start once it does, so the first master is killed
    # mid-run.
    second = master("second")
    standby = master("standby", "--standby")
    assert second.wait(240) == 2, procs.log("second")[-3000:]
    refusals = [line for line in procs.log("second").splitlines() if "another master runs this run" in line]
    assert len(refusals) == 1, procs.log("second")[-3000:]
    assert f"pid {first.pid}" in refusals[0] and "--standby" in refusals[0], refusals
    wait_until(lambda: "waiting to take over" in procs.log("standby"), 240, "the standby waiting")
    assert head().get("epoch") == 1 and standby.poll() is None  # neither wrote anything
    w1 = procs.start("w1", "worker", cfg, "--repo", bus, "--node-id", "w1", "--json")
    w2 = procs.start("w2", "worker", cfg, "--repo", bus, "--node-id", "w2", "--json")
    wait_until(lambda: head().get("outer_step", -1) >= 1, 240, "the first outer step")
    first.send_signal(signal.SIGKILL)
    first.wait()
    r1, r2 = procs.result("w1", w1), procs.result("w2", w2)
    rs = procs.result("standby", standby)

    assert rs["epoch"] == 2 and head()["epoch"] == 2 and rs["rejected"] == []
    assert rs["outer_step"] >= 4 and "adopted the global of outer step" in procs.log("standby")
    # The first master's rounds that reached the bus: those at or below the marks the standby took
    # over with. Any it applied but never published (killed in between) stayed on the bus, and the
    # standby applied them.
    with safe_open(str(tmp_path / "first" / "diloco-master" / "master_state.safetensors"), "pt") as f:
        first_applied = json.loads(f.metadata()["applied"])
    hwm = rs["took_over"]["hwm"]

    def published(delta_id: str) -> bool:
        node, seq = codec.parse_delta_name(delta_id.split("/", 1)[1])
        return seq <= hwm.get(node, -1)

    by_first = [i for i in first_applied if published(i)]
    redone = [i for i in first_applied if not published(i)]
    applied = by_first + rs["applied"]
    uploaded = sorted(f"{w['node']}/{name}" for w in (r1, r2) for name in w["uploaded"])
    lists = f"first: {first_applied}\nstandby: {rs['applied']}\nmarks: {hwm}\nuploaded: {uploaded}"
    assert len(applied) == len(set(applied)), f"a delta was applied twice\n{lists}"
    assert sorted(applied) == uploaded, f"missing or extra deltas\n{lists}"
    assert set(redone) <= set(rs["applied"]), lists
    assert by_first, lists  # the first master did publish rounds before it was killed
    assert list((bus_dir / "deltas").rglob("*.safetensors")) == []
