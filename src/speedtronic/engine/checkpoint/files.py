"""Checkpoint files: atomic saves, the ``latest`` pointer, pruning, safe loading and summaries.

A checkpoint directory holds ``step_00000123.pt`` files (one ``torch.save`` zip archive each) and a
``latest`` text file naming the newest complete one. A sharded run (``distributed.strategy: fsdp``)
writes ``step_00000123.dcp`` directories instead: a Distributed Checkpoint of the model and optimizer
(one file per rank, written by every rank) plus ``run.pt``, the rest of the payload; the directory is
filled under a hidden temp name and renamed into place once complete, so it too is all or nothing. Every write goes to a hidden temp file in the
same directory, is fsynced and then renamed into place, so a crash at any moment leaves either the old
file or the new one, never half of one. One process writes to a directory at a time (rank 0).

This module never unpickles arbitrary objects: every load goes through ``torch.load(weights_only=True)``,
which only rebuilds tensors and plain data, and a file that needs anything else is refused with a
``CheckpointError``. Saves check the payload up front so that a checkpoint which could not be loaded
back is never written in the first place.
"""

from __future__ import annotations

import logging
import os
import pickle
import pickletools
import re
import secrets
import shutil
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

import torch

from speedtronic.atomic_files import atomic_write
from speedtronic.errors import CheckpointError, PathNotFound

__all__ = [
    "CHECKPOINT_FORMAT",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_file",
    "pack_python_rng",
    "resolve_checkpoint",
    "save_checkpoint",
    "unpack_python_rng",
]

logger = logging.getLogger(__name__)

# Bump when the payload layout changes incompatibly; loaders refuse formats newer than this. The layout
# of each format (and the upgrade of older ones) is in engine/checkpoint/layout.py.
CHECKPOINT_FORMAT = 2

LATEST_POINTER = "latest"
_STEP_RE = re.compile(r"step_(\d+)\.(pt|dcp)")
SHARDED_SUFFIX = ".dcp"
RUN_FILE = "run.pt"  # inside a sharded checkpoint directory: everything but the DCP shards
# Our own temp names only (".step_00000123.pt.<hex>.tmp", ".latest.<hex>.tmp"), so cleanup can never
# touch a file this module did not create.
_TMP_RE = re.compile(r"\.(step_\d+\.pt|step_\d+\.dcp|latest)\.[0-9a-f]+\.tmp")
# Phrases torch's weights-only unpickler uses when it meets something other than tensors/plain data.
_REFUSED_RE = re.compile(r"GLOBAL|unrecognized function|Can only create new object|must be imported to load")
_PICKLE_OBJECT_OPS = {"GLOBAL", "STACK_GLOBAL", "INST", "OBJ", "REDUCE", "NEWOBJ", "NEWOBJ_EX", "BUILD"}


def _step_name(step: int, suffix: str = ".pt") -> str:
    return f"step_{step:08d}{suffix}"


def is_sharded_checkpoint(path: Path) -> bool:
    """A sharded checkpoint: a directory holding the run file and DCP's metadata."""
    return path.is_dir() and (path / RUN_FILE).is_file() and (path / ".metadata").is_file()


def _is_checkpoint(path: Path) -> bool:
    return path.is_file() if path.suffix == ".pt" else is_sharded_checkpoint(path)


# --------------------------------------------------------------------------------------------- saving


def _unloadable(obj: Any, where: str) -> str | None:
    """Where ``obj`` holds something ``torch.load(weights_only=True)`` would refuse, else None."""
    if obj is None or type(obj) in (bool, int, float, complex, str, bytes, bytearray):
        return None
    if type(obj) in (torch.Tensor, torch.nn.Parameter) or isinstance(obj, (torch.dtype, torch.device)):
        return None
    found = None
    if type(obj) in (dict, OrderedDict, Counter):
        for key, value in obj.items():
            found = _unloadable(key, f"{where} key {key!r}") or _unloadable(value, f"{where}[{key!r}]")
            if found:
                break
        return found
    if type(obj) in (list, tuple, set, torch.Size):
        for i, value in enumerate(obj):
            found = _unloadable(value, f"{where}[{i}]")
            if found:
                break
        return found
    return f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}"


