"""Turning one work unit of an input file into tokens: the code each ``data prepare`` worker runs.

:func:`tokenize_unit` reads a :class:`~speedtronic.engine.data.inputs.Unit`, splits it into
documents (a text file is one document; a JSONL line or a Parquet row is one), tokenises them,
appends the separator tokens after each document end and returns the little-endian token bytes with
one *piece* per document (its token count, whether the document ends here and, for ``--dedup``, a
digest of its text). Bad input never raises out of a worker: a malformed JSON line, a missing or
non-string text field, text that is not UTF-8 or an unreadable file becomes a message naming the
file and line (or row group), either collected as skipped (``skip_bad``) or returned as the unit's
fatal error, which the main process reports as one line with exit 1.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np

from speedtronic.errors import DataError

from .inputs import Unit, import_pyarrow_parquet
from .text import iter_chunks
from .tokenizer import ByteTokenizer, Tokenizer

__all__ = ["ReadOptions", "UnitResult", "import_pyarrow_parquet", "open_binary", "tokenize_unit"]

_SKIP_HINT = "fix it or pass --skip-bad to skip bad records (they are counted)"


@dataclass(frozen=True)
class ReadOptions:
    """What every worker needs besides the unit: how to read records and end documents."""

    dtype: str  # "uint16" | "uint32"
    separator: tuple[int, ...] = ()
    text_field: str = "text"
    skip_bad: bool = False
    dedup: bool = False
    chunk_bytes: int = 1 << 20
    batch_docs: int = 256  # records encoded per encode_batch call


@dataclass
class UnitResult:
    """A unit's tokens and documents; ``error`` set means the unit failed and nothing else counts."""

    tokens: bytes = b""
    pieces: list[tuple[int, bool, bytes | None]] = field(default_factory=list)
    bad: list[str] = field(default_factory=list)
    error: str | None = None
    bytes_read: int = 0


class _Bad(Exception):
    """One bad record (message already names file and line)."""


def open_binary(path: str, compression: str | None) -> IO[bytes]:
    """``path`` opened for reading bytes, decompressing ``gz`` / ``zst`` on the fly."""
    if compression == "gz":
        return gzip.open(path, "rb")
    if compression == "zst":
        try:
            import zstandard  # lazy: optional dependency
        except ImportError:
            raise DataError(
                f"{path} is zstd-compressed, which needs the zstandard package: pip install zstandard "
                "(or 'speedtronic-lm[zstd]'), or decompress it first (zstd -d)"
            ) from None
        raw = open(path, "rb")  # noqa: SIM115 - closed with the reader (closefd)
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    return open(path, "rb")


class _Encoder:
    """Documents → token bytes and pieces, encoding records in batches (fast path for HF tokenizers)."""

    def __init__(self, tok: Tokenizer, opts: ReadOptions) -> None:
        self.tok, self.opts = tok, opts
        self.np_dtype = np.dtype("<u2" if opts.dtype == "uint16" else "<u4")
        self.parts: list[bytes] = []
        self.pieces: list[tuple[int, bool, bytes | None]] = []
        self.pending: list[str] = []
        self.sep = np.asarray(opts.separator, dtype=self.np_dtype)

    def _ids(self, ids: Any) -> np.ndarray:
        if isinstance(ids, (bytes, bytearray)):
            return np.frombuffer(ids, dtype=np.uint8).astype(self.np_dtype)
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= np.iinfo(self.np_dtype).max + 1):
            raise OverflowError
        return arr.astype(self.np_dtype)

    def add_piece(self, ids: Any, ends_doc: bool, digest: bytes | None) -> None:
        arr = self._ids(ids)
        if ends_doc and self.sep.size:
            arr = np.concatenate([arr, self.sep])
        self.parts.append(arr.tobytes())
        self.pieces.append((int(arr.size), ends_doc, digest))

    def add_doc(self, text: str) -> None:
        """Queue one record (a whole document); encoded at the next flush."""
        self.pending.append(text)
        if len(self.pending) >= self.opts.batch_docs:
            self.flush()

    def flush(self) -> None:
        docs, self.pending = self.pending, []
        if not docs:
            return
        if isinstance(self.tok, ByteTokenizer):
            encoded: list[Any] = [d.encode("utf-8") for d in docs]
        elif hasattr(self.tok, "encode_batch"):
            encoded = self.tok.encode_batch(docs)
        else:
            encoded = [self.tok.encode(d) for d in docs]
        for text, ids in zip(docs, encoded, strict=True):
            digest = _digest(text.encode("utf-8")) if self.opts.dedup else None
            self.add_piece(ids, True, digest)

    def result(self, bytes_read: int, bad: list[str]) -> UnitResult:
        self.flush()
        # The numpy dtypes above are explicitly little-endian: the format is the same on every machine.
        return UnitResult(b"".join(self.parts), self.pieces, bad, None, bytes_read)


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _line_of(path: str, offset: int) -> int:
    """1-based line number of byte ``offset`` of an uncompressed file (only computed for messages)."""
    line, pos = 1, 0
    with open(path, "rb") as f:
        while pos < offset:
            block = f.read(min(1 << 20, offset - pos))
            if not block:
                break
            line += block.count(b"\n")
            pos += len(block)
    return line


