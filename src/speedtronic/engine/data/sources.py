"""Random-access token sources: in-memory arrays, synthetic tokens, token files and raw byte files.

A :class:`TokenSource` is a read-only sequence of token ids that can hand out any window
``[start, start + length)`` as an int64 tensor. The loader only ever asks for windows, so a
source may live in memory (:class:`TokenArray`, :class:`SyntheticTokens`), be memory-mapped
(:class:`TokenFile`, one file of a ``prepare``d dataset; :class:`ShardedTokens`, many files seen as
one sequence) or be read with ``seek`` (:class:`ByteFileSource`,
a large text file under the byte tokenizer, where byte offset == token offset). File-backed
sources pickle by path and reopen lazily, so DataLoader workers never copy the data.
"""

from __future__ import annotations

import array
import bisect
import hashlib
import io
import mmap
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch

from speedtronic.errors import DataError

from .meta import itemsize_of
from .text import DEFAULT_CHUNK_BYTES, encode_chunk, iter_chunks
from .tokenizer import ByteTokenizer, Tokenizer

__all__ = [
    "ByteFileSource",
    "ShardedTokens",
    "SubRange",
    "SyntheticTokens",
    "TokenArray",
    "TokenFile",
    "TokenSource",
    "mix_seed",
    "split_point",
    "split_train_val",
    "tokenize_bytes",
    "tokenize_file",
]

_TORCH_DTYPE = {"uint8": torch.uint8, "uint16": torch.uint16, "uint32": torch.uint32}


def mix_seed(seed: int, *parts: object) -> int:
    """A 63-bit generator seed derived from ``seed`` and ``parts`` (e.g. an epoch number).

    Hashing (rather than ``seed + epoch``) keeps neighbouring seeds and epochs uncorrelated, and
    is stable across processes and Python versions, unlike ``hash()``.
    """
    key = ":".join(str(p) for p in (int(seed), *parts)).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2**63 - 1)


class TokenSource(ABC):
    """A finite, read-only sequence of token ids with random access by window."""

    name: str = "tokens"

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def _read(self, start: int, length: int) -> torch.Tensor:
        """Tokens ``[start, start + length)`` (already bounds-checked) as a 1-D tensor of any int dtype."""

    def read(self, start: int, length: int) -> torch.Tensor:
        """Tokens ``[start, start + length)`` as a 1-D int64 tensor."""
        if start < 0 or length < 0 or start + length > len(self):
            raise ValueError(f"window [{start}, {start + length}) out of range for {len(self)} tokens")
        return self._read(start, length).to(torch.int64)

    def windows(self, starts: Sequence[int], length: int) -> torch.Tensor:
        """A ``[len(starts), length]`` int64 tensor of windows."""
        if len(starts) == 0:
            return torch.empty((0, length), dtype=torch.int64)
        return torch.stack([self.read(int(s), length) for s in starts])

    def slice(self, start: int, end: int) -> TokenSource:
        """Tokens ``[start, end)`` as a source of their own (no copy)."""
        if not 0 <= start <= end <= len(self):
            raise ValueError(f"slice [{start}, {end}) out of range for {len(self)} tokens")
        return SubRange(self, start, end)


class SubRange(TokenSource):
    """A contiguous range of another source."""

    def __init__(self, base: TokenSource, start: int, end: int) -> None:
        self.base, self.start, self.end = base, start, end
        self.name = base.name

    def __len__(self) -> int:
        return self.end - self.start

    def _read(self, start: int, length: int) -> torch.Tensor:
        return self.base._read(self.start + start, length)

    def windows(self, starts: Sequence[int], length: int) -> torch.Tensor:
        for s in starts:
            if s < 0 or s + length > len(self):
                raise ValueError(f"window [{s}, {s + length}) out of range for {len(self)} tokens")
        return self.base.windows([self.start + int(s) for s in starts], length)

    def slice(self, start: int, end: int) -> TokenSource:
        if not 0 <= start <= end <= len(self):
            raise ValueError(f"slice [{start}, {end}) out of range for {len(self)} tokens")
        return SubRange(self.base, self.start + start, self.start + end)


