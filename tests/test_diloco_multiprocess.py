"""DiLoCo end to end: separate master and worker processes (the real CLI) training the reference model
on tinyshakespeare, over a directory bus and over the Hub bus against the loopback Hub server.

Each test counts deltas: every delta a worker reports as uploaded is applied by the master exactly
once (no duplicates, none missing), and the global model's validation loss goes down.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import SRC_DIR, TOKEN_VARIABLES
from speedtronic.diloco import codec

pytestmark = pytest.mark.slow

TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


@pytest.fixture
def text() -> Path | None:
    """tinyshakespeare from ../shared when it is there; else None: the embedded copy of the same corpus."""
    return TEXT if TEXT.exists() else None


def write_config(tmp_path: Path, text: Path | None, max_steps: int = 20, **distributed: Any) -> Path:
    cfg = {
        "run": {"name": "dl", "max_steps": max_steps, "log_every": 5, "eval_every": 0, "device": "cpu"},
        "model": {"n_layer": 2, "n_head": 2, "d_model": 64},
        "data": {"block_size": 64, "micro_batch_size": 8, "val_batches": 4}
        | ({"text_path": str(text)} if text is not None else {}),
        "optimizer": {"lr": 3.0e-3},
        "checkpoint": {"every_steps": 5, "keep_last": 2},
        "logging": {"hooks": []},
        "distributed": {
            "enabled": True,
            "inner_steps": 5,
            "poll_interval": 0.2,
            "max_wait": 90.0,
            "retry_initial": 0.2,
            "retry_max": 1.0,
            "max_staleness": 100,
            "max_rounds_ahead": 1,
            "sync_ramp": False,
            "late_join_wait": 0.0,  # every node is started up front: end as soon as all are done
            **distributed,
        },
    }
    path = tmp_path / "diloco.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


class Procs:
    """Real `python -m speedtronic` processes with their output in files."""

    def __init__(self, tmp_path: Path, base_env: dict[str, str] | None = None) -> None:
        self.tmp_path = tmp_path
        self.base_env = base_env or {}
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(
        self, name: str, *args: object, env: dict[str, str] | None = None, ranks: int = 1
    ) -> subprocess.Popen[bytes]:
        child = {k: v for k, v in os.environ.items() if k not in TOKEN_VARIABLES}
        child.update(PYTHONPATH=str(SRC_DIR), HF_HOME=str(self.tmp_path / f"hf-{name}"), COLUMNS="1000")
        child.update(self.base_env)
        child.update(env or {})
        out = open(self.tmp_path / f"{name}.out", "ab")  # noqa: SIM115 - closed by the process' end
        err = open(self.tmp_path / f"{name}.err", "ab")  # noqa: SIM115
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
        proc = subprocess.Popen(
            [sys.executable, *(launcher if ranks > 1 else []), "-m", "speedtronic", *map(str, args)],
            cwd=self.tmp_path,
            env=child,
            stdout=out,
            stderr=err,
        )
        self.procs.append(proc)
        return proc

    def result(self, name: str, proc: subprocess.Popen[bytes], timeout: float = 240) -> dict[str, Any]:
        rc = proc.wait(timeout)
        err = (self.tmp_path / f"{name}.err").read_text(errors="replace")
        assert rc == 0, f"{name} exited {rc}:\n{err[-4000:]}"
        lines = (self.tmp_path / f"{name}.out").read_text().strip().splitlines()
        return json.loads(lines[-1])

    def log(self, name: str) -> str:
        return (self.tmp_path / f"{name}.err").read_text(errors="replace")

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def procs(tmp_path: Path):
    p = Procs(tmp_path)
    yield p
    p.kill_all()


def wait_until(condition: Callable[[], bool], timeout: float = 120, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def assert_exactly_once(master: dict[str, Any], *workers: dict[str, Any]) -> None:
    uploaded = {f"{w['node']}/{name}" for w in workers for name in w["uploaded"]}
    applied = master["applied"]
    assert len(applied) == len(set(applied)), f"a delta was applied twice: {applied}"
    assert set(applied) == set(uploaded), (
        sorted(set(uploaded) - set(applied)),
        sorted(set(applied) - set(uploaded)),
    )
    assert master["rejected"] == []


def assert_loss_went_down(master: dict[str, Any]) -> None:
    losses = [v["val_loss"] for v in master["global_val_loss"]]
    assert len(losses) >= 3, losses
    assert losses[-1] < losses[0] - 0.5, losses


def test_master_and_two_workers_over_a_directory_bus_with_the_master_killed(
    tmp_path: Path, text: Path | None, procs: Procs
) -> None:
    """The master trains too (three contributors per round); it is SIGKILLed after the first outer step
    and restarted: its outer loop resumes from its saved state, its training from its checkpoint."""
    cfg = write_config(tmp_path, text, min_deltas=3)
    bus_dir = tmp_path / "bus"
    bus = f"file://{bus_dir}"
    master = procs.start("master", "master", cfg, "--repo", bus, "--json")
    w1 = procs.start("w1", "worker", cfg, "--repo", bus, "--node-id", "w1", "--json")
    w2 = procs.start("w2", "worker", cfg, "--repo", bus, "--node-id", "w2", "--json")

    def outer_step() -> int:
        try:
            return json.loads((bus_dir / "head.json").read_text())["outer_step"]
        except (OSError, ValueError):
            return -1

    wait_until(lambda: outer_step() >= 1, what="the first outer step")
    master.send_signal(signal.SIGKILL)
    master.wait()
    killed_at = outer_step()
    master = procs.start("master2", "master", cfg, "--repo", bus, "--json")
    r1, r2, rm = procs.result("w1", w1), procs.result("w2", w2), procs.result("master2", master)
    # 20 steps / H=5: four deltas per node, one per node in a round, so at least 4 rounds; once a node
    # has sent its final delta a round needs one delta fewer (master.expected), so a node that ends
    # first (timing) leaves rounds of fewer deltas at the end. Every delta applied once is the point.
    assert killed_at < 4 <= rm["outer_step"], (killed_at, rm["outer_step"])
    assert "resumed state at outer step" in procs.log("master2") and "resumed from" in procs.log("master2")
    # Four deltas per node, and one or two more from the master's node when its last delta before the
    # kill was applied but not in its checkpoint: it restarts from the current global and redoes those
    # steps (coordinator.attach), new work numbered after the master's mark, never a resend.
    assert 12 <= len(rm["applied"]) <= 14 and rm["worker"]["node"] == "master", rm["applied"]
    # The killed process's own uploads are in no summary: they are the master node's applied deltas
    # numbered below everything its restarted process sent.
    restarted = sorted(rm["worker"]["uploaded"])
    first = restarted[0] if restarted else "master--99999999.safetensors"
    killed = {
        "node": "master",
        "uploaded": [
            a.split("/", 1)[1]
            for a in rm["applied"]
            if a.startswith("master/") and a.split("/", 1)[1] < first
        ],
    }
    assert_exactly_once(rm, r1, r2, rm["worker"], killed)
    assert_loss_went_down(rm)
    assert r1["outer_step"] >= 1 and r1["bytes_sent"] > 0  # max_rounds_ahead=1: w1 waited for a global
    assert "inner step 10 · outer step" in procs.log("w1")  # progress: inner/outer step, last sync, bytes
    assert list((bus_dir / "deltas" / "w1").glob("*.safetensors")) == []  # processed deltas deleted


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_worker_of_two_ranks_over_a_directory_bus(
    tmp_path: Path, text: Path | None, procs: Procs, strategy: str
) -> None:
    """Inside a machine the ranks train with DDP or FSDP; rank 0 alone talks to the bus. Under DDP it
    broadcasts the global weights it installs; under FSDP its deltas come from the gathered whole
    weights and what it installs is scattered to the shards. The master only aggregates here."""
    # 15 steps, H=5: with max_rounds_ahead=1 the worker must install a global before its third delta.
    cfg = write_config(tmp_path, text, max_steps=15, min_deltas=1, master_trains=False, strategy=strategy)
    bus = f"file://{tmp_path / 'bus'}"
    master = procs.start("master", "master", cfg, "--repo", bus, "--json")
    worker = procs.start("w1", "worker", cfg, "--repo", bus, "--node-id", "w1", "--json", ranks=2)
    rw, rm = procs.result("w1", worker), procs.result("master", master)
    assert rw["node"] == "w1" and rw["steps"] == 15 and rm["outer_step"] == 3
    assert rw["tokens"] == 15 * 2 * 8 * 64  # two ranks' micro-batches per step
    assert_exactly_once(rm, rw)  # the master rejected nothing: whole, finite deltas
    assert rw["strategy"] == strategy
    assert_loss_went_down(rm)
    # Beyond the initial install (outer step 0), rank 0 installed a newer global and broadcast it.
    assert re.search(r"installed global model of outer step [1-9]", procs.log("w1"))


HUB_TOKENS = {"owner": "hf_ownerloopback0001", "alice": "hf_aliceloopback0002", "bob": "hf_bobloopback00003"}


@pytest.mark.usefixtures("restore_secrets", "isolated_env")
def test_master_and_two_workers_over_the_hub_with_faults(tmp_path: Path, text: Path | None) -> None:
    from hub_server import HubServer

    server = HubServer()
    for user, token in HUB_TOKENS.items():
        server.state.add_user(user, token)
    procs = Procs(tmp_path, {"HF_HUB_DISABLE_XET": "1", "HF_ENDPOINT": server.url})
    try:
        _hub_run(tmp_path, text, server, procs)
    finally:
        procs.kill_all()
        server.stop()


def hub_cli(server: Any, command: str, *args: object) -> dict[str, Any]:
    """`speedtronic hub COMMAND ... --json` in this process (as the run's owner), its JSON result."""
    from typer.testing import CliRunner

    from speedtronic.cli.app import build_app

    argv = ["hub", command, *map(str, args), "--endpoint", server.url, "--json"]
    env = {"HF_TOKEN": HUB_TOKENS["owner"], "HF_HUB_DISABLE_XET": "1"}
    result = CliRunner().invoke(build_app(with_plugins=False), argv, env=env)
    assert result.exit_code == 0, result.output
    assert HUB_TOKENS["owner"] not in result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def _hub_run(tmp_path: Path, text: Path | None, server: Any, procs: Procs) -> None:
    # Enough retries (~6 s of backoff) to ride out the 3 s outage below, whenever it starts. A short
    # node lease: alice's restart after kill -9 waits for hers to expire (a live id is refused).
    cfg = write_config(tmp_path, text, max_steps=15, request_timeout=2.0, retry_attempts=8, node_lease_s=20)
    owner = {"HF_TOKEN": HUB_TOKENS["owner"]}
    repo = "owner/dl-run"
    assert hub_cli(server, "init", repo, "--config", cfg, "--gated")["outer_step"] == 0
    for user in ("alice", "bob"):
        assert hub_cli(server, "add-collaborator", repo, user)["granted_read_access"] is True
    master = procs.start("master", "master", cfg, "--repo", repo, "--no-train", "--json", env=owner)

    def worker(name: str, user: str) -> subprocess.Popen[bytes]:
        args = ("worker", cfg, "--repo", repo, "--node-id", user, "--json")
        return procs.start(name, *args, env={"HF_TOKEN": HUB_TOKENS[user]})

    alice, bob = worker("alice", "alice"), worker("bob", "bob")

    def alice_repo() -> dict[str, bytes]:
        with server.state.lock:
            known = "alice/dl-run-deltas" in server.state.repos
        return server.files("alice/dl-run-deltas") if known else {}

    def alice_sent() -> int:
        """The highest delta number in alice's repo (each upload prunes the processed ones)."""
        names = [p.rsplit("/", 1)[1] for p in alice_repo() if p.startswith("deltas/alice/")]
        return max((codec.parse_delta_name(n)[1] for n in names), default=-1)

    # Worker killed mid-upload: alice's second delta lands, but the answer never reaches her. (Her
    # delta repo's commits are its README, which carries the run's tag, her lease on her node id, its
    # renewals every ~7 s, and her deltas; should the hung commit be a renewal, her delta lands acked.)
    wait_until(lambda: alice_sent() >= 0, what="alice's first delta")
    server.hang_after_next(1, 60, match="alice/dl-run-deltas/commit")
    wait_until(lambda: alice_sent() >= 1, what="alice's second delta")
    alice.send_signal(signal.SIGKILL)
    alice.wait()
    server.clear_faults()
    # What the killed process sent (its record died with it): every number up to the highest on the bus.
    killed = {"node": "alice", "uploaded": [codec.delta_name("alice", s) for s in range(alice_sent() + 1)]}
    lease = json.loads(alice_repo()["leases/alice.json"])  # kill -9: her lease stays until it expires
    wait_until(lambda: lease["expires_at"] < time.time(), 60, "alice's lease to expire")
    # The Hub misbehaves while training goes on: 503s, hung requests, then down for a while.
    server.fail_next(6, 503)
    server.hang_next(2, 4.0)
    alice = worker("alice2", "alice")
    time.sleep(2.0)
    server.stop()
    time.sleep(3.0)
    server.start()

    ra, rb, rm = procs.result("alice2", alice), procs.result("bob", bob), procs.result("master", master)
    assert "resumed from" in procs.log("alice2")
    # 15 steps / H=5: three rounds, or four: alice's restart waits for her lease to expire, and when
    # the master has applied her delta #1 by then, she re-does steps 6-10 from her step-5 checkpoint and
    # numbers on after the master's mark (#2, #3), so her last delta can make a round of its own. When
    # the re-done delta is bit for bit the #1 the killed process sent, the master rejects it as a
    # replay: that work counts once.
    assert rm["outer_step"] >= 3, rm["outer_step"]  # more where a round closes at its grace
    replayed = {
        r["id"] for r in rm["rejected"] if r["reason"].startswith("replay: the same payload as alice/")
    }
    assert {r["id"] for r in rm["rejected"]} == replayed, rm["rejected"]
    alice2 = {"node": "alice", "uploaded": [n for n in ra["uploaded"] if f"alice/{n}" not in replayed]}
    assert_exactly_once({**rm, "rejected": []}, killed, alice2, rb)
    assert_loss_went_down(rm)
    warnings = procs.log("master") + procs.log("bob") + procs.log("alice2")
    assert "HTTP 503" in warnings or "retrying" in warnings
    # hub status reports the outer step and each collaborator's latest delta and lag
    st = hub_cli(server, "status", repo)
    assert st["outer_step"] == rm["outer_step"]
    nodes = {c["node"]: c for c in st["collaborators"]}
    alice_last = max(codec.parse_delta_name(n)[1] for n in alice2["uploaded"])
    assert nodes["alice"]["latest_applied_seq"] == alice_last and nodes["bob"]["lag"] is not None
    for name in ("master", "alice2", "bob"):
        assert HUB_TOKENS["owner"] not in procs.log(name) and HUB_TOKENS["alice"] not in procs.log(name)
