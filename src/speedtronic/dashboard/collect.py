"""What the dashboard shows, gathered in the background: one `Source` per command-line argument.

A source is a folder of runs (`runs/`: every `<name>/metrics.jsonl` under it, read by speedtronic.runs)
or a DiLoCo swarm's bus (file://, s3://, a Hub repo, or a run directory holding manifest.json), read
with the very function behind `hub status --json` (diloco/launch.run_status), so the page and the
terminal never disagree. A `Collector` polls each source on its own thread and keeps its latest good
document; the HTTP server only ever reads what is kept, so a bus that hangs or is down never blocks
the page: the page shows the last data with its age and the error, one line, scrubbed of secrets.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speedtronic.dashboard.history import SwarmHistory
from speedtronic.errors import ConfigError
from speedtronic.secrets import scrub

MAX_CURVE = 400  # points per run curve sent to the page (evenly thinned, the last one kept)
HUB_REPO = re.compile(r"^(hf://)?[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")


def thin(points: list[tuple[int, float]], limit: int = MAX_CURVE) -> list[list[float]]:
    """At most `limit` points of a curve, evenly spaced, keeping the first and the last."""
    if len(points) <= limit:
        return [list(p) for p in points]
    stride = (len(points) - 1) / (limit - 1)
    return [list(points[round(i * stride)]) for i in range(limit)]


def one_line(error: BaseException) -> str:
    """An error as the page shows it: its type when it has no message, one line, no secret."""
    text = " ".join(str(error).split()) or type(error).__name__
    return scrub(text)[:400]


class Source:
    """One thing the dashboard shows. Subclasses say how to read it (`read`, on a collector thread)."""

    kind = "?"

    def __init__(self, label: str, interval_s: float) -> None:
        self.label = scrub(label)
        self.interval_s = interval_s

    def read(self) -> dict[str, Any]:
        raise NotImplementedError


class RunsSource(Source):
    """A folder of runs, or one run's folder (it holds metrics.jsonl)."""

    kind = "runs"

    def __init__(self, path: Path, interval_s: float) -> None:
        super().__init__(str(path), interval_s)
        self.path = path

    def read(self) -> dict[str, Any]:
        from speedtronic.runs import METRICS_NAME, find_runs, summarize

        own = self.path / METRICS_NAME
        found = [summarize(self.path.name, own)] if own.is_file() else find_runs(self.path)
        return {"runs": [self._run(run.as_dict(curves=True)) for run in found]}

    @staticmethod
    def _run(run: dict[str, Any]) -> dict[str, Any]:
        run["train"] = thin(run["train"])
        run["val"] = thin(run["val"])
        run["evals"] = {name: thin(points) for name, points in run["evals"].items()}
        run.pop("path", None)  # the name says which; the page needs no local path
        return run


class SwarmSource(Source):
    """A DiLoCo run's bus: its `hub status --json` document, plus the history seen so far."""

    kind = "swarm"

    def __init__(self, url: str, endpoint: str | None, interval_s: float) -> None:
        super().__init__(url, interval_s)
        self.url, self.endpoint = url, endpoint
        self.history = SwarmHistory()
        self.global_bytes: int | None = None  # one fp32 global model, from the manifest's shapes
        self.sized = False

    def read(self) -> dict[str, Any]:
        from speedtronic.diloco.launch import run_status

        status = run_status(self.url, self.endpoint, retry_budget_s=min(10.0, max(2.0, self.interval_s)))
        if not self.sized:  # once: the model's shapes never change during a run
            try:
                self.global_bytes, self.sized = self._global_bytes(), True
            except Exception:  # the status was read: show it, and size the model at a later read
                self.global_bytes = None
        self.history.add(status)
        return {"status": status, "history": self.history.document(), "global_bytes": self.global_bytes}

    def _global_bytes(self) -> int | None:
        """Bytes of one global model as published (fp32: 4 bytes a value), from manifest.json."""
        from speedtronic.diloco.bus.registry import open_bus

        with open_bus(self.url, endpoint=self.endpoint, retry_budget_s=5.0, retry_attempts=2) as bus:
            manifest = bus.read_manifest() or {}
        total = 0
        for spec in (manifest.get("params") or {}).values():
            shape = spec.get("shape") if isinstance(spec, dict) else None
            if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
                return None
            size = 1
            for d in shape:
                size *= d
            total += 4 * size
        return total or None


