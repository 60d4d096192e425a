"""DDP against DiLoCo over a rate-limited link, as real processes: wall-clock to a loss and bytes on the link.

    sudo PYTHONPATH=src python bench/wan.py --mbit 30 --workers 4 --json > wan-30.json
    PYTHONPATH=src python bench/wan.py --simulate wan-10.json wan-30.json wan-100.json

The link. The bench creates its own network namespace (`ip netns add`), sets its loopback's MTU to
1500 and brings it up, and puts a token-bucket qdisc on it (`tc qdisc add dev lo root tbf rate
<mbit>mbit burst 256kb latency 200ms`). Every process of an arm runs inside that namespace
(`ip netns exec NAME python …`) and addresses only 127.0.0.1, so every byte between them crosses the
one shaped device: gloo's all-reduce for DDP (`speedtronic train --nproc N`, torchrun --standalone,
gloo on the CPU), and for DiLoCo the HTTP between the master, the workers and a loopback
Hub-compatible server (tests/hub_server.py, the real huggingface_hub client) running in the namespace
too. Like the Hub, it takes safetensors files (deltas, globals, updates) as LFS uploads of their raw
bytes; `--inline-uploads` makes it take them as base64 inside the commit, as every run whose JSON has
no `hub_uploads` key was measured (a third more bytes for each of those files). Bytes on the link are the qdisc's own counter ("Sent N bytes" of `tc -s qdisc show dev lo` in the
namespace), read every half second; an arm's bytes are the counter's growth from its first training
process's start to the moment it reached the target (and to its end). The namespace is deleted at the
end, on an error and on Ctrl-C. Without root, `ip` or `tc` the bench says so and exits 2
(`SPEEDTRONIC_WAN_NO_ROOT=1` forces that answer, for tests).

What the link is, and is not. The qdisc shapes loopback, so all processes share ONE link of the given
rate (like N machines behind one uplink, or a hub-and-spoke WAN whose hub has exactly that rate), and
each byte is counted once (sender → receiver on the same device). Latency is not modelled in the
measured runs: `netem` is not in this kernel, and tbf's `latency` parameter is only the longest a
packet may wait in the bucket's queue (a queue bound, not a propagation delay). The simulator
(--simulate) adds a round-trip time as a parameter instead.

Arms (`--arms`, comma-separated; each trains the same model on the same data — the embedded corpus, or
/work/shared/data/tinyshakespeare.txt when present — with the same per-process micro-batch):

  ddp       N ranks, `speedtronic train --nproc N`: every step all-reduces an fp32 gradient; it trains
            --steps steps, and its final validation loss is the TARGET.
  diloco    N workers (`speedtronic worker`, node ids w0…) and a master that does NOT train
            (`speedtronic master --no-train`, it only aggregates, evaluates each global on the
            validation batches and publishes), over the loopback Hub; the shipped DiLoCo defaults
            (int8 deltas with error feedback, outer lr 0.7, automatic outer momentum with its warm-up,
            clipped-mean aggregation, the loss probe, each global installed one step after the sync it
            answers (overlap_steps 1), background delta upload and global polling) except the knobs a
            tiny run must set: inner_steps = --inner-steps, poll_interval, max_wait, request_timeout,
            late_join_wait. It trains up to --budget × the DDP steps per worker and stops at the target.
  single    one process, no link traffic, up to --budget × (N × the DDP steps) steps (the same tokens
            as DDP at --budget 1), stopped at the target.
  streaming the diloco arm with Streaming DiLoCo on: distributed.sync.fragments = --fragments (synced in
            turn, each upload 1/P of the model, split by --fragment-layout) and overlap_steps =
            --overlap (each fragment's global installed that many steps after its sync); not in the
            default --arms.

Measured per arm: seconds to target (from the arm's first process start to the first validation loss at
or below the target: DDP/single from the `eval` events of their metrics.jsonl, stamped when the bench
sees them, polled every 0.2 s; DiLoCo from the master's "outer step N … global val loss X" log lines,
stamped on arrival), link bytes to target and in all, the final validation loss, steps, rounds, and
compute utilisation. The same times from each arm's FIRST TRAINING STEP (`*_steady_s_to_target`: the
first `step` event of its metrics, for DiLoCo the first worker's, subtracted) and the start-up itself
(`*_startup_s`: process start -> that first step; `diloco_startup_fraction` = start-up / time to target)
separate what the link and the algorithm cost from what launching Python and torch costs. Compute utilisation = (steps the arm's slowest process trained × the median
step time of the single arm, which has no communication at all) ÷ the arm's wall-clock: the time the
arm would have taken with free communication over the time it took — "how measured": the trainer does
not time forward/backward on its own, so the single arm's step time stands for pure compute. On 2 shared
CPU cores N processes also slow each other down, which this counts as lost utilisation too; the
`cpu_share` key says how many cores there were per process.

The size. The model is a 2×32 of 41 K parameters (block 64, micro-batch 8, 4 ranks/workers, H 25,
budget 4, fp32, no torch.compile). At `--steps 150 --eval-every 10`, the size of the older tables, all
four arms took 121 s at 100 Mbit/s, 146 s at 30 and 246 s at 10 on 2 otherwise idle CPU cores
(bench/results/wan-*-overlap1.json; the guide, docs/guides/diloco.md "Over a slow link", has the table
and the exact commands), but start-up (importing torch in 5 processes on 2 cores) was half of DiLoCo's
time to target. The default, 1,500 DDP steps validated every 50, makes DiLoCo train about 90 s, and
start-up 10% of its time to target at 100 Mbit/s and less on slower links (bench/results/wan-*-1500.json,
docs/benchmarks.md); DDP's arm then takes minutes at 30 Mbit/s and about half an hour at 10.

--simulate FILE… reads one or more --json outputs of this bench and runs the calibrated model in
bench/wan_model.py: it fits compute per step and per-round overhead on the fastest link measured,
checks that it reproduces every measured arm within 15% (printed), then extrapolates goodput and time
to target to 8–1,000 nodes, 10 Mbit/s–10 Gbit/s and failure rates.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
SHARED_TEXT = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"  # ../shared beside the project
TESTS = ROOT / "tests"
RUN = "owner/wan"
LIVE: list[int] = []  # process groups started, killed when the bench ends however it ends
STEP_LOG = re.compile(r"outer step (\d+) from .*global val loss ([0-9.]+|nan|inf)")


def token(user: str) -> str:
    return f"hf_{user}wanbenchtoken".ljust(24, "0")


def missing_privileges() -> str | None:
    """Why the bench cannot shape a link here, or None."""
    if os.environ.get("SPEEDTRONIC_WAN_NO_ROOT"):
        return "SPEEDTRONIC_WAN_NO_ROOT is set (treated as not root)"
    if os.geteuid() != 0:
        return "not root (network namespaces and tc need root: run it with sudo)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (install iproute2)"
    return None


class Link:
    """A network namespace whose loopback is a token-bucket link of `mbit` Mbit/s; deleted on close."""

    def __init__(self, mbit: float, burst: str) -> None:
        self.name = f"stwan{os.getpid()}"
        self.mbit = mbit
        self._sh("ip", "netns", "add", self.name)
        try:
            self.exec_sh("ip", "link", "set", "lo", "mtu", "1500")  # burst must exceed one packet
            self.exec_sh("ip", "link", "set", "lo", "up")
            self.exec_sh(
                *("tc", "qdisc", "add", "dev", "lo", "root", "tbf"),
                *("rate", f"{mbit:g}mbit", "burst", burst, "latency", "200ms"),
            )
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _sh(*argv: str) -> str:
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"wan: `{' '.join(argv)}` failed: {done.stderr.strip()}")
        return done.stdout

    def exec_sh(self, *argv: str) -> str:
        return self._sh("ip", "netns", "exec", self.name, *argv)

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def sent(self) -> int:
        """Bytes the qdisc has sent (each byte between two processes in the namespace, once)."""
        out = self.exec_sh("tc", "-s", "qdisc", "show", "dev", "lo")
        found = re.search(r"Sent (\d+) bytes", out)
        if not found:
            raise SystemExit(f"wan: no byte counter in `tc -s qdisc show dev lo`: {out.strip()}")
        return int(found.group(1))

    def close(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)


class Watch:
    """Processes of one arm: their output lines and metrics files stamped as they appear, the link counter
    sampled every 0.5 s, and the first time a validation loss reached the target."""

    def __init__(self, link: Link, target: float | None) -> None:
        self.link, self.target = link, target
        self.t0 = time.monotonic()
        self.bytes0 = link.sent()
        self.samples: list[tuple[float, int]] = [(0.0, 0)]
        self.losses: list[tuple[float, float]] = []  # (seconds since t0, val loss)
        self.reached: float | None = None
        self.first_step: tuple[float, int] | None = None  # (seconds, step) of the first step event seen
        self.procs: list[subprocess.Popen[bytes]] = []
        self.lines: list[tuple[float, str, str]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _sample(self) -> None:
        while not self.stop.wait(0.5):
            with contextlib.suppress(SystemExit):
                self.samples.append((self.now(), self.link.sent() - self.bytes0))

    def loss(self, value: float) -> None:
        with self.lock:
            self.losses.append((self.now(), value))
            if self.reached is None and self.target is not None and value <= self.target:
                self.reached = self.now()

    def start(self, name: str, argv: list[str], cwd: Path, env: dict[str, str], log: Path) -> None:
        proc = subprocess.Popen(
            [*self.link.prefix(), *argv],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the bench ends it (and torchrun's ranks)
        )
        self.procs.append(proc)
        LIVE.append(proc.pid)

        def pump() -> None:
            with log.open("w", encoding="utf-8") as out:
                for raw in proc.stdout:  # type: ignore[union-attr]
                    line = raw.decode(errors="replace")
                    out.write(line)
                    self.lines.append((self.now(), name, line))
                    found = STEP_LOG.search(line) if name == "master" else None
                    if found:
                        self.loss(float(found.group(2)))

        threading.Thread(target=pump, daemon=True).start()

    def follow_metrics(self, path: Path, done: list[dict[str, Any]], losses: bool = True) -> None:
        """Tail a metrics.jsonl; with `losses`, its `eval` events are the arm's validation losses at the
        time they appear (not for DiLoCo workers: their own final eval is of a local model, not the global)."""

        def tail() -> None:
            offset = 0
            while not self.stop.is_set():
                if path.exists():
                    with path.open("rb") as f:
                        f.seek(offset)
                        chunk = f.read()
                    complete = chunk[: chunk.rfind(b"\n") + 1]
                    offset += len(complete)
                    for line in complete.decode().splitlines():
                        event = json.loads(line)
                        done.append(event)
                        if event.get("event") == "step" and self.first_step is None:
                            self.first_step = (self.now(), int(event["step"]))
                        if losses and event.get("event") == "eval" and event.get("val_loss") is not None:
                            self.loss(float(event["val_loss"]))
                time.sleep(0.2)

        threading.Thread(target=tail, daemon=True).start()

    def wait(self, stop_at_target: bool, timeout: float) -> float:
        """Wait for every process to end (or the target, then end them); the arm's wall-clock."""
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in self.procs):
            if (stop_at_target and self.reached is not None) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        wall = self.now()
        self.end()
        time.sleep(0.6)  # the last metrics lines
        self.samples.append((self.now(), self.link.sent() - self.bytes0))
        self.stop.set()
        return wall

    def end(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def bytes_at(self, t: float | None) -> int | None:
        if t is None:
            return None
        return next((b for s, b in self.samples if s >= t), self.samples[-1][1])


def config(args: argparse.Namespace, steps: int, diloco: bool) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "run": {
            "name": "wan",
            "max_steps": steps,
            "log_every": 5,
            "eval_every": 0 if diloco else args.eval_every,
            "device": "cpu",
            "seed": 1337,
        },
        "model": {"n_layer": args.n_layer, "n_head": args.n_head, "d_model": args.d_model},
        "data": {"block_size": args.block, "micro_batch_size": args.batch, "val_batches": args.val_batches},
        "optimizer": {"lr": args.lr},
        "scheduler": {"warmup_steps": max(1, args.steps // 20)},
        "checkpoint": {"every_steps": 100000},
        "logging": {"hooks": ["jsonl"]},
        # fp32 and no torch.compile: compiling takes a minute per process on 2 cores, longer than a
        # short arm trains, and bf16 autocast on some CPUs only would make arms differ by machine.
        "precision": {"mode": "fp32"},
        "compile": False,
    }
    if SHARED_TEXT.exists():
        cfg["data"]["text_path"] = str(SHARED_TEXT)
    if diloco:
        cfg["distributed"] = {
            "enabled": True,
            "sync": {"inner_steps": args.inner_steps},
            "node": {"poll_interval": 0.5},
            "rounds": {"max_wait": 120.0, "late_join_wait": 0.0},
            "worker": {"upload_shutdown_timeout": 30.0},
            # The real Hub's request and commit budgets are not what this bench measures (the loopback
            # Hub enforces none); left at the Hub's figures, a 0.5 s poll spends them in minutes and the
            # nodes' lease renewals queue behind the budget until the leases lapse.
            "bus": {"request_timeout": 60.0, "hub_request_budget": 1000000, "hub_commit_budget": 1000000},
        }
        from speedtronic.config.distributed import MOVED

        for item in args.diloco_set:  # --diloco-set KEY=VALUE: distributed.KEY for a variant of the arm
            key, _, value = item.partition("=")
            # KEY is `section.field` (sync.fragments) or a flat name as earlier runs recorded it (fragments)
            section, name = MOVED[key] if key in MOVED else key.split(".", 1)
            cfg["distributed"].setdefault(section, {})[name] = yaml.safe_load(value)
    return cfg


def env_for(workdir: Path, user: str, url: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "AWS_"))}
    env.update(
        PYTHONPATH=str(ROOT / "src"),
        OMP_NUM_THREADS="1",
        HF_HOME=str(workdir / f"hf-{user}"),
        HF_HUB_DISABLE_XET="1",
        HF_TOKEN=token(user),
        COLUMNS="200",
        GLOO_SOCKET_IFNAME="lo",  # only the namespace's loopback
        MASTER_ADDR="127.0.0.1",
    )
    if url:
        env["HF_ENDPOINT"] = url
    return env


