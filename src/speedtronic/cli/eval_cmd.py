"""`speedtronic eval CHECKPOINT`: is the model any good? Bits per byte on text, accuracy on tasks.

The work is engine/eval/evaluate.py's (scoring) and speedtronic/eval_tasks.py's (task files, statistics);
this module parses options, checks task files before the model is loaded, shows a progress bar on
a terminal and prints a table or the `--json` object.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from speedtronic.cli.common import JsonOption, console, emit_json

if TYPE_CHECKING:
    from speedtronic.eval_compare import Subject


def eval_command(
    checkpoints: Annotated[
        list[Path],
        typer.Argument(
            help="A step_*.pt file, a sharded step_*.dcp folder, or a checkpoint directory (its latest); "
            "several: scored side by side, with a comparison table.",
            metavar="CHECKPOINT...",
            show_default=False,
        ),
    ],
    data: Annotated[
        list[str] | None,
        typer.Option(
            "--data",
            "-d",
            help="Text to score (loss, perplexity, bits per byte): a text file, a folder, a glob, JSONL or "
            "Parquet as `data prepare` reads them, or a prepared dataset (its validation split). Repeat it, "
            "or write NAME=PATH, to score a mixture's sources each (data_sources) and pooled.",
            metavar="[NAME=]PATH",
        ),
    ] = None,
    task: Annotated[
        list[str] | None,
        typer.Option(
            "--task",
            help="A task file (.jsonl), a suite (.yaml) or a shipped one by name (shakespeare-cloze, "
            "shakespeare-next-line, shakespeare); repeatable.",
            metavar="TASK",
        ),
    ] = None,
    max_tokens: Annotated[
        int,
        typer.Option("--max-tokens", min=0, help="Tokens of --data scored at most (0: all of it)."),
    ] = 1_000_000,
    batch_size: Annotated[
        int, typer.Option("--batch-size", "-b", min=1, help="Sequences per forward pass.")
    ] = 16,
    text_field: Annotated[
        str, typer.Option("--text-field", help="The text field of JSONL records and Parquet rows.")
    ] = "text",
    device: Annotated[
        str, typer.Option("--device", help="auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:N or mps.")
    ] = "auto",
    global_bus: Annotated[
        str | None,
        typer.Option(
            "--global",
            help="A DiLoCo run's bus (file://DIR, owner/name, s3://…): its latest global model is scored "
            "too, in the first CHECKPOINT's architecture, and compared with the checkpoints.",
            metavar="BUS",
        ),
    ] = None,
    harness: Annotated[
        list[str] | None,
        typer.Option(
            "--harness",
            help="LM Evaluation Harness tasks (comma-separated, repeatable: arc_easy,hellaswag); needs the "
            "lm-eval extra, and the Hub for the harness's own datasets unless they are cached.",
            metavar="TASKS",
        ),
    ] = None,
    harness_include: Annotated[
        list[Path] | None,
        typer.Option(
            "--harness-include", help="A folder of harness task YAML files (local tasks); repeatable."
        ),
    ] = None,
    limit: Annotated[
        int | None, typer.Option("--limit", min=1, help="Harness examples per task at most (a quick look).")
    ] = None,
    num_fewshot: Annotated[
        int | None, typer.Option("--num-fewshot", min=0, help="Harness few-shot examples (task default).")
    ] = None,
    json_: JsonOption = False,
) -> None:
    """Score checkpoints: loss, perplexity and bits per byte on text, accuracy on tasks.

    Example: `speedtronic eval runs/shakespeare/checkpoints --task shakespeare --data held-out.txt`;
    `speedtronic eval w1/checkpoints w2/checkpoints --global file://bus --task shakespeare` compares a
    DiLoCo run's global model with its workers'.
    """
    from speedtronic.eval_tasks import load_tasks

    one_data, sources = _data_specs(data or [])
    given = bool(data) or bool(task)
    harness_tasks = _harness_tasks(harness, given, harness_include, limit, num_fewshot)
    tasks = load_tasks(task or [])  # a bad task file fails before the model is loaded
    if harness_tasks:
        from speedtronic.interop import require_lm_eval

        require_lm_eval()

    from speedtronic.engine.eval.evaluate import evaluate_model
    from speedtronic.eval_compare import subjects
    from speedtronic.plugins import registries

    reports = []
    with _progress_bar(enabled=not json_) as progress:
        for subject in subjects(checkpoints, global_bus, device=device, registries=registries()):
            report = evaluate_model(
                subject.model,
                subject.tokenizer,
                max_seq_len=subject.max_seq_len,
                data=one_data,
                tasks=tasks,
                max_tokens=max_tokens or None,
                batch_size=batch_size,
                text_field=text_field,
                progress=progress,
                sources=sources,
            )
            report.update(label=subject.label, checkpoint=subject.checkpoint, step=subject.step)
            if harness_tasks:
                report["harness"] = _run_harness(
                    subject, harness_tasks, batch_size, harness_include, limit, num_fewshot
                )
            reports.append(report)
    _emit(reports, json_)


def _data_specs(specs: list[str]) -> tuple[str | None, dict[str, str] | None]:
    """`--data` as (one path, None), or (None, {name: path}) for several or named ones: a name is the
    part before `=` when it is a plain word, else the path's default source name (config/data_sources.py)."""
    import re

    from speedtronic.config.data_sources import SOURCE_NAME_PATTERN, default_source_name
    from speedtronic.errors import ConfigError

    named = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if sep and re.fullmatch(SOURCE_NAME_PATTERN, name) and path:
            named.append((name, path, True))
        else:
            named.append((default_source_name(spec), spec, False))
    if len(named) == 1 and not named[0][2]:
        return named[0][1], None
    sources: dict[str, str] = {}
    for name, path, _ in named:
        if not name or name in sources:
            raise ConfigError(
                f"--data {path}: {'no name from its file name' if not name else f'a second source named {name!r}'}; "
                "write NAME=PATH"
            )
        sources[name] = path
    return (None, sources) if sources else (None, None)


