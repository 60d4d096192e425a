"""The Hub flow as the documentation gives it, run verbatim against the loopback Hub.

- The Hub blocks of docs/guides/diloco.md (the README shows only the local flow) are read from the page and
  each `speedtronic …` line is run as written, as a real process (`hub init`, `hub add-collaborator`
  as the owner; `master` as the owner; `worker` with the token of its `--node-id` user; `hub status`
  after the run), from a directory whose `configs/diloco-hub.yaml` is the shipped config made tiny
  (the commands are the page's; only the model and step counts are the test's). The run must work:
  the collaborator reads the gated run it was granted, every node's deltas are applied, and the
  master, which trains, never commits a delta of its own node to the Hub.
- `hub status --json` equals the master's metrics.json on applied, rejected, pending and finished
  (totals and per node) after a run with rejected deltas, one of them after the last outer step.
- The wrapper that keeps the training master's own deltas local (bus/local_deltas.py), over a real
  directory bus.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import SRC_DIR, TOKEN_VARIABLES
from docs_blocks import ROOT, extract_blocks
from hub_server import HubServer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("isolated_env")]

TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
USERS = ("you", "friend", "alice", "bob")


def token(user: str) -> str:
    return f"hf_{user}flowtoken".ljust(24, "0")


def hub_blocks(page: str) -> list[str]:
    """The page's shell blocks that create a run on the Hub (owner/name, not file:// or s3://)."""
    found = []
    for block in extract_blocks(ROOT / page):
        for line in block.code.splitlines():
            if not line.startswith("speedtronic hub init "):
                continue
            words = shlex.split(line, comments=True)
            if "://" not in words[3]:
                found.append(block.code)
                break
    assert found, f"{page}: no Hub block (speedtronic hub init OWNER/NAME …) found"
    return found


def commands(code: str) -> list[list[str]]:
    return [
        w
        for w in (shlex.split(line, comments=True) for line in code.splitlines())
        if w[:1] == ["speedtronic"]
    ]


def tiny_config(workdir: Path) -> None:
    """configs/diloco-hub.yaml under `workdir`: the shipped one, made small enough for a test."""
    cfg = yaml.safe_load((ROOT / "configs" / "diloco-hub.yaml").read_text(encoding="utf-8"))
    cfg["run"].update(max_steps=10, log_every=5, device="cpu")
    cfg["model"].update(n_layer=1, n_head=2, d_model=32)
    cfg["data"].update(block_size=32, micro_batch_size=4, val_batches=2)
    if TEXT.exists():
        cfg["data"]["text_path"] = str(TEXT)
    cfg["checkpoint"].update(every_steps=5)
    cfg["logging"] = {"hooks": []}
    dist = cfg["distributed"]
    dist.setdefault("sync", {}).update(inner_steps=5, ramp=False)
    dist.setdefault("node", {}).update(poll_interval=0.2)
    dist.setdefault("rounds", {}).update(max_wait=60.0, late_join_wait=0.0)
    dist.setdefault("bus", {}).update(request_timeout=10.0, retry_initial=0.2, retry_max=1.0)
    (workdir / "configs").mkdir(parents=True)
    (workdir / "configs" / "diloco-hub.yaml").write_text(yaml.safe_dump(cfg), encoding="utf-8")


class Flow:
    """Runs `speedtronic …` lines as real processes in `workdir`, each as the user it belongs to."""

    def __init__(self, workdir: Path, server: HubServer) -> None:
        self.workdir, self.server = workdir, server
        self.started: list[tuple[str, subprocess.Popen[bytes]]] = []

    def env(self, user: str, name: str) -> dict[str, str]:
        child = {k: v for k, v in os.environ.items() if k not in TOKEN_VARIABLES}
        child.update(
            PYTHONPATH=str(SRC_DIR),
            HF_HOME=str(self.workdir / f"hf-{name}"),
            HF_ENDPOINT=self.server.url,
            HF_HUB_DISABLE_XET="1",
            HF_TOKEN=token(user),
            COLUMNS="1000",
        )
        return child

    @staticmethod
    def user_of(words: list[str]) -> str:
        if words[1] == "worker":  # on the collaborator's machine, with their token
            return words[words.index("--node-id") + 1]
        return "you"  # the run's owner (an organisation's admin for your-org/…)

    def run(self, words: list[str], name: str) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [sys.executable, "-m", "speedtronic", *words[1:]],
            cwd=self.workdir,
            env=self.env(self.user_of(words), name),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, (
            f"{shlex.join(words)} exited {result.returncode}:\n{result.stderr[-3000:]}"
        )
        return result

    def start(self, words: list[str], name: str) -> subprocess.Popen[bytes]:
        out = open(self.workdir / f"{name}.out", "wb")  # noqa: SIM115 - closed when the process ends
        err = open(self.workdir / f"{name}.err", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-m", "speedtronic", *words[1:]],
            cwd=self.workdir,
            env=self.env(self.user_of(words), name),
            stdout=out,
            stderr=err,
        )
        self.started.append((name, proc))
        return proc

    def finish(self) -> None:
        for name, proc in self.started:
            rc = proc.wait(300)
            err = (self.workdir / f"{name}.err").read_text(errors="replace")
            assert rc == 0, f"{name} exited {rc}:\n{err[-4000:]}"
            for user in USERS:
                assert token(user) not in err + (self.workdir / f"{name}.out").read_text(errors="replace")

    def kill(self) -> None:
        for _, proc in self.started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def hub_server() -> HubServer:
    server = HubServer()
    for user in USERS:
        server.state.add_user(user, token(user))
    # For the guide's organisation run: "you" administers your-org, its members may write.
    server.state.orgs["your-org"] = {"you": "admin", "alice": "write", "bob": "write"}
    return server


