"""Opening the entries of ``data.sources`` (config/data_sources.py) as token sources: the one place a
source spec is turned into tokens. A new kind of location (``hf://datasets/...``) is added here: in
:func:`_inputs`, which turns an entry's location into local input files (the run plan's check and the
loader both go through it), and in :func:`_open_path`, which decides how those files are read.

* ``dataset: DIR`` — a directory written by ``speedtronic data prepare``: memory-mapped shards, its own
  validation split (:func:`dataset_sources`, which the single ``data.dataset`` path uses too).
* ``path: FILE`` — one plain text file: tokenised into memory when it is at most the memory budget,
  read by seeking under the byte tokenizer when bigger, exactly as ``data.text_path`` is.
* ``path: hf://datasets/OWNER/NAME[@REV][/PATH]`` — a Hugging Face Hub dataset, prepared once with
  ``data prepare``'s Hub reader (engine/data/hub.py) into ``<cache>/hub/`` and read as a dataset; after
  that no network is used.
* ``path:`` anything else (JSONL, Parquet, compressed files, a folder or a glob, or a big text file
  under a BPE tokenizer) — prepared once with ``data prepare``'s own code into a cache folder keyed by
  the files (paths, sizes, modification times) and the options, then read as a dataset. A run that
  starts again, or another rank, finds it there (ranks take turns through a file lock).

Every source of a mixture has the same tokenizer: ``data.tokenizer`` when set, else the one the
prepared datasets share, else the byte tokenizer (:func:`mixture_tokenizer_spec`, read without loading
any data, so ``validate`` and the run plan see the vocabulary cheaply).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speedtronic.config.data_sources import DataSource
from speedtronic.errors import DataError, DataPathError

from .hub import hub_dataset_dir, is_hub_dataset, parse_hub_uri
from .inputs import InputFile, find_inputs
from .meta import read_meta, token_files
from .sources import ByteFileSource, ShardedTokens, TokenFile, TokenSource, split_train_val, tokenize_file
from .tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "CACHE_ENV",
    "OpenedSource",
    "cache_root",
    "dataset_sources",
    "mixture_tokenizer_spec",
    "open_sources",
]

log = logging.getLogger(__name__)

#: Where prepared copies of ``path`` sources are kept (default ``$XDG_CACHE_HOME/speedtronic/prepared``).
CACHE_ENV = "SPEEDTRONIC_DATA_CACHE"


@dataclass(frozen=True)
class OpenedSource:
    """One source of a mixture, opened: its name, weight, train and validation tokens, and a summary."""

    name: str
    weight: float
    train: TokenSource
    val: TokenSource | None
    description: str


def cache_root() -> Path:
    """The folder that holds prepared copies of ``path`` sources."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "speedtronic" / "prepared"


def dataset_sources(
    directory: str, cfg_tokenizer: str | None
) -> tuple[TokenSource, TokenSource | None, Tokenizer, dict[str, Any]]:
    """``(train, val or None, tokenizer, meta)`` of a prepared dataset directory."""
    meta = read_meta(directory)
    d = Path(directory)

    def split(name: str) -> TokenSource:
        files = [
            TokenFile(f, meta["dtype"], name=d.name, vocab_size=meta["vocab_size"])
            for f, n in token_files(meta, d, name)
            if n > 0
        ]
        return files[0] if len(files) == 1 else ShardedTokens(files, name=d.name)

    train = split("train")
    val = split("val") if meta["val_tokens"] > 0 else None
    spec = cfg_tokenizer if cfg_tokenizer is not None else meta["tokenizer"]
    try:
        tokenizer = load_tokenizer(spec)
    except DataError as exc:
        raise DataError(
            f"{exc} (dataset {d} was prepared with tokenizer {meta['tokenizer']!r}; set tokenizer)"
        ) from exc
    if tokenizer.vocab_size != meta["vocab_size"]:
        raise DataError(
            f"dataset {d} was prepared with tokenizer {meta['tokenizer']!r} (vocab {meta['vocab_size']:,}) but "
            f"tokenizer {spec!r} has vocab {tokenizer.vocab_size:,}: use the same tokenizer or re-run "
            "`speedtronic data prepare`"
        )
    return train, val, tokenizer, meta


def _field(index: int, source: DataSource) -> str:
    return f"data.sources[{index}].{'dataset' if source.dataset else 'path'}"


def _meta_of(index: int, source: DataSource) -> dict[str, Any]:
    path = Path(source.location).expanduser()
    if not path.is_dir():
        raise DataPathError(
            f"{_field(index, source)}: {path} is not a directory written by `speedtronic data prepare`",
            _field(index, source),
        )
    return read_meta(path)


def mixture_tokenizer_spec(sources: Sequence[DataSource], cfg_tokenizer: str | None) -> str | None:
    """The mixture's tokenizer spec (see the module doc), checking that every dataset agrees with it;
    every path source must exist. Reads only meta.json files and directory entries."""
    prepared = {i: _meta_of(i, s)["tokenizer"] for i, s in enumerate(sources) if s.dataset}
    for i, s in enumerate(sources):
        if s.path:
            _inputs(i, s)
    if cfg_tokenizer is not None:
        return cfg_tokenizer
    specs = sorted(set(prepared.values()))
    if len(specs) > 1:
        raise DataPathError(
            f"data.sources: the datasets were prepared with different tokenizers ({', '.join(map(repr, specs))}); a "
            "mixture has one tokenizer: set data.tokenizer and prepare every dataset with it",
            "data.sources",
        )
    return specs[0] if specs else None


