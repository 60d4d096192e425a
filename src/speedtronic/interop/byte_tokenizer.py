"""Our byte-level tokenizer (token id == UTF-8 byte) as files `transformers.AutoTokenizer` loads.

A `tokenizer.json` needs no custom code when written as a byte-level BPE with 256 tokens and no merges:

* the ByteLevel pre-tokenizer (use_regex false, no prefix space) maps each byte b of the UTF-8 text to
  the printable character GPT-2 uses for it (`bytes_to_unicode`), and nothing else: no splitting, no
  added spaces;
* the BPE vocabulary gives that character the id b; with no merges every byte stays its own token;
* the ByteLevel decoder maps the characters back to bytes and decodes them as UTF-8 (invalid
  sequences become U+FFFD, as `ByteTokenizer.decode` does).

So `AutoTokenizer.from_pretrained(folder).encode(text) == list(text.encode("utf-8"))`. There are no
special tokens: the model's vocabulary is exactly the 256 bytes (an eos id, if the run used one, is a
byte and is named in the configs by id only). Written as plain JSON, so neither `tokenizers` nor
`transformers` is needed to export.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from speedtronic.atomic_files import atomic_write_text

# Marks our tokenizer_config.json so `speedtronic sample` can use ByteTokenizer without `tokenizers`.
MARKER = "speedtronic_byte_tokenizer"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (what the ByteLevel pre-tokenizer uses)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def tokenizer_json() -> dict[str, Any]:
    table = bytes_to_unicode()
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {table[b]: b for b in range(256)},
            "merges": [],
        },
    }


def write_byte_tokenizer(folder: str | Path, model_max_length: int) -> list[str]:
    """Write tokenizer.json and tokenizer_config.json into `folder`; returns the file names."""
    folder = Path(folder)
    atomic_write_text(folder / "tokenizer.json", json.dumps(tokenizer_json(), ensure_ascii=False, indent=1))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        MARKER: True,
    }
    atomic_write_text(folder / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    return ["tokenizer.json", "tokenizer_config.json"]


def is_byte_tokenizer(folder: str | Path) -> bool:
    """Whether `folder` holds the byte tokenizer written by `write_byte_tokenizer`."""
    path = Path(folder) / "tokenizer_config.json"
    try:
        return bool(json.loads(path.read_text(encoding="utf-8")).get(MARKER))
    except (OSError, ValueError, AttributeError):
        return False
