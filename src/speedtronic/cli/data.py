"""`speedtronic data prepare INPUT... --out DIR`: tokenise files, folders or globs once into token shards."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from speedtronic.cli.common import JsonOption, console, emit_json

data_app = typer.Typer(help="Prepare training data.", no_args_is_help=True)


@data_app.command("prepare")
def prepare(
    inputs: Annotated[
        list[str],
        typer.Argument(
            help="Files, folders or globs of .txt, .jsonl/.json or .parquet (optionally .gz/.zst), or "
            "one Hub dataset: hf://datasets/OWNER/NAME[@REVISION][/PATH].",
            metavar="INPUT...",
            show_default=False,
        ),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output directory (token shards and meta.json).")],
    tokenizer: Annotated[
        str | None, typer.Option("--tokenizer", help="byte (default) or a Hugging Face tokenizer.json path.")
    ] = None,
    val_fraction: Annotated[
        float,
        typer.Option(
            "--val-fraction",
            min=0.0,
            max=0.99,
            help="Share of the documents held out for validation (of the tokens for one single document).",
        ),
    ] = 0.1,
    text_field: Annotated[
        str, typer.Option("--text-field", help="The field (JSONL) or column (Parquet) holding the text.")
    ] = "text",
    separator: Annotated[
        str | None,
        typer.Option(
            "--separator",
            help="Text whose tokens end each document, instead of the tokenizer's EOS token ('' for nothing).",
        ),
    ] = None,
    dedup: Annotated[bool, typer.Option("--dedup", help="Drop exact duplicate documents.")] = False,
    skip_bad: Annotated[
        bool,
        typer.Option(
            "--skip-bad", help="Skip bad records (malformed JSON, no text, not UTF-8) and count them."
        ),
    ] = False,
    workers: Annotated[
        int | None, typer.Option("--workers", min=1, help="Tokenising processes (default: the CPU cores).")
    ] = None,
    shard_mb: Annotated[
        int, typer.Option("--shard-mb", min=1, help="Size of each token shard file in MiB.")
    ] = 256,
    max_tokens: Annotated[
        int | None,
        typer.Option(
            "--max-tokens", min=1, help="Stop after this many tokens (train + val; the last document is cut)."
        ),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume/--restart", help="Continue an interrupted run of the same command.")
    ] = True,
    overwrite: Annotated[
        bool,
        typer.Option("--overwrite", help="Replace the dataset in an --out directory that is not empty."),
    ] = False,
    json_: JsonOption = False,
) -> None:
    """Tokenise INPUTS (constant memory, in parallel) into uint16/uint32 token shards for `data.dataset`.

    Each document (a text file, a JSONL line, a Parquet row) ends with the tokenizer's EOS token
    (or --separator); validation takes whole documents.

    Example: `speedtronic data prepare big.txt --out data/big` (then `data.dataset: data/big`).
    A Hub dataset: `speedtronic data prepare hf://datasets/HuggingFaceFW/fineweb-edu/sample/10BT
    --max-tokens 1000000000 --out data/fineweb-edu` (its files stream into the Hugging Face cache).
    """
    from speedtronic.engine.data.meta import dtype_for_vocab, itemsize_of
    from speedtronic.engine.data.prepare import default_workers, prepare_dataset
    from speedtronic.engine.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    shard_tokens = (shard_mb << 20) // itemsize_of(dtype_for_vocab(tok.vocab_size))
    from speedtronic.engine.data.hub import is_hub_dataset

    if any(is_hub_dataset(spec) for spec in inputs):
        from speedtronic.cli.data_hub import prepare_from_hub

        meta = prepare_from_hub(
            inputs, out, tok, val_fraction=val_fraction, text_field=text_field, separator=separator,
            dedup=dedup, skip_bad=skip_bad, workers=workers or default_workers(), shard_tokens=shard_tokens,
            max_tokens=max_tokens, resume=resume, overwrite=overwrite,
        )  # fmt: skip
    else:
        with _progress() as report:
            meta = prepare_dataset(
                inputs,
                out,
                tokenizer=tok,
                val_fraction=val_fraction,
                progress=report,
                text_field=text_field,
                separator=separator,
                dedup=dedup,
                skip_bad=skip_bad,
                workers=workers or default_workers(),
                shard_tokens=shard_tokens,
                resume=resume,
                overwrite=overwrite,
                max_tokens=max_tokens,
            )
    _print_notes(meta, tokenizer, separator)
    if json_:
        emit_json({"out": str(out), **meta})
    else:
        docs = meta["documents"]
        console.print(
            f"[green]✓[/green] wrote {out}: {meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens "
            f"({docs['train']:,} / {docs['val']:,} documents) in "
            f"{len(meta['shards']['train']) + len(meta['shards']['val'])} shards, {meta['dtype']}"
        )


@contextmanager
def _progress() -> Iterator[Callable[[int, int], None]]:
    """A transient byte-progress bar on a terminal (nothing elsewhere); yields `report(done, total)`."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    with Progress(
        "[bold]tokenising",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    ) as progress:
        task = progress.add_task("prepare", total=None)

        def report(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        yield report


def _print_notes(meta: dict[str, Any], tokenizer: str | None, separator: str | None) -> None:
    """What a person should know about the prepared data: skipped records, documents run together."""
    from rich.markup import escape

    if meta["bad_records_skipped"]:
        first = "; ".join(meta["bad_examples"][:3])
        skipped = meta["bad_records_skipped"]
        console.print(
            f"[yellow]skipped {skipped:,} bad record{'' if skipped == 1 else 's'}[/yellow] "
            f"(first: {escape(first)})",
            soft_wrap=True,
        )
    docs = meta["documents"]
    if separator is None and not meta["separator"] and docs["train"] + docs["val"] > 1:
        # Said, not changed: a default separator would change every prepared dataset's tokens.
        console.print(
            f"[yellow]note:[/yellow] the {escape(tokenizer or 'byte')} tokenizer has no EOS token, so the "
            "documents follow each other with nothing between them; to mark where one ends, prepare "
            "again with --separator (e.g. --separator $'\\n\\n' for a blank line) and --overwrite",
            soft_wrap=True,
        )


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data", rich_help_panel="Training")
