"""A harness for DiLoCo tests with real processes: a master and workers as `python -m speedtronic master`
/ `speedtronic worker` subprocesses on a directory bus, on the loopback Hub (tests/hub_server.py, with
its request and commit windows when the test sets them), or on any bus the test can list (S3).

Why a harness: the swarm tests used to count deltas with `applied == 12` and `outer_step == 3`, which
load can break without anything being wrong (a resumed node sends one delta more, a slow node makes a
round more), and their messages did not say which delta was extra. Here every test builds one report
from what the processes and the bus say, and asserts what the protocol promises: exactly once.

- `Swarm` starts nodes (each life with its own log files `<life>.out` / `<life>.err`), kills one with
  SIGKILL, restarts it (same node id, same output directory: it resumes from its checkpoint; where a
  node-id lease of the dead process still holds the id, again until one start is accepted), starts a
  duplicate, and waits for conditions (bus state, log lines, exits) against generous deadlines — never
  a fixed sleep standing in for a condition.
- A watcher thread records every delta file that appears on the bus (the directory bus: a listing
  every 10 ms; the loopback Hub: every commit the server holds, exactly), when the run's outer step
  moved, and when each process exited. It is what knows what a SIGKILLed process sent: that process
  never prints a summary.
- `Swarm.report()` joins the final master's `--json` summary (its state survives a SIGKILL, so the
  last master's `applied` and `rejected` cover the whole run; a master killed last is read from its
  state file; another master's state — a standby's predecessor — is merged in), every worker life's
  `--json` summary (`uploaded`), the watcher's record and what is left on the bus, per node.
- `assert_exactly_once(report)`: no delta applied twice, every delta sent or seen is applied,
  rejected with a reason, or still on the bus, nothing is applied that no one sent, and no name was
  uploaded by two processes running at once. On failure it prints the full lists.
- `round_figures()`: each round's wait against the nodes' round times (issue 23's figures).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from conftest import SRC_DIR, TOKEN_VARIABLES

TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
DELTA_RE = re.compile(r"^(?P<node>[A-Za-z0-9][A-Za-z0-9_.-]{0,63})--(?P<seq>\d{8,12})\.safetensors$")
OWNER = "owner"


def token(user: str) -> str:
    """A loopback Hub token for `user` (never a real one)."""
    return f"hf_{user}churntoken".ljust(24, "0")


def text_path() -> Path | None:
    """tinyshakespeare from ../shared when it is there; else None: the embedded copy of the same corpus."""
    return TEXT if TEXT.exists() else None


def write_config(
    path: Path,
    text: Path | None = None,
    max_steps: int = 20,
    model: dict[str, Any] | None = None,
    data: dict[str, Any] | None = None,
    **distributed: Any,
) -> Path:
    """A DiLoCo YAML (at `path`, or `path`/diloco.yaml for a directory) for the reference model."""
    if path.suffix not in (".yaml", ".yml"):
        path = path / "diloco.yaml"
    cfg = {
        "run": {"name": "dl", "max_steps": max_steps, "log_every": 5, "eval_every": 0, "device": "cpu"},
        "model": model or {"n_layer": 2, "n_head": 2, "d_model": 64},
        "data": (data or {"block_size": 64, "micro_batch_size": 8, "val_batches": 4})
        | ({"text_path": str(text)} if text is not None else {}),
        "optimizer": {"lr": 3.0e-3},
        "checkpoint": {"every_steps": 5, "keep_last": 2},
        "logging": {"hooks": []},
        "distributed": nested_distributed(
            {
                "enabled": True,
                "inner_steps": 5,
                "poll_interval": 0.2,
                "max_wait": 90.0,
                "retry_initial": 0.2,
                "retry_max": 1.0,
                "max_staleness": 100,
                "max_rounds_ahead": 1,
                # These swarms test membership, leases, churn and exactly-once with workers that run ahead
                # of the master (bounded by max_rounds_ahead); the shipped overlap_steps (1: wait for the
                # answering global) is what test_diloco_streaming_swarm.py and the attack suite run.
                "overlap_steps": 0,
                "sync_ramp": False,
                "late_join_wait": 0.0,
                **distributed,
            }
        ),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def nested_distributed(flat: dict[str, Any]) -> dict[str, Any]:
    """The `distributed` section for settings given by their flat names (`min_deltas=2`, as the swarm
    tests pass them): each in its subsection (`rounds: {min_deltas: 2}`), so no run warns of old keys."""
    from speedtronic.config.distributed import MOVED

    nested: dict[str, Any] = {}
    for key, value in flat.items():
        if key in MOVED:
            section, name = MOVED[key]
            nested.setdefault(section, {})[name] = value
        else:
            nested[key] = value
    return nested


def supported(**fields: Any) -> dict[str, Any]:
    """The `distributed` settings among `fields` that this tree's config schema has (a setting that a
    branch adds, such as a lease time, is passed once it exists and left out before)."""
    from speedtronic.config.distributed import MOVED
    from speedtronic.config.schema import DistributedConfig

    return {k: v for k, v in fields.items() if k in MOVED or k in DistributedConfig.model_fields}


def wait_until(condition: Callable[[], Any], timeout: float = 240, what: str = "", every: float = 0.1) -> Any:
    """Poll `condition` until it is truthy (returned) or `timeout` seconds pass (AssertionError)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)