def save_checkpoint(
    directory: str | Path, step: int, payload: dict[str, Any], keep_last: int | None = None
) -> Path:
    """Atomically write ``directory/step_{step:08d}.pt``, point ``latest`` at it, prune, return its path.

    ``payload`` is saved with ``format`` and ``step`` added (the caller's dict is not modified).
    ``keep_last`` keeps that many highest-numbered step files up to this one (None or 0 keeps all): the
    file just written and the ``keep_last - 1`` highest below it. Files numbered above it (an
    abandoned run's, or junk such as a planted ``step_99999999.pt``) neither count nor are deleted.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if keep_last is not None and keep_last < 0:
        raise ValueError(f"keep_last must be None or >= 0, got {keep_last!r}")
    directory = Path(directory)
    data = {**payload, "format": CHECKPOINT_FORMAT, "step": step}
    final = directory / _step_name(step)
    # Catch it now rather than at resume time, hours later, when the file would be refused.
    problem = _unloadable(data, "payload")
    if problem:
        raise CheckpointError(
            f"cannot save checkpoint {final}: {problem}, which load_checkpoint would refuse; "
            "convert it to tensors or plain dict/list/str/int/float data"
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # Prune first too: a save killed between its rename and its prune leaves one extra file, and
        # without this, every such kill in a row would add another.
        _prune(directory, step, keep_last)
        atomic_write(final, lambda f: _torch_save(data, f))
        # The pointer moves only after the step file is durable, so it never names a partial file.
        atomic_write(directory / LATEST_POINTER, lambda f: f.write(f"{final.name}\n".encode()))
    except OSError as exc:
        # The atomic write has already removed its temp file, so nothing half-written stays.
        reason = exc.strerror or _first_line(exc)
        raise CheckpointError(
            f"could not write checkpoint {final} ({reason}); make sure checkpoint.directory is a "
            "writable directory with free space (the previous checkpoint is untouched)"
        ) from None
    _prune(directory, step, keep_last)
    return final


def _prune(directory: Path, step: int, keep_last: int | None) -> None:
    """Before and after writing step `step`: keep `keep_last - 1` step files below it (the one being
    written is the last kept). Pruning is housekeeping: it logs problems but never fails a save."""
    doomed: list[Path] = []
    try:
        if keep_last:
            older = [p for s, p in list_checkpoints(directory) if s < step]
            doomed += older[: max(0, len(older) - (keep_last - 1))]
        # Temp files left by a save that was killed; ours are all finished by now.
        doomed += [p for p in directory.iterdir() if _TMP_RE.fullmatch(p.name)]
    except OSError as exc:
        logger.warning("could not list %s to prune old checkpoints: %s", directory, exc)
    for path in doomed:
        try:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        except OSError as exc:
            logger.warning("could not remove old checkpoint file %s: %s", path, exc)


def begin_sharded(directory: str | Path, step: int, keep_last: int | None = None) -> Path:
    """Make the hidden temp directory a sharded checkpoint of `step` is written into (by every rank),
    after pruning; `publish_sharded` completes it. Called on one rank."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _prune(directory, step, keep_last)
        temp = directory / f".{_step_name(step, SHARDED_SUFFIX)}.{secrets.token_hex(4)}.tmp"
        temp.mkdir()
    except OSError as exc:
        raise CheckpointError(
            f"could not create a checkpoint in {directory} ({exc.strerror or exc}); make sure "
            "checkpoint.dir is a writable directory with free space"
        ) from exc
    return temp


def publish_sharded(
    directory: str | Path, step: int, temp: Path, payload: dict[str, Any], keep_last: int | None = None
) -> Path:
    """Write the run file into `temp` (whose DCP shards every rank has finished), rename it to
    ``step_N.dcp`` and move ``latest`` to it, then prune. Called on one rank."""
    directory = Path(directory)
    data = {**payload, "format": CHECKPOINT_FORMAT, "step": step}
    final = directory / _step_name(step, SHARDED_SUFFIX)
    problem = _unloadable(data, "payload")
    if problem:
        shutil.rmtree(temp, ignore_errors=True)
        raise CheckpointError(
            f"cannot save checkpoint {final}: {problem}, which load_checkpoint would refuse"
        )
    try:
        atomic_write(temp / RUN_FILE, lambda f: torch.save(data, f))
        _fsync_dir(temp)
        if final.exists():  # the same step saved again (a re-run): the new one replaces it
            if final.is_dir():
                shutil.rmtree(final)
            else:
                final.unlink()
        os.replace(temp, final)
        _fsync_dir(directory)
        atomic_write(directory / LATEST_POINTER, lambda f: f.write(f"{final.name}\n".encode()))
    except OSError as exc:
        raise CheckpointError(
            f"could not write checkpoint {final} ({exc.strerror or exc}); make sure checkpoint.dir is a "
            "writable directory with free space"
        ) from exc
    _prune(directory, step, keep_last)
    return final


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def checkpoint_size(path: Path) -> int:
    """Bytes on disk of a checkpoint file, or of every file of a sharded checkpoint."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


# ---------------------------------------------------------------------------------------- resolution


def list_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """All ``step_*.pt`` files (and ``step_*.dcp`` folders) in ``directory`` as ``(step, path)``, sorted
    by step; [] if none. A symbolic link is never one: a checkpoint directory holds its own files."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _STEP_RE.fullmatch(path.name)
        if match and not path.is_symlink() and _is_checkpoint(path):
            found.append((int(match.group(1)), path))
    return sorted(found, key=lambda item: (item[0], item[1].name))


