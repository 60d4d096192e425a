"""``prepare_dataset``: tokenise files, folders or globs of text/JSONL/Parquet into token shards.

The output directory holds ``train-NNNNN.bin`` / ``val-NNNNN.bin`` shards and ``meta.json`` (format
version 2, with the shard index: tokens and documents per shard). Training from it memory-maps the
shards, so start-up is instant and any corpus size works.

How it runs: the inputs are cut into work units (``inputs.py``); a pool of ``workers`` processes
tokenises units (``readers.py``) while this process takes the results *in input order*, so the
output never depends on the number of workers. Each document ends with the separator tokens (the
tokenizer's EOS by default). Documents go whole to train or validation: document ``i`` is
validation when ``floor((i + 1) * f) > floor(i * f)`` (every ``1/f``-th document, spread over the
corpus); should that leave validation empty, the last document becomes validation, or, for an input
that is a single document (one text file), its last ``f`` of the tokens, as before format 2.
``dedup`` drops exact duplicate documents (first occurrence kept; 16 bytes of memory per document).

Memory stays bounded: at most ``2 × workers`` units are in flight. Everything is written to
``OUT/.prepare-partial/`` with a small state file saved every few units and whenever a shard is
closed; a run interrupted (Ctrl-C, a kill, a crash) continues from there when started again with
the same inputs and options. Only a finished run replaces the dataset in ``OUT``, ``meta.json``
last, so an interrupted run never leaves a directory that looks complete. A bad input error
(exit 1) discards the partial output. No torch needed.

``max_tokens`` stops the run at that many tokens (train + validation; the document it falls in is cut
there and counts as ended). The run itself (``run_prepare``) takes its work units from a *feed*, so
the Hub input (``hub.py``) can download each file only when its first unit is needed.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import multiprocessing
import os
import re
import shutil
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speedtronic.errors import ConfigError, DataError

from .inputs import DEFAULT_UNIT_BYTES, InputFile, Unit, find_inputs, plan_units
from .meta import FORMAT_NAME, META_NAME, SHARDED_VERSION, dtype_for_vocab, itemsize_of
from .readers import ReadOptions, UnitResult, tokenize_unit
from .shards import ShardWriter
from .text import DEFAULT_CHUNK_BYTES
from .tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "DEFAULT_SHARD_TOKENS",
    "PrepareJob",
    "default_workers",
    "make_job",
    "prepare_dataset",
    "run_prepare",
    "unit_weights",
]

#: Tokens per shard file (256 MiB of uint16): big enough to keep the file count low.
DEFAULT_SHARD_TOKENS = 1 << 27
PARTIAL_DIR = ".prepare-partial"
_STATE = "state.json"
_HASHES = "dedup.bin"
_CHECKPOINT_UNITS = 32
_MAX_BAD_EXAMPLES = 5
_OWNED = re.compile(r"^(train|val)(-\d{5})?\.bin$")  # token files a prepare run owns in OUT


def default_workers() -> int:
    """The CPU cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def is_val_document(index: int, val_fraction: float) -> bool:
    """Whether document ``index`` (0-based, after de-duplication) belongs to the validation split."""
    return int((index + 1) * val_fraction) > int(index * val_fraction)


# -- the worker pool ------------------------------------------------------------------------------

_WORKER: tuple[Tokenizer, ReadOptions] | None = None


def _init_worker(tok: Tokenizer, opts: ReadOptions) -> None:
    global _WORKER
    _WORKER = (tok, opts)
    # Each worker is one core: a tokenizer's own thread pool would only oversubscribe the machine.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _work(unit: Unit) -> UnitResult:
    assert _WORKER is not None
    return tokenize_unit(unit, *_WORKER)


