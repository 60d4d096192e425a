"""The on-disk format of a prepared dataset directory: token files and ``meta.json``.

``prepare`` writes it and the dataset reader validates it here, so both sides agree on one
definition. The ``.bin`` files are flat arrays of little-endian ``uint16`` (vocabulary <= 65,535)
or ``uint32`` token ids; ``meta.json`` is written last, so its presence marks a complete directory.
Version 1 has one ``train.bin`` and one ``val.bin``; version 2 (written since) lists its shards in
``meta.json["shards"]`` (``{"train": [{"file", "tokens", "documents"}, ...], "val": [...]}``). Both
load. ``meta.json`` is input like any other: shard names must be plain file names in the directory.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from speedtronic.errors import DataError

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "META_NAME",
    "SHARDED_VERSION",
    "TRAIN_NAME",
    "VAL_NAME",
    "dtype_for_vocab",
    "itemsize_of",
    "read_meta",
    "token_files",
]

FORMAT_NAME = "speedtronic-tokens"
FORMAT_VERSION = 2
SHARDED_VERSION = 2  # the first version with shards
META_NAME = "meta.json"
TRAIN_NAME = "train.bin"
VAL_NAME = "val.bin"

_ITEMSIZE = {"uint16": 2, "uint32": 4}
_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "format": str,
    "version": int,
    "dtype": str,
    "vocab_size": int,
    "tokenizer": str,
    "train_tokens": int,
    "val_tokens": int,
}


def dtype_for_vocab(vocab_size: int) -> str:
    """``"uint16"`` when every id fits in 16 bits, else ``"uint32"``."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if vocab_size > 1 << 32:
        raise ValueError(f"vocab_size {vocab_size} does not fit in uint32 token files")
    return "uint16" if vocab_size <= 65535 else "uint32"


def itemsize_of(dtype: str) -> int:
    try:
        return _ITEMSIZE[dtype]
    except KeyError:
        raise ValueError(f"unsupported token dtype {dtype!r}; expected one of {sorted(_ITEMSIZE)}") from None


def _rerun_hint(meta: dict[str, Any] | None, directory: Path) -> str:
    src = (meta or {}).get("source", {}).get("name") if isinstance((meta or {}).get("source"), dict) else None
    return f"re-run `speedtronic data prepare {src or '<inputs>'} --out {directory}`"


def read_meta(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Load and validate ``meta.json`` of a prepared directory, including the ``.bin`` file sizes.

    Raises :class:`DataError` naming the file and the fix for anything missing or inconsistent.
    """
    d = Path(directory)
    if not d.is_dir():
        raise DataError(
            f"dataset directory {d} not found: create it with `speedtronic data prepare <text> {d}`"
        )
    path = d / META_NAME
    if not path.is_file():
        raise DataError(
            f"{path} is missing, so {d} is not a complete prepared dataset; {_rerun_hint(None, d)}"
        )
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path} is unreadable or corrupt ({exc}); {_rerun_hint(None, d)}") from exc
    if not isinstance(meta, dict):
        raise DataError(f"{path} is corrupt (not a JSON object); {_rerun_hint(None, d)}")
    for key, typ in _REQUIRED.items():
        # bool is an int subclass; a true/false where a count belongs is corruption too.
        if not isinstance(meta.get(key), typ) or isinstance(meta.get(key), bool):
            raise DataError(
                f"{path} is corrupt: field {key!r} missing or not a {typ.__name__}; {_rerun_hint(meta, d)}"
            )
    if meta["format"] != FORMAT_NAME:
        raise DataError(
            f"{path} is not a speedtronic dataset (format {meta['format']!r}); {_rerun_hint(meta, d)}"
        )
    if meta["version"] > FORMAT_VERSION:
        raise DataError(
            f"{path} has format version {meta['version']}, newer than this speedtronic understands "
            f"({FORMAT_VERSION}); upgrade speedtronic or {_rerun_hint(meta, d)}"
        )
    if meta["dtype"] not in _ITEMSIZE:
        raise DataError(f"{path} is corrupt: unknown dtype {meta['dtype']!r}; {_rerun_hint(meta, d)}")
    if meta.get("byteorder", "little") != "little" or sys.byteorder != "little":
        raise DataError(f"{path}: token files are little-endian and this machine is {sys.byteorder}-endian")
    if min(meta["vocab_size"], meta["train_tokens"] + 1, meta["val_tokens"] + 1) <= 0:
        raise DataError(f"{path} is corrupt: negative counts; {_rerun_hint(meta, d)}")
    size = _ITEMSIZE[meta["dtype"]]
    for split, key in (("train", "train_tokens"), ("val", "val_tokens")):
        files = token_files(meta, d, split)
        if sum(n for _, n in files) != meta[key]:
            raise DataError(
                f"{path} is corrupt: its {split} shards do not add up to {key}; {_rerun_hint(meta, d)}"
            )
        for f, tokens in files:
            expected = tokens * size
            actual = f.stat().st_size if f.is_file() else None
            if actual != expected:
                found = "missing" if actual is None else f"{actual:,} bytes"
                raise DataError(
                    f"{f} is {found} but {path} says {tokens:,} {meta['dtype']} tokens ({expected:,} bytes); "
                    f"the directory is incomplete or was modified: {_rerun_hint(meta, d)}"
                )
    return meta


def token_files(meta: dict[str, Any], directory: Path, split: str) -> list[tuple[Path, int]]:
    """``(path, tokens)`` of each token file of ``split`` (``"train"``/``"val"``), in order."""
    path = directory / META_NAME
    if meta["version"] < SHARDED_VERSION:
        name, key = (TRAIN_NAME, "train_tokens") if split == "train" else (VAL_NAME, "val_tokens")
        return [(directory / name, meta[key])]
    shards = meta.get("shards", {}).get(split) if isinstance(meta.get("shards"), dict) else None
    if not isinstance(shards, list):
        raise DataError(f"{path} is corrupt: no {split} shard list; {_rerun_hint(meta, directory)}")
    out = []
    for s in shards:
        name = s.get("file") if isinstance(s, dict) else None
        tokens = s.get("tokens") if isinstance(s, dict) else None
        # A shard name is a plain file name: a path could reach outside the dataset directory.
        if (
            not isinstance(name, str)
            or Path(name).name != name
            or name in ("", ".", "..")
            or not isinstance(tokens, int)
            or isinstance(tokens, bool)
            or tokens < 0
        ):
            raise DataError(
                f"{path} is corrupt: bad {split} shard entry {s!r}; {_rerun_hint(meta, directory)}"
            )
        out.append((directory / name, tokens))
    return out
