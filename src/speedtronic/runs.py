"""Reading finished (and running) runs back from `runs/<name>/metrics.jsonl`, for `speedtronic runs`.

The jsonl hook appends one JSON object per training event; a resumed run appends to the same file,
so one file may hold several `train_start … train_end` segments. This module folds them into one
summary per run (steps, tokens, losses, throughput, wall time, optimizer, lr) and into loss curves,
and draws curves as text for a terminal. The PNG plot (`plot_png`) needs matplotlib (the `plot` extra).

Never imports torch; a line that is not JSON (a crash mid-write) is skipped, not fatal.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from speedtronic.errors import ConfigError

METRICS_NAME = "metrics.jsonl"


@dataclass
class RunSummary:
    name: str
    path: str  # the metrics file
    steps: int | None = None
    tokens: int | None = None
    final_loss: float | None = None  # the last logged training loss (an interval mean)
    final_val_loss: float | None = None
    best_val_loss: float | None = None
    tokens_per_s: float | None = None
    wall_s: float | None = None  # summed over the run's segments (resumes)
    optimizer: str | None = None
    lr: float | None = None  # the configured peak learning rate
    finished: bool = False
    core: float | None = None  # the last evaluation's CORE aggregate over run.eval_tasks
    accuracy: dict[str, float] = field(default_factory=dict)  # the last evaluation's, per task
    # data.sources: the last evaluation's validation loss of each source
    val_by_source: dict[str, float] = field(default_factory=dict)
    train: list[tuple[int, float]] = field(default_factory=list, repr=False)
    val: list[tuple[int, float]] = field(default_factory=list, repr=False)
    # run.eval_tasks by step: "core" and each task's accuracy
    evals: dict[str, list[tuple[int, float]]] = field(default_factory=dict, repr=False)

    def as_dict(self, curves: bool = False) -> dict[str, Any]:
        data = asdict(self)
        if not curves:
            data.pop("train")
            data.pop("val")
            data.pop("evals")
        return data


def read_events(path: Path) -> list[dict[str, Any]]:
    events = []
    with path.open(encoding="utf-8", errors="replace") as lines:
        for line in lines:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict):
                events.append(event)
    return events


def summarize(name: str, path: Path) -> RunSummary:
    run = RunSummary(name=name, path=str(path))
    wall = 0.0
    tok_s = []
    for event in read_events(path):
        kind = event.get("event")
        if kind == "train_start":
            config = event.get("config") or {}
            optimizer = config.get("optimizer") or {}
            run.optimizer = optimizer.get("name", run.optimizer)
            run.lr = optimizer.get("lr", run.lr)
            run.finished = False
        elif kind == "step" and _finite(event.get("loss")):
            # A resumed run may repeat steps after its last checkpoint: the later value wins.
            run.train = [point for point in run.train if point[0] < event["step"]]
            run.train.append((int(event["step"]), float(event["loss"])))
            run.tokens = event.get("tokens_seen", run.tokens)
        elif kind in ("eval", "outer_step"):  # outer_step: a DiLoCo master's global val loss
            if _finite(event.get("val_loss")):
                run.val = [point for point in run.val if point[0] < event["step"]]
                run.val.append((int(event["step"]), float(event["val_loss"])))
            sources = {
                k.removeprefix("val_loss/"): float(v)
                for k, v in event.items()
                if k.startswith("val_loss/") and _finite(v)
            }
            run.val_by_source = sources or run.val_by_source
            _task_points(run, event)
        elif kind == "train_end":
            run.steps = event.get("steps", run.steps)
            run.tokens = event.get("tokens", run.tokens)
            run.optimizer = run.optimizer or event.get("optimizer")
            if _finite(event.get("elapsed_s")):
                wall += float(event["elapsed_s"])
            if _finite(event.get("tokens_per_s")) and event["tokens_per_s"] > 0:
                tok_s.append((float(event["tokens_per_s"]), float(event.get("elapsed_s") or 0.0)))
            run.finished = not event.get("interrupted", False)
    if run.steps is None and run.train:
        run.steps = run.train[-1][0]
    run.final_loss = run.train[-1][1] if run.train else None
    run.final_val_loss = run.val[-1][1] if run.val else None
    run.best_val_loss = min(loss for _, loss in run.val) if run.val else None
    run.wall_s = wall or None
    if tok_s:  # time-weighted over the segments
        weight = sum(seconds for _, seconds in tok_s)
        run.tokens_per_s = sum(rate * seconds for rate, seconds in tok_s) / weight if weight else tok_s[-1][0]
    return run


def _task_points(run: RunSummary, event: dict[str, Any]) -> None:
    """run.eval_tasks' results of one eval event (engine/eval/during_training.py), if it has any."""
    tasks = event.get("tasks")
    if (
        not _finite(event.get("core"))
        or not isinstance(tasks, dict)
        or not isinstance(event.get("step"), int)
    ):
        return
    step = int(event["step"])
    values = {"core": float(event["core"])}
    values |= {
        str(name): float(r["accuracy"])
        for name, r in tasks.items()
        if isinstance(r, dict) and _finite(r.get("accuracy"))
    }
    for name, value in values.items():
        curve = [point for point in run.evals.get(name, []) if point[0] < step]
        run.evals[name] = [*curve, (step, value)]
    run.core = values.pop("core")
    run.accuracy = values


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def find_runs(root: Path) -> list[RunSummary]:
    """Every run under `root` (folders holding metrics.jsonl), newest metrics first."""
    if not root.is_dir():
        return []
    files = [path for path in root.glob(f"*/{METRICS_NAME}") if path.is_file()]
    files.sort(key=lambda path: path.stat().st_mtime, reverse=True)
    return [summarize(path.parent.name, path) for path in files]


