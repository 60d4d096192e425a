"""Issue 36's chaos soak: a DiLoCo swarm under a fault on a schedule, against its fault-free twin.

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/chaos.py [--minutes 30] [--every 30] [--workers 8] \
        [--bus file|s3|hub] [--seed 0] [--out DIR] [--json] [--no-twin] [--twin-after]

The method and where it stands: docs/guides/chaos.md; every run so far: docs/guides/chaos-history.md.
In short: a master (`master --no-train`: it evaluates every global), a hot standby (`master --standby`) and N workers paced by bench/_paced.py to
one step per `--step-s` (well under a process's CPU share), real processes on a directory, S3 (moto on
127.0.0.1, bench/_servers.py) or the loopback Hub (tests/hub_server.py), for `--minutes`. From
`--every` seconds after the first outer step, a fault every `--every` seconds, drawn (seeded) from a
shuffled deck holding each kind once:

  kill_worker   kill -9 of a worker, restarted after --restart-delay (same id and directory: it resumes;
                again until its node lease lets it in)
  kill_master   kill -9 of the active master: the standby takes over when the lease lapses
  stop_worker   SIGSTOP of a worker for its node lease + 5 s, then SIGCONT (it goes on if nobody took its
                id meanwhile, else it stops and the supervisor starts it again)
  stop_master   SIGSTOP of the active master for its lease + 5 s, then SIGCONT: it must be fenced
  bus_down      --outage-s without the bus: S3/Hub refusing connections; a directory remounted read-only
  storm         --outage-s of every other request answered 429 or 500 (S3, Hub)
  join          a new worker id joins
  leave         a worker leaves for good (SIGTERM)

A supervisor (systemd's Restart=on-failure) starts again a worker that exited on its own (listed in
`unplanned_exits`) and keeps a master and a standby. A process is stopped at a moment it does not hold
the directory bus's lock (a frozen lock holder blocks every process on the bus: another fault).

The fault-free twin runs beside the soak (same length, same settings, its own bus; `--twin-after`: after
it). Reported, from the bus (a watcher reads head.json every 0.2 s and lists the deltas), the masters'
logs and the workers' `--json` summaries: goodput retained (tokens in applied deltas by the window's
end, against the twin's), the final global val loss against the twin's and its largest rise between
evaluations, exactly-once (every delta id sent or seen is in one published round, rejected with a
reason, or left on the bus), failover times, each joiner's first step (and process start) → first applied delta, and the
timeline (`<out>/chaos.json`, `<out>/chaos.png`). At the window's end workers get SIGTERM, the master
drains the bus (up to 90 s), then the masters get SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import itertools
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
sys.path.insert(0, str(HERE))
from _servers import DirectoryBus, HubBus, S3Bus, open_bus  # noqa: E402

SCORE_BATCHES = 256  # validation batches each arm's final global is scored on (32K tokens at the soak's size)
TEXT = HERE.parents[2] / "shared" / "data" / "tinyshakespeare.txt"
OPEN: list[tuple[Any, Any]] = []  # (swarm, bus) of the soaks running: SIGTERM closes them all
KINDS = ("kill_worker", "kill_master", "stop_worker", "stop_master", "bus_down", "storm", "join", "leave")
Bus = DirectoryBus | S3Bus | HubBus


@dataclass
class Settings:
    minutes: float
    every: float
    workers: int
    bus: str
    seed: int
    out: Path
    step_s: float
    inner_steps: int
    restart_delay: float
    outage_s: float
    node_lease_s: float
    master_lease_s: float
    twin: bool
    drain_s: float = 90.0
    global_wait: float | None = None  # distributed.worker.global_wait (None: the shipped max_wait)
    kinds: tuple[str, ...] = KINDS  # the faults drawn (--kinds): all of them by default
    # distributed.bus.hub_commit_budget / hub_request_budget (None: the shipped 128 commits an hour per
    # repo, 1,000 requests per 5 minutes): raised, the loopback Hub runs at the soak's pace.
    hub_budget: int | None = None
    # data.val_batches of every node: the master's loss probe scores each delta on them. 16 batches of
    # 4 x 32 = 2,048 tokens, the probe's minimum (diloco/master/checks.py PROBE_MIN_TOKENS); the soaks
    # before 2026-12-07 ran 2 (256 tokens), where noise alone weighed 11-15% of honest deltas 0.
    val_batches: int = 16


def max_steps(s: Settings) -> int:
    """run.max_steps of every node: three times what a worker at `step_s` trains in the window (never
    reached), a multiple of inner_steps. It also sets the LR schedule's length and warm-up (5% of it)."""
    return int(s.minutes * 60 / s.step_s * 3) // s.inner_steps * s.inner_steps


def write_config(folder: Path, s: Settings) -> Path:
    steps = max_steps(s)
    cfg = {
        "run": {"name": "chaos", "max_steps": steps, "log_every": 50, "eval_every": 0, "device": "cpu"},
        "model": {"n_layer": 1, "n_head": 2, "d_model": 32},
        "data": {"block_size": 32, "micro_batch_size": 4, "val_batches": s.val_batches}
        | ({"text_path": str(TEXT)} if TEXT.exists() else {}),
        "optimizer": {"lr": 3.0e-3},
        "checkpoint": {"every_steps": s.inner_steps * 2, "keep_last": 2},
        "logging": {"hooks": []},
        "distributed": {
            "enabled": True,
            "sync": {"inner_steps": s.inner_steps, "ramp": False},
            "node": {"poll_interval": 0.5, "lease_s": s.node_lease_s},
            "rounds": {"max_wait": 120.0, "initial_grace": 10.0, "late_join_wait": 0.0},
            "bus": {"retry_initial": 0.5, "retry_max": 5.0, "request_timeout": 10.0} | _hub_budgets(s),
            "worker": {"max_rounds_ahead": 1}
            | ({"global_wait": s.global_wait} if s.global_wait is not None else {}),
            "master": {"lease_s": s.master_lease_s, "trains": False},
        },
    }
    path = folder / "chaos.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def _hub_budgets(s: Settings) -> dict[str, int]:
    """The Hub's commit and request budgets the nodes plan within (`--hub-budget`), where raised."""
    if s.hub_budget is None:
        return {}
    return {"hub_commit_budget": s.hub_budget, "hub_request_budget": s.hub_budget}


# -- processes -------------------------------------------------------------------------------------


@dataclass
class Life:
    name: str  # unique per life: its log files' stem
    node: str  # worker id, or the master's slot ("ma" / "mb")
    role: str  # "master" | "worker"
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes]
    started: float
    ended: float | None = None
    killed: bool = False
    termed: bool = False
    stopped: bool = False
    refused: bool = False  # a start refused while the id's lease was held (exit 2)