def _read_pointer(directory: Path) -> tuple[Path | None, str]:
    """The file ``latest`` names, or None plus why it cannot be used."""
    pointer = directory / LATEST_POINTER
    try:
        with open(pointer, "rb") as f:
            name = f.read(4096).decode("utf-8").strip()
    except FileNotFoundError:
        return None, "missing"
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"unreadable ({exc})"
    # A bare file name only: a pointer must never lead outside its directory.
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        return None, f"corrupt ({name[:60]!r})"
    target = directory / name
    if target.is_symlink():
        return None, f"a symbolic link ({name}); a checkpoint directory holds its own files"
    if not _is_checkpoint(target):
        return None, f"dangling (names {name}, which does not exist)"
    return target, ""


def latest_checkpoint(directory: str | Path) -> Path | None:
    """Like ``resolve_checkpoint`` but returns None when there is no checkpoint."""
    path = Path(directory)
    if path.is_file() or is_sharded_checkpoint(path):
        return path
    if not path.is_dir():
        return None
    target, problem = _read_pointer(path)
    if target is not None:
        return target
    # Trust the pointer over the highest number when it is valid (a resumed run may save lower steps);
    # otherwise the highest step that loads and holds the step its name says (a junk or planted
    # step_99999999.pt is skipped, said once).
    for _, candidate in reversed(list_checkpoints(path)):
        try:
            load_file(candidate, mmap=candidate.suffix == ".pt")
        except CheckpointError as error:
            logger.warning("skipping %s: %s", candidate, error)
            continue
        logger.warning("checkpoint pointer %s is %s; using %s", path / LATEST_POINTER, problem, candidate)
        return candidate
    return None


def resolve_checkpoint(path: str | Path) -> Path:
    """A file → itself; a directory → the file its ``latest`` names (else the highest step_*.pt)."""
    path = Path(path)
    if not path.exists():
        raise PathNotFound(f"checkpoint path {path} does not exist; check the path or train first")
    found = latest_checkpoint(path)
    if found is None:
        raise CheckpointError(f"no checkpoint in {path}; train with checkpoint.enabled: true first")
    return found


def _torch_save(data: Any, file: Any) -> None:
    """torch.save, with a failed write (a full disk, a file-size limit) raised as the OSError it is:
    torch's zip writer reports it as a RuntimeError ("[enforce fail at inline_container.cc] …")."""
    try:
        torch.save(data, file)
    except RuntimeError as error:
        if "inline_container" not in str(error) and "write" not in str(error).lower():
            raise
        raise OSError("the write failed: no space left or the file-size limit reached") from None


# ------------------------------------------------------------------------------------------- loading


def _first_line(exc: BaseException, limit: int = 120) -> str:
    text = str(exc)
    # The weights-only unpickler buries the actual problem under a paragraph of advice.
    text = text.partition("WeightsUnpickler error:")[2] or text
    text = [line.strip() for line in text.splitlines() if line.strip()]
    line = text[0].split(". ")[0] if text else type(exc).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _raw_pickle_has_objects(path: Path) -> bool | None:
    """Scan (never execute) a raw pickle's opcodes: True if it builds objects, None if unparseable."""
    try:
        with open(path, "rb") as f:
            return any(op.name in _PICKLE_OBJECT_OPS for op, _, _ in pickletools.genops(f))
    except Exception:
        return None