def resolve_run(spec: str, root: Path) -> RunSummary:
    """A run by name (under `root`), by folder, or by metrics file."""
    candidates = [root / spec / METRICS_NAME, Path(spec) / METRICS_NAME, Path(spec)]
    for path in candidates:
        if path.is_file():
            name = path.parent.name if path.name == METRICS_NAME else path.stem
            return summarize(name, path)
    known = ", ".join(run.name for run in find_runs(root)) or "none"
    raise ConfigError(
        f"no run {spec!r}: not a folder under {root} with {METRICS_NAME}, nor a metrics file "
        f"(runs under {root}: {known})"
    )


# ------------------------------------------------------------------------------------------ plots


def text_plot(
    runs: list[RunSummary], width: int = 72, height: int = 18, val: bool = False, metric: str | None = None
) -> str:
    """The runs' training (or validation) loss curves as text, one marker per run, with axes; or,
    with `metric` ("core" or a task's name, from run.eval_tasks), that metric's curve."""
    markers = "*o+x#@%&"
    series = [(run, run.evals.get(metric, []) if metric else run.val if val else run.train) for run in runs]
    points = [p for _, curve in series for p in curve]
    if not points:
        if metric:
            known = sorted({name for run in runs for name in run.evals}) or ["none (set run.eval_tasks)"]
            return f"no {metric!r} values logged (task metrics: {', '.join(known)})"
        return "no loss values logged yet"
    x_lo, x_hi = min(p[0] for p in points), max(p[0] for p in points)
    y_lo, y_hi = min(p[1] for p in points), max(p[1] for p in points)
    if y_hi == y_lo:
        y_hi = y_lo + 1e-9
    if x_hi == x_lo:
        x_hi = x_lo + 1
    grid = [[" "] * width for _ in range(height)]

    def cell(x: float, y: float) -> tuple[int, int]:
        return round((y_hi - y) / (y_hi - y_lo) * (height - 1)), round(
            (x - x_lo) / (x_hi - x_lo) * (width - 1)
        )

    for index, (_, curve) in enumerate(series):
        marker = markers[index % len(markers)]
        for (x0, y0), (x1, y1) in itertools.pairwise(curve):  # a faint line between points
            (_, c0), (_, c1) = cell(x0, y0), cell(x1, y1)
            for col in range(c0 + 1, c1):
                y = y0 + (y1 - y0) * (col - c0) / (c1 - c0)
                row, _ = cell(x0, y)
                if grid[row][col] == " ":
                    grid[row][col] = "·"
        for x, y in curve:
            row, col = cell(x, y)
            grid[row][col] = marker
    label_width = max(len(f"{y_hi:.3f}"), len(f"{y_lo:.3f}"))
    title = f"{metric} by step" if metric else f"{'val' if val else 'train'} loss by step"
    lines = [title]
    for row_index, row in enumerate(grid):
        y = y_hi - (y_hi - y_lo) * row_index / (height - 1)
        label = f"{y:.3f}" if row_index in (0, height // 2, height - 1) else ""
        lines.append(f"{label:>{label_width}} │" + "".join(row).rstrip())
    lines.append(" " * label_width + " └" + "─" * width)
    right = str(x_hi)
    lines.append(" " * (label_width + 2) + str(x_lo) + right.rjust(width - len(str(x_lo))))
    lines.append("  ".join(f"{markers[i % len(markers)]} {run.name}" for i, (run, _) in enumerate(series)))
    return "\n".join(lines)


def plot_png(runs: list[RunSummary], out: Path, title: str | None = None) -> Path:
    """Training (solid) and validation (dashed, dots) loss by step for each run, as a PNG."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(
            "an image plot needs matplotlib: pip install 'speedtronic-lm[plot]' (or leave out --out "
            "for a plot in the terminal)"
        ) from None
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    # A panel per task metric (run.eval_tasks: core and each task's accuracy) below the loss panel.
    metrics = sorted({name for run in runs for name in run.evals}, key=lambda name: (name != "core", name))
    figure, panels = plt.subplots(
        1 + len(metrics), 1, figsize=(8, 5 + 2.5 * len(metrics)), dpi=120, squeeze=False
    )
    axes = panels[0][0]
    try:
        for panel, name in zip(panels[1:], metrics, strict=True):
            for index, run in enumerate(runs):
                if run.evals.get(name):
                    steps, values = zip(*run.evals[name], strict=True)
                    panel[0].plot(
                        steps, values, color=f"C{index % 10}", marker="o", markersize=3, label=run.name
                    )
            panel[0].set_ylabel("CORE (centred)" if name == "core" else f"{name} accuracy")
            panel[0].set_xlabel("step")
            panel[0].grid(True, alpha=0.3)
            panel[0].legend()
        for index, run in enumerate(runs):
            color = f"C{index % 10}"
            if run.train:
                steps, losses = zip(*run.train, strict=True)
                axes.plot(steps, losses, color=color, linewidth=1.5, label=f"{run.name} train")
            if run.val:
                steps, losses = zip(*run.val, strict=True)
                axes.plot(
                    steps,
                    losses,
                    color=color,
                    linestyle="--",
                    marker="o",
                    markersize=4,
                    label=f"{run.name} val",
                )
        axes.set_xlabel("step")
        axes.set_ylabel("loss (nats per token)")
        axes.set_title(title or "loss curves: " + ", ".join(run.name for run in runs))
        axes.grid(True, alpha=0.3)
        axes.legend()
        figure.tight_layout()
        out.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(out, format="png")
    finally:
        plt.close(figure)
    return out