class Swarm:
    """The run's processes: start, kill, stop, restart, and their logs."""

    def __init__(self, s: Settings, bus: Bus, folder: Path, t0: float) -> None:
        self.s, self.bus, self.folder, self.t0 = s, bus, folder, t0
        self.cfg = write_config(folder, s)
        self.lives: dict[str, Life] = {}
        self.lock = threading.Lock()
        self.logs = folder / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.closed = False

    def now(self) -> float:
        return time.time() - self.t0

    def _env(self, node: str, role: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
        env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
        env.update(COLUMNS="1000", OMP_NUM_THREADS="1", HF_HOME=str(self.folder / f"hf-{node}"))
        env.update(self.bus.env(node, role))
        return env

    def _name(self, base: str) -> str:
        n = 1
        while (name := base if n == 1 else f"{base}.{n}") in self.lives:
            n += 1
        return name

    def start(self, role: str, node: str, *extra: str) -> Life:
        if self.closed:
            raise RuntimeError("the swarm is closed")
        out_dir = self.folder / "nodes" / node
        argv = [role, str(self.cfg), "--repo", self.bus.repo, "--set", f"run.output_dir={out_dir}"]
        argv += (["--node-id", node, *extra] if role == "worker" else ["--no-train", *extra]) + ["--json"]
        if isinstance(self.bus, (S3Bus, HubBus)):
            argv += ["--endpoint", self.bus.url]
        with self.lock:
            name = self._name(node)
            marker = self.logs / f"{name}.first_step"
            command = [sys.executable, str(HERE / "_paced.py"), "--step-s", str(self.s.step_s)]
            command += ["--first-step", str(marker), "--", *argv]
            env = self._env(node, role)
            with open(self.logs / f"{name}.out", "ab") as out, open(self.logs / f"{name}.err", "ab") as err:
                proc = subprocess.Popen(command, cwd=self.folder, env=env, stdout=out, stderr=err)
            life = Life(name, node, role, command, env, proc, self.now())
            self.lives[name] = life
        return life

    def log(self, life: Life) -> str:
        try:
            return (self.logs / f"{life.name}.err").read_text(errors="replace")
        except OSError:
            return ""

    def live(self, role: str) -> list[Life]:
        with self.lock:
            return [x for x in self.lives.values() if x.role == role and x.proc.poll() is None]

    def signal(self, life: Life, sig: int) -> None:
        if life.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                life.proc.send_signal(sig)

    def suspend(self, life: Life) -> None:
        """SIGSTOP, at a moment it does not hold the directory bus's lock (see the module docstring)."""
        lock = self.bus.root / ".bus.lock" if isinstance(self.bus, DirectoryBus) else None
        for _ in range(400):
            self.signal(life, signal.SIGSTOP)
            if lock is None or not holds_flock(life.proc.pid, lock):
                life.stopped = True
                return
            self.signal(life, signal.SIGCONT)
            time.sleep(0.05)
        raise RuntimeError(f"{life.name} held {lock} at each of 400 tries")

    def resume(self, life: Life) -> None:
        self.signal(life, signal.SIGCONT)
        life.stopped = False

    def kill(self, life: Life) -> None:
        life.killed = True
        self.signal(life, signal.SIGKILL)
        life.proc.wait()
        life.ended = self.now()

    def rejoin(self, node: str, timeout: float = 180.0) -> Life | None:
        """Start worker `node` again until one start is accepted (a dead life's node lease holds the id,
        exit 2 naming --node-id, until it lapses)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            life = self.start("worker", node)
            joined = re.compile(rf"DiLoCo node {re.escape(node)} on ")
            while life.proc.poll() is None and not joined.search(self.log(life)):
                time.sleep(0.2)
            if life.proc.poll() is None or life.proc.returncode != 2 or "--node-id" not in self.log(life):
                return life
            life.ended, life.refused = self.now(), True
            time.sleep(1.0)
        return None

    def close(self) -> None:
        self.closed = True
        for life in list(self.lives.values()):
            self.signal(life, signal.SIGCONT)
            self.signal(life, signal.SIGKILL)
            life.proc.wait()


def holds_flock(pid: int, path: Path) -> bool:
    """Whether `pid` holds a flock on `path` (/proc/locks: "N: FLOCK ADVISORY WRITE <pid> maj:min:inode")."""
    try:
        inode = path.stat().st_ino
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return False
    return any(
        len(p) >= 6 and p[1] == "FLOCK" and p[4] == str(pid) and p[5].endswith(f":{inode}")
        for p in (line.split() for line in lines)
    )


# -- the watcher ---------------------------------------------------------------------------------------


@dataclass
class HeadSeen:
    t: float
    epoch: int
    outer_step: int
    tokens: int
    val_loss: float | None
    hwm: dict[str, int]
    claimed: int = 0  # what the applied deltas claimed: a folded or merged delta, all it carries


class Watcher:
    """head.json and the delta files, as the bench sees them (never through the processes)."""

    def __init__(self, bus: Bus, clock: Any, every: float = 0.2) -> None:
        self.bus, self.clock, self.every = bus, clock, every
        self.heads: list[HeadSeen] = []
        self.seen: dict[str, float] = {}
        self.load: list[float] = []  # the machine's 1-minute load average, sampled each look
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="chaos-watcher", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        last: tuple[int, int, int] | None = None
        while not self._stop.is_set():
            t = self.clock()
            raw = self.bus.read("head.json")
            head = _parse(raw)
            if head is not None:
                key = (int(head.get("epoch", 0)), int(head.get("outer_step", -1)), _tokens(head))
                if key != last:
                    last = key
                    status = head.get("status") or {}
                    loss = status.get("global_val_loss") if isinstance(status, dict) else None
                    hwm = {str(k): int(v) for k, v in (head.get("hwm") or {}).items()}
                    with self.lock:
                        seen = HeadSeen(
                            t, key[0], key[1], key[2], _float(loss), hwm, _tokens(head, "claimed")
                        )
                        self.heads.append(seen)
            ids = self.bus.delta_ids()
            with self.lock:
                self.load.append(os.getloadavg()[0])
                for i in ids:
                    self.seen.setdefault(i, t)
            self._stop.wait(self.every)

    def snapshot(self) -> tuple[list[HeadSeen], dict[str, float]]:
        with self.lock:
            return list(self.heads), dict(self.seen)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(10)


def _parse(raw: bytes | None) -> dict[str, Any] | None:
    if not raw:
        return None
    try:
        head = json.loads(raw)
    except ValueError:
        return None
    return head if isinstance(head, dict) else None


def _tokens(head: dict[str, Any], key: str = "tokens") -> int:
    """The tokens of the applied deltas: as the master bounds each one's weight ("tokens"), or as
    they claimed ("claimed": a delta that folded k rounds carries k rounds of training)."""
    nodes = head.get("nodes") or {}
    return sum(int(v.get(key) or 0) for v in nodes.values() if isinstance(v, dict))


def _float(value: Any) -> float | None:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


# -- the faults ------------------------------------------------------------------------------------------


@dataclass
class Fault:
    t: float
    kind: str
    target: str
    end: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)


class Chaos:
    """Draws and applies the faults; keeps a master and a standby running between them."""

    def __init__(self, swarm: Swarm, s: Settings, watcher: Watcher) -> None:
        self.swarm, self.s, self.watcher = swarm, s, watcher
        self.rng = random.Random(s.seed)
        self.kinds = [k for k in s.kinds if k != "storm" or swarm.bus.storms]
        self.deck: list[str] = []
        self.faults: list[Fault] = []
        self.threads: list[threading.Thread] = []
        self.joined = 0
        self.keeping = threading.Event()
        self.busy: set[str] = set()  # nodes a fault is acting on (stopped, waiting to restart)
        self.master_busy = threading.Lock()
        self.steady_at: float | None = None  # the first outer step: faults start `every` s later
        self.restarted: set[str] = set()  # worker lives the supervisor started again
        self.unplanned: list[dict[str, Any]] = []  # workers that exited on their own

    def draw(self) -> str:
        if not self.deck:
            self.deck = list(self.kinds)
            self.rng.shuffle(self.deck)
        return self.deck.pop()

    def active_master(self) -> Life | None:
        """The live master with the highest epoch it took over with (the first one until any did)."""
        best, best_epoch = None, -1
        for life in self.swarm.live("master"):
            epochs = [int(e) for e in re.findall(r"master epoch (\d+) at outer step", self.swarm.log(life))]
            epoch = max(epochs) if epochs else -1
            if epoch > best_epoch:
                best, best_epoch = life, epoch
        return best if best_epoch >= 0 else None

    def pick_worker(self) -> Life | None:
        lives = [x for x in self.swarm.live("worker") if x.node not in self.busy and not x.stopped]
        return self.rng.choice(sorted(lives, key=lambda x: x.name)) if lives else None

    def inject(self) -> None:
        kind = self.draw()
        t = self.swarm.now()
        act = getattr(self, f"_{kind}")
        fault = Fault(t, kind, "")
        self.faults.append(fault)
        thread = threading.Thread(target=self._guarded, args=(act, fault), name=f"fault-{kind}", daemon=True)
        self.threads.append(thread)
        thread.start()
        time.sleep(1.0)  # its target is chosen by then, mostly: the log line names it
        print(f"[{t:7.1f}s] {kind} {fault.target}", file=sys.stderr, flush=True)

    def _guarded(self, act: Any, fault: Fault) -> None:
        try:
            act(fault)
        except Exception as error:  # a fault that could not be applied is recorded, not fatal
            fault.detail["error"] = f"{type(error).__name__}: {error}"
        finally:
            if fault.end is None:
                fault.end = self.swarm.now()

    # each fault ----------------------------------------------------------------------------------------
    def _kill_worker(self, fault: Fault) -> None:
        life = self.pick_worker()
        if life is None:
            fault.detail["skipped"] = "no live worker"
            return
        fault.target = life.node
        self.busy.add(life.node)
        try:
            self.swarm.kill(life)
            time.sleep(self.s.restart_delay)
            fault.end = self.swarm.now()
            new = self.swarm.rejoin(life.node)
            fault.detail["restarted"] = new.name if new else None
            fault.detail["rejoined_at"] = round(self.swarm.now(), 2)
        finally:
            self.busy.discard(life.node)

    def _stop_worker(self, fault: Fault) -> None:
        life = self.pick_worker()
        if life is None:
            fault.detail["skipped"] = "no live worker"
            return
        fault.target = life.node
        self.busy.add(life.node)
        try:
            self.swarm.suspend(life)
            time.sleep(self.s.node_lease_s + 5)
            self.swarm.resume(life)
            resumed = self.swarm.now()
            # Past its lease it goes on only if nobody took its id meanwhile (diloco/identity.py: a late
            # renewal of a lease still its own); otherwise it stops, and the supervisor below starts it
            # again, as systemd's Restart=on-failure would. The worker is back (`back`, for
            # worker_capacity) when it resumed, or once it exited and the supervisor may restart it.
            with contextlib.suppress(subprocess.TimeoutExpired):
                fault.detail["exit"] = life.proc.wait(30)
            fault.detail["back"] = round(self.swarm.now() if "exit" in fault.detail else resumed, 2)
        finally:
            self.busy.discard(life.node)

    def _master_fault(self, fault: Fault, freeze: bool) -> None:
        with self.master_busy:
            life = self.active_master()
            standby = [x for x in self.swarm.live("master") if x is not life]
            if life is None or not standby:
                fault.detail["skipped"] = "no active master with a standby"
                return
            fault.target = life.name
            epoch = self.watcher_epoch()
            fault.detail["epoch_before"] = epoch
            fault.detail["acted_at"] = round(
                self.swarm.now(), 2
            )  # later than `t` if another held the masters
            if not freeze:
                self.swarm.kill(life)
            else:
                self.swarm.suspend(life)
                time.sleep(self.s.master_lease_s + 5)
            taken = self.wait_epoch_above(epoch, timeout=120, tick=lambda: self._standby_for(life))
            fault.detail["taken_over"] = taken
            if freeze:
                self.swarm.resume(life)
                try:
                    life.proc.wait(60)
                    fault.detail["old_master_exit"] = life.proc.returncode
                except subprocess.TimeoutExpired:
                    fault.detail["old_master_exit"] = None  # still running: not fenced
                life.ended = self.swarm.now()

    def _kill_master(self, fault: Fault) -> None:
        self._master_fault(fault, freeze=False)

    def _stop_master(self, fault: Fault) -> None:
        self._master_fault(fault, freeze=True)

    def _bus_down(self, fault: Fault) -> None:
        fault.target = self.swarm.bus.kind
        self.swarm.bus.down()
        try:
            time.sleep(self.s.outage_s)
        finally:
            self.swarm.bus.up()

    def _storm(self, fault: Fault) -> None:
        status = self.rng.choice((429, 500))
        fault.target, fault.detail["status"] = self.swarm.bus.kind, status
        self.swarm.bus.storm(status, self.s.outage_s)
        time.sleep(self.s.outage_s)

    def _join(self, fault: Fault) -> None:
        self.joined += 1
        node = f"j{self.joined}"
        fault.target = node
        if isinstance(self.swarm.bus, HubBus):
            add_collaborator(self.swarm, node)
        self.swarm.start("worker", node)

    def _leave(self, fault: Fault) -> None:
        life = self.pick_worker()
        if life is None:
            fault.detail["skipped"] = "no live worker"
            return
        fault.target = life.node
        self.busy.add(life.node)  # for good
        life.termed = True
        self.swarm.signal(life, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            fault.detail["exit"] = life.proc.wait(120)
        life.ended = self.swarm.now()

    # the masters -----------------------------------------------------------------------------------------
    def watcher_epoch(self) -> int:
        heads, _ = self.watcher.snapshot()
        return heads[-1].epoch if heads else 0

    def wait_epoch_above(
        self, epoch: int, timeout: float, tick: Callable[[], None] | None = None
    ) -> float | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.watcher_epoch() > epoch:
                return round(self.swarm.now(), 2)
            if tick is not None:
                tick()
            time.sleep(0.2)
        return None

    def _standby_for(self, life: Life) -> None:
        """While a master fault waits for the takeover (holding the masters, so `keep_masters` waits):
        when no other master process runs — the one taken for the standby was a fenced master on its way
        out, which the fault's check saw alive a moment before it exited — start one in the other slot,
        as systemd's Restart=on-failure would have restarted it, instead of waiting the fault's 120 s."""
        if any(x is not life for x in self.swarm.live("master")):
            return
        slot = "mb" if life.node == "ma" else "ma"
        lives = [x for x in list(self.swarm.lives.values()) if x.node == slot]
        if lives and lives[-1].ended is None:
            lives[-1].ended = self.swarm.now()
        self.swarm.start("master", slot, "--standby")

    def supervise(self) -> None:
        """What a process supervisor would do: a worker that exited on its own (not killed, not told to
        stop) is started again, and recorded (`unplanned_exits`); a master and a standby at all times."""
        while not self.keeping.wait(1.0):
            self.restart_workers()
            self.keep_masters()

    def restart_workers(self) -> None:
        for life in list(self.swarm.lives.values()):
            if (
                life.role != "worker"
                or life.killed
                or life.termed
                or life.refused
                or life.proc.poll() is None
            ):
                continue
            if life.node in self.busy or life.name in self.restarted:
                continue
            self.restarted.add(life.name)
            life.ended = life.ended if life.ended is not None else self.swarm.now()
            errors = [x for x in self.swarm.log(life).splitlines() if x.startswith("error:")]
            self.unplanned.append(
                {
                    "t": round(life.ended, 2),
                    "life": life.name,
                    "rc": life.proc.returncode,
                    "error": errors[-1][:300] if errors else None,
                }
            )
            self.busy.add(life.node)
            threading.Thread(target=self._restart, args=(life.node,), daemon=True).start()

    def _restart(self, node: str) -> None:
        try:
            self.swarm.rejoin(node)
        except RuntimeError:  # closed meanwhile
            pass
        finally:
            self.busy.discard(node)

    def keep_masters(self) -> None:
        """A master and a standby at all times: a slot whose process ended comes back as `--standby` once
        the run's epoch has moved past it (someone took over), or 60 s after it ended."""
        if not self.master_busy.acquire(blocking=False):
            return  # a master fault is under way: it decides
        try:
            live = {x.node for x in self.swarm.live("master")}
            for slot in ("ma", "mb"):
                if slot in live:
                    continue
                lives = list(self.swarm.lives.values())  # a copy: other threads add lives meanwhile
                last = [x for x in lives if x.node == slot][-1]
                ended = last.ended if last.ended is not None else self.swarm.now()
                if last.ended is None:
                    last.ended = ended
                moved = self.watcher_epoch() > self.life_epoch(last)
                if moved or self.swarm.now() - ended > 60:
                    self.swarm.start("master", slot, "--standby")
        finally:
            self.master_busy.release()

    def life_epoch(self, life: Life) -> int:
        epochs = [int(e) for e in re.findall(r"master epoch (\d+) at outer step", self.swarm.log(life))]
        return max(epochs) if epochs else 0


def _as_owner(bus: HubBus) -> None:
    """This process talks to the loopback Hub as the run's owner (a loopback token, never a real one)."""
    from _servers import OWNER, hub_token

    os.environ.update(HF_TOKEN=hub_token(OWNER), HF_HUB_DISABLE_XET="1", HF_HOME=str(bus.folder / "hf-bench"))


def add_collaborator(swarm: Swarm, node: str) -> None:
    """`hub add-collaborator` as the owner (in this process), and a Hub user for the node."""
    from speedtronic.diloco.launch import add_collaborator_to_run

    bus = swarm.bus
    assert isinstance(bus, HubBus)
    bus.add_user(node)
    _as_owner(bus)
    add_collaborator_to_run(bus.repo, node, None, None, bus.url)


def hub_init(swarm: Swarm, nodes: list[str]) -> None:
    """`hub init --gated` and each node listed, as the owner."""
    from speedtronic.diloco.launch import init_run

    bus = swarm.bus
    assert isinstance(bus, HubBus)
    _as_owner(bus)
    init_run(bus.repo, swarm.cfg, None, bus.url, False, True)
    for node in nodes:
        add_collaborator(swarm, node)


# -- one soak ----------------------------------------------------------------------------------------------


def soak(s: Settings, folder: Path, faults: bool) -> dict[str, Any]:
    """One run of `s.minutes` (with faults or the twin without); its figures."""
    folder.mkdir(parents=True, exist_ok=True)
    window = s.minutes * 60
    bus = open_bus(s.bus, folder)
    t0 = time.time()
    swarm = Swarm(s, bus, folder, t0)
    OPEN.append((swarm, bus))
    watcher = Watcher(bus, swarm.now)
    chaos = Chaos(swarm, s, watcher)
    try:
        workers = [f"w{i}" for i in range(s.workers)]
        if isinstance(bus, HubBus):
            hub_init(swarm, workers)
        # The standby once the first master holds the run (on the Hub `hub init` published the first
        # global already: a standby started at once could claim the lease before it).
        start_master(swarm)
        swarm.start("master", "mb", "--standby")
        for node in workers:
            swarm.start("worker", node)
        # The supervisor runs beside the twin too: there it should have nothing to do (it would say so).
        threading.Thread(target=chaos.supervise, daemon=True).start()
        # The first fault `every` seconds after the swarm's first outer step (start-up is not the
        # steady state the soak is about), then every `every` seconds; none fired in a burst.
        next_fault = math.inf
        while swarm.now() < window:
            if next_fault == math.inf and any(h.outer_step >= 1 for h in watcher.snapshot()[0]):
                next_fault = swarm.now() + s.every
                chaos.steady_at = swarm.now()
            if faults and next_fault <= swarm.now() and swarm.now() < window - s.outage_s - 5:
                chaos.inject()
                while next_fault <= swarm.now():
                    next_fault += s.every
            time.sleep(0.2)
        chaos.keeping.set()
        for thread in chaos.threads:
            thread.join(max(1.0, s.outage_s + s.node_lease_s + 120))
        return finish(swarm, watcher, chaos, window)
    finally:
        chaos.keeping.set()
        watcher.stop()
        swarm.close()
        bus.close()


def start_master(swarm: Swarm) -> Life:
    """The first master ("ma"), once it holds the run (its log names its epoch) or has exited."""
    first = swarm.start("master", "ma")
    _wait(lambda: EPOCH_RE.search(swarm.log(first)) or first.proc.poll() is not None, 600, "the master")
    return first


def finish(swarm: Swarm, watcher: Watcher, chaos: Chaos, window: float) -> dict[str, Any]:
    """End the window: workers stop (SIGTERM), the master drains the bus, the masters stop; the figures."""
    ended_at = swarm.now()
    kept = keep_global(swarm)
    for life in swarm.live("worker"):
        swarm.resume(life)
        life.termed = True
        swarm.signal(life, signal.SIGTERM)
    for life in swarm.live("worker"):
        try:
            life.proc.wait(120)
        except subprocess.TimeoutExpired:
            swarm.kill(life)
    deadline = time.monotonic() + swarm.s.drain_s
    while time.monotonic() < deadline and pending_ids(swarm, watcher):
        time.sleep(1.0)
    for life in swarm.live("master"):
        swarm.resume(life)
        life.termed = True
        swarm.signal(life, signal.SIGTERM)
    for life in swarm.live("master"):
        try:
            life.proc.wait(60)
        except subprocess.TimeoutExpired:
            swarm.kill(life)
    time.sleep(1.0)  # the watcher's last look
    return figures(swarm, watcher, chaos, window, ended_at) | {"window_end_global": kept}


def keep_global(swarm: Swarm) -> dict[str, Any] | None:
    """A copy of the global the head names at the window's end (`<folder>/window_end_global.safetensors`),
    for `score_globals`; None when the bus gives none (the head or its global unreadable)."""
    head = _parse(swarm.bus.read("head.json"))
    name = head.get("global") if head else None
    data = swarm.bus.read(name) if isinstance(name, str) else None
    if head is None or not data:
        return None
    path = swarm.folder / "window_end_global.safetensors"
    path.write_bytes(data)
    return {"path": str(path), "outer_step": int(head.get("outer_step", -1))}


def pending_ids(swarm: Swarm, watcher: Watcher) -> set[str]:
    """Delta ids on the bus now that no published round holds and no master rejected."""
    ledger = master_record(swarm, watcher.snapshot()[0])
    on_bus = swarm.bus.delta_ids(history=False) if isinstance(swarm.bus, HubBus) else swarm.bus.delta_ids()
    return on_bus - set(ledger["applied"]) - set(ledger["rejected"])


# -- what the logs, the summaries and the bus say -----------------------------------------------------------

ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}/[A-Za-z0-9][A-Za-z0-9_.-]*\.safetensors")
ROUND_RE = re.compile(r"DiLoCo master: outer step (\d+) from (.*)$")
PUBLISHED_RE = re.compile(r"DiLoCo master: published outer step (\d+) ")
EPOCH_RE = re.compile(r"DiLoCo master: master epoch (\d+) at outer step (\d+)")
REJECT_RE = re.compile(r"DiLoCo master: rejected delta (\S+) from (\S+) by (\S+): (.*)$")
PROBED_RE = re.compile(r"DiLoCo master: loss probe: delta (\S+) from \S+ alone raises .* it weighs 0")
RETRY_RE = re.compile(
    r"DiLoCo master: outer step \d+ with its momentum raises .*?; without the momentum: \S+, (taken|no better)"
)
GAVE_UP_RE = re.compile(r"no global answered .*? (within [\d.]+s|\(no new global for)")
INNER_RE = re.compile(r"^(\S+) INFO speedtronic\.diloco: DiLoCo node \S+ · inner step (\d+) ·", re.M)
WAITED_RE = re.compile(
    r"^(\S+) INFO speedtronic\.diloco: DiLoCo node \S+ · inner step \d+ · .* · waited ([\d.]+)s for globals$",
    re.M,
)


