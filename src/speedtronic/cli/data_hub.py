"""`speedtronic data prepare hf://datasets/...`: the Hub input's side of the command — its progress bar
(bytes downloaded, bytes and tokens tokenised) and the line saying which commit and files were read.
The work is engine/data/hub.py's."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from speedtronic.cli.common import console
from speedtronic.engine.data.prepare import Progress
from speedtronic.engine.data.tokenizer import Tokenizer
from speedtronic.errors import ConfigError


class _Bars:
    """Two transient bars on a terminal (nothing elsewhere): downloads and tokenising."""

    def __init__(self, progress: Any, max_tokens: int | None) -> None:
        self.progress = progress
        self.max_tokens = max_tokens
        self.download = progress.add_task("downloading", total=None, tokens="")
        self.tokenise = progress.add_task("tokenising", total=None, tokens="0 tokens")

    def downloaded(self, done: int, total: int) -> None:
        self.progress.update(self.download, completed=done, total=total)

    def tokenised(self, done: int, total: int, tokens: int) -> None:
        cap = f" of {self.max_tokens:,}" if self.max_tokens else ""
        self.progress.update(self.tokenise, completed=done, total=total, tokens=f"{tokens:,}{cap} tokens")


@contextmanager
def _bars(max_tokens: int | None) -> Iterator[_Bars]:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    with Progress(
        TextColumn("[bold]{task.description:<11}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TextColumn("{task.fields[tokens]}"),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    ) as progress:
        yield _Bars(progress, max_tokens)


def prepare_from_hub(
    inputs: list[str],
    out: Path,
    tok: Tokenizer,
    *,
    max_tokens: int | None,
    **options: bool | int | float | str | None,
) -> dict[str, Any]:
    """Prepare the one Hub dataset in ``inputs`` into ``out``; ``options`` are ``data prepare``'s."""
    from rich.markup import escape

    from speedtronic.engine.data.hub import prepare_hub_dataset

    if len(inputs) != 1:
        raise ConfigError(
            "an hf://datasets/... input must be the only input of `data prepare`; prepare the others "
            "into their own --out and list both under data.sources"
        )
    with _bars(max_tokens) as bars:
        report: Progress = bars.tokenised
        meta = prepare_hub_dataset(
            inputs[0],
            out,
            tok,
            max_tokens=max_tokens,
            progress=report,
            download_progress=bars.downloaded,
            **options,  # type: ignore[arg-type]
        )
    source = meta["source"]
    console.print(
        f"read {source['files']} of {source['files_listed']} files ({source['bytes']:,} bytes) of "
        f"{escape(source['name'])} at commit {source['revision'][:12]}; they stay in the Hugging Face "
        "cache (HF_HUB_CACHE) for the next run",
        soft_wrap=True,
    )
    return meta