def holds_flock(pid: int, path: Path) -> bool:
    """Whether process `pid` holds a flock on `path` (read from /proc/locks: "N: FLOCK ADVISORY WRITE
    <pid> <maj>:<min>:<inode> ...")."""
    try:
        inode = path.stat().st_ino
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        parts = line.split()
        if (
            len(parts) >= 6
            and parts[1] == "FLOCK"
            and parts[4] == str(pid)
            and parts[5].endswith(f":{inode}")
        ):
            return True
    return False


def suspend_outside_flock(proc: subprocess.Popen[bytes], lock: Path, tries: int = 200) -> None:
    """SIGSTOP `proc` at a moment it does not hold the directory bus's run lock. Suspended inside it
    (a lease renewal takes it every ttl/3), the process would block every other process's lease and
    publish until resumed: that is what a frozen lock holder does, not what a test of a frozen *worker*
    means to show."""
    for _ in range(tries):
        proc.send_signal(signal.SIGSTOP)
        if not holds_flock(proc.pid, lock):
            return
        proc.send_signal(signal.SIGCONT)
        time.sleep(0.05)
    raise AssertionError(f"process {proc.pid} held {lock} at each of {tries} tries")


def delta_ids(paths: Iterable[str]) -> set[str]:
    """ "node/name" of the delta files among bus paths `…/deltas/<node>/<node>--<seq>.safetensors`."""
    out = set()
    for path in paths:
        parts = path.split("/")
        match = DELTA_RE.match(parts[-1])
        if match and len(parts) >= 3 and parts[-3] == "deltas" and parts[-2] == match["node"]:
            out.add(f"{parts[-2]}/{parts[-1]}")
    return out


def hub_delta_ids(server: Any, history: bool = False) -> set[str]:
    """Delta ids in every repo of the loopback Hub: at the head, or (`history`) in any commit ever —
    exact, even for a delta deleted right after it landed."""
    with server.state.lock:
        repos = list(server.state.repos.values())
        snapshots = [files for r in repos for _, files in (r.commits if history else r.commits[-1:])]
        return delta_ids(path for files in snapshots for path in files)


def _seq(delta_id: str) -> int:
    match = DELTA_RE.match(delta_id.split("/")[-1])
    return int(match["seq"]) if match else -1


@dataclass
class Life:
    """One process: a node's life from start to exit."""

    name: str  # unique per life: the log files' stem ("w1", "w1.2")
    node: str  # the node id it runs as ("master" for a master)
    role: str  # "master" | "worker"
    args: tuple[str, ...]  # after `python`: `-m speedtronic ROLE CONFIG …`
    env: dict[str, str]
    proc: subprocess.Popen[bytes]
    started: float
    killed_at: float | None = None
    rc: int | None = None
    ended: float | None = None  # seconds into the run it was first seen exited (the watcher)


