"""Evaluation task files and suites: reading them (untrusted input), and the arithmetic of their scores.

A task file is JSON lines, one example an object:

* multiple choice: ``{"context": str, "choices": [str, ...], "label": int}`` — the model is right when
  the labelled choice is the likeliest continuation of the context (``acc``: summed log-likelihood;
  ``acc_norm``: log-likelihood per character of the choice, as the LM Evaluation Harness normalises);
* completion: ``{"context": str, "answer": str}`` — right when the greedy continuation of the context
  is the answer's tokens (exact match).

One file holds one kind. Other keys (an ``id``, a source) are allowed and ignored. A suite is a YAML
file naming tasks (``tasks: [name-or-path, {task: name-or-path, metric: acc_norm}, ...]``), paths
relative to the suite; shipped tasks and suites (resources/tasks/) are reachable by short name.

The aggregate is nanochat's CORE: each task's accuracy centred on chance,
``centred = (accuracy - chance) / (1 - chance)`` (0 at chance, 1 when always right, negative below
chance), averaged with equal weight over the tasks. Chance is the mean of ``1 / len(choices)`` over a
multiple-choice task's examples and 0 for a completion task.

Nothing here imports torch: task files are checked before a model is loaded.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from speedtronic.errors import ConfigError

MAX_TASK_BYTES = 64 << 20  # a task file is read whole; a bigger one is surely not a task file
MAX_SUITE_BYTES = 1 << 20
KINDS = ("multiple_choice", "completion")
METRICS = {"multiple_choice": ("acc", "acc_norm"), "completion": ("exact_match",)}
_SHIPPED = "speedtronic.resources"


@dataclass(frozen=True)
class Example:
    context: str
    choices: tuple[str, ...] = ()  # multiple choice
    label: int = 0
    answer: str = ""  # completion


@dataclass(frozen=True)
class Task:
    """One task: its examples (all of one kind) and the metric that is its headline accuracy."""

    name: str
    source: str  # the file it came from, for messages
    kind: str
    examples: tuple[Example, ...]
    metric: str

    @property
    def chance(self) -> float:
        if self.kind == "completion":
            return 0.0
        return sum(1.0 / len(e.choices) for e in self.examples) / len(self.examples)


@dataclass
class Suite:
    name: str
    tasks: list[Task] = field(default_factory=list)


def shipped_dir() -> Path:
    """The folder of the shipped task files and suites."""
    return Path(str(resources.files(_SHIPPED).joinpath("tasks")))


def shipped_names() -> list[str]:
    folder = shipped_dir()
    if not folder.is_dir():
        return []
    return sorted(p.stem for p in folder.iterdir() if p.suffix in (".jsonl", ".yaml"))


def _read(path: Path, limit: int, what: str) -> str:
    if not path.is_file():  # a FIFO or device is not a file: never opened
        raise ConfigError(f"{what} {path} is not a regular file; name a .jsonl task or .yaml suite")
    size = path.stat().st_size
    if size > limit:
        raise ConfigError(f"{what} {path} is {size:,} bytes; at most {limit:,} are read")
    try:
        return path.read_bytes()[:limit].decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"{what} {path}: not UTF-8 ({error.reason}); re-encode it as UTF-8") from None
    except OSError as error:
        raise ConfigError(f"{what} {path}: cannot read it ({error.strerror})") from None


def _example(record: Any, where: str) -> tuple[str, Example]:
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: an example must be a JSON object, not {type(record).__name__}")
    context = record.get("context")
    if not isinstance(context, str) or not context:
        raise ConfigError(f"{where}: 'context' must be a non-empty string (the text the model continues)")
    if "choices" in record:
        choices, label = record.get("choices"), record.get("label")
        if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) for c in choices):
            raise ConfigError(f"{where}: 'choices' must be a list of at least 2 strings")
        if any(not c for c in choices):
            raise ConfigError(f"{where}: a choice is empty; every choice needs at least one character")
        if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(choices):
            raise ConfigError(
                f"{where}: 'label' must be the index of the right choice, an integer in 0..{len(choices) - 1}"
            )
        return "multiple_choice", Example(context, tuple(choices), label)
    answer = record.get("answer")
    if "answer" not in record:
        raise ConfigError(
            f"{where}: an example needs 'choices' and 'label' (multiple choice) or 'answer' (completion)"
        )
    if not isinstance(answer, str) or not answer:
        raise ConfigError(f"{where}: 'answer' must be a non-empty string")
    return "completion", Example(context, answer=answer)


def read_task(path: str | Path, *, name: str | None = None, metric: str | None = None) -> Task:
    """A task file, checked line by line; any fault is a ConfigError naming file:line (exit 2)."""
    path = Path(path)
    text = _read(path, MAX_TASK_BYTES, "task file")
    kind: str | None = None
    examples: list[Example] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
        except RecursionError:
            raise ConfigError(f"{where}: JSON nested too deeply") from None
        this, example = _example(record, where)
        if kind is not None and this != kind:
            raise ConfigError(
                f"{where}: a {this.replace('_', '-')} example in a {kind.replace('_', '-')} task; "
                "put each kind in its own file"
            )
        kind = this
        examples.append(example)
    if kind is None:
        raise ConfigError(f"task file {path} holds no examples (one JSON object a line)")
    metric = metric or METRICS[kind][0]
    if metric not in METRICS[kind]:
        raise ConfigError(
            f"{path}: metric {metric!r} does not apply to a {kind.replace('_', '-')} task "
            f"(use {' or '.join(METRICS[kind])})"
        )
    return Task(name or path.stem, str(path), kind, tuple(examples), metric)


def read_suite(path: str | Path) -> Suite:
    """A suite file: `name` (optional) and `tasks`, each a name or path, or {task, metric}."""
    from speedtronic.config.strict_yaml import parse_yaml

    path = Path(path)
    data = parse_yaml(_read(path, MAX_SUITE_BYTES, "suite file"), str(path))
    if not isinstance(data, dict) or set(data) - {"name", "tasks"} or not isinstance(data.get("tasks"), list):
        raise ConfigError(f"suite {path}: must be a mapping with a 'tasks' list (and optionally a 'name')")
    if not data["tasks"]:
        raise ConfigError(f"suite {path}: 'tasks' is empty; name at least one task")
    suite = Suite(str(data.get("name") or path.stem))
    for index, entry in enumerate(data["tasks"]):
        where = f"suite {path}: tasks[{index}]"
        metric = None
        if isinstance(entry, dict):
            if set(entry) - {"task", "metric", "name"} or not isinstance(entry.get("task"), str):
                raise ConfigError(f"{where}: give 'task' (a name or path) and optionally 'metric' and 'name'")
            metric, spec, name = entry.get("metric"), entry["task"], entry.get("name")
            if metric is not None and metric not in ("acc", "acc_norm", "exact_match"):
                raise ConfigError(f"{where}: metric {metric!r} is not acc, acc_norm or exact_match")
        elif isinstance(entry, str):
            spec, name = entry, None
        else:
            raise ConfigError(f"{where}: a task is a name, a path, or a mapping with 'task'")
        found = _task_path(spec, relative_to=path.parent)
        if found is None or found.suffix in (".yaml", ".yml"):
            raise ConfigError(f"{where}: {spec!r} is not a task file nor a shipped task ({_known()})")
        suite.tasks.append(read_task(found, name=name, metric=metric))
    return suite


def _known() -> str:
    return "shipped: " + (", ".join(shipped_names()) or "none")


def _task_path(spec: str, relative_to: Path | None = None) -> Path | None:
    candidates = [Path(spec).expanduser()]
    if relative_to is not None and not Path(spec).is_absolute():
        candidates.insert(0, relative_to / spec)
    for candidate in candidates:
        if candidate.exists():
            return candidate
    if "/" not in spec and "\\" not in spec:
        for suffix in (".jsonl", ".yaml"):
            shipped = shipped_dir() / f"{spec}{suffix}"
            if shipped.is_file():
                return shipped
    return None


def load_tasks(specs: list[str], field_name: str = "--task") -> list[Task]:
    """Tasks from `--task` values: task files, suite files, or shipped short names. Names must be
    unique (they key the results)."""
    tasks: list[Task] = []
    for spec in specs:
        path = _task_path(spec)
        if path is None:
            raise ConfigError(f"{field_name} {spec!r}: no such file nor shipped task or suite ({_known()})")
        if path.suffix in (".yaml", ".yml"):
            tasks += read_suite(path).tasks
        else:
            tasks.append(read_task(path))
    seen: set[str] = set()
    for task in tasks:
        if task.name in seen or task.name == "aggregate":
            raise ConfigError(
                f"{field_name}: two tasks are named {task.name!r} (a task is named by its file's stem); "
                "rename one, or give it a name in a suite"
            )
        seen.add(task.name)
    return tasks


# ---------------------------------------------------------------------------------------- arithmetic


def mean_stderr(hits: list[bool]) -> float | None:
    """The standard error of a mean of 0/1 outcomes (sample standard deviation / sqrt(n), as the LM
    Evaluation Harness reports it); None for fewer than 2 examples."""
    n = len(hits)
    if n < 2:
        return None
    p = sum(hits) / n
    return math.sqrt(p * (1.0 - p) / (n - 1))


def centred(accuracy: float, chance: float) -> float:
    """Accuracy centred on chance: 0 at chance, 1 at perfect (CORE's per-task score)."""
    return (accuracy - chance) / (1.0 - chance) if chance < 1.0 else 0.0


def core_score(results: dict[str, dict[str, Any]]) -> float | None:
    """The mean of the tasks' centred accuracies (None with no tasks)."""
    if not results:
        return None
    return sum(r["centred"] for r in results.values()) / len(results)