def eval_losses(events: list[dict[str, Any]]) -> list[float]:
    return [
        float(e["val_loss"]) for e in events if e.get("event") == "eval" and e.get("val_loss") is not None
    ]


def step_times(events: list[dict[str, Any]]) -> list[float]:
    return [float(e["step_time_s"]) for e in events if e.get("event") == "step" and e.get("step_time_s")]


def last_step(events: list[dict[str, Any]]) -> int:
    return max((int(e["step"]) for e in events if e.get("event") == "step"), default=0)


def run_trainer(args: argparse.Namespace, link: Link, workdir: Path, arm: str, target: float | None) -> dict:
    """The DDP arm (nproc = workers) or the single worker: `speedtronic train` in the namespace."""
    nproc = args.workers if arm == "ddp" else 1
    steps = args.steps if arm == "ddp" else int(args.budget * args.workers * args.steps)
    folder = workdir / arm
    folder.mkdir()
    (folder / "wan.yaml").write_text(yaml.safe_dump(config(args, steps, diloco=False)))
    argv = [sys.executable, "-m", "speedtronic", "train", "wan.yaml", "--no-resume"]
    if nproc > 1:
        argv += ["--nproc", str(nproc)]
    watch = Watch(link, target)
    events: list[dict[str, Any]] = []
    watch.follow_metrics(folder / "runs" / "wan" / "metrics.jsonl", events)
    watch.start(arm, argv, folder, env_for(folder, "owner"), folder / "train.log")
    wall = watch.wait(stop_at_target=target is not None, timeout=args.arm_timeout)
    losses = eval_losses(events)
    code = [p.returncode for p in watch.procs]
    if not losses:
        tail = "".join(line for _, _, line in watch.lines[-15:])
        raise SystemExit(f"wan: the {arm} arm logged no validation loss (exit {code}):\n{tail}")
    times = step_times(events)
    return {
        "arm": arm,
        "processes": nproc,
        "wall_s": wall,
        "steps": last_step(events),
        "planned_steps": steps,
        "final_val_loss": losses[-1],
        "val_losses": [[round(t, 2), v] for t, v in watch.losses],
        "s_to_target": watch.reached,
        "link_bytes": watch.samples[-1][1],
        "link_bytes_to_target": watch.bytes_at(watch.reached),
        "median_step_s": statistics.median(times) if times else None,
        "exit_codes": code,
        "first_step_seen": list(watch.first_step) if watch.first_step else None,
    }