class Procs:
    """Bare `python -m speedtronic` processes with their output in `<name>.out` / `<name>.err`: for tests
    that drive processes by hand (the older tests' interface; `Swarm` builds on the same environment)."""

    def __init__(self, tmp_path: Path, base_env: dict[str, str] | None = None) -> None:
        self.tmp_path = tmp_path
        self.base_env = base_env or {}
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(
        self, name: str, *args: object, env: dict[str, str] | None = None, ranks: int = 1
    ) -> subprocess.Popen[bytes]:
        child = child_env(self.tmp_path, name, {**self.base_env, **(env or {})})
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
        with (
            open(self.tmp_path / f"{name}.out", "ab") as out,
            open(self.tmp_path / f"{name}.err", "ab") as err,
        ):
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
        assert rc == 0, f"{name} exited {rc}:\n{self.log(name)[-4000:]}"
        lines = (self.tmp_path / f"{name}.out").read_text().strip().splitlines()
        return json.loads(lines[-1])

    def log(self, name: str) -> str:
        return (self.tmp_path / f"{name}.err").read_text(errors="replace")

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def child_env(tmp_path: Path, name: str, extra: dict[str, str]) -> dict[str, str]:
    """A child's environment: no HF token of ours, this tree on the path, its own HF_HOME, wide logs."""
    child = {k: v for k, v in os.environ.items() if k not in TOKEN_VARIABLES}
    child.update(PYTHONPATH=str(SRC_DIR), HF_HOME=str(tmp_path / f"hf-{name}"), COLUMNS="1000")
    child.update(extra)
    return child


@dataclass
class Report:
    """What the run did, per delta id ("node/name") and per node."""

    sent: dict[str, list[str]]  # node -> ids its exited lives reported uploaded (`--json` summaries)
    seen: dict[str, float]  # id -> seconds into the run the watcher first saw it on the bus
    applied: list[str]  # the final master's applied ids, in order, duplicates kept
    rejected: list[dict[str, str]]  # [{id, reason}]
    remaining: list[str]  # ids on the bus at the end
    killed: dict[str, int]  # node -> SIGKILLed lives (their uploads are known from the bus only)
    extra: set[str] = field(default_factory=set)  # ids the test itself put on the bus
    master: dict[str, Any] = field(default_factory=dict)  # the final master's summary
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)  # life -> its summary
    rounds: list[tuple[int, float]] = field(default_factory=list)  # (outer step, seconds into the run)
    watch_exact: bool = False  # `seen` holds every delta ever on the bus (the loopback Hub's commits)
    # Ids that two processes running at the same time both reported uploaded: one overwrote the other.
    clashes: list[str] = field(default_factory=list)

    @property
    def all_sent(self) -> set[str]:
        return {i for ids in self.sent.values() for i in ids}

    @property
    def duplicates(self) -> list[str]:
        return sorted(i for i, n in Counter(self.applied).items() if n > 1)

    @property
    def rejected_ids(self) -> set[str]:
        return {r["id"] for r in self.rejected}

    @property
    def lost(self) -> list[str]:
        """Sent or seen, but neither applied, rejected nor left on the bus."""
        known = self.all_sent | set(self.seen) | self.extra
        return sorted(known - set(self.applied) - self.rejected_ids - set(self.remaining))

    @property
    def unexplained(self) -> list[str]:
        """Applied, though no life reported it and the watcher never saw it, from a node never killed."""
        known = self.all_sent | set(self.seen) | self.extra
        return sorted(i for i in set(self.applied) - known if self.killed.get(i.split("/")[0], 0) == 0)

    @property
    def left_valid(self) -> list[str]:
        """Still on the bus at the end, neither applied nor rejected: valid work nobody processed. (An
        applied delta in a collaborator's own repo stays until that worker's next upload prunes it.)"""
        return sorted(set(self.remaining) - self.rejected_ids - set(self.applied))

    def nodes(self) -> dict[str, dict[str, int]]:
        rows: dict[str, dict[str, int]] = {}

        def row(delta_id: str) -> dict[str, int]:
            return rows.setdefault(
                delta_id.split("/")[0], {"sent": 0, "seen": 0, "applied": 0, "rejected": 0, "left": 0}
            )

        for i in self.all_sent:
            row(i)["sent"] += 1
        for i in self.seen:
            row(i)["seen"] += 1
        for i in self.applied:
            row(i)["applied"] += 1
        for i in self.rejected_ids:
            row(i)["rejected"] += 1
        for i in self.remaining:
            row(i)["left"] += 1
        return dict(sorted(rows.items()))

    def lists(self) -> str:
        """Every list, in full: what an exactly-once failure prints."""
        return "\n".join(
            [
                f"sent (reported by exited lives): {sorted(self.all_sent)}",
                f"seen on the bus: {sorted(self.seen)}",
                f"applied ({len(self.applied)}): {self.applied}",
                f"rejected: {self.rejected}",
                f"remaining on the bus: {self.remaining} (neither applied nor rejected: {self.left_valid})",
                f"duplicates applied: {self.duplicates}",
                f"lost (sent or seen, not applied/rejected/remaining): {self.lost}",
                f"applied but sent by no one: {self.unexplained}",
                f"SIGKILLed lives per node: {self.killed}",
                f"one name, two processes at once: {self.clashes}",
            ]
        )

    def table(self) -> str:
        lines = ["node            sent  seen  applied  rejected  left"]
        for node, r in self.nodes().items():
            lines.append(
                f"{node:<14} {r['sent']:>5} {r['seen']:>5} {r['applied']:>8} {r['rejected']:>9} "
                f"{r['left']:>5}"
            )
        lines.append(
            f"total: sent {len(self.all_sent)}, seen {len(self.seen)}, applied {len(self.applied)}, "
            f"rejected {len(self.rejected)}, left {len(self.remaining)} ({len(self.left_valid)} valid), "
            f"duplicates applied {len(self.duplicates)}"
        )
        return "\n".join(lines)


