"""``build_data``: turn the data section of a config into a training loader + validation batches.

``sources`` (a weighted mixture: source_spec.py opens the entries, mixture.py mixes them) excludes
the single-source fields. Otherwise the precedence is ``synthetic`` → ``dataset`` (a directory written by ``prepare``) → ``text_path``
→ the embedded default corpus. A text file smaller than ``memory_budget_bytes`` is tokenised once
into memory; a bigger one is never loaded whole: under the byte tokenizer it is read by seeking
(random access, shuffling works), under any other tokenizer it is streamed sequentially.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speedtronic.errors import ConfigError

from .loader import Batch, TrainLoader, make_val_batches
from .mixture import MixtureLoader, WeightedSource
from .source_spec import dataset_sources, mixture_tokenizer_spec, open_sources
from .sources import (
    ByteFileSource,
    SyntheticTokens,
    TokenSource,
    split_train_val,
    tokenize_bytes,
    tokenize_file,
)
from .stream import TextStream
from .text import DEFAULT_CHUNK_BYTES, DEFAULT_CORPUS_NAME, file_size, read_default_corpus_bytes
from .tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

__all__ = ["DEFAULT_MEMORY_BUDGET_BYTES", "DataBundle", "build_data"]

#: Text files up to this size are tokenised into memory; larger ones are read incrementally.
DEFAULT_MEMORY_BUDGET_BYTES = 64 << 20


@dataclass
class DataBundle:
    """Everything the trainer needs from the data layer."""

    train: TrainLoader | MixtureLoader
    tokenizer: Tokenizer
    vocab_size: int
    description: str
    val_source: TokenSource | TextStream | None = None
    block_size: int = 0
    micro_batch_size: int = 1
    num_val_batches: int = 0
    # data.sources: each source's validation split and weight, by name (empty for one source).
    val_by_source: dict[str, TokenSource | None] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    _val_cache: list[Batch] | None = field(default=None, repr=False)
    _source_cache: dict[str, list[Batch]] | None = field(default=None, repr=False)

    def val_batches(self) -> list[Batch]:
        """Deterministic validation batches (the same list every call; possibly empty); a mixture's are
        every source's, one after another."""
        if self._val_cache is None:
            if self.val_by_source:
                self._val_cache = [b for batches in self.source_val_batches().values() for b in batches]
            else:
                self._val_cache = make_val_batches(
                    self.val_source,
                    block_size=self.block_size,
                    micro_batch_size=self.micro_batch_size,
                    max_batches=self.num_val_batches,
                )
        return list(self._val_cache)

    def source_val_batches(self) -> dict[str, list[Batch]]:
        """A mixture's validation batches by source (``val_batches`` of each source; {} for one source)."""
        if self._source_cache is None:
            self._source_cache = {
                name: make_val_batches(
                    val,
                    block_size=self.block_size,
                    micro_batch_size=self.micro_batch_size,
                    max_batches=self.num_val_batches,
                )
                for name, val in self.val_by_source.items()
            }
        return dict(self._source_cache)

    def describe(self) -> str:
        """One line for logs, e.g. ``text x.txt: 1,003,854 train / 111,540 val tokens, byte tokenizer``."""
        return self.description

    def close(self) -> None:
        self.train.close()


def _get(cfg: Any, name: str, default: Any) -> Any:
    value = getattr(cfg, name, default)
    return default if value is None else value


def _vocab(cfg_vocab: int | None, tokenizer_vocab: int, what: str) -> int:
    if cfg_vocab is None:
        return tokenizer_vocab
    if cfg_vocab < tokenizer_vocab:
        raise ConfigError(
            f"vocab_size={cfg_vocab} is smaller than the {what} vocabulary ({tokenizer_vocab:,}); "
            "set vocab_size to at least that, or leave it unset to use the tokenizer's"
        )
    return int(cfg_vocab)


def _counts(train: TokenSource, val: TokenSource | None) -> str:
    return f"{len(train):,} train / {len(val) if val is not None else 0:,} val tokens"