class TokenArray(TokenSource):
    """Tokens held in memory as a 1-D integer tensor (kept in its compact dtype)."""

    def __init__(self, tokens: torch.Tensor, name: str = "tokens") -> None:
        if (
            tokens.dim() != 1
            or tokens.is_floating_point()
            or tokens.is_complex()
            or tokens.dtype == torch.bool
        ):
            raise ValueError(
                f"TokenArray needs a 1-D integer tensor, got {tuple(tokens.shape)} {tokens.dtype}"
            )
        self.tokens = tokens.contiguous()
        self.name = name
        self._offsets: dict[int, torch.Tensor] = {}  # window length -> [[0, 1, ..., length - 1]]

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def _read(self, start: int, length: int) -> torch.Tensor:
        return self.tokens[start : start + length]

    def windows(self, starts: Sequence[int], length: int) -> torch.Tensor:
        # One gather instead of B slices + stack; the bounds are checked on the Python ints and the
        # offsets 0..length-1 made once (this runs every step: each tensor op here is eager overhead).
        starts = list(starts)
        if starts and (min(starts) < 0 or max(starts) + length > len(self)):
            raise ValueError(f"windows of length {length} out of range for {len(self)} tokens")
        offsets = self._offsets.get(length)
        if offsets is None:
            offsets = self._offsets[length] = torch.arange(length, dtype=torch.int64)[None, :]
        idx = torch.as_tensor(starts, dtype=torch.int64)[:, None] + offsets
        return self.tokens[idx].to(torch.int64)

    def slice(self, start: int, end: int) -> TokenSource:
        if not 0 <= start <= end <= len(self):
            raise ValueError(f"slice [{start}, {end}) out of range for {len(self)} tokens")
        return TokenArray(self.tokens[start:end], self.name)