def assert_exactly_once(report: Report, *, allow_left: bool = True) -> None:
    """Every delta exactly once: none applied twice; every one sent (or seen on the bus) applied,
    rejected with a reason, or still on the bus; none applied that no one sent. `allow_left=False`
    also refuses valid deltas left unprocessed on the bus."""
    problems = []
    if report.duplicates:
        problems.append(f"applied more than once: {report.duplicates}")
    if report.lost:
        problems.append(f"lost: {report.lost}")
    if report.unexplained:
        problems.append(f"applied, sent by no one: {report.unexplained}")
    if report.clashes:
        problems.append(f"uploaded under one name by two processes at once: {report.clashes}")
    missing = report.all_sent - set(report.seen)
    if missing and report.watch_exact:  # the directory watcher polls: a quickly processed file may slip by
        problems.append(f"reported uploaded but never on the bus: {sorted(missing)}")
    no_reason = [r for r in report.rejected if not str(r.get("reason") or "").strip()]
    if no_reason:
        problems.append(f"rejected without a reason: {no_reason}")
    if not allow_left and report.left_valid:
        problems.append(f"valid deltas left unprocessed on the bus: {report.left_valid}")
    assert not problems, "exactly-once violated: " + "; ".join(problems) + "\n" + report.lists()


class Swarm:
    """Real `speedtronic` processes on one bus, with a watcher on the bus.

    bus="directory": `file://<tmp>/bus`. bus="hub": the loopback Hub (owns the server unless one is
    given), run repo `owner/<run>`, each worker node its own Hub user (its node id) and token.
    """

    def __init__(
        self,
        tmp_path: Path,
        bus: str = "directory",
        *,
        server: Any = None,
        run: str = "dl-run",
        env: dict[str, str] | None = None,
        watch_every: float = 0.01,
        repo: str | None = None,
        list_ids: Callable[[], set[str]] | None = None,
        read_head: Callable[[], dict[str, Any] | None] | None = None,
    ) -> None:
        self.tmp_path = tmp_path
        self.kind = bus
        self.base_env = dict(env or {})
        self.lives: dict[str, Life] = {}
        self.lock = threading.Lock()
        self.t0 = time.monotonic()
        self.seen: dict[str, float] = {}
        self.rounds: list[tuple[int, float]] = []
        self.server = None
        self._own_server = False
        if bus == "directory":
            self.bus_dir = tmp_path / "bus"
            self.repo = f"file://{self.bus_dir}"
        elif bus == "hub":
            from hub_server import HubServer

            self.server = server or HubServer()
            self._own_server = server is None
            self.server.state.add_user(OWNER, token(OWNER))
            self.repo = f"{OWNER}/{run}"
            self.base_env.update(HF_HUB_DISABLE_XET="1", HF_ENDPOINT=self.server.url)
        elif bus == "other":  # any other bus (S3): the test says how to list it and read its head
            assert repo and list_ids and read_head, "bus='other' needs repo, list_ids and read_head"
            self.repo = repo
        else:
            raise ValueError(f"bus {bus!r}: directory, hub or other")
        self._list_ids, self._read_head = list_ids, read_head
        self._stop = threading.Event()
        self._watch_every = watch_every
        self._watcher = threading.Thread(target=self._watch, name="swarm-watcher", daemon=True)
        self._watcher.start()

    # -- the bus as this test sees it (never through the processes) ------------------------------
    def delta_files(self) -> set[str]:
        """Ids of the delta files on the bus now."""
        found = set()
        if self._list_ids is not None:
            return set(self._list_ids())
        if self.server is None:
            root = self.bus_dir / "deltas"
            try:
                with os.scandir(root) as nodes:
                    for node in nodes:
                        if not node.is_dir(follow_symlinks=False):
                            continue
                        try:
                            with os.scandir(node.path) as files:
                                found.update(
                                    f"{node.name}/{f.name}"
                                    for f in files
                                    if DELTA_RE.match(f.name) and f.is_file(follow_symlinks=False)
                                )
                        except OSError:
                            continue
            except OSError:
                pass
            return found
        return hub_delta_ids(self.server)

    def head(self) -> dict[str, Any] | None:
        """The run's head.json, or None before the first publish."""
        if self._read_head is not None:
            return self._read_head()
        try:
            if self.server is None:
                return json.loads((self.bus_dir / "head.json").read_text())
            with self.server.state.lock:
                repo = self.server.state.repos.get(self.repo)
                data = repo.head[1].get("head.json") if repo is not None and repo.commits else None
            return json.loads(data) if data else None
        except (OSError, ValueError):
            return None

    def outer_step(self) -> int:
        head = self.head()
        return int(head["outer_step"]) if head else -1

    def hwm(self, node: str) -> int:
        head = self.head() or {}
        return int((head.get("hwm") or {}).get(node, -1))

    def _watch(self) -> None:
        last = None
        while not self._stop.is_set():
            now = time.monotonic() - self.t0
            # On the loopback Hub: every file any commit ever held, exact even for deltas deleted at once.
            ids = self.delta_files() if self.server is None else hub_delta_ids(self.server, history=True)
            step = self.outer_step()
            with self.lock:
                lives = list(self.lives.values())
            for life in lives:
                if life.ended is None and life.proc.poll() is not None:
                    life.ended = now
            with self.lock:
                for i in ids:
                    self.seen.setdefault(i, now)
                if step != last and step >= 0:
                    self.rounds.append((step, now))
                    last = step
            self._stop.wait(self._watch_every if self.server is None else max(0.05, self._watch_every))

    # -- the run ---------------------------------------------------------------------------------
    def cli(self, *args: object, user: str = OWNER) -> dict[str, Any]:
        """`speedtronic ARGS --json` in this process (`hub init`, `hub add-collaborator`, `hub status`)."""
        from typer.testing import CliRunner

        from speedtronic.cli.app import build_app

        argv = [*map(str, args), "--json"]
        env = {}
        if self.server is not None:
            argv += ["--endpoint", self.server.url]
            env = {"HF_TOKEN": token(user), "HF_HUB_DISABLE_XET": "1"}
        result = CliRunner().invoke(build_app(with_plugins=False), argv, env=env)
        assert result.exit_code == 0, (
            f"speedtronic {' '.join(argv)} exited {result.exit_code}: {result.output}"
        )
        return json.loads(result.stdout.strip().splitlines()[-1])

    def init(self, config: Path, collaborators: Iterable[str] = (), **flags: bool) -> None:
        """`hub init` the run (gated on the Hub) and `hub add-collaborator` each node."""
        extra = ["--gated"] if self.server is not None and flags.get("gated", True) else []
        self.cli("hub", "init", self.repo, "--config", config, *extra)
        for node in collaborators:
            self.add_collaborator(node)

    def add_collaborator(self, node: str) -> dict[str, Any]:
        """`hub add-collaborator REPO NODE` (works while the run is going: a manifest edit)."""
        if self.server is not None:
            self.server.state.add_user(node, token(node))
        return self.cli("hub", "add-collaborator", self.repo, node)

    def _env(self, node: str, role: str, env: dict[str, str] | None) -> dict[str, str]:
        extra = dict(self.base_env)
        if self.server is not None:
            extra["HF_TOKEN"] = token(OWNER if role == "master" else node)
        return child_env(self.tmp_path, node, {**extra, **(env or {})})

    def _life_name(self, base: str) -> str:
        if base not in self.lives:
            return base
        n = 2
        while f"{base}.{n}" in self.lives:
            n += 1
        return f"{base}.{n}"

    def start(
        self,
        role: str,
        config: Path,
        *args: object,
        node: str | None = None,
        name: str | None = None,
        env: dict[str, str] | None = None,
        ranks: int = 1,
    ) -> Life:
        """Start `speedtronic ROLE CONFIG --repo REPO [--node-id NODE] ARGS --json`."""
        node = node or ("master" if role == "master" else "")
        assert node, "a worker needs a node id"
        life = self._life_name(name or node)
        argv = [role, str(config), "--repo", self.repo, *(["--node-id", node] if role == "worker" else [])]
        argv += [*map(str, args), "--json"]
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
        command = (*(launcher if ranks > 1 else []), "-m", "speedtronic", *argv)
        proc = self._popen(life, node, role, command, env or {})
        with self.lock:
            self.lives[life] = Life(life, node, role, command, env or {}, proc, time.monotonic() - self.t0)
        return self.lives[life]

    def master(self, config: Path, *args: object, name: str = "master", **kw: Any) -> Life:
        return self.start("master", config, *args, name=name, **kw)

    def worker(self, config: Path, node: str, *args: object, name: str | None = None, **kw: Any) -> Life:
        return self.start("worker", config, *args, node=node, name=name, **kw)

    def kill(self, life: str | Life) -> Life:
        """SIGKILL one process and reap it."""
        life = self._get(life)
        if life.proc.poll() is None:
            life.proc.send_signal(signal.SIGKILL)
        life.rc = life.proc.wait()
        life.killed_at = time.monotonic() - self.t0
        life.ended = life.ended if life.ended is not None else life.killed_at
        return life

    def restart(self, life: str | Life, name: str | None = None, until_accepted: float = 0.0) -> Life:
        """The same node again (same id, same output directory: it resumes from its checkpoint).

        `until_accepted` > 0 (a worker): where the dead process's node-id lease still holds the id
        (exit 2 naming --node-id, until the lease expires), start it again until one is accepted —
        it logs that it joined the run — within that many seconds."""
        old = self._get(life)
        assert old.proc.poll() is not None, f"{old.name} is still running"
        deadline = time.monotonic() + until_accepted
        while True:
            new = self._life_name(name or old.node)
            proc = self._popen(new, old.node, old.role, old.args, old.env)
            fresh = Life(new, old.node, old.role, old.args, old.env, proc, time.monotonic() - self.t0)
            with self.lock:
                self.lives[new] = fresh
            if until_accepted <= 0 or old.role != "worker":
                return fresh
            joined = rf"DiLoCo node {re.escape(old.node)} on "

            def decided(life: Life = fresh, joined: str = joined) -> bool:
                return life.proc.poll() is not None or re.search(joined, self.log(life)) is not None

            wait_until(decided, max(1.0, deadline - time.monotonic()) + 240, f"{new} to join or be refused")
            if fresh.proc.poll() is None or fresh.proc.returncode != 2 or "--node-id" not in self.log(fresh):
                return fresh  # joined (or failed otherwise: the caller's assertions say so)
            fresh.rc = 2
            assert time.monotonic() < deadline, f"{old.node} still refused after {until_accepted:.0f}s"
            time.sleep(1.0)  # the lease's holder is dead: try again once it may have expired

    def _popen(
        self, life: str, node: str, role: str, args: tuple[str, ...], env: dict[str, str]
    ) -> subprocess.Popen[bytes]:
        out = open(self.tmp_path / f"{life}.out", "ab")  # noqa: SIM115 - the child holds it
        err = open(self.tmp_path / f"{life}.err", "ab")  # noqa: SIM115
        try:
            return subprocess.Popen(
                [sys.executable, *args],
                cwd=self.tmp_path,
                env=self._env(node, role, env),
                stdout=out,
                stderr=err,
            )
        finally:
            out.close()
            err.close()

    def _get(self, life: str | Life) -> Life:
        return life if isinstance(life, Life) else self.lives[life]

    def log(self, life: str | Life) -> str:
        return (self.tmp_path / f"{self._get(life).name}.err").read_text(errors="replace")

    def wait_log(self, life: str | Life, pattern: str, timeout: float = 240) -> re.Match[str]:
        """Wait for a line matching `pattern` in a life's log (fails early if it exits without one)."""
        life = self._get(life)

        def found() -> re.Match[str] | None:
            match = re.search(pattern, self.log(life))
            if match is None and life.proc.poll() is not None:
                match = re.search(pattern, self.log(life))  # written just before the exit
                assert match, (
                    f"{life.name} exited {life.proc.returncode} without /{pattern}/:\n"
                    + self.log(life)[-3000:]
                )
            return match

        return wait_until(found, timeout, f"/{pattern}/ in {life.name}'s log")

    def wait_exit(self, life: str | Life, timeout: float = 600) -> int:
        life = self._get(life)
        try:
            life.rc = life.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{life.name} still running after {timeout:.0f}s:\n{self.log(life)[-3000:]}"
            ) from None
        return life.rc

    def result(self, life: str | Life, timeout: float = 600) -> dict[str, Any]:
        """Wait for a life to exit 0 and return its `--json` summary."""
        life = self._get(life)
        rc = self.wait_exit(life, timeout)
        assert rc == 0, f"{life.name} exited {rc}:\n{self.log(life)[-4000:]}"
        lines = (self.tmp_path / f"{life.name}.out").read_text().strip().splitlines()
        assert lines, f"{life.name} printed no summary:\n{self.log(life)[-3000:]}"
        return json.loads(lines[-1])

    def summaries(self, timeout: float = 600) -> dict[str, dict[str, Any]]:
        """The `--json` summary of every life that exited 0 (waits for each to exit)."""
        out = {}
        for name, life in self.lives.items():
            if life.killed_at is None and self.wait_exit(life, timeout) == 0:
                out[name] = self.result(life)
        return out

    def state_files(self) -> list[Path]:
        """Every master's saved state under the swarm's directory (one per state directory)."""
        return sorted(self.tmp_path.glob("**/diloco-master/master_state.safetensors"))

    def state(self, path: Path | None = None) -> dict[str, Any]:
        """A master's saved state (master_state.safetensors metadata: applied, rejected, hwm, …), what
        survives its SIGKILL; `path` defaults to the only one there is."""
        from safetensors import safe_open

        if path is None:
            paths = self.state_files()
            assert len(paths) == 1, f"expected one master state under {self.tmp_path}: {paths}"
            path = paths[0]
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
        out: dict[str, Any] = {k: json.loads(v) for k, v in meta.items() if k != "format"}
        out["state"] = str(path)
        return out

    def report(self, master: str | Life, extra: Iterable[str] = (), timeout: float = 600) -> Report:
        """The run's report; `master` names the life whose summary is final (the last master). A
        master that was SIGKILLed last is read from its saved state instead."""
        summaries = self.summaries(timeout)
        final = self._get(master).name
        if final not in summaries:
            assert self._get(final).killed_at is not None, f"{final} exited {self._get(final).rc}"
            summaries[final] = self.state()  # the only master: SIGKILLed last
        time.sleep(3 * self._watch_every)  # the watcher's last look
        sent: dict[str, list[str]] = {}
        workers = {}
        for name, s in summaries.items():
            life = self.lives[name]
            w = s if life.role == "worker" else s.get("worker")
            if w and life.role in ("worker", "master"):
                workers[name] = w
                sent.setdefault(w["node"], []).extend(f"{w['node']}/{n}" for n in w["uploaded"])
        killed = Counter(life.node for life in self.lives.values() if life.killed_at is not None)
        by_id: dict[str, list[Life]] = {}
        for name, w in workers.items():
            for n in w["uploaded"]:
                by_id.setdefault(f"{w['node']}/{n}", []).append(self.lives[name])
        # A restarted life reports what its checkpoint restored from the previous one: only lives that
        # ran at the same time clash.
        clashes = sorted(
            i
            for i, lives in by_id.items()
            if any(
                a.started < (b.ended or float("inf")) and b.started < (a.ended or float("inf"))
                for a, b in itertools.combinations(lives, 2)
            )
        )
        with self.lock:
            seen, rounds = dict(self.seen), list(self.rounds)
        m = summaries[final]
        applied, rejected = list(m["applied"]), list(m["rejected"])
        # Another master's state (a second master, a standby with its own state directory): what it
        # applied counts too, unless the final master resumed from it (its history starts with it).
        # A standby that took over says at which marks (`took_over.hwm`): what the dead master applied
        # past them never reached the bus (killed before it published), and the standby applied it.
        marks = (m.get("took_over") or {}).get("hwm")
        for path in self.state_files():
            if str(path) == str(m.get("state")):
                continue
            other = self.state(path)
            if applied[: len(other["applied"])] == other["applied"]:
                continue
            theirs = other["applied"]
            if isinstance(marks, dict):
                theirs = [i for i in theirs if _seq(i) <= int(marks.get(i.split("/")[0], -1))]
            applied = theirs + applied
            rejected = other["rejected"] + rejected
        return Report(
            sent=sent,
            seen=seen,
            applied=applied,
            rejected=rejected,
            remaining=sorted(self.delta_files()),
            killed=dict(killed),
            extra=set(extra),
            master=m,
            workers=workers,
            rounds=rounds,
            watch_exact=self.server is not None,
            clashes=clashes,
        )

    def close(self) -> None:
        """Kill what still runs, stop the watcher (and the server this swarm started)."""
        for life in self.lives.values():
            if life.proc.poll() is None:
                life.proc.kill()
                life.proc.wait()
        self._stop.set()
        self._watcher.join(5)
        if self._own_server and self.server is not None:
            self.server.stop()


