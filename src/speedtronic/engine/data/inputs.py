"""Finding the input files of ``data prepare`` and cutting them into work units for the worker pool.

An input spec is a file, a folder (searched recursively, in sorted order) or a glob. Each file has
a *kind* from its name: ``.txt`` (one document per file), ``.jsonl`` / ``.json`` (one record per
line, or a JSON array), ``.parquet`` (one record per row), optionally compressed ``.gz`` (stdlib)
or ``.zst`` (the ``zstandard`` package). A folder contributes only files of a known kind; a file
named explicitly with another suffix is read as text.

Inputs are untrusted: only regular files are read (a FIFO or device in a folder would block or
never end), and symbolic links are not followed out of a folder. A :class:`Unit` is a piece of one
file small enough for one worker task: a newline-aligned byte range of an uncompressed text or
JSONL file, one Parquet row group, or a whole compressed file (a compressed stream cannot seek).
Planning depends only on the files' contents and sizes, so a resumed run plans the same units.
"""

from __future__ import annotations

import glob
import itertools
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speedtronic.errors import DataError

from .text import align_to_line

__all__ = ["DEFAULT_UNIT_BYTES", "InputFile", "Unit", "find_inputs", "plan_units"]

#: Bytes of uncompressed text per work unit: big enough to amortise a task, small enough to balance.
DEFAULT_UNIT_BYTES = 4 << 20

_KINDS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
}
_COMPRESSIONS = {".gz": "gz", ".zst": "zst"}


@dataclass(frozen=True)
class InputFile:
    """One input file: its kind (``text``/``jsonl``/``parquet``), compression and identity."""

    path: str
    kind: str
    compression: str | None
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class Unit:
    """A piece of one input file processed by one task.

    ``start``/``end`` are a byte range (text, JSONL) or a row-group index range (Parquet); ``end``
    is -1 for "to the end" (compressed files). ``first``/``last``: the unit starts/ends its file,
    which for a text file is where its document starts/ends.
    """

    file: InputFile
    start: int
    end: int
    first: bool
    last: bool


def _kind_of(path: Path, explicit: bool) -> tuple[str, str | None] | None:
    suffixes = [s.lower() for s in path.suffixes]
    compression = _COMPRESSIONS.get(suffixes[-1]) if suffixes else None
    if compression:
        suffixes = suffixes[:-1]
    kind = _KINDS.get(suffixes[-1]) if suffixes else None
    if kind == "parquet" and compression:
        return None  # Parquet compresses internally; a .parquet.gz is not something pyarrow reads
    if kind is None:
        return ("text", compression) if explicit else None
    return kind, compression


def _regular(path: Path) -> os.stat_result | None:
    """stat of ``path`` if it is a regular file (following a link named explicitly), else None."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def _input_file(path: Path, explicit: bool) -> InputFile | None:
    kind = _kind_of(path, explicit)
    st = _regular(path)
    if kind is None or st is None:
        return None
    return InputFile(str(path), kind[0], kind[1], st.st_size, st.st_mtime_ns)


def _walk(folder: Path) -> list[Path]:
    found: list[Path] = []
    # followlinks=False: a link to a folder elsewhere is not entered; hidden names (.git, ...) skipped.
    for root, dirs, files in os.walk(folder, followlinks=False):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [Path(root) / name for name in sorted(files) if not name.startswith(".")]
    return found


def find_inputs(specs: str | os.PathLike[str] | list[str | os.PathLike[str]]) -> list[InputFile]:
    """The input files named by ``specs`` (files, folders, globs), in a stable order, without repeats.

    Raises :class:`DataError` for a spec that names nothing readable.
    """
    if isinstance(specs, (str, os.PathLike)):
        specs = [specs]
    out: list[InputFile] = []
    seen: set[str] = set()
    for spec in specs:
        text = os.fspath(spec)
        path = Path(text).expanduser()
        if path.is_dir():
            files = [f for f in (_input_file(p, explicit=False) for p in _walk(path)) if f is not None]
            if not files:
                raise DataError(
                    f"folder {path} holds no .txt, .jsonl, .json or .parquet files (optionally .gz/.zst); "
                    "point at the files or rename them"
                )
        elif any(c in text for c in "*?["):
            matches = sorted(glob.glob(os.path.expanduser(text), recursive=True))
            files = [f for f in (_input_file(Path(m), explicit=False) for m in matches) if f is not None]
            if not files:
                raise DataError(f"the pattern {text!r} matches no .txt, .jsonl, .json or .parquet files")
        elif path.exists():
            one = _input_file(path, explicit=True)
            if one is None:
                why = "is not a regular file" if _regular(path) is None else "is a compressed Parquet file"
                raise DataError(f"input {path} {why}; give a text, JSONL or Parquet file, a folder or a glob")
            files = [one]
        else:
            raise DataError(f"input {path} not found; give a file, a folder or a glob such as 'data/*.jsonl'")
        for f in files:
            if f.path not in seen:
                seen.add(f.path)
                out.append(f)
    return out


def _byte_units(f: InputFile, unit_bytes: int) -> list[Unit]:
    if f.size == 0:
        return [Unit(f, 0, 0, True, True)]
    cuts = [0]
    with open(f.path, "rb") as fh:
        while cuts[-1] < f.size:
            nxt = min(f.size, cuts[-1] + unit_bytes)
            # Cut just after a newline so a line (a JSONL record, a word of text) is never split.
            nxt = align_to_line(fh, nxt, f.size) if nxt < f.size else nxt
            cuts.append(nxt)
    return [Unit(f, a, b, a == 0, b == f.size) for a, b in itertools.pairwise(cuts)]


def _parquet_row_groups(f: InputFile) -> int:
    pq = import_pyarrow_parquet(f.path)
    try:
        return int(pq.ParquetFile(f.path).metadata.num_row_groups)
    except Exception as exc:  # pyarrow raises ArrowInvalid/OSError for anything not Parquet
        raise DataError(f"{f.path}: not a readable Parquet file ({str(exc).strip()})") from None


def plan_units(files: list[InputFile], unit_bytes: int = DEFAULT_UNIT_BYTES) -> list[Unit]:
    """Work units covering ``files`` in order (see module docstring)."""
    if unit_bytes < 4:
        raise ValueError(f"unit_bytes must be >= 4, got {unit_bytes}")
    units: list[Unit] = []
    for f in files:
        if f.kind == "parquet":
            n = _parquet_row_groups(f)
            units += [Unit(f, g, g + 1, g == 0, g == n - 1) for g in range(n)] or [Unit(f, 0, 0, True, True)]
        elif f.compression or _is_json_array(f):
            units.append(Unit(f, 0, -1, True, True))
        else:
            units += _byte_units(f, unit_bytes)
    return units


def _is_json_array(f: InputFile) -> bool:
    """A ``.json`` file whose first non-blank byte is ``[`` holds one array of records, read whole."""
    if f.kind != "jsonl" or f.compression or not f.path.lower().endswith(".json"):
        return False
    with open(f.path, "rb") as fh:
        head = fh.read(4096).lstrip()
    return head.startswith(b"[")


def import_pyarrow_parquet(path: str) -> Any:
    """pyarrow.parquet, imported when a Parquet file is met (an optional dependency). It lives here,
    below readers.py, so that the two modules do not import each other."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{path} is Parquet, which needs pyarrow: pip install pyarrow (or 'speedtronic-lm[parquet]')"
        ) from None
    return pq
