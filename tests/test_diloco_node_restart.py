"""A worker's node id survives what a supervisor does to it, on real processes and a directory bus:

- kill -9, then the same node restarted on the same machine and node directory: it takes its dead
  predecessor's lease back at once (diloco/same_host.py) instead of being refused until the lease
  lapses (600 s here: without the fix the restart exits 2 at once), resumes and its deltas count;
- a second live process on the same node directory is refused (exit 2 naming --node-id), whatever
  the bus's lease says;
- SIGSTOP past the node lease, then SIGCONT, with nobody claiming the id meanwhile: the worker renews
  late, keeps its id and goes on (it used to stop);
and every delta id sent is applied once."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from speedtronic.diloco.bus.base import ClaimHeld
from speedtronic.diloco.bus.directory import LOCK_FILE, DirectoryBus
from speedtronic.diloco.identity import NODE_HOLDER_FILE, claim_node, holder_token, node_directory_lock
from swarm_harness import (
    Swarm,
    assert_exactly_once,
    suspend_outside_flock,
    text_path,
    wait_until,
    write_config,
)

pytestmark = pytest.mark.usefixtures("isolated_env")

HOLD = """
import sys, time
from pathlib import Path
from speedtronic.diloco.bus.directory import DirectoryBus
from speedtronic.diloco.identity import claim_node, node_directory_lock
bus, node_dir = DirectoryBus(sys.argv[1]), Path(sys.argv[2])
before, lock = node_directory_lock(node_dir, "w1", "--node-id")
lease = claim_node(bus, "w1", 600.0, predecessor=before)
print(lease.claim.holder, flush=True)
time.sleep(600)
"""


def test_a_dead_predecessor_on_the_node_directory_gives_its_lease_back_a_live_one_does_not(
    tmp_path: Path,
) -> None:
    bus_dir, node_dir = tmp_path / "bus", tmp_path / "out" / "w1"
    bus = DirectoryBus(str(bus_dir))
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(bus_dir), str(node_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        holder = proc.stdout.readline().strip() if proc.stdout else ""
        assert holder.count("/") == 2, holder
        shown = holder.rsplit("/", 1)[0]  # host/pid: never the token's secret part
        with pytest.raises(
            ClaimHeld, match=f"another worker process on this machine \\({shown}\\) runs as w1"
        ):
            node_directory_lock(node_dir, "w1", "--node-id")  # alive: its flock holds the directory
        with pytest.raises(ClaimHeld, match="in use on"):  # from elsewhere: the bus's lease refuses it
            claim_node(bus, "w1", 600.0)
        proc.send_signal(signal.SIGSTOP)  # frozen, not gone: still refused
        with pytest.raises(ClaimHeld, match="another worker process on this machine"):
            node_directory_lock(node_dir, "w1", "--node-id")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    before, lock = node_directory_lock(node_dir, "w1", "--node-id")
    try:
        assert before == holder
        assert holder_token() in (node_dir / NODE_HOLDER_FILE).read_text()  # recorded for the next one
        lease = claim_node(bus, "w1", 600.0, predecessor=before)
        assert lease is not None and lease.claim.holder == holder_token()
        lease.close()
    finally:
        assert lock is not None
        lock.close()


@pytest.mark.slow
def test_a_worker_killed_or_frozen_comes_back_at_once_and_every_delta_counts_once(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, text_path(), max_steps=600, node_lease_s=600.0)
    frozen_cfg = write_config(tmp_path / "frozen.yaml", text_path(), max_steps=600, node_lease_s=3.0)
    swarm = Swarm(tmp_path)
    try:
        swarm.init(cfg, collaborators=["w1", "w2"])
        master = swarm.master(cfg, "--no-train")
        w1 = swarm.worker(cfg, "w1")
        w2 = swarm.worker(frozen_cfg, "w2")
        wait_until(lambda: swarm.hwm("w1") >= 0 and swarm.hwm("w2") >= 0, what="a delta of each applied")

        dup = swarm.worker(cfg, "w1", name="w1-dup")  # the same node directory, while w1 lives
        assert swarm.wait_exit(dup, 300) == 2, swarm.log(dup)[-2000:]
        assert "--node-id w1: another worker process on this machine" in swarm.log(dup), swarm.log(dup)[
            -2000:
        ]

        before = swarm.hwm("w1")
        again = swarm.restart(swarm.kill(w1))  # no retry loop: the first start must be accepted
        swarm.wait_log(again, r"previous process on this node directory .* gone; taking it back")
        wait_until(lambda: swarm.hwm("w1") > before, what="a delta of the restarted w1 applied")

        suspend_outside_flock(w2.proc, Path(swarm.bus_dir) / LOCK_FILE)
        time.sleep(5.0)  # the fault itself: frozen past its 3 s lease
        w2.proc.send_signal(signal.SIGCONT)
        swarm.wait_log(w2, r"renewed late .* no other process took the id")
        frozen_at = swarm.hwm("w2")
        wait_until(lambda: swarm.hwm("w2") > frozen_at, what="a delta of w2 applied after the freeze")

        report = swarm.report(master)
        try:
            assert_exactly_once(report, allow_left=False)
        except AssertionError as error:  # why the master ended with valid deltas left, if it did
            logs = "".join(f"\n{life.name} log:\n{swarm.log(life)[-4000:]}" for life in (master, again, w2))
            raise AssertionError(f"{error}{logs}") from None
        assert w2.proc.wait(timeout=600) == 0, swarm.log(w2)[-3000:]
        assert again.proc.wait(timeout=600) == 0, swarm.log(again)[-3000:]
        assert "no longer owns" not in swarm.log(w2), swarm.log(w2)[-3000:]
    finally:
        swarm.close()