def worker_time(swarm: Swarm, until: float) -> dict[str, Any]:
    """What the workers' logs say of their time: waits for a global that gave up (on `global_wait`
    running out, or on the master's quiet: diloco/worker/head_pace.py), and the inner steps trained by
    `until` (epoch seconds: the window's end; the soak's workers train on while its last faults end),
    each life's last step logged by then less its first (a life's first ≤ 10 steps, and a killed
    life's steps since its last log line, are not counted, in either arm), and the seconds training
    stood still waiting for a global by then (each life's last progress line says its total)."""
    within = quiet = steps = 0
    waited = 0.0
    per_s = [0.0] * max(0, math.ceil(until - swarm.t0))
    for life in (x for x in swarm.lives.values() if x.role == "worker"):
        text = swarm.log(life)
        for reason in GAVE_UP_RE.findall(text):
            within, quiet = (within + 1, quiet) if reason.startswith("within") else (within, quiet + 1)
        points = [(_epoch(at) - swarm.t0, int(n)) for at, n in INNER_RE.findall(text) if _epoch(at) <= until]
        steps += points[-1][1] - points[0][1] if points else 0
        spread_steps(points, per_s)
        totals = [float(s) for at, s in WAITED_RE.findall(text) if _epoch(at) <= until]
        waited += totals[-1] if totals else 0.0
    return {
        "waits_given_up": {"global_wait": within, "master_quiet": quiet},
        "inner_steps_trained": steps,
        "waited_for_global_s": round(waited, 1),
        "inner_steps_per_s": [round(x, 2) for x in per_s],
    }