def _record_text(record: Any, field_name: str, where: str) -> str:
    if not isinstance(record, dict):
        raise _Bad(
            f"{where}: a record must be a JSON object with a {field_name!r} field, got {type(record).__name__}"
        )
    value = record.get(field_name)
    if not isinstance(value, str):
        fields = ", ".join(list(map(str, record))[:8]) or "none"
        what = "missing" if value is None else f"a {type(value).__name__}, not a string"
        raise _Bad(f"{where}: text field {field_name!r} is {what} (fields: {fields}); pass --text-field NAME")
    return value


def _jsonl_lines(unit: Unit) -> Iterator[tuple[int, bytes]]:
    """(line number or -1 if unknown yet, raw line) of a JSONL unit."""
    f = unit.file
    if f.compression:
        with open_binary(f.path, f.compression) as fh:
            yield from enumerate(fh, start=1)
        return
    with open(f.path, "rb") as fh:
        fh.seek(unit.start)
        remaining = unit.end - unit.start
        # Line numbers of a byte range are only known by counting from the file start: -1 means
        # "work it out on error" (rare) instead of reading every earlier byte for every unit.
        for raw in fh:
            if remaining <= 0:
                break
            remaining -= len(raw)
            yield -1, raw


def _read_jsonl(unit: Unit, enc: _Encoder, opts: ReadOptions, bad: list[str]) -> int:
    f = unit.file
    if unit.end == -1 and not f.compression:  # a .json holding one array of records
        with open(f.path, "rb") as fh:
            data = fh.read()
        try:
            records = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _Bad(
                f"{f.path}: not valid JSON ({exc}); a .json file must be JSON lines or one array"
            ) from None
        for i, record in enumerate(records if isinstance(records, list) else [records]):
            try:
                enc.add_doc(_record_text(record, opts.text_field, f"{f.path}: record {i + 1}"))
            except _Bad as exc:
                if not opts.skip_bad:
                    raise
                bad.append(str(exc))
        return len(data)
    read = 0
    offset = unit.start
    for number, raw in _jsonl_lines(unit):
        read += len(raw)
        line_start, offset = offset, offset + len(raw)
        if not raw.strip():
            continue
        try:
            try:
                record = json.loads(raw)
            except UnicodeDecodeError as exc:
                raise _Bad(
                    f"{{where}}: not valid UTF-8 ({exc.reason}); re-encode the file as UTF-8"
                ) from None
            except json.JSONDecodeError as exc:
                # json's own messages can end in "at" ("Unterminated string starting at"): a comma
                # keeps the column apart (it once read "starting at at column 10").
                raise _Bad(f"{{where}}: malformed JSON ({exc.msg}, column {exc.colno})") from None
            text = _record_text(record, opts.text_field, "{where}")
        except _Bad as exc:
            line = number if number > 0 else _line_of(f.path, line_start)
            msg = str(exc).replace("{where}", f"{f.path}:{line}")
            if not opts.skip_bad:
                raise _Bad(msg) from None
            bad.append(msg)
            continue
        if text:
            enc.add_doc(text)
    return read


def _read_parquet(unit: Unit, enc: _Encoder, opts: ReadOptions, bad: list[str]) -> int:
    f = unit.file
    if unit.end == unit.start:  # a Parquet file without row groups: no documents
        return 0
    pq = import_pyarrow_parquet(f.path)
    where = f"{f.path}: row group {unit.start}"
    try:
        pf = pq.ParquetFile(f.path)
        names = pf.schema_arrow.names
        if opts.text_field not in names:
            raise _Bad(
                f"{where}: no column {opts.text_field!r} (columns: {', '.join(names[:8])}); pass --text-field NAME"
            )
        column = pf.read_row_group(unit.start, columns=[opts.text_field]).column(0)
    except _Bad:
        raise
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for corrupt data
        raise _Bad(f"{where}: unreadable Parquet data ({str(exc).strip()})") from None
    for i, value in enumerate(column.to_pylist()):
        if not isinstance(value, str):
            msg = f"{where}, row {i}: text column {opts.text_field!r} is {'null' if value is None else type(value).__name__}"
            if not opts.skip_bad:
                raise _Bad(msg)
            bad.append(msg)
        elif value:
            enc.add_doc(value)
    return int(column.nbytes)