def _load_error(path: Path, exc: Exception) -> CheckpointError:
    """Turn whatever torch.load raised into one actionable line."""
    if isinstance(exc, OSError):
        return CheckpointError(
            f"cannot read checkpoint {path} ({exc.strerror or exc}); check its permissions"
        )
    try:
        with open(path, "rb") as f:
            header = f.read(4)
    except OSError:
        header = b""
    refused = isinstance(exc, pickle.UnpicklingError) and bool(_REFUSED_RE.search(str(exc)))
    bare_pickle = None
    if header[:1] == b"\x80" and not refused:
        # Not a torch.save zip archive but a bare pickle: the unpickler may have stopped on an opcode it
        # does not support before reaching any global, so look at the opcodes ourselves.
        bare_pickle = _raw_pickle_has_objects(path)
        refused = bool(bare_pickle)
    if refused:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        detail = f"; found {found.group(1)}" if found else ""
        return CheckpointError(
            f"checkpoint {path} contains arbitrary Python objects and was refused "
            f"(only tensors and plain data are loaded{detail})"
        )
    if not header:
        reason = "empty file"
    elif bare_pickle is False:
        reason = "a bare pickle, not a torch.save zip archive"
    elif header[:2] != b"PK" and header[:1] != b"\x80":
        reason = "not a torch.save zip archive"
    else:
        reason = _first_line(exc)
    return CheckpointError(
        f"checkpoint {path} is truncated or corrupt ({reason}); delete it or resume from an earlier step_*.pt"
    )


def _validate(path: Path, payload: Any) -> dict[str, Any]:
    if not isinstance(payload, dict):
        raise CheckpointError(
            f"checkpoint {path} holds a {type(payload).__name__}, not a speedtronic checkpoint dict; "
            "point at a step_*.pt written by speedtronic"
        )
    fmt = payload.get("format")
    if fmt is None:
        raise CheckpointError(
            f"checkpoint {path} has no 'format' field, so speedtronic did not write it; "
            "point at a step_*.pt written by speedtronic"
        )
    if isinstance(fmt, bool) or not isinstance(fmt, int) or fmt < 1:
        raise CheckpointError(f"checkpoint {path} has an invalid format {fmt!r}; it is corrupt, delete it")
    match = _STEP_RE.fullmatch(path.name) or _STEP_RE.fullmatch(path.parent.name)
    saved = payload.get("step")
    if match and saved != int(match.group(1)):
        raise CheckpointError(
            f"checkpoint {path} is named for step {int(match.group(1))} but holds step {saved!r}; it was "
            "renamed or planted: resume from another step_*.pt"
        )
    if fmt > CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint {path} has format {fmt}, newer than this speedtronic reads ({CHECKPOINT_FORMAT}); "
            "upgrade speedtronic to load it"
        )
    return payload


def _load(path: Path, map_location: str | torch.device, mmap: bool = False) -> dict[str, Any]:
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as exc:
        raise _load_error(path, exc) from exc
    return _validate(path, payload)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Resolve ``path`` (file or directory) and load it with tensors and plain data only."""
    return _load(resolve_checkpoint(path), map_location)


def load_file(path: Path, *, mmap: bool = False) -> dict[str, Any]:
    """Load one checkpoint file onto the CPU (tensors and plain data only), optionally memory-mapped;
    for a sharded checkpoint, its run file (the shards are read through run_checkpoint.py)."""
    if path.is_dir():
        path = path / RUN_FILE
    return _load(path, "cpu", mmap=mmap)


# ------------------------------------------------------------------------------------------ RNG state


def pack_python_rng(state: tuple[Any, ...]) -> tuple[int, tuple[int, ...], float | None]:
    """``random.getstate()`` in a form weights-only loading accepts (it already is; this validates it)."""
    return _python_rng(state)


def unpack_python_rng(obj: Any) -> tuple[int, tuple[int, ...], float | None]:
    """A stored Python RNG state back as the exact tuple ``random.setstate`` requires."""
    return _python_rng(obj)


def _python_rng(obj: Any) -> tuple[int, tuple[int, ...], float | None]:
    # random.setstate insists on tuples (not lists) and fails with an obscure TypeError otherwise.
    try:
        version, internal, gauss = obj
        result = (int(version), tuple(int(x) for x in internal), None if gauss is None else float(gauss))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            "checkpoint Python RNG state is malformed (expected random.getstate() layout); "
            "resume from another step_*.pt"
        ) from exc
    return result