@pytest.mark.parametrize("page", ["docs/guides/diloco.md"])
def test_the_documented_hub_flow_runs_verbatim(page: str, tmp_path: Path) -> None:
    server = hub_server()
    flow = Flow(tmp_path, server)
    tiny_config(tmp_path)
    try:
        for b, code in enumerate(hub_blocks(page)):
            later: list[list[str]] = []
            repo = ""
            for i, words in enumerate(commands(code)):
                name = f"b{b}-{i}-{words[1]}"
                if words[1] in ("master", "worker"):
                    flow.start(words, name)
                elif words[1:3] == ["hub", "status"]:
                    later.append(words)  # an operator's look once the run is over
                else:
                    flow.run(words, name)
                    repo = repo or words[3]
            if flow.started:
                check_run(flow, server, repo, later)
                flow.started = []
            else:  # only init and add-collaborator (the organisation's block): the run exists
                manifest = json.loads(server.files(repo)["manifest.json"])
                assert set(manifest["collaborators"]) >= {"master", "alice", "bob"}
                assert server.state.repos[repo].gated
    finally:
        flow.kill()
        server.stop()


def check_run(flow: Flow, server: HubServer, repo: str, status_lines: list[list[str]]) -> None:
    flow.finish()
    run_repo = server.state.repos[repo]
    assert run_repo.gated and not run_repo.private  # `hub init`'s default
    assert "friend" in run_repo.granted  # granted by `hub add-collaborator`
    [metrics_path] = list(flow.workdir.glob("runs/*/diloco-master/metrics.json"))
    metrics = json.loads(metrics_path.read_text())
    # 10 steps, H=5: two deltas from each node, all applied; both finished.
    assert metrics["nodes"]["master"]["applied"] == 2 and metrics["nodes"]["friend"]["applied"] == 2, metrics
    assert metrics["rejected"] == 0 and metrics["finished"] == ["friend", "master"]
    # The master trained, and none of its own deltas cost a commit (or a file) on the Hub.
    with server.state.lock:
        log = list(server.state.commit_log)
    touched = [(r, p) for r, _, paths in log for p in paths if p.startswith("deltas/master/")]
    assert touched == [], touched
    assert any(
        p.startswith("deltas/friend/") for r, _, paths in log if r.startswith("friend/") for p in paths
    )
    for words in status_lines:
        shown = flow.run(words, "status").stdout
        assert "4 applied · 0 rejected · 0 pending · 2 finished" in shown, shown
    st = json.loads(flow.run([*status_lines[0], "--json"], "status-json").stdout.strip().splitlines()[-1])
    assert_status_equals_metrics(st, metrics)


def assert_status_equals_metrics(st: dict[str, Any], metrics: dict[str, Any]) -> None:
    keys = ("applied", "rejected", "pending", "finished")
    assert {k: st[k] for k in keys} == {k: metrics[k] for k in keys}, (st, metrics)
    per_node = {n: {k: v[k] for k in keys} for n, v in st["nodes"].items() if n in metrics["nodes"]}
    assert per_node == {n: {k: v[k] for k in keys} for n, v in metrics["nodes"].items()}, (st, metrics)


