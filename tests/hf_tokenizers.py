"""`make_hf_tokenizer`: the small byte-level BPE tokenizer.json that tests train for a run, a prepared
dataset or an export (skips the test when the `tokenizers` package is missing)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

EOT = "<|endoftext|>"


def make_hf_tokenizer(
    path: Path,
    texts: str | Sequence[str],
    *,
    vocab_size: int = 320,
    special_tokens: Sequence[str] = (EOT,),
    split_newlines: bool = True,
) -> Path:
    """Train a byte-level BPE on `texts` and save it at `path`. `split_newlines`: the pre-tokenizer
    isolates newlines, so that cutting a text into chunks at newlines never changes its tokens."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Split("\n", "isolated"), byte_level])
        if split_newlines
        else byte_level
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([texts] if isinstance(texts, str) else list(texts), trainer)
    tok.save(str(path))
    return path