def _inputs(index: int, source: DataSource) -> list[InputFile]:
    """The local input files a ``path`` entry names (none for a Hub dataset, whose address is checked)."""
    try:
        if is_hub_dataset(source.location):
            parse_hub_uri(source.location)
            return []
        return find_inputs(source.location)
    except DataError as exc:
        raise DataPathError(f"{_field(index, source)}: {exc}", _field(index, source)) from None


def open_sources(
    sources: Sequence[DataSource],
    tokenizer: Tokenizer,
    *,
    val_fraction: float,
    memory_budget_bytes: int,
    chunk_bytes: int,
) -> list[OpenedSource]:
    """Every entry of ``data.sources`` opened with the mixture's ``tokenizer``."""
    opened = []
    for index, source in enumerate(sources):
        if source.dataset:
            train, val, _, meta = dataset_sources(str(Path(source.dataset).expanduser()), tokenizer.spec)
            what = f"dataset {Path(source.dataset).name} ({meta['dtype']})"
        else:
            train, val, what = _open_path(
                index, source, tokenizer, val_fraction, memory_budget_bytes, chunk_bytes
            )
        desc = f"{source.key} ×{source.weight:g}: {what}, {len(train):,} train / {len(val) if val else 0:,} val tokens"
        opened.append(OpenedSource(source.key, float(source.weight), train, val, desc))
    return opened


def _open_path(
    index: int, source: DataSource, tokenizer: Tokenizer, val_fraction: float, budget: int, chunk_bytes: int
) -> tuple[TokenSource, TokenSource | None, str]:
    """A ``path`` source's tokens: in memory or by seeking for one plain text file, else prepared."""
    if is_hub_dataset(source.location):
        directory = _hub_prepared(source, tokenizer, val_fraction)
        train, val, _, _ = dataset_sources(str(directory), tokenizer.spec)
        return train, val, f"{source.location} (prepared in {directory})"
    files = _inputs(index, source)
    one = files[0] if len(files) == 1 else None
    if one is not None and one.kind == "text" and one.compression is None and Path(source.location).is_file():
        name = Path(one.path).name
        if one.size <= budget:
            train, val = split_train_val(
                tokenize_file(one.path, tokenizer, chunk_bytes=chunk_bytes), val_fraction
            )
            return train, val, f"text {name}"
        if isinstance(tokenizer, ByteTokenizer):
            train, val = split_train_val(ByteFileSource(one.path), val_fraction)
            return train, val, f"text {name} (read from disk)"
    directory = _prepared(files, source, tokenizer, val_fraction, chunk_bytes)
    train, val, _, _ = dataset_sources(str(directory), tokenizer.spec)
    return train, val, f"{source.location} (prepared in {directory})"


def _prepared(
    files: list[InputFile], source: DataSource, tokenizer: Tokenizer, val_fraction: float, chunk_bytes: int
) -> Path:
    """The cache folder holding ``files`` prepared with these options, preparing it when missing."""
    key = {
        "inputs": [[os.path.abspath(f.path), f.size, f.mtime_ns] for f in files],
        "tokenizer": tokenizer.spec,
        "vocab": tokenizer.vocab_size,
        "val_fraction": val_fraction,
        "text_field": source.text_field,
        "chunk_bytes": chunk_bytes,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    root = cache_root()
    out = root / f"{source.key}-{digest}"
    with _locked(root / f".{source.key}-{digest}.lock"):
        if not (out / "meta.json").is_file():
            from .prepare import default_workers, prepare_dataset

            log.info("data.sources %r: preparing %s into %s (once)", source.key, source.location, out)
            prepare_dataset(
                [f.path for f in files],
                out,
                tokenizer,
                val_fraction,
                chunk_bytes=chunk_bytes,
                text_field=source.text_field,
                workers=1 if _distributed() else min(4, default_workers()),
            )
    return out


def _hub_prepared(source: DataSource, tokenizer: Tokenizer, val_fraction: float) -> Path:
    """The cache folder of a Hub dataset entry, prepared once (ranks take turns, as for local files)."""
    root = cache_root() / "hub"
    digest = hashlib.sha256(source.location.encode()).hexdigest()[:16]
    with _locked(root / f".{source.key}-{digest}.lock"):
        return hub_dataset_dir(
            source.location,
            root,
            tokenizer,
            text_field=source.text_field,
            val_fraction=val_fraction,
            workers=1,
        )


def _distributed() -> bool:
    """Whether this process is a rank of a process group: it then prepares without forking a pool (a
    fork of a process whose collective threads are running is not safe)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (created): ranks of one run prepare a source one at a time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise DataError(
            f"cannot use the data cache {path.parent} ({exc}); set {CACHE_ENV} to a writable folder"
        ) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
