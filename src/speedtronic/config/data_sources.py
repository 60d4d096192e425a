"""`data.sources`: a weighted mixture of training data, one entry per source.

    data:
      sources:
        - {path: data/web.jsonl, weight: 0.5}          # a text, JSONL or Parquet file, a folder or a glob
        - {dataset: data/code, weight: 0.3, name: code}  # a directory written by `speedtronic data prepare`
        - {path: books.txt, weight: 0.2}

Each entry names exactly one of `path` and `dataset`; `weight` is positive (the weights need not sum
to 1: they are normalised); `name` defaults to the file or folder name without its suffixes and must
be unique, since it keys the source's position in checkpoints, its validation loss in the metrics
and its token count in `train --json`. The entries are checked here; reading them is
engine/data/source_spec.py's job. Never imports torch.
"""

from __future__ import annotations

import re
from pathlib import PurePath

from pydantic import Field, model_validator

from speedtronic.config.section import Section

__all__ = ["MIX_BLOCK", "SOURCE_NAME_PATTERN", "DataSource", "check_sources", "default_source_name"]

#: Sequences per block of the mixture's schedule (engine/data/mixture.py): each block holds every
#: source's share exactly, so a weight below 1/MIX_BLOCK of the total would never be drawn.
MIX_BLOCK = 4096

# A source's name keys metrics (`val_loss/<name>`) and checkpoint entries: one plain word.
SOURCE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
_KNOWN_SUFFIXES = (".gz", ".zst", ".txt", ".text", ".md", ".jsonl", ".json", ".parquet")


class DataSource(Section):
    """One source of a data mixture (see the module doc)."""

    path: str | None = Field(
        None,
        description="A text, JSONL or Parquet file (optionally .gz/.zst), a folder of them or a glob; "
        "or a Hub dataset `hf://datasets/OWNER/NAME[@REV][/PATH]`; anything but one plain text file is "
        "prepared once into a cache (`data prepare`).",
    )
    dataset: str | None = Field(None, description="A directory written by `speedtronic data prepare`.")
    weight: float = Field(1.0, gt=0, description="Share of the training sequences (normalised over sources).")
    name: str | None = Field(
        None,
        max_length=64,
        pattern=SOURCE_NAME_PATTERN,
        description="Names the source in metrics and checkpoints (default: the file or folder name).",
    )
    text_field: str = Field(
        "text", min_length=1, description="The text field of JSONL records and Parquet rows."
    )

    @model_validator(mode="after")
    def _one_location(self) -> DataSource:
        if bool(self.path) == bool(self.dataset):
            raise ValueError(
                "a data source names exactly one of path (text, JSONL, Parquet, a folder or a glob) and "
                "dataset (a prepared directory)"
            )
        return self

    @property
    def location(self) -> str:
        """The path or dataset directory the entry names."""
        return str(self.path or self.dataset)

    @property
    def key(self) -> str:
        """The source's name: `name`, else the default from its file or folder name."""
        return self.name or default_source_name(self.location)


def default_source_name(location: str) -> str:
    """`data/web.jsonl.gz` → `web`, `data/code/` → `code`; "" when nothing usable is left (a glob)."""
    base = PurePath(location.rstrip("/\\")).name
    changed = True
    while changed:
        changed = False
        for suffix in _KNOWN_SUFFIXES:
            if base.lower().endswith(suffix) and len(base) > len(suffix):
                base, changed = base[: -len(suffix)], True
    return base if re.fullmatch(SOURCE_NAME_PATTERN, base) and len(base) <= 64 else ""


def check_sources(sources: list[DataSource]) -> None:
    """Raise ValueError naming the entry when the list is empty, a name is missing or names repeat."""
    if not sources:
        raise ValueError("data.sources is empty: give at least one source, or remove data.sources")
    seen: dict[str, int] = {}
    for index, source in enumerate(sources):
        key = source.key
        if not key:
            raise ValueError(
                f"data.sources[{index}] ({source.location!r}) needs a name: its file name gives none "
                "(letters, digits, '.', '_' and '-')"
            )
        if key in seen:
            raise ValueError(
                f"data.sources[{seen[key]}] and data.sources[{index}] are both named {key!r}: give each "
                "source a unique name"
            )
        seen[key] = index
    total = sum(s.weight for s in sources)
    for index, source in enumerate(sources):
        if source.weight * MIX_BLOCK < total:
            raise ValueError(
                f"data.sources[{index}] ({source.key!r}): weight {source.weight:g} is below 1/{MIX_BLOCK} of the "
                "total, so it would never be drawn; raise it or remove the source"
            )
