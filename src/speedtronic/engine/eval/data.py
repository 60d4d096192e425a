"""The documents `speedtronic eval --data` scores: read the way `data prepare` reads its inputs.

A text file is one document, a JSONL line or a Parquet row one (its text field), a folder or glob
every such file; a prepared dataset directory (one holding meta.json) gives its validation split
(its training split when it has none), cut into documents at its separator. Each document comes
with its UTF-8 bytes, which is what bits per byte divides by, so a byte-level model and a BPE model
are measured against the same text.

Reading goes through data/readers.py's `tokenize_unit` with the byte tokenizer: its tokens are the
documents' bytes, and it already knows JSONL, Parquet, compression and how to name a bad record.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from speedtronic.errors import ConfigError, DataError


@dataclass(frozen=True)
class Document:
    tokens: list[int]  # in the model's tokenizer
    nbytes: int  # UTF-8 bytes of its text


def is_prepared(path: Path) -> bool:
    return path.is_dir() and (path / "meta.json").is_file()


def documents(spec: str, tokenizer: Any, text_field: str = "text") -> Iterator[Document]:
    """The documents of `spec` (see the module doc), tokenized by `tokenizer`, lazily in order."""
    path = Path(spec).expanduser()
    if is_prepared(path):
        yield from _prepared_documents(path, tokenizer)
        return
    from speedtronic.engine.data.inputs import find_inputs, plan_units
    from speedtronic.engine.data.readers import ReadOptions, tokenize_unit
    from speedtronic.engine.data.tokenizer import ByteTokenizer

    try:
        files = find_inputs(spec)
    except DataError as error:
        raise ConfigError(f"--data: {error}") from None
    as_bytes = ByteTokenizer()
    options = ReadOptions("uint16", text_field=text_field)
    pending: list[bytes] = []
    for unit in plan_units(files):
        result = tokenize_unit(unit, as_bytes, options)
        if result.error is not None:
            raise DataError(result.error)
        data = np.frombuffer(result.tokens, dtype="<u2").astype(np.uint8).tobytes()
        offset = 0
        for count, ends_doc, _ in result.pieces:
            pending.append(data[offset : offset + count])
            offset += count
            if ends_doc:
                text = b"".join(pending)
                pending = []
                if text:
                    yield _document(text, tokenizer)
    if pending and b"".join(pending):
        yield _document(b"".join(pending), tokenizer)


def _document(data: bytes, tokenizer: Any) -> Document:
    from speedtronic.engine.data.tokenizer import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        return Document(list(data), len(data))
    # A text file that is not UTF-8 is scored as the text a tokenizer would see (replacement
    # characters), and its bytes counted as that text's.
    text = data.decode("utf-8", errors="replace")
    return Document(list(tokenizer.encode(text)), len(text.encode("utf-8")))


def _prepared_documents(directory: Path, tokenizer: Any) -> Iterator[Document]:
    from speedtronic.engine.data.meta import read_meta, token_files

    meta = read_meta(directory)
    spec = getattr(tokenizer, "spec", None)
    if meta["tokenizer"] != spec or meta["vocab_size"] != tokenizer.vocab_size:
        raise ConfigError(
            f"--data: {directory} was tokenized with {meta['tokenizer']} (vocab {meta['vocab_size']:,}), "
            f"the model with {spec} (vocab {tokenizer.vocab_size:,}); score the text files instead"
        )
    split = "val" if meta["val_tokens"] > 0 else "train"
    separator = meta.get("separator")
    if isinstance(separator, dict) and isinstance(separator.get("ids"), list):
        sep = [int(i) for i in separator["ids"]]
    elif meta.get("eos_id") is not None and separator is None:
        sep = [int(meta["eos_id"])]
    else:
        sep = []
    carry: list[int] = []
    for path, count in token_files(meta, directory, split):
        if count == 0:
            continue
        ids = np.memmap(path, dtype="<u2" if meta["dtype"] == "uint16" else "<u4", mode="r")
        tokens = carry + ids[:count].astype(np.int64).tolist()
        carry = []
        for piece, last in _split(tokens, sep):
            if last:
                carry = piece  # a document may continue in the next shard
            elif piece:
                yield _from_tokens(piece, tokenizer)
    if carry:
        yield _from_tokens(carry, tokenizer)


def _split(tokens: list[int], sep: list[int]) -> Iterator[tuple[list[int], bool]]:
    """(piece, is_the_unterminated_tail) of `tokens` cut at every occurrence of `sep`."""
    if not sep:
        yield tokens, True
        return
    start, i, n = 0, 0, len(sep)
    while i <= len(tokens) - n:
        if tokens[i : i + n] == sep:
            yield tokens[start:i], False
            i += n
            start = i
        else:
            i += 1
    yield tokens[start:], True


def _from_tokens(tokens: list[int], tokenizer: Any) -> Document:
    from speedtronic.engine.data.tokenizer import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        return Document(tokens, len(tokens))
    return Document(tokens, len(tokenizer.decode(tokens).encode("utf-8")))
