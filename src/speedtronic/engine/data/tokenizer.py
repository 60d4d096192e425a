"""Tokenizers: the built-in byte tokenizer and a wrapper around a Hugging Face ``tokenizer.json``.

Everything else in the data layer talks to the small :class:`Tokenizer` protocol defined here, so
a plugin can supply its own tokenizer object. This module deliberately imports neither torch nor
``tokenizers`` at import time: the CLI imports it to describe configs and the optional
``tokenizers`` package is only needed when a ``tokenizer.json`` is actually used.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from speedtronic.errors import DataError

__all__ = ["BYTE_SPEC", "ByteTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer"]

#: The tokenizer spec string that selects :class:`ByteTokenizer` (also what ``None`` means).
BYTE_SPEC = "byte"

# Tried in order when a tokenizer.json does not say which token ends a document.
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[EOS]", "<|eot_id|>")


@runtime_checkable
class Tokenizer(Protocol):
    """What the data layer needs from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int | None: ...

    @property
    def spec(self) -> str:
        """The string :func:`load_tokenizer` turns back into this tokenizer (stored in meta.json)."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def describe(self) -> str:
        """A few words for log lines, e.g. ``byte tokenizer``."""
        ...


class ByteTokenizer:
    """Tokens are the UTF-8 bytes of the text: vocabulary 256, no training, no files."""

    vocab_size: int = 256
    spec: str = BYTE_SPEC

    def __init__(self, eos_id: int | None = None) -> None:
        if eos_id is not None and not 0 <= eos_id < 256:
            raise ValueError(f"ByteTokenizer eos_id must be in [0, 256), got {eos_id}")
        self.eos_id = eos_id

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # A model (or a synthetic dataset with a larger vocabulary) can emit ids outside a byte;
        # map them to a byte that is never valid UTF-8 so they decode as U+FFFD instead of raising.
        data = bytes(i if 0 <= i < 256 else 0xFF for i in (int(x) for x in ids))
        return data.decode("utf-8", errors="replace")

    def describe(self) -> str:
        return "byte tokenizer"

    def __repr__(self) -> str:
        return f"ByteTokenizer(eos_id={self.eos_id})"


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer loaded from a ``tokenizer.json`` file.

    ``path`` may also be a directory that contains ``tokenizer.json``. Special tokens are never
    added by :meth:`encode`: the training stream is plain text, documents are not wrapped.
    """

    def __init__(self, path: str | os.PathLike[str], *, eos_token: str | None = None) -> None:
        try:
            import tokenizers  # lazy: optional dependency
        except ImportError as exc:
            raise DataError(
                f"tokenizer {os.fspath(path)!r} needs the Hugging Face `tokenizers` package, which is not "
                "installed: pip install tokenizers (or pip install 'speedtronic-lm[tokenizers]'), "
                "or use the built-in byte tokenizer (tokenizer: byte)"
            ) from exc
        file = Path(path).expanduser()
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise DataError(
                f"tokenizer file {file} not found: pass the path of a Hugging Face tokenizer.json "
                "(or a directory holding one), or 'byte' for the built-in byte tokenizer"
            )
        try:
            self._tok: Any = tokenizers.Tokenizer.from_file(str(file))
        except Exception as exc:  # the Rust side raises a bare Exception for malformed JSON
            raise DataError(
                f"{file} is not a valid Hugging Face tokenizer.json ({str(exc).strip() or type(exc).__name__}); "
                "save one with tokenizers.Tokenizer.save() or transformers' save_pretrained()"
            ) from exc
        self.path = file.resolve()
        self._vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self._eos_id = self._find_eos(eos_token)

    def _find_eos(self, eos_token: str | None) -> int | None:
        if eos_token is not None:
            tid = self._tok.token_to_id(eos_token)
            if tid is None:
                raise DataError(f"{self.path}: eos token {eos_token!r} is not in the vocabulary")
            return int(tid)
        for candidate in _EOS_CANDIDATES:
            tid = self._tok.token_to_id(candidate)
            if tid is not None:
                return int(tid)
        return None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def spec(self) -> str:
        return str(self.path)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Many documents in one call (what ``data prepare`` uses; same ids as :meth:`encode` each)."""
        return [list(e.ids) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=False))

    def describe(self) -> str:
        return f"tokenizer {self.path.name} (vocab {self._vocab_size:,})"

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self._vocab_size})"


def load_tokenizer(spec: str | os.PathLike[str] | None) -> Tokenizer:
    """``None`` or ``"byte"`` → :class:`ByteTokenizer`; anything else is a path to a tokenizer.json."""
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in ("", BYTE_SPEC)):
        return ByteTokenizer()
    return HFTokenizer(spec)
