"""Writing a split (``train`` or ``val``) of a prepared dataset as numbered token shards.

Shards are ``train-00000.bin``, ``train-00001.bin``, ... : flat little-endian token arrays, each
closed once it holds at least ``shard_tokens`` tokens, so no corpus ever needs one giant file.
The writer records, per shard, its tokens and the documents that end in it (the index that
``meta.json`` stores). Its whole state is a small dict (closed shards + length of the open one),
which is what makes ``prepare`` resumable: on resume the open shard is truncated back to the
recorded length and any later shard file is removed. No torch here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any

__all__ = ["ShardWriter", "shard_name"]


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


class ShardWriter:
    """Appends tokens of one split to numbered shard files in ``directory``."""

    def __init__(
        self,
        directory: Path,
        split: str,
        itemsize: int,
        shard_tokens: int,
        state: dict[str, Any] | None = None,
    ) -> None:
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
        self.directory, self.split, self.itemsize, self.shard_tokens = (
            directory,
            split,
            itemsize,
            shard_tokens,
        )
        state = state or {}
        self.shards: list[dict[str, Any]] = [dict(s) for s in state.get("shards", [])]
        self.open_tokens = int(state.get("open_tokens", 0))
        self.open_docs = int(state.get("open_docs", 0))
        path = self._open_path()
        # Resume: drop whatever the interrupted run wrote after its last saved state.
        if path.exists() or self.open_tokens:
            with open(path, "ab") as f:
                f.truncate(self.open_tokens * itemsize)
        for stale in directory.glob(f"{split}-*.bin"):
            if stale.name > path.name:
                stale.unlink()
        self._fh = open(path, "ab")  # noqa: SIM115 - closed in close()/roll()

    def _open_path(self) -> Path:
        return self.directory / shard_name(self.split, len(self.shards))

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards) + self.open_tokens

    @property
    def documents(self) -> int:
        return sum(s["documents"] for s in self.shards) + self.open_docs

    def write(self, data: bytes | memoryview, docs_ended: int) -> None:
        self._fh.write(data)
        self.open_tokens += len(data) // self.itemsize
        self.open_docs += docs_ended

    def roll_if_full(self) -> bool:
        """Close the open shard if it reached ``shard_tokens`` (called between units); True if closed."""
        if self.open_tokens < self.shard_tokens:
            return False
        self.roll()
        return True

    def roll(self) -> None:
        """Close the open shard (if it holds anything) and start the next one."""
        if self.open_tokens == 0:
            return
        self.sync()
        self._fh.close()
        self.shards.append(
            {"file": self._open_path().name, "tokens": self.open_tokens, "documents": self.open_docs}
        )
        self.open_tokens = self.open_docs = 0
        self._fh = open(self._open_path(), "ab")  # noqa: SIM115

    def sync(self) -> None:
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def state(self) -> dict[str, Any]:
        return {
            "shards": [dict(s) for s in self.shards],
            "open_tokens": self.open_tokens,
            "open_docs": self.open_docs,
        }

    def close(self) -> list[dict[str, Any]]:
        """Close the last shard and return the shard index; an empty open shard file is removed."""
        self.roll()
        self._fh.close()
        with contextlib.suppress(FileNotFoundError):
            self._open_path().unlink()
        return self.shards

    def take_tail(self, n: int, into: ShardWriter, docs: int) -> None:
        """Move the last ``n`` tokens (ending ``docs`` documents) of this split to the end of ``into``.

        Used when the document rule left validation empty: the last document (or, for a single
        document, its last tokens) becomes the validation split. Call after :meth:`close`.
        """
        moved: list[tuple[Path, int]] = []  # (shard, first token to move)
        ends_here = self.shards[-1] if self.shards else None  # the moved documents end in the last shard
        left = n
        while left > 0 and self.shards:
            last = self.shards[-1]
            take = min(left, last["tokens"])
            moved.append((self.directory / last["file"], last["tokens"] - take))
            left -= take
            if take == last["tokens"]:
                self.shards.pop()
            else:
                last["tokens"] -= take
        for i, (path, first) in enumerate(reversed(moved)):
            with open(path, "r+b") as f:
                f.seek(first * self.itemsize)
                start = f.tell()
                shutil.copyfileobj(f, into._fh, 1 << 20)
                into.open_tokens += (f.tell() - start) // self.itemsize
                f.truncate(first * self.itemsize)
            if first == 0:
                path.unlink()
            if i == len(moved) - 1:
                into.open_docs += docs
        if ends_here is not None and self.shards and self.shards[-1] is ends_here:
            ends_here["documents"] = max(0, ends_here["documents"] - docs)
