"""Sequential streaming of a large text file through a (non-byte) tokenizer, in constant memory.

A Hugging Face tokenizer cannot map a byte offset to a token offset without tokenising
everything before it, so a text file too big to tokenise into memory is read front to back in
newline-aligned chunks (:func:`~speedtronic.engine.data.text.iter_chunks`) and cut into
consecutive windows. Memory is one chunk of text plus its tokens, whatever the file size.

Resume without fast-forwarding: a position in the stream is ``(epoch, offset, skip)`` — the byte
offset of the chunk holding the next window's first token, and how many of that chunk's tokens
come before it. Chunk boundaries depend only on the offset they start from, so re-reading from
``offset`` re-creates the same chunk, and skipping ``skip`` tokens lands on exactly the token an
uninterrupted run would have read next. The state is a handful of ints, independent of file size.

Data-parallel ranks each stream their own newline-aligned byte range of the file (disjoint);
validation is the last ``val_fraction`` of the file's *bytes* (line-aligned), since the token
count of a streamed file is unknown until it has been read once.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

from speedtronic.errors import DataError

from .sources import _LazyFile
from .text import DEFAULT_CHUNK_BYTES, align_to_line, encode_chunk, iter_chunks
from .tokenizer import Tokenizer

__all__ = ["StreamPos", "TextStream"]


class StreamPos(NamedTuple):
    """Where the next window of a :class:`TextStream` starts (see module docstring)."""

    epoch: int
    offset: int
    skip: int


class TextStream:
    """Byte range ``[start, end)`` of a text file, tokenised on the fly and read sequentially."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        tokenizer: Tokenizer,
        *,
        start: int = 0,
        end: int | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        name: str | None = None,
    ) -> None:
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
        except OSError as exc:
            raise DataError(f"cannot read text file {self.path}: {exc}") from exc
        self.start, self.end = start, size if end is None else end
        if not 0 <= self.start <= self.end <= size:
            raise ValueError(f"byte range [{start}, {end}) out of range for {self.path} ({size} bytes)")
        self.tokenizer = tokenizer
        self.chunk_bytes = chunk_bytes
        self.name = name or self.path.name
        self._file = _LazyFile(self.path)

    @property
    def num_bytes(self) -> int:
        return self.end - self.start

    def _sub(self, start: int, end: int) -> TextStream:
        return TextStream(
            self.path, self.tokenizer, start=start, end=end, chunk_bytes=self.chunk_bytes, name=self.name
        )

    def _align(self, offset: int) -> int:
        return max(self.start, align_to_line(self._file.get(), offset, self.end, self.chunk_bytes))

    def split(self, val_fraction: float) -> tuple[TextStream, TextStream | None]:
        """``(train, val)`` with val the last ``val_fraction`` of the bytes, cut at a line start."""
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        if val_fraction == 0.0:
            return self, None
        cut = self._align(self.end - int(self.num_bytes * val_fraction))
        return self._sub(self.start, cut), (self._sub(cut, self.end) if cut < self.end else None)

    def shard(self, rank: int, world_size: int) -> TextStream:
        """The ``rank``-th of ``world_size`` disjoint, line-aligned byte ranges."""
        if world_size == 1:
            return self
        lo = self._align(self.start + self.num_bytes * rank // world_size)
        hi = self._align(self.start + self.num_bytes * (rank + 1) // world_size)
        if lo >= hi:
            raise DataError(
                f"{self.path}: too small to give data-parallel rank {rank} of {world_size} any lines; "
                "use a bigger text file or fewer ranks"
            )
        return self._sub(lo, hi)

    def first_pos(self, epoch: int = 0) -> StreamPos:
        return StreamPos(epoch, self.start, 0)

    def windows(self, length: int, stride: int, pos: StreamPos) -> Iterator[tuple[list[int], StreamPos]]:
        """Windows of ``length`` tokens every ``stride`` tokens from ``pos`` to the end of this epoch.

        Yields ``(window, next_pos)`` where ``next_pos`` is where the following window starts. A
        tail shorter than ``length`` at the end of the range is dropped.
        """
        if not 0 < stride < length:
            raise ValueError(f"need 0 < stride < length, got stride={stride}, length={length}")
        if not self.start <= pos.offset <= self.end:
            raise ValueError(f"stream offset {pos.offset} outside [{self.start}, {self.end}) of {self.path}")
        pending: deque[tuple[int, Sequence[int]]] = deque()  # (chunk offset, its tokens)
        p = pos.skip  # index into pending[0] of the next window's first token
        buffered = 0  # tokens in pending
        first = True
        f = self._file.get()
        for offset, data in iter_chunks(f, pos.offset, self.end, self.chunk_bytes):
            toks = encode_chunk(self.tokenizer, data, f"{self.path} (chunk at byte {offset})")
            if first:
                first = False
                if pos.skip > len(toks):
                    raise DataError(
                        f"saved data position (byte {pos.offset}, token {pos.skip}) does not match {self.path}: "
                        "the file or tokenizer changed since the checkpoint; resume with the same data"
                    )
            pending.append((offset, toks))
            buffered += len(toks)
            while buffered - p >= length:
                window: list[int] = []
                i, j = 0, p
                while len(window) < length:
                    chunk = pending[i][1]
                    take = min(length - len(window), len(chunk) - j)
                    window.extend(chunk[j : j + take])
                    i, j = i + 1, 0
                p += stride
                while pending and p >= len(pending[0][1]):  # drop chunks the next window is past
                    p -= len(pending[0][1])
                    buffered -= len(pending[0][1])
                    pending.popleft()
                # stride < length leaves at least one token buffered, so pending is never empty here.
                yield window, StreamPos(pos.epoch, pending[0][0], p)

    def close(self) -> None:
        self._file.close()

    def describe(self) -> str:
        return f"{self.num_bytes:,} bytes streamed"
