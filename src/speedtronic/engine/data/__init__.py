"""Speedtronic's data layer: tokenizers, token sources, the resumable train loader and ``prepare``.

Modules: ``tokenizer`` (byte / Hugging Face tokenizers), ``text`` (chunked text reading, default
corpus), ``meta`` (prepared-directory format), ``sources`` (random-access token sources),
``stream`` (sequential streaming of big text files), ``loader`` (TrainLoader, validation batches),
``mixture`` (MixtureLoader: ``data.sources`` mixed by weight), ``source_spec`` (opening those sources),
``build`` (``build_data`` from a config) and ``prepare`` (``prepare_dataset``).

The names below are imported lazily (PEP 562) so that ``import speedtronic.engine.data.tokenizer``
or ``.prepare`` does not pull in torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "BYTE_SPEC": "tokenizer",
    "ByteTokenizer": "tokenizer",
    "HFTokenizer": "tokenizer",
    "Tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "DEFAULT_CHUNK_BYTES": "text",
    "default_corpus_path": "text",
    "read_default_corpus": "text",
    "FORMAT_VERSION": "meta",
    "dtype_for_vocab": "meta",
    "read_meta": "meta",
    "ByteFileSource": "sources",
    "SyntheticTokens": "sources",
    "TokenArray": "sources",
    "TokenFile": "sources",
    "TokenSource": "sources",
    "split_train_val": "sources",
    "tokenize_bytes": "sources",
    "tokenize_file": "sources",
    "StreamPos": "stream",
    "TextStream": "stream",
    "Batch": "loader",
    "TrainLoader": "loader",
    "WindowPlan": "loader",
    "make_val_batches": "loader",
    "MixtureLoader": "mixture",
    "WeightedSource": "mixture",
    "DEFAULT_MEMORY_BUDGET_BYTES": "build",
    "DataBundle": "build",
    "build_data": "build",
    "prepare_dataset": "prepare",
}

__all__ = [
    "BYTE_SPEC",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_MEMORY_BUDGET_BYTES",
    "FORMAT_VERSION",
    "Batch",
    "ByteFileSource",
    "ByteTokenizer",
    "DataBundle",
    "HFTokenizer",
    "MixtureLoader",
    "StreamPos",
    "SyntheticTokens",
    "TextStream",
    "TokenArray",
    "TokenFile",
    "TokenSource",
    "Tokenizer",
    "TrainLoader",
    "WeightedSource",
    "WindowPlan",
    "build_data",
    "default_corpus_path",
    "dtype_for_vocab",
    "load_tokenizer",
    "make_val_batches",
    "prepare_dataset",
    "read_default_corpus",
    "read_meta",
    "split_train_val",
    "tokenize_bytes",
    "tokenize_file",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # static analysers and IDEs see the real names
    from .build import DEFAULT_MEMORY_BUDGET_BYTES, DataBundle, build_data
    from .loader import Batch, TrainLoader, WindowPlan, make_val_batches
    from .meta import FORMAT_VERSION, dtype_for_vocab, read_meta
    from .mixture import MixtureLoader, WeightedSource
    from .prepare import prepare_dataset
    from .sources import (
        ByteFileSource,
        SyntheticTokens,
        TokenArray,
        TokenFile,
        TokenSource,
        split_train_val,
        tokenize_bytes,
        tokenize_file,
    )
    from .stream import StreamPos, TextStream
    from .text import DEFAULT_CHUNK_BYTES, default_corpus_path, read_default_corpus
    from .tokenizer import BYTE_SPEC, ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
