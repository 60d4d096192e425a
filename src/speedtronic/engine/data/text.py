"""Reading text files in bounded chunks, and the embedded default corpus.

Every path that turns a text file into tokens (in-memory tokenisation, the streaming source and
``prepare``) goes through :func:`iter_chunks` + :func:`encode_chunk`, so they all produce the same
token stream for the same file. Chunks end at a newline where one exists, which keeps a word from
being split between two ``encode`` calls; for tokenizers whose pre-tokenizer splits at newlines
(whitespace/byte-level BPE, WordLevel, ...) the stream is then identical to encoding the whole file.
For the byte tokenizer the tokens are simply the file's bytes. No torch import here.
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from speedtronic.errors import DataError, DataPathError

from .tokenizer import ByteTokenizer, Tokenizer

if TYPE_CHECKING:
    from importlib.abc import Traversable

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_CORPUS_NAME",
    "align_to_line",
    "default_corpus_path",
    "encode_chunk",
    "file_size",
    "iter_chunks",
    "read_default_corpus",
    "read_default_corpus_bytes",
]

#: Bytes read per ``read()`` when tokenising a file; bounds the memory of streaming and prepare.
DEFAULT_CHUNK_BYTES = 1 << 20

DEFAULT_CORPUS_NAME = "tinyshakespeare.txt"
_CORPUS_PACKAGE = "speedtronic.resources"
_CORPUS_RESOURCE = "tinyshakespeare.txt.gz"


def _utf8_cut(data: bytes) -> int:
    """Length of the longest prefix of ``data`` that does not end inside a UTF-8 sequence."""
    # Step back over continuation bytes (10xxxxxx) to the lead byte of the last character; keep
    # everything if that character is complete, else cut just before it.
    n = len(data)
    i = n - 1
    while i >= 0 and n - i < 4 and (data[i] & 0xC0) == 0x80:
        i -= 1
    if i < 0 or (data[i] & 0xC0) == 0x80:
        return n  # not UTF-8; leave it to the decoder to complain
    lead = data[i]
    need = 1 if lead < 0x80 else 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4
    return n if n - i >= need else i


def iter_chunks(
    f: BinaryIO, start: int, end: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[tuple[int, bytes]]:
    """Yield ``(offset, data)`` covering bytes ``[start, end)`` of ``f`` in order.

    Each chunk is at most ``chunk_bytes`` long and, unless it is the last one, ends just after a
    newline (or, for a line longer than a chunk, at a UTF-8 character boundary). Where the next
    chunk starts depends only on the current offset, never on history, which is what lets the
    streaming source resume from a saved offset and see exactly the same chunks again.
    """
    if chunk_bytes < 4:
        raise ValueError(f"chunk_bytes must be >= 4, got {chunk_bytes}")
    pos = start
    while pos < end:
        f.seek(pos)
        data = f.read(min(chunk_bytes, end - pos))
        if not data:
            name = getattr(f, "name", "file")
            raise DataError(
                f"{name}: ended at byte {pos}, expected {end} bytes; was it modified while reading?"
            )
        if pos + len(data) < end:
            nl = data.rfind(b"\n")
            cut = nl + 1 if nl >= 0 else _utf8_cut(data)
            data = data[: cut or len(data)]
        yield pos, data
        pos += len(data)


def align_to_line(f: BinaryIO, offset: int, end: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """The first line start at or after ``offset`` (``end`` if there is none before it)."""
    if offset <= 0:
        return 0
    pos = offset
    f.seek(offset - 1)
    if f.read(1) == b"\n":
        return offset
    while pos < end:
        f.seek(pos)
        data = f.read(min(chunk_bytes, end - pos))
        if not data:
            break
        nl = data.find(b"\n")
        if nl >= 0:
            return pos + nl + 1
        pos += len(data)
    return end


def encode_chunk(tokenizer: Tokenizer, data: bytes, where: str = "text") -> bytes | list[int]:
    """Tokens for one chunk; the byte tokenizer uses the raw bytes (no decode/encode round trip)."""
    if isinstance(tokenizer, ByteTokenizer):
        return data
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{where} is not valid UTF-8 ({exc.reason} near byte {exc.start}); re-encode it as UTF-8 "
            "(e.g. iconv -t UTF-8) or use the byte tokenizer, which accepts any bytes"
        ) from None
    return tokenizer.encode(text)


def default_corpus_path() -> Traversable:
    """The packaged gzip of tinyshakespeare, used when no dataset is configured."""
    from importlib import resources

    try:
        res = resources.files(_CORPUS_PACKAGE).joinpath(_CORPUS_RESOURCE)
    except ModuleNotFoundError:
        res = None
    if res is None or not res.is_file():
        raise DataError(
            f"the embedded default corpus ({_CORPUS_PACKAGE}/{_CORPUS_RESOURCE}) is missing from this "
            "installation: set data.text_path or data.dataset, or reinstall speedtronic"
        )
    return res


def read_default_corpus_bytes() -> bytes:
    """UTF-8 bytes of the default corpus (decompressed)."""
    res = default_corpus_path()
    try:
        return gzip.decompress(res.read_bytes())
    except (OSError, EOFError) as exc:
        raise DataError(
            f"the embedded default corpus {res} is corrupt ({exc}); reinstall speedtronic"
        ) from exc


def read_default_corpus() -> str:
    """Text of the embedded default corpus."""
    return read_default_corpus_bytes().decode("utf-8")


def check_text_path(path: str | os.PathLike[str], field: str = "data.text_path") -> Path:
    """`path` as a regular text file, or a DataPathError naming `field` (exit 2). Never opens it, so
    a FIFO cannot block and /dev/zero is not read."""
    p = Path(path)
    if not p.exists():
        raise DataPathError(f"{field}: text file {p} not found; check the path", field)
    if not p.is_file():
        kind = "a directory" if p.is_dir() else "not a regular file (a device, FIFO or socket)"
        raise DataPathError(f"{field}: {p} is {kind}; name a text file", field)
    return p


def file_size(path: str | os.PathLike[str]) -> int:
    """Size of a text file, with a DataError naming it when it cannot be read."""
    p = Path(path)
    try:
        return check_text_path(p).stat().st_size
    except OSError as exc:
        raise DataError(f"cannot read text file {p}: {exc}") from exc