def round_figures(swarm: Swarm, report: Report) -> dict[str, Any]:
    """How long rounds waited, against how long the nodes take per round.

    A round's wait: from the moment it could start (the previous global published and one of its
    deltas on the bus) to its own publish; rounds during which a master was down are left out. Which
    deltas made a round comes from the masters' logs ("outer step N from ID, ID"); times from the
    watcher. A node's round time: the median gap between its consecutive deltas' arrivals (a gap
    across its own SIGKILL left out)."""
    published: dict[int, float] = {}
    for step, t in report.rounds:
        published.setdefault(step, t)
    members: dict[int, list[str]] = {}
    downs: list[tuple[float, float]] = []
    masters = [life for life in swarm.lives.values() if life.role == "master"]
    for life in masters:
        for match in re.finditer(r"outer step (\d+) from (\S+(?:, \S+)*)", swarm.log(life)):
            members.setdefault(int(match[1]), [i.rstrip(",") for i in match[2].split(", ")])
        if life.killed_at is not None:
            later = [m.started for m in masters if m.started >= life.killed_at]
            downs.append((life.killed_at, min(later) if later else float("inf")))
    waits: dict[int, float] = {}
    for step, ids in sorted(members.items()):
        if step not in published or step - 1 not in published:
            continue
        arrived = [report.seen[i] for i in ids if i in report.seen]
        start = max(published[step - 1], min(arrived) if arrived else published[step - 1])
        if any(a < published[step] and b > start for a, b in downs):
            continue  # a master was down (or starting again) during this round
        waits[step] = published[step] - start
    per_node: dict[str, list[float]] = {}
    for delta_id, t in report.seen.items():
        per_node.setdefault(delta_id.split("/")[0], []).append(t)
    node_round: dict[str, float] = {}
    for node, times in per_node.items():
        times.sort()
        kills = [life.killed_at for life in swarm.lives.values() if life.node == node and life.killed_at]
        # A gap across the node's own SIGKILL is its restart, not its round time.
        gaps = sorted(b - a for a, b in itertools.pairwise(times) if not any(a < k < b for k in kills))
        if gaps:
            node_round[node] = gaps[len(gaps) // 2]
    longest = max(waits.items(), key=lambda kv: kv[1]) if waits else (None, 0.0)
    slowest = max(node_round.items(), key=lambda kv: kv[1]) if node_round else (None, 0.0)
    return {
        "waits": waits,
        "longest_wait": longest[1],
        "longest_wait_round": longest[0],
        "node_round_s": node_round,
        "slowest_node": slowest[0],
        "slowest_round_s": slowest[1],
    }