def _harness_tasks(
    harness: list[str] | None,
    data_or_task: bool,
    harness_include: list[Path] | None,
    limit: int | None,
    num_fewshot: int | None,
) -> list[str]:
    """The --harness tasks, after checking that something is to be scored and that the harness's
    options come with --harness (a usage error, exit 2, otherwise)."""
    from speedtronic.errors import ConfigError

    harness_tasks = [t.strip() for spec in harness or [] for t in spec.split(",") if t.strip()]
    if not data_or_task and not harness_tasks:
        raise ConfigError(
            "speedtronic eval: give --data PATH (text to score), --task TASK and/or --harness TASKS"
        )
    if (harness_include or limit is not None or num_fewshot is not None) and not harness_tasks:
        raise ConfigError("speedtronic eval: --harness-include, --limit and --num-fewshot go with --harness")
    return harness_tasks


def _run_harness(
    subject: Subject,
    harness_tasks: list[str],
    batch_size: int,
    include: list[Path] | None,
    limit: int | None,
    num_fewshot: int | None,
) -> dict[str, Any]:
    """The LM Evaluation Harness's results for one model."""
    from speedtronic.interop.lm_eval_harness import SpeedtronicLM, run_harness

    lm = SpeedtronicLM(
        model=subject.model,
        tokenizer=subject.tokenizer,
        max_seq_len=subject.max_seq_len,
        batch_size=batch_size,
    )
    return run_harness(
        lm, harness_tasks, include=[str(p) for p in include or []], limit=limit, num_fewshot=num_fewshot
    )


def _emit(reports: list[dict[str, Any]], json_: bool) -> None:
    """One model's report, or every model's and the comparison table: --json or the human view."""
    from speedtronic.eval_compare import comparison

    if len(reports) == 1:
        if json_:
            emit_json(reports[0])
        else:
            print_report(reports[0])
        return
    rows = comparison(reports)
    if json_:
        emit_json({"models": reports, "comparison": rows})
    else:
        for report in reports:
            print_report(report)
        print_comparison(rows)