def run_diloco(
    args: argparse.Namespace, link: Link, workdir: Path, target: float | None, arm: str = "diloco"
) -> dict:
    if arm == "streaming":  # the same arm with the fragments and the overlap set
        extra = [
            f"sync.fragments={args.fragments}",
            f"sync.overlap_steps={args.overlap}",
            f"sync.fragment_layout={args.fragment_layout}",
        ]
        args = argparse.Namespace(**{**vars(args), "diloco_set": [*args.diloco_set, *extra]})
    folder = workdir / arm
    folder.mkdir()
    steps = int(args.budget * args.steps)
    (folder / "wan.yaml").write_text(yaml.safe_dump(config(args, steps, diloco=True)))
    nodes = [f"w{i}" for i in range(args.workers)]
    # The loopback Hub, in the namespace: every request of the run crosses the shaped link.
    url_file = folder / "hub.url"
    hub = subprocess.Popen(
        [
            *link.prefix(),
            sys.executable,
            __file__,
            "--serve-hub",
            str(url_file),
            "--users",
            ",".join(nodes),
            *(["--inline-uploads"] if args.inline_uploads else []),
        ],
        env=env_for(folder, "owner"),
        start_new_session=True,
    )
    LIVE.append(hub.pid)
    try:
        deadline = time.monotonic() + 30
        while not url_file.exists() or not url_file.read_text().strip():
            if hub.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("wan: the loopback Hub did not start")
            time.sleep(0.1)
        url = url_file.read_text().strip()
        speedtronic = [*link.prefix(), sys.executable, "-m", "speedtronic"]
        owner = env_for(folder, "owner", url)
        for argv in (
            ["hub", "init", RUN, "wan.yaml"],
            *(["hub", "add-collaborator", RUN, node] for node in nodes),
        ):
            done = subprocess.run(
                [*speedtronic, *argv], cwd=folder, env=owner, capture_output=True, text=True
            )
            if done.returncode:
                raise SystemExit(
                    f"wan: speedtronic {' '.join(argv)} exited {done.returncode}: {done.stderr[-2000:]}"
                )
        watch = Watch(link, target)
        master_dir = folder / "master"
        master_dir.mkdir()
        watch.start(
            "master",
            [
                sys.executable,
                "-m",
                "speedtronic",
                "master",
                str(folder / "wan.yaml"),
                "--repo",
                RUN,
                "--no-train",
            ],
            master_dir,
            env_for(folder, "owner", url),
            folder / "master.log",
        )
        worker_events: dict[str, list[dict[str, Any]]] = {}
        for node in nodes:
            cwd = folder / node
            cwd.mkdir()
            worker_events[node] = []
            watch.follow_metrics(
                cwd / "runs" / "wan" / node / "metrics.jsonl", worker_events[node], losses=False
            )
            watch.start(
                node,
                [
                    sys.executable,
                    "-m",
                    "speedtronic",
                    "worker",
                    str(folder / "wan.yaml"),
                    "--repo",
                    RUN,
                    "--node-id",
                    node,
                ],
                cwd,
                env_for(folder, node, url),
                folder / f"{node}.log",
            )
        wall = watch.wait(stop_at_target=target is not None, timeout=args.arm_timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(hub.pid, signal.SIGTERM)
        hub.wait(10)
    rounds = [(t, line) for t, name, line in watch.lines if name == "master" and STEP_LOG.search(line)]
    if not watch.losses:
        tail = "".join(line for _, _, line in watch.lines[-25:])
        raise SystemExit(f"wan: the DiLoCo master logged no global val loss:\n{tail}")
    times = [t for e in worker_events.values() for t in step_times(e)]
    return {
        "arm": arm,
        "processes": args.workers,
        "master_trains": False,
        "wall_s": wall,
        "steps": min((last_step(e) for e in worker_events.values()), default=0),
        "planned_steps": steps,
        "inner_steps": args.inner_steps,
        "rounds": len(rounds),
        "round_times_s": [round(t, 2) for t, _ in rounds],
        "final_val_loss": watch.losses[-1][1],
        "val_losses": [[round(t, 2), v] for t, v in watch.losses],
        "s_to_target": watch.reached,
        "link_bytes": watch.samples[-1][1],
        "link_bytes_to_target": watch.bytes_at(watch.reached),
        "median_step_s": statistics.median(times) if times else None,
        "exit_codes": [p.returncode for p in watch.procs],
        "first_step_seen": list(watch.first_step) if watch.first_step else None,
    }


def serve_hub(url_file: str, users: str, inline: bool) -> None:
    """Inside the namespace: the loopback Hub with the owner and one user per worker, until SIGTERM.
    Safetensors files go up as LFS (raw bytes, as the Hub takes them; env_for disables Xet, which the
    loopback Hub does not speak) unless `inline`: then as base64 in the commit, as every run recorded
    before `hub_uploads` was (bench/results/wan-*.json without that key)."""
    sys.path.insert(0, str(TESTS))
    from hub_server import HubServer

    server = HubServer()
    if not inline:
        server.state.lfs_suffixes = (".safetensors",)
    server.state.add_user("owner", token("owner"))
    for user in filter(None, users.split(",")):
        server.state.add_user(user, token(user))
    signal.signal(signal.SIGTERM, lambda *_: (server.stop(), os._exit(0)))
    Path(url_file).write_text(server.url)
    while True:
        time.sleep(3600)


def utilisation(arm: dict[str, Any], compute_step_s: float | None) -> float | None:
    """Steps × pure-compute step time ÷ wall, counted from the first step the bench saw (process start,
    imports and data loading are the same for every arm and not link time)."""
    seen = arm.get("first_step_seen")
    if not compute_step_s or not seen or arm["wall_s"] <= seen[0]:
        return None
    return min(1.0, (arm["steps"] - seen[1]) * compute_step_s / (arm["wall_s"] - seen[0]))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    arms = [a for a in args.arms.split(",") if a]
    if "ddp" not in arms and args.target is None:
        raise SystemExit(
            "wan: --arms must include ddp (its final validation loss is the target), or give --target"
        )
    link = Link(args.mbit, args.burst)
    results: dict[str, dict[str, Any]] = {}
    started = time.monotonic()
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="wan-", dir=args.workdir))
    try:
        if "ddp" in arms:
            ddp = run_trainer(args, link, workdir, "ddp", None)
            results["ddp"] = ddp
            target = ddp["final_val_loss"]
            ddp["s_to_target"] = next(t for t, v in ddp["val_losses"] if v <= target)
        else:  # exploring: the target of an earlier DDP run at the same settings
            target = args.target
        for arm in arms:
            if arm in ("diloco", "streaming"):
                results[arm] = run_diloco(args, link, workdir, target, arm)
            elif arm == "single":
                results[arm] = run_trainer(args, link, workdir, "single", target)
            elif arm != "ddp":
                raise SystemExit(f"wan: unknown arm {arm!r} in --arms (ddp, diloco, streaming, single)")
            print(f"wan: {arm} done: {summary(results[arm])}", file=sys.stderr, flush=True)
    finally:
        for group in LIVE:  # Ctrl-C or an error mid-arm: no process outlives the namespace
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        link.close()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"wan: kept {workdir}", file=sys.stderr)
    compute = results.get("single", {}).get("median_step_s")
    for arm in results.values():
        arm["compute_utilisation"] = utilisation(arm, compute)
    cores = os.cpu_count() or 1

    def get(arm: str, key: str) -> Any:
        return results.get(arm, {}).get(key)

    return {
        "link_mbit": args.mbit,
        "target_val_loss": target,
        "ddp_s_to_target": get("ddp", "s_to_target"),
        "diloco_s_to_target": get("diloco", "s_to_target"),
        "single_s_to_target": get("single", "s_to_target"),
        "streaming_s_to_target": get("streaming", "s_to_target"),
        "streaming_link_bytes": get("streaming", "link_bytes"),
        "streaming_fragments": args.fragments if "streaming" in results else None,
        "streaming_overlap_steps": args.overlap if "streaming" in results else None,
        "streaming_fragment_layout": args.fragment_layout if "streaming" in results else None,
        **steady_figures(results),
        "ddp_link_bytes": get("ddp", "link_bytes"),
        "diloco_link_bytes": get("diloco", "link_bytes"),
        "diloco_link_bytes_to_target": get("diloco", "link_bytes_to_target"),
        "workers": args.workers,
        "eval_every": args.eval_every,
        "ddp_steps": args.steps,
        "inner_steps": args.inner_steps,
        "diloco_overrides": args.diloco_set,
        "cpu_cores": cores,
        "cpu_share": cores / (args.workers + (1 if {"diloco", "streaming"} & set(results) else 0)),
        "utilisation_method": "steps x single-arm median step time / wall (single has no communication)",
        "latency_model": "none (netem missing; tbf latency 200ms is a queue bound, not a delay)",
        "hub_uploads": "inline base64" if args.inline_uploads else "lfs",
        "model": f"{args.n_layer}x{args.d_model}, block {args.block}, micro-batch {args.batch}",
        "bench_wall_s": time.monotonic() - started,
        "arms": results,
    }


