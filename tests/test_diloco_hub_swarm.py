"""A DiLoCo swarm on the loopback Hub with the Hub's limits enforced: 4, 16 and 36 collaborators.

Lightweight nodes: one thread each, a real Coordinator and HubBus (its own Hub user, token and
gated delta repo) driving a tiny model whose "training" is a random nudge per step; the master is a
real Master with its own HubBus. The server enforces a request window per token and a commit rate
per repo and answers 429 + Retry-After beyond them, like the Hub; clients are configured with the
same budgets and must stay inside them.

Churn at every size: a quarter of the nodes join late (after outer step 2), one node leaves after
its first delta and rejoins later under the same id, the master is killed mid-run and restarted
from its state, and a listed peer drops garbage. Asserted: every delta a node uploaded is applied
exactly once or rejected with a logged reason; nothing is pending at the end (`hub status`); no
request failed (no bus error surfaced anywhere); the master's requests per idle poll stay flat as
the swarm grows. The figures are printed (run with -s to see them).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hub_server import HubServer
from speedtronic.config import load_config
from speedtronic.config.distributed import MOVED
from speedtronic.diloco import codec
from speedtronic.diloco.bus.hub import HubBus, run_tag
from speedtronic.diloco.manifest import add_collaborator, build_manifest, now
from speedtronic.diloco.master import Master
from speedtronic.diloco.worker import Coordinator
from speedtronic.engine.sync import StopTraining
from swarm_harness import Report, assert_exactly_once, hub_delta_ids

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("isolated_env")]

RUN = "owner/run"
OWNER = "hf_ownerswarm00000000"
WINDOW, REQUESTS = 4.0, 160  # per token; the Hub: 300 s, 1000
COMMIT_WINDOW, COMMITS = 8.0, 24  # per repo; the Hub: 3600 s, ~128
END = 4  # the run's end (manifest run.outer_steps)
H = 2  # inner steps between syncs


def token(user: str) -> str:
    return f"hf_{user}swarmtoken".ljust(24, "0")


def settings(**extra: object) -> Any:
    values = {
        "inner_steps": H,
        "poll_interval": 0.2,
        "async_delta_upload": False,
        "async_global_poll": False,
        "min_deltas": 4,
        "max_wait": 2.0,
        "max_staleness": 1000,
        "squash_every": 0,
        "retry_initial": 0.1,
        "retry_max": 1.0,
        "request_timeout": 10.0,
        "delta_upload_shutdown_timeout": 30.0,
        "hub_request_budget": REQUESTS,
        "hub_request_window": WINDOW,
        "hub_commit_budget": COMMITS,
        "hub_commit_window": COMMIT_WINDOW,
        **extra,
    }
    where = {k: "{}.{}".format(*MOVED[k]) if k in MOVED else k for k in values}  # flat name -> section.field
    return load_config(None, [f"distributed.{where[k]}={v}" for k, v in values.items()])


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(8, 8)


class Swarm:
    def __init__(self, server: HubServer, n: int, tmp_path: Path) -> None:
        self.server, self.n, self.tmp_path = server, n, tmp_path
        self.cfg = settings()
        self.nodes = [f"n{i:02d}" for i in range(n)]
        server.state.add_user("owner", OWNER)
        for node in [*self.nodes, "mallory"]:
            server.state.add_user(node, token(node))
        owner = self.bus(OWNER)
        owner.api.create_repo(RUN, private=False)
        owner.check_master_access()  # the run tag: the master's one listing call finds the run repo
        model = tiny()
        self.specs = codec.param_specs(model)
        manifest = build_manifest(self.cfg, self.specs)
        manifest["run"]["outer_steps"] = END
        for node in [*self.nodes, "mallory"]:
            manifest = add_collaborator(manifest, node, node)
        owner.write_manifest(manifest)
        self.manifest = manifest
        self.initial = codec.snapshot(model)
        data = codec.encode(self.initial, "fp32", {"kind": "global", "outer_step": "0", "node": "master"})
        owner.publish(data, {"format": codec.FORMAT_VERSION, "outer_step": 0, "updated_at": now()})
        self.uploaded: list[str] = []
        self.ended_early: list[str] = []
        self.lives: dict[str, int] = {}
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.master_bus: HubBus | None = None
        self.polls = 0
        self.poll_requests = 0

    def bus(self, tok: str) -> HubBus:
        return HubBus(RUN, config=self.cfg.distributed.bus, endpoint=self.server.url, token=tok)

    def master(self) -> Master:
        if self.master_bus is not None:  # the killed master's figures still count
            self.polls += self.master_bus.polls
            self.poll_requests += self.master_bus.poll_requests
        self.master_bus = self.bus(OWNER)
        m = Master(
            self.cfg,
            self.master_bus,
            self.manifest,
            dict(self.initial),
            state_dir=self.tmp_path / "master",
            momentum=0.0,
            lr=0.7,
        )
        m.start_state()
        m.start()
        return m

    def life(self, node: str, steps: int) -> None:
        """One node's life: join, train `steps` steps (or until the run's end), leave."""
        try:
            bus = self.bus(token(node))
            bus.check_worker_access(node)
            model = tiny()
            coordinator = Coordinator(self.cfg, bus, node, bus.read_manifest() or {})
            coordinator.attach(model, step=0, tokens=0, final_step=steps)
            with self.lock:  # a rejoin trains on other data: its deltas are not replays of earlier ones
                self.lives[node] = self.lives.get(node, 0) + 1
                seed = zlib.crc32(f"{node}/{self.lives[node]}".encode())
            generator = torch.Generator().manual_seed(seed)
            try:
                for step in range(1, steps + 1):
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(torch.randn(p.shape, generator=generator) * 1e-3)
                    coordinator.after_step(model, step=step, tokens=step * 64)
            except StopTraining:
                with self.lock:
                    self.ended_early.append(node)
            finally:
                coordinator.close()
            with self.lock:
                self.uploaded += [f"{node}/{name}" for name in coordinator.uploaded]
                if coordinator.uploader.queue:
                    self.errors.append(f"{node}: {len(coordinator.uploader.queue)} deltas never uploaded")
        except Exception as error:  # surfaced in the main thread's assertions
            with self.lock:
                self.errors.append(f"{node}: {type(error).__name__}: {error}")

    def start(self, node: str, steps: int) -> threading.Thread:
        thread = threading.Thread(target=self.life, args=(node, steps), name=f"swarm-{node}", daemon=True)
        thread.start()
        return thread


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def run_swarm(n: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    server = HubServer()
    try:
        server.limit_requests(REQUESTS, WINDOW)
        server.limit_commits(COMMITS, COMMIT_WINDOW)
        swarm = Swarm(server, n, tmp_path / f"swarm{n}")
        late = swarm.nodes[n - max(1, n // 4) :]
        leaver = swarm.nodes[1]
        early = [node for node in swarm.nodes if node not in late]
        started = time.monotonic()
        master = swarm.master()
        threads = [swarm.start(node, 2 if node == leaver else 4 * H) for node in early]
        mallory = swarm.bus(token("mallory"))
        mallory.check_worker_access("mallory")
        mallory.put_delta("mallory", codec.delta_name("mallory", 0), b"garbage" * 100)
        wait_for(lambda: master.outer_step >= 2, 60, "outer step 2")
        master.stop()  # killed mid-run: a new master resumes from its state on disk
        master = swarm.master()
        threads += [swarm.start(node, 3 * H) for node in late]  # late joiners, after the run's middle
        threads[early.index(leaver)].join(30)
        threads.append(swarm.start(leaver, 2 * H))  # the leaver rejoins under the same id
        for thread in threads:
            thread.join(120)
        master.wait(END, idle_s=20.0, linger_s=0.5)
        master.stop()
        elapsed = time.monotonic() - started
        assert not swarm.errors, swarm.errors
        assert master.error is None
        assert swarm.master_bus is not None
        polls = swarm.polls + swarm.master_bus.polls
        poll_requests = swarm.poll_requests + swarm.master_bus.poll_requests

        # Every delta applied exactly once, or rejected with a reason, or still on the bus (processed
        # ones stay in a collaborator's own repo until its next upload prunes them).
        sent: dict[str, list[str]] = {}
        for delta_id in swarm.uploaded:
            sent.setdefault(delta_id.split("/")[0], []).append(delta_id)
        report = Report(
            sent=sent,
            seen=dict.fromkeys(hub_delta_ids(server, history=True), 0.0),
            applied=list(master.applied),
            rejected=list(master.rejected),
            remaining=sorted(hub_delta_ids(server)),
            killed={},
            extra={"mallory/mallory--00000000.safetensors"},
            watch_exact=True,
        )
        assert_exactly_once(report, allow_left=False)
        applied = Counter(master.applied)
        rejected = {r["id"]: r["reason"] for r in master.rejected}
        assert set(rejected) == {"mallory/mallory--00000000.safetensors"}, report.lists()
        assert master.finished >= set(swarm.nodes)

        # The operator's view: metrics.json agrees with the master, per node.
        metrics = json.loads((swarm.tmp_path / "master" / "metrics.json").read_text())
        assert metrics["applied"] == len(applied) and metrics["rejected"] == len(rejected)
        assert sum(n["applied"] for n in metrics["nodes"].values()) == len(applied)
        assert metrics["nodes"]["mallory"]["rejected"] == 1 and metrics["bytes_in"] > 0

        # Nothing pending, per `hub status` (a fresh client, as an operator would run it).
        from speedtronic.diloco.launch import run_status

        monkeypatch.setenv("HF_TOKEN", OWNER)
        status = run_status(RUN, server.url)
        pending = {c["node"]: c["pending"] + c["new_on_bus"] for c in status["collaborators"]}
        assert not any(pending.values()), pending  # mallory's rejected file is neither
        assert status["rejected"] == metrics["rejected"] and status["applied"] == metrics["applied"]

        # The master's idle poll: one listing call, whatever the number of collaborators.
        probe = swarm.bus(OWNER)
        probe.list_deltas(None)  # first look: every repo's tree once
        before = probe.requests.taken
        probe.list_deltas(None)
        idle = probe.requests.taken - before
        tagged = len(list(probe.api.list_models(filter=run_tag(RUN))))
        return {
            "n": n,
            "elapsed_s": elapsed,
            "sent": len(swarm.uploaded),
            "applied": len(applied),
            "rejected": len(rejected),
            "ended_early": len(swarm.ended_early),
            "outer_steps": master.outer_step,
            "polls": polls,
            "requests_per_poll": poll_requests / max(1, polls),
            "idle_poll_requests": idle,
            "tagged_repos": tagged,
            "throttled": len(server.state.throttled),
            "master_requests": server.state.by_token.get("owner", 0),
        }
    finally:
        server.stop()


def test_a_swarm_within_the_hubs_limits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    rows = []
    with caplog.at_level(logging.INFO, logger="speedtronic.diloco"):
        for n in (4, 16, 36):
            rows.append(run_swarm(n, tmp_path, monkeypatch))
    failures = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING
        and any(k in r.getMessage() for k in ("failed", "could not", "retrying"))
        and "HTTP 429" not in r.getMessage()
    ]
    assert not failures, failures[:5]
    print("\ncollaborators  sent applied rejected early-end outer  polls  req/poll  idle-poll  429s  time")
    for r in rows:
        print(
            f"{r['n']:>13} {r['sent']:>5} {r['applied']:>7} {r['rejected']:>8} {r['ended_early']:>9} "
            f"{r['outer_steps']:>5} {r['polls']:>6} {r['requests_per_poll']:>9.2f} {r['idle_poll_requests']:>10} "
            f"{r['throttled']:>5} {r['elapsed_s']:>5.1f}s"
        )
    idle = [r["idle_poll_requests"] for r in rows]
    assert idle[0] == idle[-1] <= 2, idle  # flat: one listing call (plus unlisted repos, in turn)
    assert all(r["tagged_repos"] == r["n"] + 2 for r in rows)  # every delta repo + mallory's + the run