def spread_steps(points: list[tuple[float, int]], per_s: list[float]) -> None:
    """Add one life's steps to `per_s` (a bin per second of the window): the steps between two progress
    lines spread evenly over the seconds between them (the lines' stamps are whole seconds)."""
    for (a, first), (b, last) in itertools.pairwise(points):
        if last <= first:
            continue
        if b <= a:  # one stamp: the steps fall in its second
            if 0 <= int(a) < len(per_s):
                per_s[int(a)] += last - first
            continue
        for k in range(max(0, math.floor(a)), min(len(per_s), math.ceil(b))):
            per_s[k] += (last - first) * (min(b, k + 1) - max(a, k)) / (b - a)


def master_record(swarm: Swarm, heads: list[HeadSeen]) -> dict[str, Any]:
    """Every master life's rounds and whether a published global includes them: a round of outer step N
    is in every later global the same life published (its weights carry it), so it counts once that life
    published step N or later (its log says "published outer step M", or the watcher saw its epoch's head
    of step M ≥ N). A round no global of its life ever included is redone by the next master. Also every
    rejection with its reason, the deltas the loss probe weighed 0 (no worker here is hostile: each
    is a false positive of the probe, diloco/master/checks.py), and the steps that raised the loss over
    outer.RISE and were retried without the momentum (the retry taken, or the step standing)."""
    applied: list[str] = []
    unpublished: list[str] = []
    rejected: dict[str, str] = {}
    probed_out: set[str] = set()
    retries = {"taken": 0, "stood": 0}
    for life in [x for x in swarm.lives.values() if x.role == "master"]:
        epoch, rounds, published = 0, [], []
        for line in swarm.log(life).splitlines():
            if m := EPOCH_RE.search(line):
                epoch = int(m[1])
            elif m := ROUND_RE.search(line):
                rounds.append((epoch, int(m[1]), ID_RE.findall(m[2])))
            elif m := PUBLISHED_RE.search(line):
                published.append((epoch, int(m[1])))
            elif m := REJECT_RE.search(line):
                rejected.setdefault(f"{m[2]}/{m[1]}", f"{m[3]}: {m[4]}")
            elif m := PROBED_RE.search(line):
                probed_out.add(m[1])
            elif m := RETRY_RE.search(line):
                retries["taken" if m[1] == "taken" else "stood"] += 1
        epochs = {e for e, _, _ in rounds}
        published += [(h.epoch, h.outer_step) for h in heads if h.epoch in epochs and epoch > 0]
        last = {}
        for e, step in published:
            last[e] = max(last.get(e, -1), step)
        for e, step, ids in rounds:
            (applied if last.get(e, -1) >= step else unpublished).extend(ids)
    return {
        "applied": applied,
        "unpublished": unpublished,
        "rejected": rejected,
        "probed_out": probed_out,
        "momentum_retries": retries,
    }