def classify(arg: str, endpoint: str | None, interval_s: float | None) -> Source:
    """The source an argument names: a bus URL (scheme://…), a run directory bus (it holds
    manifest.json), a folder of runs, or a Hub repo (owner/name that is not a local path)."""
    path = Path(arg).expanduser()
    if "://" in arg:
        local = arg.startswith("file://")
        return SwarmSource(arg, endpoint, interval_s or (2.0 if local else 30.0))
    if path.is_dir() and (path / "manifest.json").is_file():
        return SwarmSource(f"file://{path.resolve()}", endpoint, interval_s or 2.0)
    if path.is_dir():
        return RunsSource(path, interval_s or 5.0)
    if HUB_REPO.match(arg) and not path.exists():
        return SwarmSource(arg, endpoint, interval_s or 30.0)
    raise ConfigError(
        f"dashboard: {arg!r} is not a folder of runs, a run directory (manifest.json), nor a bus URL "
        "(file://PATH, s3://BUCKET/PREFIX, owner/name on the Hub); name one of those"
    )


@dataclass
class Kept:
    """What the collector keeps of one source: its latest good document and its latest error."""

    source: Source
    document: dict[str, Any] | None = None
    fetched_at: float | None = None  # when `document` was read (Unix seconds)
    error: str | None = None  # the latest read's error, cleared by a good read
    error_at: float | None = None
    reads: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def view(self, index: int, now: float) -> dict[str, Any]:
        with self.lock:
            age = None if self.fetched_at is None else max(0.0, now - self.fetched_at)
            return {
                "id": index,
                "kind": self.source.kind,
                "label": self.source.label,
                "interval_s": self.source.interval_s,
                "fetched_at": self.fetched_at,
                "age_s": None if age is None else round(age, 1),
                "error": self.error,
                "error_at": self.error_at,
                "reads": self.reads,
                **(self.document or {}),
            }


class Collector:
    """Polls every source on its own daemon thread; `state()` is what the page reads."""

    def __init__(self, sources: list[Source]) -> None:
        self.kept = [Kept(source) for source in sources]
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        for i, kept in enumerate(self.kept):
            thread = threading.Thread(target=self._loop, args=(kept,), name=f"dashboard-{i}", daemon=True)
            thread.start()
            self.threads.append(thread)

    def poll_once(self, kept: Kept) -> None:
        """Read one source; a failure of any kind is kept as its error, never raised (the page lives on)."""
        try:
            document = kept.source.read()
        except Exception as error:
            with kept.lock:
                kept.error, kept.error_at = one_line(error), time.time()
            return
        with kept.lock:
            kept.document, kept.fetched_at = document, time.time()
            kept.error = kept.error_at = None
            kept.reads += 1

    def _loop(self, kept: Kept) -> None:
        while not self.stop.is_set():
            self.poll_once(kept)
            self.stop.wait(kept.source.interval_s)

    def state(self) -> dict[str, Any]:
        now = time.time()
        return {"now": now, "sources": [kept.view(i, now) for i, kept in enumerate(self.kept)]}

    def status(self, index: int) -> dict[str, Any] | None:
        """The `hub status --json` document of swarm source `index`, as last read (None: none yet)."""
        if not 0 <= index < len(self.kept) or self.kept[index].source.kind != "swarm":
            return None
        with self.kept[index].lock:
            return (self.kept[index].document or {}).get("status")

    def close(self) -> None:
        self.stop.set()
