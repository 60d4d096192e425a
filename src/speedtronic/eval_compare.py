"""Several models under one evaluation: checkpoints side by side, and a DiLoCo run's global model.

`speedtronic eval A B --global BUS` scores each checkpoint and the bus's latest global model on the
same data and tasks (and harness tasks), so "is the global model better than any single node's?"
is one command: the comparison rows hold bits per byte, loss, each task's accuracy and the CORE
aggregate per model.

The global model is a bus file (diloco/codec.py: weights keyed by unique parameter, no config), so
it is scored in the architecture of the first checkpoint: that run is rebuilt (engine/checkpoint/load_run.py)
and the global's weights, validated against its parameter shapes like any global a worker installs,
are copied in. The bus's manifest fingerprint must match that run's parameters, or the global is
refused (a worker of another run cannot lend it its shape).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speedtronic.errors import ConfigError


@dataclass
class Subject:
    """One model to evaluate: what the report calls it, and the model with its tokenizer."""

    label: str
    checkpoint: str
    step: int
    model: Any
    tokenizer: Any
    max_seq_len: int


def subjects(
    checkpoints: list[Path], global_bus: str | None, *, device: str, registries: Any
) -> Iterator[Subject]:
    """Each checkpoint's model, then (with `global_bus`) the bus's latest global in the first
    checkpoint's architecture; one at a time, so only one model is in memory."""
    from speedtronic.engine.checkpoint.load_run import load_run

    for path in checkpoints:
        run = load_run(path, device=device, registries=registries)
        yield Subject(
            str(path), str(run.path), run.checkpoint.step, run.model, run.tokenizer, run.plan.max_seq_len
        )
        del run
    if global_bus is not None:
        run = load_run(checkpoints[0], device=device, registries=registries)
        step = install_global(run.model, global_bus)
        yield Subject("global", global_bus, step, run.model, run.tokenizer, run.plan.max_seq_len)


def install_global(model: Any, bus_url: str) -> int:
    """Copy the bus's latest global model into `model` (in place); returns its outer step."""
    import torch

    from speedtronic.diloco import codec
    from speedtronic.diloco.bus.base import BusError
    from speedtronic.diloco.bus.registry import open_bus
    from speedtronic.diloco.manifest import check_manifest
    from speedtronic.diloco.spec import global_bytes_cap

    specs = codec.param_specs(model)
    try:
        bus = open_bus(bus_url, retry_budget_s=10.0, retry_attempts=3, retry_max=2.0)
        manifest = bus.read_manifest()
        if manifest is None:
            raise ConfigError(f"--global {bus_url}: no DiLoCo run there (manifest.json is missing)")
        check_manifest(manifest, specs, bus_url)  # the global has this model's parameters
        head = bus.read_head()
        if head is None:
            raise ConfigError(f"--global {bus_url}: no global model published yet (head.json is missing)")
        data = bus.read_global_capped(head, global_bytes_cap(specs))  # never a file past the model's size
    except BusError as error:
        raise ConfigError(f"--global {bus_url}: cannot read the global model ({error})") from None
    try:
        decoded = codec.decode(data, specs, kind="global")
    except codec.Rejected as error:
        raise ConfigError(f"--global {bus_url}: the global model is unusable ({error})") from None
    params = codec.unique_params(model)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(decoded.tensors[name].to(p.device, p.dtype))
    return decoded.int("outer_step", int(head.get("outer_step", -1)))


def comparison(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per model: label, step, bits per byte, loss, each task's accuracy, CORE, and the
    harness tasks' first metric (the same columns for every row; null where a model lacks one)."""
    tasks: list[str] = []
    harness: list[tuple[str, str]] = []
    for report in reports:
        tasks += [t for t in report.get("tasks") or {} if t not in tasks]
        for task, metrics in ((report.get("harness") or {}).get("results") or {}).items():
            metric = headline(metrics)
            if metric is not None and (task, metric) not in harness:
                harness.append((task, metric))
    rows = []
    for report in reports:
        results = (report.get("harness") or {}).get("results") or {}
        row: dict[str, Any] = {
            "label": report.get("label"),
            "step": report.get("step"),
            "bits_per_byte": report.get("bits_per_byte"),
            "loss": report.get("loss"),
        }
        row.update({t: (report.get("tasks") or {}).get(t, {}).get("accuracy") for t in tasks})
        row["core"] = (report.get("accuracy") or {}).get("aggregate")
        row.update({f"{t}/{m}": (results.get(t) or {}).get(m) for t, m in harness})
        rows.append(row)
    return rows


def headline(metrics: dict[str, Any]) -> str | None:
    """A harness task's headline metric key ("acc,none", "bits_per_byte,none", …): the first
    numeric one that is not a standard error (metric keys are "metric,filter"; sample_len is not one)."""
    for key, value in metrics.items():
        if "," in key and "stderr" not in key and isinstance(value, (int, float)):
            return key
    return None