class SyntheticTokens(TokenArray):
    """A reproducible, learnable pseudo-random token stream generated from ``seed``.

    The stream is a sequence of motifs (fixed random phrases of ``motif_len`` tokens) drawn from a
    small set, with a little uniform noise. Within a motif the next token is predictable from the
    previous ones, so a smoke run's loss visibly drops well below ``log(vocab_size)``. Generation
    is vectorised (about 10 ms per million tokens) and depends only on the arguments.
    """

    def __init__(
        self,
        vocab_size: int,
        num_tokens: int,
        seed: int = 0,
        *,
        num_motifs: int = 64,
        motif_len: int = 16,
        noise: float = 0.05,
    ) -> None:
        if vocab_size < 2 or num_tokens < 1 or num_motifs < 1 or motif_len < 1 or not 0.0 <= noise <= 1.0:
            raise ValueError(
                f"SyntheticTokens: need vocab_size >= 2, num_tokens >= 1, num_motifs >= 1, motif_len >= 1 "
                f"and 0 <= noise <= 1 (got {vocab_size}, {num_tokens}, {num_motifs}, {motif_len}, {noise})"
            )
        g = torch.Generator().manual_seed(mix_seed(seed, "synthetic"))
        dtype = torch.int32 if vocab_size <= 2**31 - 1 else torch.int64
        motifs = torch.randint(0, vocab_size, (num_motifs, motif_len), generator=g, dtype=dtype)
        picks = torch.randint(0, num_motifs, (-(-num_tokens // motif_len),), generator=g)
        stream = motifs[picks].reshape(-1)[:num_tokens].clone()
        mask = torch.rand(num_tokens, generator=g) < noise
        stream[mask] = torch.randint(0, vocab_size, (int(mask.sum()),), generator=g, dtype=dtype)
        super().__init__(stream, name="synthetic")
        self.vocab_size, self.seed = vocab_size, seed


class _LazyFile:
    """Per-process lazily opened read-only file handle; pickles as its path."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh: BinaryIO | None = None
        self._pid = -1

    def get(self) -> BinaryIO:
        # A handle inherited through fork shares its seek position with the parent: reopen per process.
        if self._fh is None or self._pid != os.getpid():
            try:
                self._fh = open(self.path, "rb")  # noqa: SIM115 - kept open for the source's lifetime
            except OSError as exc:
                raise DataError(f"cannot open {self.path}: {exc}") from exc
            self._pid = os.getpid()
        return self._fh

    def close(self) -> None:
        if self._fh is not None and self._pid == os.getpid():
            self._fh.close()
        self._fh = None

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"])  # type: ignore[misc]


class TokenFile(TokenSource):
    """A flat binary file of ``uint16``/``uint32`` token ids, memory-mapped on first use.

    Only the pages that windows touch are read, so any size works in constant process memory.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        dtype: str = "uint16",
        *,
        name: str | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.path = Path(path)
        self.dtype = dtype
        # Every window read is checked against it (cheap: a max over one window), so a file that does
        # not match its meta.json — ids past the vocabulary, or the wrong dtype — is a DataError, not an
        # IndexError deep inside the embedding.
        self.vocab_size = vocab_size
        self.itemsize = itemsize_of(dtype)
        try:
            size = self.path.stat().st_size
        except OSError as exc:
            raise DataError(
                f"token file {self.path} cannot be read ({exc}); re-run `speedtronic data prepare`"
            ) from exc
        if size % self.itemsize:
            raise DataError(
                f"token file {self.path} is {size} bytes, not a multiple of {self.itemsize} ({dtype}); "
                "it is truncated or not a token file: re-run `speedtronic data prepare`"
            )
        self._len = size // self.itemsize
        self.name = name or self.path.name
        self._file = _LazyFile(self.path)
        self._mm: mmap.mmap | None = None
        self._mm_pid = -1

    def __len__(self) -> int:
        return self._len

    def _map(self) -> mmap.mmap:
        if self._mm is None or self._mm_pid != os.getpid():
            self._mm = mmap.mmap(self._file.get().fileno(), 0, access=mmap.ACCESS_READ)
            self._mm_pid = os.getpid()
        return self._mm

    def _read(self, start: int, length: int) -> torch.Tensor:
        if length == 0:
            return torch.empty(0, dtype=torch.int64)
        raw = bytearray(self._map()[start * self.itemsize : (start + length) * self.itemsize])
        tokens = torch.frombuffer(raw, dtype=_TORCH_DTYPE[self.dtype]).to(torch.int64)
        if self.vocab_size is not None and int(tokens.max()) >= self.vocab_size:
            at = start + int((tokens >= self.vocab_size).nonzero()[0])
            raise DataError(
                f"{self.path}: token id {int(tokens[at - start]):,} at position {at:,} is outside the "
                f"vocabulary of its meta.json ({self.vocab_size:,}); the file does not match meta.json "
                "(wrong dtype or vocab_size, or a modified file): re-run `speedtronic data prepare`"
            )
        return tokens

    def close(self) -> None:
        if self._mm is not None and self._mm_pid == os.getpid():
            self._mm.close()
        self._mm = None
        self._file.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_mm"], state["_mm_pid"] = None, -1
        return state


class ShardedTokens(TokenSource):
    """Several token sources (the shards of a prepared dataset) read as one sequence, in order.

    A window that crosses a shard boundary is joined from both shards, so the loader's windows,
    resume positions and world-size rescaling are exactly those of one file with the same tokens.
    """

    def __init__(self, shards: Sequence[TokenSource], *, name: str = "tokens") -> None:
        self.shards = [s for s in shards if len(s) > 0]
        self.starts = [0]
        for s in self.shards:
            self.starts.append(self.starts[-1] + len(s))
        self.name = name

    def __len__(self) -> int:
        return self.starts[-1]

    def _read(self, start: int, length: int) -> torch.Tensor:
        pieces = []
        i = bisect.bisect_right(self.starts, start) - 1
        while length > 0:
            offset = start - self.starts[i]
            take = min(length, len(self.shards[i]) - offset)
            pieces.append(self.shards[i]._read(offset, take))
            start, length, i = start + take, length - take, i + 1
        if not pieces:
            return torch.empty(0, dtype=torch.int64)
        return pieces[0] if len(pieces) == 1 else torch.cat([p.to(torch.int64) for p in pieces])

    def close(self) -> None:
        for s in self.shards:
            close = getattr(s, "close", None)
            if close is not None:
                close()


class ByteFileSource(TokenSource):
    """A text file under the byte tokenizer, read with ``seek`` + ``read`` per window.

    Byte offset == token offset, so this is random access over a file of any size with memory
    bounded by one batch of windows.
    """

    def __init__(self, path: str | os.PathLike[str], *, name: str | None = None) -> None:
        self.path = Path(path)
        try:
            self._len = self.path.stat().st_size
        except OSError as exc:
            raise DataError(f"cannot read text file {self.path}: {exc}") from exc
        self.name = name or self.path.name
        self._file = _LazyFile(self.path)

    def __len__(self) -> int:
        return self._len

    def _read(self, start: int, length: int) -> torch.Tensor:
        f = self._file.get()
        f.seek(start)
        data = f.read(length)
        if len(data) != length:
            raise DataError(
                f"{self.path}: short read at byte {start}; was the file truncated while training?"
            )
        return (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if length
            else torch.empty(0, dtype=torch.uint8)
        )

    def close(self) -> None:
        self._file.close()


def split_point(num_tokens: int, val_fraction: float) -> int:
    """Number of leading tokens kept for training; the last ``int(n * val_fraction)`` are validation."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    return num_tokens - int(num_tokens * val_fraction)


def split_train_val(source: TokenSource, val_fraction: float) -> tuple[TokenSource, TokenSource | None]:
    """``(train, val)``: val is the last ``val_fraction`` of the tokens, or None when that is empty."""
    cut = split_point(len(source), val_fraction)
    return source.slice(0, cut), (source.slice(cut, len(source)) if cut < len(source) else None)


def _tokenize_stream(
    f: BinaryIO, size: int, tokenizer: Tokenizer, chunk_bytes: int, where: str
) -> torch.Tensor:
    if isinstance(tokenizer, ByteTokenizer):
        f.seek(0)
        return (
            torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
            if size
            else torch.empty(0, dtype=torch.uint8)
        )
    # array.array keeps the ids compact (2 or 4 bytes each) while they accumulate.
    code = "H" if tokenizer.vocab_size <= 65535 else "I"
    out = array.array(code)
    for offset, data in iter_chunks(f, 0, size, chunk_bytes):
        out.extend(encode_chunk(tokenizer, data, f"{where} (chunk at byte {offset})"))
    if not out:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(out, dtype=torch.uint16 if code == "H" else torch.uint32)


def tokenize_file(
    path: str | os.PathLike[str], tokenizer: Tokenizer, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> TokenArray:
    """Tokenise a whole text file into memory (same token stream as ``prepare`` and streaming)."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            return TokenArray(_tokenize_stream(f, size, tokenizer, chunk_bytes, str(p)), name=p.name)
    except OSError as exc:
        raise DataError(f"cannot read text file {p}: {exc}") from exc


def tokenize_bytes(
    data: bytes, tokenizer: Tokenizer, *, name: str = "text", chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> TokenArray:
    """Tokenise in-memory UTF-8 text (e.g. the embedded corpus) exactly as a file with these bytes."""
    return TokenArray(_tokenize_stream(io.BytesIO(data), len(data), tokenizer, chunk_bytes, name), name=name)