def _results(
    units: Iterator[Unit], tok: Tokenizer, opts: ReadOptions, workers: int, single: bool
) -> Iterator[UnitResult]:
    """Results of ``units`` in order, from ``workers`` processes (or this one) with bounded look-ahead.

    ``units`` may be lazy (a Hub input downloads a file when its first unit is asked for); ``single``
    says there is at most one unit, which is not worth a pool."""
    if workers <= 1 or single:
        for unit in units:
            yield tokenize_unit(unit, tok, opts)
        return
    # fork: the tokenizer object reaches the workers without pickling, and start-up is instant.
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(tok, opts))
    try:
        todo = units
        pending: deque[Future[UnitResult]] = deque(
            pool.submit(_work, u) for _, u in zip(range(2 * workers), todo, strict=False)
        )
        while pending:
            result = pending.popleft().result()
            nxt = next(todo, None)
            if nxt is not None:
                pending.append(pool.submit(_work, nxt))
            yield result
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# -- the run state (what makes prepare resumable) -------------------------------------------------


def _fingerprint(files: list[InputFile], settings: dict[str, Any]) -> str:
    key = json.dumps({"inputs": [[f.path, f.size, f.mtime_ns] for f in files], **settings}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(data, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _load_state(partial: Path, fingerprint: str) -> dict[str, Any] | None:
    try:
        state = json.loads((partial / _STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and state.get("fingerprint") == fingerprint else None


def _file_digest(path: str) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.digest()


class _Run:
    """The main process's side of a prepare run: documents → splits, dedup, bad records, state."""

    def __init__(
        self,
        partial: Path,
        fingerprint: str,
        itemsize: int,
        shard_tokens: int,
        opts: ReadOptions,
        val_fraction: float,
        state: dict[str, Any] | None,
        max_tokens: int | None = None,
    ) -> None:
        s = state or {}
        self.partial, self.fingerprint, self.itemsize, self.opts = partial, fingerprint, itemsize, opts
        self.val_fraction, self.max_tokens = val_fraction, max_tokens
        self.units_done = int(s.get("units_done", 0))
        self.resumed_units = self.units_done
        self.doc_index = int(s.get("doc_index", 0))
        self.in_doc = bool(s.get("in_doc", False))
        self.dest = str(s.get("dest", "train"))
        self.doc_tokens = int(s.get("doc_tokens", 0))
        self.last_train_doc = int(s.get("last_train_doc", 0))
        self.duplicates = int(s.get("duplicates", 0))
        self.bad_count = int(s.get("bad_count", 0))
        self.bad_examples: list[str] = list(s.get("bad_examples", []))
        self.writers = {
            split: ShardWriter(partial, split, itemsize, shard_tokens, s.get(split))
            for split in ("train", "val")
        }
        self.written = sum(w.tokens for w in self.writers.values())
        self.seen: set[bytes] = set()
        self.hashes = None
        if opts.dedup:
            hashes = partial / _HASHES
            keep = int(s.get("hashes_bytes", 0))
            with open(hashes, "ab") as f:
                f.truncate(keep)
            data = hashes.read_bytes()
            self.seen = {data[i : i + 16] for i in range(0, len(data), 16)}
            self.hashes = open(hashes, "ab")  # noqa: SIM115 - closed in close()

    def take(self, unit: Unit, result: UnitResult) -> None:
        if result.error is not None:
            raise DataError(result.error)
        self.bad_count += len(result.bad)
        self.bad_examples += result.bad[: _MAX_BAD_EXAMPLES - len(self.bad_examples)]
        view = memoryview(result.tokens)
        offset = 0
        for n, ends, digest in result.pieces:
            if self.full:
                break
            if not self.in_doc:
                self._start_document(unit, digest)
            size = n * self.itemsize
            if self.dest != "skip":
                keep = n if self.max_tokens is None else min(n, self.max_tokens - self.written)
                ends = ends or keep < n or self.full_after(keep)  # the cap ends the last document
                self.writers[self.dest].write(view[offset : offset + keep * self.itemsize], int(ends))
                self.written += keep
                n = keep
            offset += size
            self.doc_tokens += n
            self.in_doc = not ends
            if ends and self.dest == "train":
                self.last_train_doc = self.doc_tokens
        self.units_done += 1

    @property
    def full(self) -> bool:
        """The ``max_tokens`` cap is reached: nothing more is taken."""
        return self.max_tokens is not None and self.written >= self.max_tokens

    def full_after(self, tokens: int) -> bool:
        return self.max_tokens is not None and self.written + tokens >= self.max_tokens

    def _start_document(self, unit: Unit, digest: bytes | None) -> None:
        self.doc_tokens = 0
        if self.opts.dedup:
            # A text file cut into several units is hashed here whole (its workers each saw a part).
            digest = digest if digest is not None else _file_digest(unit.file.path)
            if digest in self.seen:
                self.dest = "skip"
                self.duplicates += 1
                return
            self.seen.add(digest)
            assert self.hashes is not None
            self.hashes.write(digest)
        self.dest = "val" if is_val_document(self.doc_index, self.val_fraction) else "train"
        self.doc_index += 1

    def checkpoint(self) -> None:
        for w in self.writers.values():
            w.sync()
        state: dict[str, Any] = {
            "fingerprint": self.fingerprint,
            "units_done": self.units_done,
            "doc_index": self.doc_index,
            "in_doc": self.in_doc,
            "dest": self.dest,
            "doc_tokens": self.doc_tokens,
            "last_train_doc": self.last_train_doc,
            "duplicates": self.duplicates,
            "bad_count": self.bad_count,
            "bad_examples": self.bad_examples,
            **{split: w.state() for split, w in self.writers.items()},
        }
        if self.hashes is not None:
            self.hashes.flush()
            os.fsync(self.hashes.fileno())
            state["hashes_bytes"] = self.hashes.tell()
        _write_json(self.partial / _STATE, state)

    def finish(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
        """Close both splits; make sure validation is not empty (see module docstring)."""
        train, val = self.writers["train"], self.writers["val"]
        train_shards = train.close()
        val.roll()
        split = "documents"
        if self.val_fraction > 0 and val.tokens == 0 and train.tokens > 0:
            if self.doc_index >= 2:
                train.take_tail(self.last_train_doc, val, docs=1)
            else:
                split = "tokens"
                train.take_tail(int(train.tokens * self.val_fraction), val, docs=1)
            train_shards = train.shards
        return train_shards, val.close(), split

    def close(self) -> None:
        if self.hashes is not None:
            self.hashes.close()


# -- installing the result ------------------------------------------------------------------------


def _refuse_existing(out: Path, overwrite: bool) -> None:
    """An existing output (a file, or a folder with anything but our partial run) needs ``overwrite``."""
    if overwrite or not out.exists():
        return
    if not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a directory; pick another --out")
    found = sorted(entry.name for entry in out.iterdir() if entry.name != PARTIAL_DIR)
    if found:
        what = (
            "a prepared dataset" if META_NAME in found else f"{len(found)} entries ({', '.join(found[:3])}…)"
        )
        raise ConfigError(
            f"--out {out} already holds {what}; pass --overwrite to replace it, or pick another --out "
            "(an interrupted run resumes when the same command is given again)"
        )


def _install(partial: Path, out: Path, meta: dict[str, Any]) -> None:
    names = [s["file"] for split in ("train", "val") for s in meta["shards"][split]]
    # Drop the old meta.json first: while files move, the directory must not claim to be complete.
    with contextlib.suppress(FileNotFoundError):
        (out / META_NAME).unlink()
    for old in out.iterdir():
        if _OWNED.match(old.name) and old.name not in names:
            old.unlink()
    for name in names:
        os.replace(partial / name, out / name)
    _write_json(out / META_NAME, meta)
    shutil.rmtree(partial, ignore_errors=True)


def _source(specs: Sequence[str | os.PathLike[str]], files: list[InputFile]) -> dict[str, Any]:
    kinds: dict[str, int] = {}
    for f in files:
        kind = f.kind + (f".{f.compression}" if f.compression else "")
        kinds[kind] = kinds.get(kind, 0) + 1
    name = (
        Path(files[0].path).name if len(specs) == 1 and len(files) == 1 else " ".join(map(os.fspath, specs))
    )
    return {"name": name, "bytes": sum(f.size for f in files), "files": len(files), "kinds": kinds}


def _separator(tok: Tokenizer, separator: str | None) -> tuple[tuple[int, ...], dict[str, Any] | None]:
    if separator is None:
        return ((tok.eos_id,), {"eos_id": tok.eos_id}) if tok.eos_id is not None else ((), None)
    if separator == "":
        return (), None
    ids = tuple(int(i) for i in tok.encode(separator))
    return ids, {"text": separator, "ids": list(ids)}


@dataclass(frozen=True)
class PrepareJob:
    """What a prepare run does to each document, whatever the inputs: the tokenizer, the reading
    options and the output layout. ``settings`` go into the run's fingerprint (with the inputs)."""

    tok: Tokenizer
    opts: ReadOptions
    sep_meta: dict[str, Any] | None
    val_fraction: float
    workers: int
    shard_tokens: int
    unit_bytes: int
    max_tokens: int | None
    checkpoint_units: int = _CHECKPOINT_UNITS
    stop_after_units: int | None = None
    checkpoint_file_ends: bool = False  # also save the state when a file is done (big downloaded files)

    @property
    def itemsize(self) -> int:
        return itemsize_of(self.opts.dtype)

    def settings(self) -> dict[str, Any]:
        out = {
            "tokenizer": self.tok.spec,
            "vocab": self.tok.vocab_size,
            "separator": list(self.opts.separator),
            "text_field": self.opts.text_field,
            "skip_bad": self.opts.skip_bad,
            "dedup": self.opts.dedup,
            "val_fraction": self.val_fraction,
            "chunk_bytes": self.opts.chunk_bytes,
            "unit_bytes": self.unit_bytes,
            "shard_tokens": self.shard_tokens,
        }
        if self.max_tokens is not None:  # only when set: runs interrupted before the cap existed still resume
            out["max_tokens"] = self.max_tokens
        return out


def make_job(
    tokenizer: str | os.PathLike[str] | Tokenizer | None,
    *,
    val_fraction: float = 0.1,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    text_field: str = "text",
    separator: str | None = None,
    dedup: bool = False,
    skip_bad: bool = False,
    workers: int = 1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    unit_bytes: int = DEFAULT_UNIT_BYTES,
    max_tokens: int | None = None,
    checkpoint_units: int = _CHECKPOINT_UNITS,
    stop_after_units: int | None = None,
    checkpoint_file_ends: bool = False,
) -> PrepareJob:
    """The :class:`PrepareJob` of these options (see :func:`prepare_dataset`); ValueError for a bad one."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    tok = (
        load_tokenizer(tokenizer)
        if tokenizer is None or isinstance(tokenizer, (str, os.PathLike))
        else tokenizer
    )
    sep_ids, sep_meta = _separator(tok, separator)
    opts = ReadOptions(dtype_for_vocab(tok.vocab_size), sep_ids, text_field, skip_bad, dedup, chunk_bytes)
    return PrepareJob(
        tok, opts, sep_meta, val_fraction, workers, shard_tokens, unit_bytes, max_tokens,
        checkpoint_units, stop_after_units, checkpoint_file_ends,
    )  # fmt: skip


def unit_weights(units: Sequence[Unit]) -> list[int]:
    """Input bytes each unit stands for (progress): its byte range, or its share of a Parquet file
    (or of a compressed one, read whole)."""
    weights = [(u.end - u.start) if u.end >= 0 and u.file.kind != "parquet" else u.file.size for u in units]
    for i, u in enumerate(units):  # a Parquet file's size is shared among its row groups
        if u.file.kind == "parquet":
            weights[i] = u.file.size // max(1, sum(1 for v in units if v.file is u.file))
    return weights


#: ``feed(start, partial)``: the work units from global unit index ``start`` on, each with the input
#: bytes read once it is done (cumulative, from the first unit: the progress). ``partial`` is the run's
#: partial directory, where a feed may keep notes for a resume.
UnitFeed = Callable[[int, Path], Iterator[tuple[Unit, int]]]
#: ``progress(done, total, tokens)``: input bytes read of ``total``, and tokens written so far.
Progress = Callable[[int, int, int], None]


def _open_partial(out: Path, fingerprint: str, resume: bool, overwrite: bool) -> dict[str, Any] | None:
    """Make ``out`` and its partial directory; the saved state of an interrupted run of the same job."""
    _refuse_existing(out, overwrite)
    partial = out / PARTIAL_DIR
    try:
        out.mkdir(parents=True, exist_ok=True)
        state = _load_state(partial, fingerprint) if resume else None
        if state is None:
            shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(exist_ok=True)
    except OSError as exc:
        raise DataError(f"cannot create output directory {out}: {exc}") from exc
    return state


def _tokenise(
    run: _Run, job: PrepareJob, feed: UnitFeed, total: int, single: bool, progress: Progress | None
) -> None:
    """Take the feed's units from where ``run`` stands until they end or the cap is reached."""
    if run.full:  # a resumed run that had reached the cap: nothing more to read
        return
    start = run.units_done
    taken: deque[tuple[Unit, int]] = deque()  # units handed to the pool, not yet taken back

    def units() -> Iterator[Unit]:
        for unit, done in feed(start, run.partial):
            taken.append((unit, done))
            yield unit

    since = 0
    with contextlib.closing(_results(units(), job.tok, job.opts, job.workers, single)) as results:
        for i, result in enumerate(results, start=start):
            unit, done = taken.popleft()
            run.take(unit, result)
            since += 1
            rolled = [w.roll_if_full() for w in run.writers.values()]
            if any(rolled) or since >= job.checkpoint_units or (job.checkpoint_file_ends and unit.last):
                run.checkpoint()
                since = 0
            if progress is not None:
                progress(done, total, run.written)
            if run.full:  # before the next unit is asked for (it may be a file still to download)
                run.checkpoint()
                break
            if job.stop_after_units is not None and i + 1 - start >= job.stop_after_units:
                raise KeyboardInterrupt


def run_prepare(
    job: PrepareJob,
    out_dir: str | os.PathLike[str],
    *,
    fingerprint: str,
    feed: UnitFeed,
    total: int,
    source: Callable[[], dict[str, Any]],
    what: str,
    single: bool = False,
    progress: Progress | None = None,
    resume: bool = True,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Tokenise what ``feed`` hands out into ``out_dir`` (resumable, see the module docstring) and
    return the ``meta.json`` contents. ``fingerprint`` names the inputs and the job (a saved state
    of another fingerprint is discarded); ``source()`` is meta's ``source`` once the run is done;
    ``what`` names the inputs in an error. Used by :func:`prepare_dataset` (local files) and the
    Hub input (``hub.py``)."""
    out = Path(out_dir)
    partial = out / PARTIAL_DIR
    state = _open_partial(out, fingerprint, resume, overwrite)
    run = None
    try:
        run = _Run(partial, fingerprint, job.itemsize, job.shard_tokens, job.opts, job.val_fraction, state,
                   job.max_tokens)  # fmt: skip
        _tokenise(run, job, feed, total, single, progress)
        if progress is not None and run.units_done == 0:
            progress(0, total, 0)
        meta = _meta(run, job, source())
        _install(partial, out, meta)
    except DataError:
        if run is not None:
            run.close()
        shutil.rmtree(partial, ignore_errors=True)  # bad input: the partial output is of no use
        raise
    except OSError as exc:
        raise DataError(f"preparing {what} into {out} failed: {exc}") from exc
    return meta


def _meta(run: _Run, job: PrepareJob, source: dict[str, Any]) -> dict[str, Any]:
    train_shards, val_shards, val_split = run.finish()
    run.close()
    tok = job.tok
    # No tokens at all (empty inputs) is still a dataset; training on it says there is too little data.
    meta: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": SHARDED_VERSION,
        "dtype": job.opts.dtype,
        "byteorder": "little",
        "vocab_size": int(tok.vocab_size),
        "tokenizer": tok.spec,
        "eos_id": tok.eos_id,
        "separator": job.sep_meta,
        "train_tokens": sum(s["tokens"] for s in train_shards),
        "val_tokens": sum(s["tokens"] for s in val_shards),
        "val_fraction": job.val_fraction,
        "val_split": val_split,
        "documents": {
            "train": sum(s["documents"] for s in train_shards),
            "val": sum(s["documents"] for s in val_shards),
        },
        "duplicates_skipped": run.duplicates if job.opts.dedup else None,
        "bad_records_skipped": run.bad_count,
        "bad_examples": run.bad_examples,
        "resumed_units": run.resumed_units,
        "text_field": job.opts.text_field,
        "chunk_bytes": job.opts.chunk_bytes,
        "source": source,
        "shards": {"train": train_shards, "val": val_shards},
    }
    if job.max_tokens is not None:
        meta["max_tokens"] = job.max_tokens
    return meta


def prepare_dataset(
    inputs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    tokenizer: str | os.PathLike[str] | Tokenizer | None = None,
    val_fraction: float = 0.1,
    progress: Callable[[int, int], None] | None = None,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    text_field: str = "text",
    separator: str | None = None,
    dedup: bool = False,
    skip_bad: bool = False,
    workers: int = 1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    unit_bytes: int = DEFAULT_UNIT_BYTES,
    resume: bool = True,
    overwrite: bool = False,
    checkpoint_units: int = _CHECKPOINT_UNITS,
    stop_after_units: int | None = None,
    max_tokens: int | None = None,
) -> dict[str, Any]:
    """Tokenise ``inputs`` (files, folders, globs) into ``out_dir`` and return the ``meta.json`` contents.

    ``tokenizer`` is a spec for :func:`load_tokenizer` (None/"byte" or a tokenizer.json path) or a
    tokenizer object. ``separator``: None ends each document with the tokenizer's EOS (nothing if
    it has none, like the byte tokenizer); a string ends it with that text's tokens ("" for none).
    ``progress(done, total)`` is called after every unit, in input bytes. An ``out_dir`` that holds
    anything but an interrupted run's ``.prepare-partial`` is refused (ConfigError, exit 2) unless
    ``overwrite``, which replaces the dataset there (other files are left alone). ``max_tokens``
    stops after that many tokens (train + validation; the last document is cut there).
    ``stop_after_units`` raises KeyboardInterrupt after that many units, as an interruption would
    (for tests).
    """
    job = make_job(
        tokenizer, val_fraction=val_fraction, chunk_bytes=chunk_bytes, text_field=text_field,
        separator=separator, dedup=dedup, skip_bad=skip_bad, workers=workers, shard_tokens=shard_tokens,
        unit_bytes=unit_bytes, max_tokens=max_tokens, checkpoint_units=checkpoint_units,
        stop_after_units=stop_after_units,
    )  # fmt: skip
    specs = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    if not specs:
        raise DataError("no inputs given: name a file, a folder or a glob")
    files = find_inputs(specs)
    units = plan_units(files, unit_bytes)
    cumulative = list(itertools.accumulate(unit_weights(units)))
    report = None if progress is None else lambda done, total, _tokens: progress(done, total)
    return run_prepare(
        job,
        out_dir,
        fingerprint=_fingerprint(files, {**job.settings(), "units": len(units)}),
        feed=lambda start, _partial: zip(units[start:], cumulative[start:], strict=True),
        total=cumulative[-1] if cumulative else 0,
        source=lambda: _source(specs, files),
        what=", ".join(map(os.fspath, specs)),
        single=len(units) <= 1,
        progress=report,
        resume=resume,
        overwrite=overwrite,
    )
