"""The one checkpoint layout: what a training checkpoint holds, named here and nowhere else.

A checkpoint (format 2) is

    {"format": 2, "step": N, "created_at": ISO time,
     "config":  the user's config as written (token redacted),
     "plan":    the resolved run plan of the process that saved it (speedtronic.plan.RunPlan),
     "parts":   {name: part.state_dict()} over the run's stateful parts — PARTS below,
     "metrics": {"loss": …, "val_loss": …}}

A sharded run (`distributed.strategy: fsdp`) keeps "model" and "optimizer" out of that payload:
they go to a Distributed Checkpoint (torch.distributed.checkpoint) next to it, keyed by parameter
name (no rank count in it), each rank writing its own shards; the payload then says
`"sharded": ["model", "optimizer"]`. `read_checkpoint` consolidates them into whole tensors in one
process (what sample, export and inspect want); the trainer instead loads them straight into its
own layout, sharded over however many ranks it has (engine/checkpoint/parts.py), which reshards 2 → 1
or 1 → 2. Per-rank RNG states ride in the "rng" part as "ranks".

Writing and reading files (atomic saves, the `latest` pointer, weights-only loading) is
engine/checkpoint/files.py's job; this module maps a run to that payload and back, and finds the one a
starting run resumes from (`find_resume`, as `checkpoint.resume` says). Format 1 checkpoints
(the flat 17-key dict of the previous release) are upgraded in memory when read, so they still
resume, sample, export and inspect. Everything here treats a checkpoint as untrusted data: a missing
or mistyped entry is a CheckpointError naming it, never a KeyError.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from speedtronic.engine.checkpoint import files
from speedtronic.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from speedtronic.config import Config

# The stateful parts of a run, in the order they are restored.
PARTS = ("model", "optimizer", "scheduler", "grad_scaler", "data", "rng", "counters", "sync")
# Where each part lived in a format-1 checkpoint.
_V1_PARTS = {
    "model": "model",
    "optimizer": "optimizer",
    "scheduler": "scheduler",
    "grad_scaler": "grad_scaler",
    "data": "data_state",
    "rng": "rng",
    "sync": "coordinator",
}


@dataclass(frozen=True)
class RunCheckpoint:
    """One checkpoint of a run: where it is, the step, the user config, the plan and the parts."""

    step: int
    config: dict[str, Any]
    plan: dict[str, Any] | None  # None only for format-1 checkpoints, which stored no plan
    parts: dict[str, Any]
    metrics: dict[str, Any] = field(default_factory=dict)
    created_at: str | None = None
    path: Path | None = None
    format: int = files.CHECKPOINT_FORMAT
    # The Distributed Checkpoint holding "model" and "optimizer" (a sharded checkpoint), else None.
    sharded: Path | None = None

    def part(self, name: str) -> Any:
        """A part's state (None when the run had no such part, e.g. no grad scaler or no sync)."""
        return self.parts.get(name)

    def payload(self) -> dict[str, Any]:
        """The dict written to disk (engine/checkpoint/files.py adds "format" and "step")."""
        unknown = set(self.parts) - set(PARTS)
        if unknown:
            raise CheckpointError(f"unknown checkpoint parts {sorted(unknown)}; known: {', '.join(PARTS)}")
        return {
            "created_at": self.created_at or datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "config": self.config,
            "plan": self.plan,
            "parts": {name: self.parts[name] for name in PARTS if name in self.parts},
            "metrics": self.metrics,
        }


def write_checkpoint(directory: str | Path, checkpoint: RunCheckpoint, keep_last: int | None) -> Path:
    """Atomically save `checkpoint` as directory/step_N.pt, move `latest`, prune to `keep_last`."""
    return files.save_checkpoint(directory, checkpoint.step, checkpoint.payload(), keep_last=keep_last)


def read_checkpoint(path: str | Path, *, mmap: bool = False, consolidate: bool = True) -> RunCheckpoint:
    """Read a checkpoint file or a directory's latest (weights only), upgrading older formats.

    A sharded checkpoint's model and optimizer are consolidated into whole tensors in this process
    (no process group needed) unless `consolidate=False`, which leaves them on disk for the caller
    to load in its own layout (`load_sharded`)."""
    source = files.resolve_checkpoint(path)
    payload = files.load_file(source, mmap=mmap)
    if not files.is_sharded_checkpoint(source):
        return from_payload(payload, source)
    parts = payload.get("parts")
    if not isinstance(parts, dict):
        raise CheckpointError(f"{source} has no parts; it is corrupt, delete it")
    names = payload.get("sharded") or []
    shards = consolidate_shards(source) if consolidate else {}
    for name in names:
        parts[name] = shards.get(name, {}) if consolidate else {}
    model = parts.get("model")
    aliases = payload.get("aliases")
    if consolidate and isinstance(model, dict) and isinstance(aliases, dict):
        for alias, target in aliases.items():  # tied weights: one tensor under both names again
            if isinstance(model.get(target), torch.Tensor):
                model[alias] = model[target]
    if consolidate and not isinstance(shards.get("model"), dict):
        raise CheckpointError(f"{source} has no model weights in its shards; it is corrupt, delete it")
    return dataclasses.replace(from_payload(payload, source), sharded=source)