def steady_figures(results: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Time to target from each arm's first training step (the steady state, start-up left out) and the
    start-up itself: process start -> the first `step` event in its metrics (for DiLoCo, the first worker's).
    Both clocks start when the arm's processes are launched, so steady = from-start - start-up."""
    out: dict[str, float | None] = {}
    for name in ("ddp", "diloco", "streaming", "single"):
        arm = results.get(name, {})
        seen, reached = arm.get("first_step_seen"), arm.get("s_to_target")
        startup = float(seen[0]) if seen else None
        out[f"{name}_startup_s"] = startup
        out[f"{name}_steady_s_to_target"] = (
            max(0.0, reached - startup) if reached is not None and startup is not None else None
        )
    startup, reached = out["diloco_startup_s"], results.get("diloco", {}).get("s_to_target")
    out["diloco_startup_fraction"] = startup / reached if startup is not None and reached else None
    return out


def summary(arm: dict[str, Any]) -> str:
    reached = f"{arm['s_to_target']:.1f}s" if arm.get("s_to_target") is not None else "not reached"
    return (
        f"{arm['steps']} steps in {arm['wall_s']:.1f}s, final val {arm['final_val_loss']:.4f}, to target {reached}, "
        f"{arm['link_bytes']:,} link bytes"
    )


def print_table(result: dict[str, Any]) -> None:
    print(
        f"link {result['link_mbit']:g} Mbit/s (one shared tbf link), {result['workers']} workers, "
        f"{result['cpu_cores']} cores, target (DDP final val loss) {result['target_val_loss']:.4f}"
    )
    print(
        f"{'arm':<8} {'steps':>6} {'wall s':>8} {'s to target':>12} {'link bytes':>14} {'final val':>10} {'util':>6}"
    )
    for name, arm in result["arms"].items():
        reached = f"{arm['s_to_target']:.1f}" if arm.get("s_to_target") is not None else "-"
        util = f"{arm['compute_utilisation']:.0%}" if arm.get("compute_utilisation") is not None else "-"
        print(
            f"{name:<8} {arm['steps']:>6} {arm['wall_s']:>8.1f} {reached:>12} {arm['link_bytes']:>14,} "
            f"{arm['final_val_loss']:>10.4f} {util:>6}"
        )
    d, s = result["ddp_s_to_target"], result["diloco_s_to_target"]
    if d and s:
        print(f"DDP / DiLoCo time to target: {d / s:.2f}x")
    d, s = result.get("ddp_steady_s_to_target"), result.get("diloco_steady_s_to_target")
    if d and s:
        frac = result.get("diloco_startup_fraction") or 0.0
        print(
            f"from the first training step: DDP / DiLoCo {d / s:.2f}x "
            f"(start-up DDP {result['ddp_startup_s']:.1f}s, DiLoCo {result['diloco_startup_s']:.1f}s, "
            f"{frac:.0%} of DiLoCo's time to target)"
        )
    t = result.get("streaming_s_to_target")
    if d and t:
        print(f"DDP / streaming DiLoCo time to target: {d / t:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mbit", type=float, default=30.0, help="link rate in Mbit/s")
    parser.add_argument("--burst", default="256kb", help="tbf bucket size (must exceed the 1500-byte MTU)")
    parser.add_argument("--workers", type=int, default=4, help="DDP ranks = DiLoCo workers")
    parser.add_argument(
        "--arms", default="ddp,diloco,single", help="comma-separated: ddp, diloco, streaming, single"
    )
    parser.add_argument("--fragments", type=int, default=4, help="streaming arm: distributed.sync.fragments")
    parser.add_argument(
        "--overlap", type=int, default=1, help="streaming arm: distributed.sync.overlap_steps"
    )
    parser.add_argument(
        "--fragment-layout",
        choices=("layers", "elements"),
        default="elements",
        help="streaming arm: distributed.sync.fragment_layout (default: the shipped one, elements)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=1500,
        help="DDP steps (its final val loss is the target); the default keeps DiLoCo's start-up near or under "
        "10%% of its time to target (150, the size of the older tables: over half)",
    )
    parser.add_argument(
        "--budget", type=float, default=4.0, help="other arms: up to this x DDP's steps per process"
    )
    parser.add_argument("--inner-steps", type=int, default=25, help="DiLoCo H")
    parser.add_argument(
        "--target",
        type=float,
        default=None,
        help="exploring: this target val loss instead of running the ddp arm (e.g. an earlier run's)",
    )
    parser.add_argument(
        "--diloco-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override distributed.KEY (e.g. sync.overlap_steps) for the DiLoCo arm (default: the shipped "
        "defaults); repeatable",
    )
    parser.add_argument("--eval-every", type=int, default=50, help="DDP/single validation every N steps")
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=32)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="micro-batch per process")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--arm-timeout", type=float, default=900.0, help="end an arm after this many seconds")
    parser.add_argument("--workdir", default=None, help="where the runs go (default a temp folder)")
    parser.add_argument("--keep", action="store_true", help="keep the runs' folder")
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object (the measurement) on stdout"
    )
    parser.add_argument(
        "--simulate", nargs="+", metavar="JSON", help="run the calibrated model on saved --json files"
    )
    parser.add_argument(
        "--rtt-ms", type=float, default=50.0, help="--simulate: round-trip time between nodes (default 50)"
    )
    parser.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="--simulate: also draw the goodput table (needs matplotlib)",
    )
    parser.add_argument(
        "--inline-uploads",
        action="store_true",
        help="the loopback Hub takes safetensors as base64 in the commit (as results without a "
        "`hub_uploads` key were measured), not as LFS uploads of the raw bytes (the Hub's way)",
    )
    parser.add_argument("--serve-hub", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--users", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_hub:
        serve_hub(args.serve_hub, args.users, args.inline_uploads)
        return
    if args.simulate:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from wan_model import main as simulate

        raise SystemExit(simulate(args.simulate, args.rtt_ms / 1000, args.plot))
    why = missing_privileges()
    if why:
        print(
            f"wan: cannot shape a link here: {why}. Run as root on Linux with iproute2 (ip, tc).",
            file=sys.stderr,
        )
        raise SystemExit(2)
    try:
        result = measure(args)
    except KeyboardInterrupt:
        print("wan: interrupted; the namespace is deleted", file=sys.stderr)
        raise SystemExit(130) from None
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)


if __name__ == "__main__":
    main()
