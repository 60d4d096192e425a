"""``prepare_dataset``: tokenise a text file once into ``train.bin`` / ``val.bin`` / ``meta.json``.

Training from a prepared directory memory-maps the token files, so start-up is instant and any
corpus size works. Preparation itself runs in constant memory: the text is read and tokenised in
newline-aligned chunks (the same chunks every other text path uses, so the tokens are identical)
and appended to a temporary file; the last ``val_fraction`` of the *tokens* is then moved to the
validation file. Files are written under temporary names and renamed into place, ``meta.json``
last, so an interrupted run never leaves a directory that looks complete. No torch needed.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from speedtronic.errors import DataError

from .meta import FORMAT_NAME, FORMAT_VERSION, META_NAME, TRAIN_NAME, VAL_NAME, dtype_for_vocab, itemsize_of
from .text import DEFAULT_CHUNK_BYTES, encode_chunk, file_size, iter_chunks
from .tokenizer import Tokenizer, load_tokenizer

__all__ = ["prepare_dataset"]

_TYPECODE = {"uint16": "H", "uint32": "I"}


def _split_point(num_tokens: int, val_fraction: float) -> int:
    # Same rule as sources.split_point (kept local so prepare does not import torch).
    return num_tokens - int(num_tokens * val_fraction)


def _fsync(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def prepare_dataset(
    text_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    tokenizer: str | os.PathLike[str] | Tokenizer | None = None,
    val_fraction: float = 0.1,
    progress: Callable[[int, int], None] | None = None,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> dict[str, Any]:
    """Tokenise ``text_path`` into ``out_dir`` and return the ``meta.json`` contents.

    ``tokenizer`` is a spec for :func:`load_tokenizer` (None/"byte" or a tokenizer.json path) or a
    tokenizer object. ``progress(bytes_done, bytes_total)`` is called after every chunk.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    tok = (
        load_tokenizer(tokenizer)
        if tokenizer is None or isinstance(tokenizer, (str, os.PathLike))
        else tokenizer
    )
    dtype = dtype_for_vocab(tok.vocab_size)
    itemsize = itemsize_of(dtype)
    code = _TYPECODE[dtype]
    if array.array(code).itemsize != itemsize:  # 'I' is 4 bytes on every platform torch supports
        raise RuntimeError(f"array typecode {code!r} is not {itemsize} bytes on this platform")
    src = Path(text_path)
    total = file_size(src)
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"cannot create output directory {out}: {exc}") from exc

    tag = f".tmp-{os.getpid()}"
    tmp_train, tmp_val, tmp_meta = (out / f".{n}{tag}" for n in (TRAIN_NAME, VAL_NAME, META_NAME))
    try:
        num_tokens = 0
        with open(src, "rb") as f, open(tmp_train, "wb") as w:
            for offset, data in iter_chunks(f, 0, total, chunk_bytes):
                ids = array.array(code)
                try:
                    ids.extend(encode_chunk(tok, data, f"{src} (chunk at byte {offset})"))
                except OverflowError:
                    raise DataError(
                        f"{src}: the tokenizer produced an id that does not fit {dtype} although its "
                        f"vocab_size is {tok.vocab_size}; the tokenizer reports a wrong vocab_size"
                    ) from None
                if sys.byteorder != "little":
                    ids.byteswap()  # the format is little-endian everywhere
                ids.tofile(w)
                num_tokens += len(ids)
                if progress is not None:
                    progress(offset + len(data), total)
        if progress is not None and total == 0:
            progress(0, 0)

        # Move the last val_fraction of the tokens into val.bin, a chunk at a time.
        n_train = _split_point(num_tokens, val_fraction)
        with open(tmp_train, "r+b") as a, open(tmp_val, "wb") as v:
            a.seek(n_train * itemsize)
            shutil.copyfileobj(a, v, chunk_bytes)
            a.truncate(n_train * itemsize)
        _fsync(tmp_train)
        _fsync(tmp_val)

        meta: dict[str, Any] = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "dtype": dtype,
            "byteorder": "little",
            "vocab_size": int(tok.vocab_size),
            "tokenizer": tok.spec,
            "eos_id": tok.eos_id,
            "train_tokens": n_train,
            "val_tokens": num_tokens - n_train,
            "val_fraction": val_fraction,
            "chunk_bytes": chunk_bytes,
            "source": {"name": src.name, "bytes": total},
        }
        tmp_meta.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        _fsync(tmp_meta)
        # Drop the old meta.json first: between the renames below the directory must not claim to
        # be complete with a mix of old and new token files.
        with contextlib.suppress(FileNotFoundError):
            (out / META_NAME).unlink()
        os.replace(tmp_train, out / TRAIN_NAME)
        os.replace(tmp_val, out / VAL_NAME)
        os.replace(tmp_meta, out / META_NAME)
    except OSError as exc:
        raise DataError(f"preparing {src} into {out} failed: {exc}") from exc
    finally:
        for tmp in (tmp_train, tmp_val, tmp_meta):
            with contextlib.suppress(OSError):
                tmp.unlink()
    return meta