def _decode_lines(data: bytes, first_line: int, path: str, skip_bad: bool, bad: list[str]) -> str:
    """UTF-8 text of ``data``; with ``skip_bad`` lines that are not UTF-8 are dropped and counted."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = first_line + data.count(b"\n", 0, exc.start)
        if not skip_bad:
            raise _Bad(
                f"{path}:{line}: not valid UTF-8 ({exc.reason}); re-encode it (iconv -t UTF-8) or use the "
                "byte tokenizer, which accepts any bytes"
            ) from None
    kept = []
    for i, raw in enumerate(data.splitlines(keepends=True)):
        try:
            kept.append(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            bad.append(f"{path}:{first_line + i}: not valid UTF-8 ({exc.reason})")
    return "".join(kept)


def _text_chunks(unit: Unit, opts: ReadOptions) -> Iterator[tuple[int, bytes]]:
    """(line number or -1, bytes) newline-aligned chunks of a text unit."""
    f = unit.file
    if not f.compression:
        with open(f.path, "rb") as fh:
            for _, data in iter_chunks(fh, unit.start, unit.end, opts.chunk_bytes):
                yield -1, data
        return
    line, carry = 1, b""
    with open_binary(f.path, f.compression) as fh:
        while block := fh.read(opts.chunk_bytes):
            data = carry + block
            cut = data.rfind(b"\n") + 1
            data, carry = (data[:cut], data[cut:]) if cut else (b"", data)
            if data:
                yield line, data
                line += data.count(b"\n")
        if carry:
            yield line, carry


def _read_text(unit: Unit, enc: _Encoder, opts: ReadOptions, bad: list[str], tok: Tokenizer) -> int:
    f = unit.file
    read = 0
    parts: list[Any] = []
    digest = hashlib.blake2b(digest_size=16) if opts.dedup and unit.first and unit.last else None
    for line, data in _text_chunks(unit, opts):
        read += len(data)
        if digest is not None:
            digest.update(data)
        if isinstance(tok, ByteTokenizer):
            parts.append(data)
            continue
        first_line = line if line > 0 else -1
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            if first_line < 0:
                first_line = _line_of(f.path, unit.start + read - len(data))
            text = _decode_lines(data, first_line, f.path, opts.skip_bad, bad)
        parts.append(tok.encode(text))
    if unit.first and unit.last and read == 0:
        return 0  # an empty file is no document (not even a separator)
    ids: Any = b"".join(parts) if isinstance(tok, ByteTokenizer) else [i for p in parts for i in p]
    enc.add_piece(ids, unit.last, digest.digest() if digest is not None else None)
    return read


def tokenize_unit(unit: Unit, tok: Tokenizer, opts: ReadOptions) -> UnitResult:
    """Tokens and documents of one unit; never raises for bad input (see module docstring)."""
    enc = _Encoder(tok, opts)
    bad: list[str] = []
    try:
        if unit.file.kind == "parquet":
            read = _read_parquet(unit, enc, opts, bad)
        elif unit.file.kind == "jsonl":
            read = _read_jsonl(unit, enc, opts, bad)
        else:
            read = _read_text(unit, enc, opts, bad, tok)
        return enc.result(read, bad)
    except _Bad as exc:
        return UnitResult(error=f"{exc}; {_SKIP_HINT}")
    except OverflowError:
        return UnitResult(
            error=f"{unit.file.path}: the tokenizer produced an id that does not fit {opts.dtype} although "
            f"its vocab_size is {tok.vocab_size}; the tokenizer reports a wrong vocab_size"
        )
    except (OSError, EOFError, zlib.error) as exc:
        # A truncated or corrupt .gz/.zst, or a file that vanished: the whole file is unreadable.
        return UnitResult(error=f"{unit.file.path}: cannot read ({exc}); check or re-download the file")
    except DataError as exc:
        return UnitResult(error=str(exc))
    except Exception as exc:
        if type(exc).__module__.split(".")[0] != "zstandard":  # zstandard.ZstdError: a corrupt .zst
            raise
        return UnitResult(error=f"{unit.file.path}: cannot decompress ({exc}); check or re-download the file")