def test_hub_status_json_equals_metrics_json_after_rejections(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two honest nodes and a peer that plants garbage (rejected, never deletable by the master: it
    sits in the peer's own repo): `hub status --json` reports what metrics.json says, and the rejected
    files are neither pending nor new on the bus."""
    from typer.testing import CliRunner

    from speedtronic.cli.app import build_app
    from speedtronic.diloco import codec
    from test_diloco_hub_swarm import OWNER, RUN, Swarm, settings
    from test_diloco_hub_swarm import token as swarm_token

    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    server = HubServer()
    try:
        swarm = Swarm(server, 2, tmp_path)
        swarm.cfg = settings(min_deltas=2)
        master = swarm.master()
        mallory = swarm.bus(swarm_token("mallory"))
        mallory.check_worker_access("mallory")
        mallory.put_delta("mallory", codec.delta_name("mallory", 0), b"garbage" * 100)
        threads = [swarm.start(node, 3 * 2) for node in swarm.nodes]  # 3 deltas each
        for thread in threads:
            thread.join(120)
        assert not swarm.errors, swarm.errors
        # A rejection after the last outer step: only the master's final publish (on stop) brings
        # head.json's status up to date (feedback republishes wait distributed.defences.rejection_feedback_s).
        deadline = time.monotonic() + 60
        while len(master.applied) < 6 and time.monotonic() < deadline:
            time.sleep(0.1)
        mallory.put_delta("mallory", codec.delta_name("mallory", 1), b"garbage" * 101)

        def settled() -> bool:
            return len(master.applied) == 6 and len(master.rejected) == 2 and master.pending_count == 0

        deadline = time.monotonic() + 60
        while not settled() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert settled(), (master.applied, master.rejected, master.pending_count)
        master.stop()
        assert master.error is None
        metrics = json.loads((tmp_path / "master" / "metrics.json").read_text())
        assert metrics["rejected"] == 2 and metrics["nodes"]["mallory"]["rejected"] == 2
        assert all(r["reason"] for r in metrics["rejected_recent"])

        env = {"HF_TOKEN": OWNER, "HF_HUB_DISABLE_XET": "1"}
        argv = ["hub", "status", RUN, "--endpoint", server.url, "--json"]
        result = CliRunner().invoke(build_app(with_plugins=False), argv, env=env)
        assert result.exit_code == 0, result.output
        st = json.loads(result.stdout.strip().splitlines()[-1])
        assert_status_equals_metrics(st, metrics)
        mallory_row = next(c for c in st["collaborators"] if c["node"] == "mallory")
        assert mallory_row["rejected"] == 2 and mallory_row["last_rejection"] is not None
        assert mallory_row["pending"] == [] and mallory_row["new_on_bus"] == [], mallory_row
        assert st["new_on_bus"] == 0 and OWNER not in result.output
        # The round rule, the epoch and lease and the end as the master published them (master/rounds.py).
        for key in ("round", "epoch", "lease", "end_reason", "final"):
            assert st[key] == metrics[key], (key, st[key], metrics[key])
        assert st["round"] and st["round"]["rule"] == "min_deltas", st["round"]  # this run sets min_deltas
        text = CliRunner().invoke(build_app(with_plugins=False), argv[:-1], env=env)
        assert "6 applied · 2 rejected · 0 pending · 2 finished" in text.stdout, text.stdout
        assert "last rejected: mallory--00000001.safetensors: " in text.stdout, text.stdout
        assert "  round " in text.stdout and "min_deltas" in text.stdout, text.stdout
    finally:
        server.stop()


def test_local_deltas_keep_one_node_in_process_and_pass_the_rest_through(tmp_path: Path) -> None:
    """The wrapper the training master uses (bus/local_deltas.py), over a real directory bus: node
    "master"'s deltas are files under the local folder, listed together with the bus's, read, pruned
    and deleted there; another node's go to the bus."""
    from speedtronic.diloco import codec
    from speedtronic.diloco.bus.directory import DirectoryBus
    from speedtronic.diloco.bus.local_deltas import LocalDeltas

    inner = DirectoryBus(str(tmp_path / "bus"))
    inner.create_run()
    bus = LocalDeltas(inner, "master", tmp_path / "state" / "deltas")
    bus.check_worker_access("master")
    bus.check_worker_access("w1")
    mine = [codec.delta_name("master", i) for i in range(3)]
    bus.put_delta("master", mine[0], b"zero")
    bus.put_delta("master", mine[1], b"one")
    bus.put_delta("w1", codec.delta_name("w1", 0), b"theirs")
    assert sorted(p.name for p in (tmp_path / "state" / "deltas" / "master").iterdir()) == mine[:2]
    assert not (tmp_path / "bus" / "deltas" / "master").exists() or not any(
        (tmp_path / "bus" / "deltas" / "master").iterdir()
    )
    assert inner.list_own_deltas("w1") == [codec.delta_name("w1", 0)]
    assert bus.delta_exists("master", mine[1]) and not bus.delta_exists("master", mine[2])
    refs = {r.id: r for r in bus.list_deltas(None)}
    assert set(refs) == {f"master/{mine[0]}", f"master/{mine[1]}", f"w1/{codec.delta_name('w1', 0)}"}
    assert bus.get_delta(refs[f"master/{mine[1]}"], 100) == b"one"
    assert bus.get_delta(refs[f"master/{mine[1]}"], 1) == b"on"  # at most max_bytes + 1
    assert bus.get_delta(refs[f"w1/{codec.delta_name('w1', 0)}"], 100) == b"theirs"
    assert [r.node for r in bus.list_deltas({"w1": {}})] == ["w1"]  # not listed: not merged
    bus.put_delta("master", mine[2], b"two", prune=[mine[0]])  # a worker prunes what was processed
    assert bus.list_own_deltas("master") == mine[1:]
    bus.delete_deltas(list(refs.values()))
    assert bus.list_own_deltas("master") == [mine[2]] and inner.list_own_deltas("w1") == []
    with pytest.raises(Exception, match="not a delta file name"):
        bus.put_delta("master", "../escape", b"x")
