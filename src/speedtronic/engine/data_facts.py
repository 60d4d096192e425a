"""What the run plan needs to know about the data before anything is built: its vocabulary and tokenizer.

They are read without loading the data — the tokenizer file, or a prepared dataset's meta.json — so
`validate`, `shapes` and the memory plan can plan a run as cheaply as the trainer does before it
builds the data the plan describes (engine/build.py `build_data_for`).
"""

from __future__ import annotations

from speedtronic.config import Config
from speedtronic.plan import DataFacts, data_vocab_size, synthetic_vocab_size


def data_facts(config: Config) -> DataFacts:
    """The data's vocabulary and tokenizer, read without loading the data (tokenizer file or the
    prepared dataset's meta.json)."""
    from speedtronic.engine.data.tokenizer import load_tokenizer

    data = config.data
    if data.synthetic:
        return DataFacts(synthetic_vocab_size(config), data.tokenizer)
    if data.sources:  # a mixture: one tokenizer for every source (engine/data/source_spec.py)
        from speedtronic.engine.data.source_spec import mixture_tokenizer_spec

        spec = mixture_tokenizer_spec(data.sources, data.tokenizer)
        return DataFacts(data_vocab_size(config, load_tokenizer(spec).vocab_size, "tokenizer's"), spec)
    if data.dataset:
        from speedtronic.engine.data.meta import read_meta

        meta = read_meta(data.dataset)
        spec = data.tokenizer if data.tokenizer is not None else meta["tokenizer"]
        vocab, what = int(meta["vocab_size"]), "dataset's"
    else:
        if data.text_path:  # a missing text file is a config error, found by `validate` too
            from speedtronic.engine.data.text import check_text_path

            check_text_path(data.text_path)
        spec, what = data.tokenizer, "tokenizer's"
        vocab = load_tokenizer(spec).vocab_size
    return DataFacts(data_vocab_size(config, vocab, what), spec)