def build_data(
    cfg: Any,
    *,
    device_type: str = "cpu",
    rank: int = 0,
    world_size: int = 1,
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> DataBundle:
    """Build the train loader, validation split and tokenizer described by ``cfg`` (see module doc)."""
    if getattr(cfg, "sources", None):
        return _build_mixture(cfg, device_type, rank, world_size, memory_budget_bytes, chunk_bytes)
    block_size, micro_batch_size = int(cfg.block_size), int(cfg.micro_batch_size)
    val_fraction = float(_get(cfg, "val_fraction", 0.1))
    cfg_vocab = getattr(cfg, "vocab_size", None)
    tok_spec = getattr(cfg, "tokenizer", None)
    val: TokenSource | TextStream | None
    source: TokenSource | TextStream

    if _get(cfg, "synthetic", False):
        tokenizer = load_tokenizer(tok_spec)
        vocab_size = int(cfg_vocab) if cfg_vocab is not None else tokenizer.vocab_size
        seed = int(_get(cfg, "seed", 0))
        num_tokens = int(_get(cfg, "num_tokens", 1 << 20))
        source, val = split_train_val(SyntheticTokens(vocab_size, num_tokens, seed), val_fraction)
        desc = f"synthetic (seed {seed}, vocab {vocab_size:,}): {_counts(source, val)}"
    elif getattr(cfg, "dataset", None):
        source, val, tokenizer, meta = dataset_sources(str(cfg.dataset), tok_spec)
        vocab_size = _vocab(cfg_vocab, meta["vocab_size"], "dataset's")
        desc = f"dataset {Path(str(cfg.dataset)).name}: {_counts(source, val)} ({meta['dtype']}), {tokenizer.describe()}"
    else:
        tokenizer = load_tokenizer(tok_spec)
        vocab_size = _vocab(cfg_vocab, tokenizer.vocab_size, "tokenizer's")
        text_path = getattr(cfg, "text_path", None)
        if text_path:
            path = os.fspath(text_path)
            name, size = Path(path).name, file_size(path)
            if size <= memory_budget_bytes:
                source, val = split_train_val(
                    tokenize_file(path, tokenizer, chunk_bytes=chunk_bytes), val_fraction
                )
                desc = f"text {name}: {_counts(source, val)}, {tokenizer.describe()}"
            elif isinstance(tokenizer, ByteTokenizer):
                source, val = split_train_val(ByteFileSource(path), val_fraction)
                desc = f"text {name} (read from disk, {size:,} bytes): {_counts(source, val)}, byte tokenizer"
            else:
                source, val = TextStream(path, tokenizer, chunk_bytes=chunk_bytes).split(val_fraction)
                val_bytes = val.num_bytes if val is not None else 0
                desc = (
                    f"text {name} (streamed sequentially, {size:,} bytes): {source.num_bytes:,} train / "
                    f"{val_bytes:,} val bytes, {tokenizer.describe()}"
                )
        else:
            data = read_default_corpus_bytes()
            tokens = tokenize_bytes(data, tokenizer, name=DEFAULT_CORPUS_NAME, chunk_bytes=chunk_bytes)
            source, val = split_train_val(tokens, val_fraction)
            desc = f"text {DEFAULT_CORPUS_NAME} (built-in): {_counts(source, val)}, {tokenizer.describe()}"

    train = TrainLoader(
        source,
        block_size=block_size,
        micro_batch_size=micro_batch_size,
        shuffle=bool(_get(cfg, "shuffle", True)),
        drop_last=bool(_get(cfg, "drop_last", True)),
        seed=int(_get(cfg, "seed", 0)),
        num_workers=int(_get(cfg, "num_workers", 0)),
        prefetch_factor=getattr(cfg, "prefetch_factor", None),
        # Pinned host memory only helps (and only works) when batches go to a CUDA device.
        pin_memory=bool(_get(cfg, "pin_memory", False)) and device_type == "cuda",
        rank=rank,
        world_size=world_size,
    )
    if world_size > 1:
        desc += f", rank {rank}/{world_size}"
    return DataBundle(
        train=train,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        description=desc,
        val_source=val,
        block_size=block_size,
        micro_batch_size=micro_batch_size,
        num_val_batches=int(_get(cfg, "val_batches", 8)),
    )


def _build_mixture(
    cfg: Any, device_type: str, rank: int, world_size: int, memory_budget_bytes: int, chunk_bytes: int
) -> DataBundle:
    """``data.sources``: every source opened (source_spec.py) and mixed by weight (mixture.py)."""
    tokenizer = load_tokenizer(mixture_tokenizer_spec(cfg.sources, getattr(cfg, "tokenizer", None)))
    opened = open_sources(
        cfg.sources,
        tokenizer,
        val_fraction=float(_get(cfg, "val_fraction", 0.1)),
        memory_budget_bytes=memory_budget_bytes,
        chunk_bytes=chunk_bytes,
    )
    block_size, micro_batch_size = int(cfg.block_size), int(cfg.micro_batch_size)
    train = MixtureLoader(
        [WeightedSource(s.name, s.weight, s.train) for s in opened],
        block_size=block_size,
        micro_batch_size=micro_batch_size,
        shuffle=bool(_get(cfg, "shuffle", True)),
        seed=int(_get(cfg, "seed", 0)),
        num_workers=int(_get(cfg, "num_workers", 0)),
        prefetch_factor=getattr(cfg, "prefetch_factor", None),
        pin_memory=bool(_get(cfg, "pin_memory", False)) and device_type == "cuda",
        rank=rank,
        world_size=world_size,
    )
    desc = f"mixture of {len(opened)} sources ({tokenizer.describe()}): " + "; ".join(
        s.description for s in opened
    )
    if world_size > 1:
        desc += f", rank {rank}/{world_size}"
    return DataBundle(
        train=train,
        tokenizer=tokenizer,
        vocab_size=_vocab(getattr(cfg, "vocab_size", None), tokenizer.vocab_size, "tokenizer's"),
        description=desc,
        block_size=block_size,
        micro_batch_size=micro_batch_size,
        num_val_batches=int(_get(cfg, "val_batches", 8)),
        val_by_source={s.name: s.val for s in opened},
        weights={s.name: s.weight for s in opened},
    )