def find_resume(config: Config) -> RunCheckpoint | None:
    """The checkpoint this run resumes from, as `checkpoint.resume` says (auto: the latest, if any);
    a fresh start that would overwrite checkpoints is refused."""
    setting = config.checkpoint.resume
    directory = Path(config.checkpoint_dir())
    latest = files.latest_checkpoint(directory) if directory.exists() else None
    if latest is None:
        if setting is True:
            raise ConfigError(
                f"checkpoint.resume: no checkpoint in {directory} to resume from; "
                "run without --resume to start fresh"
            )
        return None
    if not config.checkpoint.enabled and setting is not True:
        return None  # this run writes no checkpoints, so it can neither overwrite nor auto-resume
    if setting is False:
        raise ConfigError(
            f"checkpoint.directory {directory} already holds {latest.name}; starting fresh would "
            "overwrite it. Resume with --resume, or pick another --set checkpoint.directory=… (or run.name)"
        )
    return read_checkpoint(latest, consolidate=False)  # shards are loaded in this run's own layout


def consolidate_shards(directory: Path) -> dict[str, Any]:
    """Every tensor of a Distributed Checkpoint, whole, in this process (the dcp_to_torch_save path)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    try:
        _load_state_dict(
            state,
            storage_reader=FileSystemReader(directory),
            planner=_EmptyStateDictLoadPlanner(),
            no_dist=True,
        )
    except Exception as error:  # DCP raises its own CheckpointException and plain OSErrors
        raise CheckpointError(
            f"{directory}: its shards cannot be read ({type(error).__name__}: {error})"
        ) from None
    return state


def tied_names(model: Any) -> dict[str, str]:
    """{name: the first name of the same parameter} for a module's tied weights."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in model.named_parameters(remove_duplicate=False):
        if id(tensor) in first:
            aliases[name] = first[id(tensor)]
        else:
            first[id(tensor)] = name
    return aliases


def write_sharded_checkpoint(
    directory: str | Path,
    checkpoint: RunCheckpoint,
    shards: dict[str, Any],
    keep_last: int | None,
    aliases: dict[str, str] | None = None,
) -> Path | None:
    """Save a sharded checkpoint, collectively: every rank calls this with its own `shards`
    ({"model": …, "optimizer": …} as DCP state dicts) and the same `checkpoint` (its other parts);
    `aliases` names the model's tied weights (`tied_names`), so consolidating restores the tie;
    rank 0 publishes the directory once every rank's shards are written. Returns the path on rank 0."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    distributed = dist.is_available() and dist.is_initialized()
    main = not distributed or dist.get_rank() == 0
    where: list[Any] = [None]
    if main:
        try:
            where[0] = str(files.begin_sharded(directory, checkpoint.step, keep_last))
        except CheckpointError as error:
            where[0] = error
    if distributed:
        dist.broadcast_object_list(where, src=0)
    if isinstance(where[0], CheckpointError):
        raise where[0]
    temp = Path(where[0])
    dcp.save(shards, checkpoint_id=temp, no_dist=not distributed)
    if distributed:
        dist.barrier()  # every rank's shards are on disk before the directory is published
    final = None
    if main:
        payload = checkpoint.payload()
        payload["sharded"] = sorted(shards)
        payload["aliases"] = dict(aliases or {})
        final = files.publish_sharded(directory, checkpoint.step, temp, payload, keep_last)
    if distributed:
        dist.barrier()  # nobody reads `latest` before it moved
    return final


def from_payload(payload: dict[str, Any], source: Path | None = None) -> RunCheckpoint:
    """A loaded payload as a RunCheckpoint (format 1 is converted: see the module docstring)."""
    where = source or "checkpoint"
    fmt = payload.get("format")
    if fmt == 1:
        payload = upgrade_v1(payload)
    config = payload.get("config")
    if not isinstance(config, dict):
        raise CheckpointError(f"{where} has no stored config, so its run cannot be rebuilt")
    parts = payload.get("parts")
    if not isinstance(parts, dict) or not isinstance(parts.get("model"), dict):
        raise CheckpointError(f"{where} has no model weights (parts.model); it is not a training checkpoint")
    plan = payload.get("plan")
    step = payload.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{where} has an invalid step {step!r}; it is corrupt, delete it")
    return RunCheckpoint(
        step=step,
        config=config,
        plan=plan if isinstance(plan, dict) else None,
        parts=parts,
        metrics=payload.get("metrics") if isinstance(payload.get("metrics"), dict) else {},
        created_at=payload.get("created_at") if isinstance(payload.get("created_at"), str) else None,
        path=source,
        format=int(fmt) if isinstance(fmt, int) else files.CHECKPOINT_FORMAT,
    )


def upgrade_v1(payload: dict[str, Any]) -> dict[str, Any]:
    """A format-1 payload in the format-2 layout (the conversion `checkpoint upgrade` writes out)."""
    parts = {new: payload[old] for new, old in _V1_PARTS.items() if payload.get(old) is not None}
    if "step" in payload:
        parts["counters"] = {
            "step": payload["step"],
            "tokens_seen": payload.get("tokens_seen", 0),
            "batches_consumed": payload.get("batches_consumed", 0),
        }
    return {
        "format": 2,
        "step": payload.get("step"),
        "created_at": payload.get("created_at"),
        "config": payload.get("config"),
        "plan": None,
        "parts": parts,
        "metrics": payload.get("metrics") or {},
    }


# ------------------------------------------------------------------------------------------- summary


def _jsonable(obj: Any) -> Any:
    """Plain JSON data for display: small tensors become lists, big ones a shape/dtype description."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        if obj.numel() <= 16:
            return obj.tolist()
        return {"tensor": list(obj.shape), "dtype": str(obj.dtype).removeprefix("torch.")}
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (bytes, bytearray)):
        return f"<{len(obj)} bytes>"
    return str(obj)