def worker_sent(swarm: Swarm) -> dict[str, list[str]]:
    """node → ids its lives' `--json` summaries say they uploaded (a SIGKILLed life prints none)."""
    sent: dict[str, list[str]] = {}
    for life in swarm.lives.values():
        if life.role != "worker":
            continue
        try:
            lines = (swarm.logs / f"{life.name}.out").read_text().strip().splitlines()
            summary = json.loads(lines[-1]) if lines else {}
        except (OSError, ValueError):
            continue
        for name in summary.get("uploaded") or []:
            sent.setdefault(life.node, []).append(f"{life.node}/{name}")
    return sent


def exactly_once(swarm: Swarm, heads: list[HeadSeen], seen: dict[str, float]) -> dict[str, Any]:
    record = master_record(swarm, heads)
    sent = {i for ids in worker_sent(swarm).values() for i in ids}
    applied = record["applied"]
    remaining = swarm.bus.delta_ids(history=False) if isinstance(swarm.bus, HubBus) else swarm.bus.delta_ids()
    known = sent | set(seen)
    lost = sorted(known - set(applied) - set(record["rejected"]) - remaining)
    twice = sorted(i for i, n in Counter(applied).items() if n > 1)
    return {
        "deltas_sent": len(known),
        "deltas_applied": len(set(applied)),
        "deltas_rejected": len(record["rejected"]),
        "deltas_left_on_bus": len(remaining - set(applied) - set(record["rejected"])),
        "deltas_lost": len(lost),
        "deltas_applied_twice": len(twice),
        "lost_ids": lost,
        "applied_twice_ids": twice,
        "rejected": record["rejected"],
        "redone_after_unpublished": len(record["unpublished"]),
        "probe_weighed_0": len(record["probed_out"] & set(applied)),
        "momentum_retries": record["momentum_retries"],
        "applied_unseen": sorted(set(applied) - known),
    }