class _progress_bar:
    """A rich bar per phase (data, each task) on a terminal's stderr; nothing elsewhere."""

    def __init__(self, enabled: bool) -> None:
        self.live = enabled and console.is_terminal
        self.bar: Any = None
        self.phases: dict[str, Any] = {}

    def __enter__(self) -> Any:
        if not self.live:
            return None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        )
        self.bar.start()
        return self.update

    def update(self, phase: str, done: int, total: int) -> None:
        if phase not in self.phases:
            self.phases[phase] = self.bar.add_task(phase, total=total)
        self.bar.update(self.phases[phase], completed=done)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def print_report(report: dict[str, Any]) -> None:
    """The human view: one line for the data, a table of the tasks with the aggregate."""
    from rich.console import Console
    from rich.table import Table

    out = Console(width=None if Console().is_terminal else 120)
    where = "global model of" if report.get("label") == "global" else "checkpoint"
    step = "outer step" if report.get("label") == "global" else "step"
    out.print(f"{where} {report['checkpoint']} ({step} {report['step']})", highlight=False, soft_wrap=True)
    scored = report.get("data")
    if scored:
        if scored["loss"] is None:
            out.print(f"data {scored['path']}: nothing to score (no document longer than one token)")
        else:
            out.print(
                f"data {scored['path']}: loss {scored['loss']:.4f} · perplexity {scored['perplexity']:.3f} · "
                f"{scored['bits_per_byte']:.4f} bits per byte · {scored['tokens']:,} tokens, "
                f"{scored['bytes']:,} bytes, {scored['documents']:,} documents",
                highlight=False,
                soft_wrap=True,  # one line, whatever the width: scripts grep it
            )
    for name, scored in (report.get("data_sources") or {}).items():
        if scored["loss"] is not None:
            bpb = scored["bits_per_byte"]
            out.print(
                f"data {name} ({scored['path']}): loss {scored['loss']:.4f}"
                + (f" · {bpb:.4f} bits per byte" if bpb is not None else "")
                + f" · {scored['tokens']:,} tokens",
                highlight=False,
                soft_wrap=True,
            )
    for name, metrics in ((report.get("harness") or {}).get("results") or {}).items():
        shown = " · ".join(
            f"{key.split(',')[0]} {value:.4f}"
            for key, value in metrics.items()
            if isinstance(value, (int, float)) and "," in key  # "metric,filter"; not sample_len
        )
        out.print(f"harness {name}: {shown}", highlight=False, soft_wrap=True)
    tasks = report.get("tasks") or {}
    if not tasks:
        return
    table = Table("task", "n", "metric", "accuracy", "± stderr", "acc", "acc_norm", "chance", "centred")
    for name, r in tasks.items():
        table.add_row(
            name,
            f"{r['n']:,}",
            r["metric"],
            f"{r['accuracy']:.4f}",
            "-" if r["stderr"] is None else f"{r['stderr']:.4f}",
            f"{r['acc']:.4f}" if "acc" in r else "-",
            f"{r['acc_norm']:.4f}" if "acc_norm" in r else "-",
            f"{r['chance']:.4f}",
            f"{r['centred']:+.4f}",
        )
    core = report["accuracy"].get("aggregate")
    table.add_row("aggregate (CORE)", "", "centred", "", "", "", "", "", f"{core:+.4f}")
    out.print(table)


def print_comparison(rows: list[dict[str, Any]]) -> None:
    """The models side by side (eval_compare.py's rows): one row per model."""
    from rich.console import Console
    from rich.table import Table

    out = Console(width=None if Console().is_terminal else 160)
    columns = [c for c in rows[0] if c != "label"]
    table = Table("model", *columns, title="comparison")
    for row in rows:
        cells = []
        for column in columns:
            value = row[column]
            if value is None:
                cells.append("-")
            elif column == "step":
                cells.append(str(value))
            elif column == "core":
                cells.append(f"{value:+.4f}")
            else:
                cells.append(f"{value:.4f}")
        table.add_row(str(row["label"]), *cells)
    out.print(table)


def register(app: typer.Typer) -> None:
    app.command("eval", rich_help_panel="Training")(eval_command)