def _dig(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, dict):
            return None
        tree = tree.get(part)
    return _jsonable(tree)


_CONFIG_FIELDS = (
    "run.name",
    "model.name",
    "model.n_layer",
    "model.d_model",
    "model.n_head",
    "optimizer.name",
    "optimizer.lr",
    "data.block_size",
    "data.micro_batch_size",
)
_PLAN_FIELDS = (
    "total_steps",
    "stop_step",
    "vocab_size",
    "tokenizer",
    "max_seq_len",
    "world_size",
    "global_batch_size",
    "accum_steps",
    "precision",
    "compile",
    "compile_reason",
)


def _model_summary(model: Any) -> tuple[int | None, list[str] | None]:
    if not isinstance(model, dict):
        return None, None
    seen: set[tuple[Any, ...]] = set()
    count = 0
    dtypes: set[str] = set()
    for tensor in model.values():
        if not isinstance(tensor, torch.Tensor):
            continue
        dtypes.add(str(tensor.dtype).removeprefix("torch."))
        # Tied weights load as views of one storage; count each distinct view once.
        key = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.stride(),
        )
        if key not in seen:
            seen.add(key)
            count += tensor.numel()
    return count, sorted(dtypes)


def read_for_inspection(path: str | Path) -> RunCheckpoint:
    """Read a checkpoint memory-mapped where possible: inspecting a multi-GB one stays cheap."""
    file = files.resolve_checkpoint(path)
    if file.is_dir():
        return read_checkpoint(file)
    with open(file, "rb") as f:
        is_zip = f.read(2) == b"PK"  # only zip archives (torch.save's format) can be mapped
    return read_checkpoint(file, mmap=is_zip)


def checkpoint_summary(run: RunCheckpoint, plan: dict[str, Any] | None = None) -> dict[str, Any]:
    """A JSON-serialisable description of a checkpoint for `speedtronic checkpoint inspect`.

    `plan` stands in for the stored plan (a format-1 checkpoint has none; see restore.inspect)."""
    assert run.path is not None
    file = run.path
    parameter_count, parameter_dtypes = _model_summary(run.part("model"))
    config, plan = run.config, plan if plan is not None else run.plan

    optimizer = None
    opt_state = run.part("optimizer")
    if isinstance(opt_state, dict):
        groups = opt_state.get("param_groups")
        state = opt_state.get("state")
        optimizer = {
            "name": _dig(config, "optimizer.name"),
            "state_entries": len(state) if isinstance(state, dict) else None,
            "param_groups": len(groups) if isinstance(groups, list) else None,
            "lr": _jsonable(groups[0].get("lr")) if groups and isinstance(groups[0], dict) else None,
        }
    scheduler = None
    sched_state = run.part("scheduler")
    if isinstance(sched_state, dict):
        scheduler = {
            "name": (plan or {}).get("schedule") or _dig(config, "scheduler.name"),
            "last_lr": _jsonable(sched_state.get("_last_lr")),
            "last_epoch": _jsonable(sched_state.get("last_epoch")),
        }
    counters = run.part("counters") or {}
    return {
        "path": str(file),
        "size_bytes": files.checkpoint_size(file),
        "sharded": run.sharded is not None,
        "format": run.format,
        "step": run.step,
        "tokens_seen": _jsonable(counters.get("tokens_seen")),
        "parameter_count": parameter_count,
        "parameter_dtypes": parameter_dtypes,
        "vocab_size": _jsonable((plan or {}).get("vocab_size")),
        "optimizer": optimizer,
        "scheduler": scheduler,
        "precision": _jsonable((plan or {}).get("precision")),
        "data_position": _jsonable(run.part("data")),
        "parts": [name for name in PARTS if run.part(name) is not None],
        "config": {k: _dig(config, k) for k in _CONFIG_FIELDS},
        "plan": {k: _jsonable(plan.get(k)) for k in _PLAN_FIELDS} if plan else None,
        "metrics": _jsonable(run.metrics),
        "created": run.created_at,
    }