def figures(swarm: Swarm, watcher: Watcher, chaos: Chaos, window: float, ended_at: float) -> dict[str, Any]:
    heads, seen = watcher.snapshot()
    in_window = [h for h in heads if h.t <= window]
    losses = [(h.t, h.val_loss) for h in in_window if h.val_loss is not None]
    rises = [b[1] - a[1] for a, b in itertools.pairwise(losses)]
    steps = sorted({(h.outer_step, h.t) for h in in_window if h.outer_step > 0}, key=lambda x: x[1])
    first_at: dict[int, float] = {}
    for step, t in steps:
        first_at.setdefault(step, t)
    gaps = sorted(
        b - a for a, b in zip(sorted(first_at.values()), sorted(first_at.values())[1:], strict=False)
    )
    tokens = in_window[-1].tokens if in_window else 0
    claimed = in_window[-1].claimed if in_window else 0
    out = {
        "window_s": round(window, 1),
        "window_ended_at_s": round(ended_at, 1),
        "started_at_epoch": round(swarm.t0, 3),  # every "t" and "_s" time here counts from it
        "tokens_applied": tokens,
        "goodput_tokens_per_s": round(tokens / window, 2),
        "tokens_applied_claimed": claimed,
        "goodput_claimed_tokens_per_s": round(claimed / window, 2),
        "outer_steps": in_window[-1].outer_step if in_window else 0,
        "round_s_median": round(gaps[len(gaps) // 2], 2) if gaps else None,
        "first_val_loss": losses[0][1] if losses else None,
        "final_val_loss": losses[-1][1] if losses else None,
        "largest_val_loss_rise": round(max(rises), 4) if rises else 0.0,
        "epochs": sorted({h.epoch for h in heads}),
        "load_avg": round(sum(watcher.load) / len(watcher.load), 2) if watcher.load else None,
        **exactly_once(swarm, heads, seen),
        **failovers(chaos, heads),
        "joiners": joiners(swarm, chaos, heads),
        "first_outer_step_s": None if chaos.steady_at is None else round(chaos.steady_at, 2),
        "faults": [asdict(f) for f in chaos.faults],
        "unplanned_exits": chaos.unplanned,
        **worker_time(swarm, swarm.t0 + window),
        "curve": [
            {
                "t": round(h.t, 2),
                "epoch": h.epoch,
                "outer_step": h.outer_step,
                "tokens": h.tokens,
                "val_loss": h.val_loss,
            }
            for h in heads
        ],
        "lives": {
            x.name: {
                "node": x.node,
                "role": x.role,
                "started": round(x.started, 2),
                "ended": None if x.ended is None else round(x.ended, 2),
                "rc": x.proc.returncode,
                "killed": x.killed,
                "termed": x.termed,
            }
            for x in swarm.lives.values()
        },
    }
    return out


def failovers(chaos: Chaos, heads: list[HeadSeen]) -> dict[str, Any]:
    """Per master fault: killed/frozen → the takeover (a new epoch: its first head) → that epoch's first
    outer step past the step it took over at (its log: "master epoch E at outer step S"); and whether an
    older epoch published anything after the takeover (a frozen master must not)."""
    took_at: dict[int, int] = {}
    for life in chaos.swarm.lives.values():
        if life.role == "master":
            for m in EPOCH_RE.finditer(chaos.swarm.log(life)):
                took_at.setdefault(int(m[1]), int(m[2]))
    rows = []
    for f in chaos.faults:
        if f.kind not in ("kill_master", "stop_master") or "epoch_before" not in f.detail:
            continue
        before = int(f.detail["epoch_before"])
        acted = float(f.detail.get("acted_at", f.t))
        later = [h for h in heads if h.t >= acted and h.epoch > before]
        row: dict[str, Any] = {"t": round(acted, 2), "kind": f.kind, "target": f.target}
        if later:
            take = later[0]
            base = took_at.get(take.epoch, take.outer_step)
            first = next((h for h in later if h.epoch == take.epoch and h.outer_step > base), None)
            row.update(epoch=take.epoch, took_over_at_step=base, takeover_s=round(take.t - acted, 2))
            row["failover_s"] = round(first.t - acted, 2) if first else None
            row["stale_publishes"] = sum(1 for h in heads if h.t > take.t and h.epoch < take.epoch)
        else:
            row.update(takeover_s=None, failover_s=None, stale_publishes=0)
        if f.kind == "stop_master":
            row["old_master_exit"] = f.detail.get("old_master_exit")
        rows.append(row)
    times = [r["failover_s"] for r in rows if r.get("failover_s") is not None]
    return {
        "failover_s": max(times) if times else None,
        "failovers": rows,
        "stale_publishes": sum(r.get("stale_publishes", 0) for r in rows),
    }


def joiners(swarm: Swarm, chaos: Chaos, heads: list[HeadSeen]) -> dict[str, dict[str, float | None]]:
    """Each joiner: its first training step (bench/_paced.py's marker) → the first head marking one of
    its deltas applied, in seconds ("s") and in outer steps published meanwhile ("rounds": 1 when its
    first delta went into the first outer step after it started training); and from its process's
    start ("from_start_s": start-up, the global's download and compilation included)."""
    out: dict[str, dict[str, float | None]] = {}
    for f in chaos.faults:
        if f.kind != "join" or not f.target:
            continue
        marker = swarm.logs / f"{f.target}.first_step"
        try:
            first = float(marker.read_text()) - swarm.t0
        except (OSError, ValueError):
            out[f.target] = {"s": None, "rounds": None, "from_start_s": None}
            continue
        applied = next((h for h in heads if h.hwm.get(f.target, -1) >= 0), None)
        before = max((h.outer_step for h in heads if h.t <= first), default=0)
        out[f.target] = {
            "s": round(applied.t - first, 2) if applied is not None else None,
            "rounds": applied.outer_step - before if applied is not None else None,
            "from_start_s": round(applied.t - f.t, 2) if applied is not None else None,
        }
    return out


# -- the report ----------------------------------------------------------------------------------------------


def plot(chaos_run: dict[str, Any], twin: dict[str, Any] | None, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_tok) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    for run, label, style in ((chaos_run, "with faults", "-"), (twin, "fault-free twin", "--")):
        if not run:
            continue
        curve = [c for c in run["curve"] if c["t"] <= run["window_s"]]
        ax_loss.plot(
            [c["t"] for c in curve if c["val_loss"]],
            [c["val_loss"] for c in curve if c["val_loss"]],
            style,
            label=label,
        )
        ax_tok.plot([c["t"] for c in curve], [c["tokens"] / 1e3 for c in curve], style, label=label)
    colours = dict(
        zip(
            KINDS,
            (
                "tab:red",
                "black",
                "tab:orange",
                "tab:purple",
                "tab:blue",
                "tab:cyan",
                "tab:green",
                "tab:brown",
            ),
            strict=False,
        )
    )
    for f in chaos_run["faults"]:
        for ax in (ax_loss, ax_tok):
            ax.axvspan(f["t"], f["end"] or f["t"] + 1, color=colours[f["kind"]], alpha=0.15)
        ax_tok.annotate(
            f"{f['kind']} {f['target']}",
            (f["t"], 0),
            rotation=90,
            fontsize=7,
            xytext=(2, 4),
            textcoords="offset points",
            va="bottom",
            color=colours[f["kind"]],
        )
    ax_loss.set_ylabel("global val loss")
    ax_tok.set_ylabel("tokens applied (k)")
    ax_tok.set_xlabel("seconds since the master started")
    ax_loss.legend()
    ax_loss.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def worker_capacity(faults: list[dict[str, Any]], workers: int, window: float) -> float:
    """The fraction of the twin's worker-seconds the fault schedule itself leaves (0..1+): a worker that
    left, is frozen, or is dead until its restart rejoins cannot train, whatever the software does; a
    joiner adds its seconds. Outages and master faults take nothing here: surviving them is the
    software's job. goodput_retained / worker_capacity is what the software kept of what it could."""
    seconds, live, at = 0.0, workers, 0.0
    for t, change in capacity_changes(faults, window):
        seconds += live * (t - at)
        live, at = live + change, t
    seconds += live * (window - at)
    return seconds / (workers * window)


def capacity_changes(faults: list[dict[str, Any]], window: float) -> list[tuple[float, int]]:
    """(time, ±1) for each change the fault schedule makes to the workers able to train (worker_capacity)."""
    return sorted(change for f in faults for change in _fault_changes(f, window))


def _fault_changes(f: dict[str, Any], window: float) -> list[tuple[float, int]]:
    t = min(float(f["t"]), window)
    back = f.get("rejoined_at") if f["kind"] == "kill_worker" else f.get("back", f.get("end"))
    if f["kind"] == "leave":
        return [(t, -1)]
    if f["kind"] == "join":
        return [(t, +1)]
    if f["kind"] in ("kill_worker", "stop_worker"):
        return [(t, -1), (min(float(back if back is not None else window), window), +1)]
    return []


def capacity_lost_by_fault(faults: list[dict[str, Any]], workers: int, window: float) -> dict[str, float]:
    """1 − worker_capacity, fault kind by kind: the worker-seconds each kind took from the schedule (a
    frozen worker: its freeze; a killed one: until its restart; a leaver: the rest of the window), less
    what joiners added, as shares of the twin's worker-seconds. The kinds that change no worker: absent."""
    lost: dict[str, float] = {}
    for f in faults:
        changes = _fault_changes(f, window)
        if changes:
            seconds = sum(-change * (window - t) for t, change in changes)
            lost[f["kind"]] = lost.get(f["kind"], 0.0) + seconds / (workers * window)
    return {k: round(v, 4) for k, v in sorted(lost.items(), key=lambda kv: -kv[1])}


def steps_short_by_fault(
    faults: list[dict[str, Any]], soak: list[float], twin: list[float], workers: int, window: float
) -> dict[str, dict[str, float]]:
    """Where the soak's training went, fault kind by kind: from each fault to the next, the inner steps
    its workers trained short of what the twin's trained per worker in the same seconds × the workers the
    schedule left able to train (worker_capacity's count), as a share of the twin's steps in the window.
    The shares add up to about worker_capacity − steps_retained (before the first fault: "start"). A
    negative share: the soak's workers trained more than the twin's per worker (nobody waits for a
    global while the bus is out)."""
    seconds = min(len(soak), len(twin), int(window))
    total = sum(twin[:seconds])
    if not seconds or not total:
        return {}
    changes, live = capacity_changes(faults, window), [workers] * seconds
    for t, change in changes:
        for k in range(min(seconds, math.ceil(t)), seconds):
            live[k] += change
    short = [twin[k] / workers * live[k] - soak[k] for k in range(seconds)]
    marks = sorted((float(f["t"]), f["kind"]) for f in faults)
    spans = [(0.0, "start"), *marks]
    out: dict[str, dict[str, float]] = {}
    for (a, kind), (b, _) in zip(spans, [*spans[1:], (float(seconds), "")], strict=True):
        row = out.setdefault(kind, {"faults": 0, "steps": 0.0})
        row["faults"] += kind != "start"
        row["steps"] += sum(short[max(0, math.ceil(a)) : min(seconds, math.ceil(b))])
    return {
        k: {"faults": int(v["faults"]), "steps": round(v["steps"]), "share": round(v["steps"] / total, 4)}
        for k, v in sorted(out.items(), key=lambda kv: -kv[1]["steps"])
    }


RISE_WITHIN_S = 45.0  # the window after a fault whose largest val-loss rise `rise_after_faults` takes


def rise_after_faults(
    curve: list[dict[str, Any]], faults: list[dict[str, Any]], within: float = RISE_WITHIN_S
) -> dict[str, float]:
    """Per fault kind, the mean of the val loss's largest rise within `within` s of each fault: the
    highest loss after it over the last one at or up to 10 s before it. Given the twin's curve and the
    soak's faults, the same instants without them: the evaluation's noise and the run's own wobble."""
    points = [(float(h["t"]), float(h["val_loss"])) for h in curve if h.get("val_loss") is not None]
    rises: dict[str, list[float]] = {}
    for f in faults:
        t = float(f["t"])
        before = [v for u, v in points if t - 10.0 <= u <= t]
        after = [v for u, v in points if t < u <= t + within]
        if before and after:
            rises.setdefault(f["kind"], []).append(max(after) - before[-1])
    return {k: round(sum(v) / len(v), 4) for k, v in sorted(rises.items())}


def score_globals(config: Path, paths: list[str], batches: int) -> list[float]:
    """The val loss of each global file on `batches` validation batches of the run's data. The master's
    per-round evaluation uses the run's 2 batches (256 tokens): its rounds stay cheap, but two arms'
    final losses then differ by evaluation noise alone (the twin's own curve moves by ±0.1 between
    consecutive rounds), far more than the 1% the soak is judged by."""
    from speedtronic.config import Config
    from speedtronic.config.loading import load_root
    from speedtronic.diloco import codec
    from speedtronic.diloco.launch import build_reference
    from speedtronic.diloco.node_eval import Evaluator

    cfg = load_root(Config, config, [f"data.val_batches={batches}"])
    reference = build_reference(cfg)
    evaluator = Evaluator(reference.model, list(reference.bundle.val_batches()), None)
    specs = codec.param_specs(reference.model)
    return [
        evaluator.loss_only(codec.decode(Path(p).read_bytes(), specs, kind="global").tensors) for p in paths
    ]


def scored(s: Settings, run: dict[str, Any], twin: dict[str, Any] | None) -> dict[str, Any]:
    """Each arm's global at the window's end on SCORE_BATCHES validation batches (`score_globals`), and
    the soak's against the twin's where both are there."""
    arms = {"": run.get("window_end_global"), "twin_": (twin or {}).get("window_end_global")}
    kept = {arm: g["path"] for arm, g in arms.items() if g}
    if not kept:
        return {}
    paths = list(kept.values())
    losses = dict(zip(kept, score_globals(s.out / "chaos" / "chaos.yaml", paths, SCORE_BATCHES), strict=True))
    out: dict[str, Any] = {"scored_val_batches": SCORE_BATCHES}
    out |= {f"{arm}final_val_loss_scored": round(loss, 4) for arm, loss in losses.items()}
    if len(losses) == 2:
        out["val_loss_vs_twin_scored"] = round(losses[""] / losses["twin_"] - 1, 4)
    return out


def loss_gap_from_tokens(
    twin_curve: list[dict[str, Any]], tokens: int, twin_tokens: int | None
) -> float | None:
    """How much higher the soak's final loss would be than the twin's from training fewer tokens alone:
    the twin's val loss against log(tokens applied), fitted by least squares over the second half of
    its tokens, at the soak's tokens over at the twin's (a fraction; None without enough points). A
    soak whose loss gap is near this lost throughput, not model quality."""
    if not twin_tokens or tokens <= 0:
        return None
    points = [
        (math.log(h["tokens"]), float(h["val_loss"]))
        for h in twin_curve
        if h.get("val_loss") is not None and twin_tokens / 2 <= h.get("tokens", 0) <= twin_tokens
    ]
    if len(points) < 3:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    spread = sum((x - mx) ** 2 for x, _ in points)
    if spread == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in points) / spread

    def fitted(t: float) -> float:
        return my + slope * (math.log(t) - mx)

    return round(fitted(tokens) / fitted(twin_tokens) - 1, 4)


def weighing_retained(retained: float | None, run: dict[str, Any], twin: dict[str, Any]) -> float | None:
    """goodput_retained counting only the deltas that weighed: × (1 − the soak's share the probe weighed
    0) ÷ (1 − the twin's)."""
    if retained is None or not run.get("deltas_applied") or not twin.get("deltas_applied"):
        return None
    soak = 1 - (run.get("probe_weighed_0") or 0) / run["deltas_applied"]
    base = 1 - (twin.get("probe_weighed_0") or 0) / twin["deltas_applied"]
    return round(retained * soak / base, 4) if base > 0 else None


def _epoch(stamp: str) -> float:
    """A log line's local-time stamp (2026-12-05T23:18:32) as epoch seconds."""
    return datetime.datetime.fromisoformat(stamp).timestamp()


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def summary(s: Settings, run: dict[str, Any], twin: dict[str, Any] | None) -> dict[str, Any]:
    tw = twin or {}
    retained = (
        run["goodput_tokens_per_s"] / tw["goodput_tokens_per_s"] if tw.get("goodput_tokens_per_s") else None
    )
    work = _ratio(run.get("goodput_claimed_tokens_per_s"), tw.get("goodput_claimed_tokens_per_s"))
    faults = [{**f, **f["detail"]} for f in run["faults"]]  # each fault with its details at the top
    capacity = worker_capacity(faults, s.workers, s.minutes * 60)
    final, twin_final = run["final_val_loss"], tw.get("final_val_loss")
    return {
        "bus": s.bus,
        "workers": s.workers,
        "minutes": s.minutes,
        "every": s.every,
        "global_wait": s.global_wait,
        "hub_budget": s.hub_budget,
        "val_batches": s.val_batches,
        "hub_uploads": "lfs" if s.bus == "hub" else None,  # safetensors as LFS objects (bench/_servers.py)
        "seed": s.seed,
        "goodput_retained": round(retained, 4) if retained is not None else None,
        "worker_capacity": round(capacity, 4),
        "goodput_of_capacity": round(retained / capacity, 4) if retained is not None and capacity else None,
        # goodput_retained counts every delta the master took, the ones the loss probe weighed 0 too
        # (head.json's tokens): this one leaves those out of both arms, each at an average delta's tokens.
        "goodput_weighing_retained": weighing_retained(retained, run, tw),
        # 1 − worker_capacity by the fault kinds that took it (a join gives: negative).
        "capacity_lost_by_fault": capacity_lost_by_fault(faults, s.workers, s.minutes * 60),
        # The training in applied deltas as claimed: a delta folded over k rounds counts k rounds here,
        # one round (its weight's bound) in goodput_retained.
        "work_retained": work,
        # Inner steps the workers trained, against the twin's: below worker_capacity, time idle or lost
        # to start-ups; above work_retained, training that no applied delta carried.
        "steps_retained": _ratio(run.get("inner_steps_trained"), tw.get("inner_steps_trained")),
        # ... and where the rest went, fault kind by kind (steps_short_by_fault).
        "steps_short_by_fault": steps_short_by_fault(
            faults,
            run.get("inner_steps_per_s") or [],
            tw.get("inner_steps_per_s") or [],
            s.workers,
            s.minutes * 60,
        ),
        "waits_given_up": run.get("waits_given_up"),
        "twin_waits_given_up": tw.get("waits_given_up"),
        # Worker-seconds training stood still waiting for a global (the sync's cost, faults' included),
        # and as a share of the twin's worker-seconds (workers × window).
        "waited_for_global_s": run.get("waited_for_global_s"),
        "twin_waited_for_global_s": tw.get("waited_for_global_s"),
        "waited_share": _ratio(run.get("waited_for_global_s"), s.workers * s.minutes * 60),
        "twin_waited_share": _ratio(tw.get("waited_for_global_s"), s.workers * s.minutes * 60),
        "goodput_tokens_per_s": run["goodput_tokens_per_s"],
        "twin_goodput_tokens_per_s": tw.get("goodput_tokens_per_s"),
        "deltas_lost": run["deltas_lost"],
        "deltas_applied_twice": run["deltas_applied_twice"],
        "deltas_sent": run["deltas_sent"],
        "deltas_applied": run["deltas_applied"],
        "deltas_rejected": run["deltas_rejected"],
        "deltas_left_on_bus": run["deltas_left_on_bus"],
        # Applied deltas the loss probe weighed 0: every worker here is honest (issue 36: under 5%).
        "probe_weighed_0_share": _ratio(run.get("probe_weighed_0"), run["deltas_applied"]),
        "twin_probe_weighed_0_share": _ratio(tw.get("probe_weighed_0"), tw.get("deltas_applied")),
        # Steps that raised the loss over outer.RISE, retried without the momentum (taken / stood).
        "momentum_retries": run.get("momentum_retries"),
        "twin_momentum_retries": tw.get("momentum_retries"),
        "first_val_loss": run["first_val_loss"],
        "final_val_loss": final,
        "twin_final_val_loss": twin_final,
        "val_loss_vs_twin": round(final / twin_final - 1, 4) if final and twin_final else None,
        # The part of that a soak owes to training fewer tokens alone (loss_gap_from_tokens).
        "val_loss_gap_from_tokens": loss_gap_from_tokens(
            tw.get("curve") or [], run["tokens_applied"], tw.get("tokens_applied")
        ),
        "largest_val_loss_rise": run["largest_val_loss_rise"],
        "twin_largest_val_loss_rise": tw.get("largest_val_loss_rise"),
        # Per fault kind, the mean largest rise within RISE_WITHIN_S of a fault; the twin at the same instants.
        "val_loss_rise_after_fault": rise_after_faults(run["curve"], run["faults"]),
        "twin_val_loss_rise_after_fault": rise_after_faults(tw.get("curve") or [], run["faults"]),
        "failover_s": run["failover_s"],
        "failovers": run["failovers"],
        "stale_publishes": run["stale_publishes"],
        "joiner_first_applied_s": {n: j["s"] for n, j in run["joiners"].items()},
        "joiner_first_applied_rounds": {n: j["rounds"] for n, j in run["joiners"].items()},
        "joiner_start_to_applied_s": {n: j.get("from_start_s") for n, j in run["joiners"].items()},
        "load_avg": run["load_avg"],
        "twin_load_avg": tw.get("load_avg"),
        "first_outer_step_s": run["first_outer_step_s"],
        "twin_first_outer_step_s": tw.get("first_outer_step_s"),
        "round_s_median": run["round_s_median"],
        "twin_round_s_median": tw.get("round_s_median"),
        "outer_steps": run["outer_steps"],
        "twin_outer_steps": tw.get("outer_steps"),
        "faults": [
            {
                "t": round(f["t"], 1),
                "kind": f["kind"],
                "target": f["target"],
                "end": None if f["end"] is None else round(f["end"], 1),
                **f["detail"],
            }
            for f in run["faults"]
        ],
        "unplanned_exits": run["unplanned_exits"],
        "lost_ids": run["lost_ids"],
        "applied_twice_ids": run["applied_twice_ids"],
        "rejected": run["rejected"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--every", type=float, default=30.0, help="seconds between faults")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--bus", choices=("file", "s3", "hub"), default="file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="where runs, logs, chaos.json, chaos.png go")
    p.add_argument("--step-s", type=float, default=0.2, help="each worker's pace: seconds per step at least")
    p.add_argument("--inner-steps", type=int, default=10, help="H")
    p.add_argument("--restart-delay", type=float, default=5.0, help="a killed worker restarts after this")
    p.add_argument("--outage-s", type=float, default=20.0, help="bus down / storm length")
    p.add_argument("--node-lease-s", type=float, default=60.0, help="a worker's lease on its id")
    p.add_argument("--master-lease-s", type=float, default=10.0, help="the master's lease on the run")
    p.add_argument(
        "--global-wait",
        type=float,
        default=None,
        help="distributed.worker.global_wait: seconds a worker waits for its answering global (default max_wait)",
    )
    p.add_argument(
        "--kinds",
        type=_kinds,
        default=KINDS,
        help=f"comma-separated faults to draw from (default all: {','.join(KINDS)})",
    )
    p.add_argument(
        "--hub-budget",
        type=int,
        default=None,
        help="commits per hour per repo and requests per 5 minutes each node plans within (default the "
        "Hub's 128 and 1000; the loopback Hub enforces neither: raise it to soak the Hub's protocol at a "
        "2-second pace)",
    )
    p.add_argument(
        "--val-batches",
        type=int,
        default=16,
        help="data.val_batches (4 x 32 tokens each) the master evaluates and probes each delta on (default 16: "
        "2,048 tokens, the loss probe's minimum; the soaks before 2026-12-07 ran 2)",
    )
    p.add_argument("--no-twin", action="store_true", help="skip the fault-free twin")
    p.add_argument("--twin-after", action="store_true", help="run the twin after the soak, not beside it")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    a = p.parse_args()
    if importlib.util.find_spec("torch") is None:  # every node would die at start, restarted forever
        p.error(
            f"{sys.executable} has no torch: run the soak with the environment speedtronic is installed in"
        )
    signal.signal(signal.SIGTERM, _terminate)
    out = a.out or Path(f"/tmp/chaos-{a.bus}-{int(time.time())}")
    out.mkdir(parents=True, exist_ok=True)
    s = Settings(
        a.minutes,
        a.every,
        a.workers,
        a.bus,
        a.seed,
        out,
        a.step_s,
        a.inner_steps,
        a.restart_delay,
        a.outage_s,
        a.node_lease_s,
        a.master_lease_s,
        not a.no_twin,
        global_wait=a.global_wait,
        kinds=a.kinds,
        hub_budget=a.hub_budget,
        val_batches=a.val_batches,
    )
    started = time.time()
    twin_box: list[dict[str, Any]] = []
    together = s.twin and not a.twin_after
    if together:  # the twin at the same time: both see the same load from whatever else runs here
        side = threading.Thread(
            target=lambda: twin_box.append(soak(s, out / "twin", faults=False)), daemon=True
        )
        side.start()
    try:
        run = soak(s, out / "chaos", faults=True)
    except BaseException:  # the twin beside it too: no process of a failed bench outlives it
        _close_all()
        raise
    if together:
        side.join()
    elif s.twin:
        twin_box.append(soak(s, out / "twin", faults=False))
    twin = twin_box[0] if twin_box else None
    result = (
        summary(s, run, twin)
        | scored(s, run, twin)
        | {"elapsed_s": round(time.time() - started, 1), "out": str(out)}
    )
    (out / "chaos.json").write_text(json.dumps({"summary": result, "chaos": run, "twin": twin}, indent=1))
    plot(
        run,
        twin,
        out / "chaos.png",
        f"chaos soak: {s.bus} bus, {s.workers} workers, a fault every {s.every:g}s",
    )
    brief = {k: v for k, v in result.items() if k != "rejected"}
    print(json.dumps(brief, indent=None if a.json else 1))


def _kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(
            f"unknown fault kind(s) {unknown or text!r}; choose from {', '.join(KINDS)}"
        )
    return kinds


def _close_all() -> None:
    """Every process of every soak killed and every bus back up (a directory unmounted)."""
    for swarm, bus in OPEN:
        with contextlib.suppress(Exception):
            swarm.close()
        with contextlib.suppress(Exception):
            bus.close()


def _terminate(*_: Any) -> None:
    """SIGTERM: `_close_all`, then exit."""
    _close_all()
    os._exit(143)


def _wait(condition: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)
    return value


if __name__ == "__main__":
    main()
