"""`speedtronic train CONFIG`: a full training run with progress, checkpoints and a JSON summary."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from speedtronic.cli.common import ConfigArgument, JsonOption, SetOption, emit_json, load_cli_config

if TYPE_CHECKING:
    from speedtronic.config import Config
    from speedtronic.engine.report import TrainResult


def train(
    config: ConfigArgument,
    set_: SetOption = None,
    max_steps: Annotated[
        int | None,
        typer.Option(
            "--max-steps",
            min=1,
            help="Stop after step N of this run (a checkpoint is saved); the LR schedule still follows "
            "run.max_steps, so a later --resume continues the same run. N may not exceed run.max_steps.",
        ),
    ] = None,
    resume: Annotated[
        bool | None,
        typer.Option(
            "--resume/--no-resume",
            help="Continue from the latest checkpoint / start fresh. Default: resume when one exists.",
            show_default=False,
        ),
    ] = None,
    device: Annotated[str | None, typer.Option("--device", help="auto, cpu, cuda, cuda:N or mps.")] = None,
    nproc: Annotated[
        int | None,
        typer.Option(
            "--nproc",
            min=1,
            help="Data-parallel processes on this machine (runs this command under torchrun --standalone).",
        ),
    ] = None,
    tensorboard: Annotated[
        bool, typer.Option("--tensorboard", help="Also write TensorBoard event files (prints their folder).")
    ] = False,
    wandb: Annotated[
        bool,
        typer.Option(
            "--wandb", help="Also log to Weights & Biases (online when logged in, else offline files)."
        ),
    ] = False,
    json_: JsonOption = False,
) -> None:
    """Train a model as the config says; --json prints steps, tokens, losses, throughput and checkpoint.

    CONFIG is a YAML file or a shipped config's name. Example: `speedtronic train shakespeare
    --max-steps 100` (then the same command again continues the run), `speedtronic train my.yaml --set
    optimizer.lr=1e-3 --tensorboard`.
    """
    cfg = _train_config(config, set_, device, resume, tensorboard, wandb)
    check_plain_run(cfg, max_steps)  # before any rank starts, so a usage error exits 2 once
    if nproc is not None and nproc > 1 and "WORLD_SIZE" not in os.environ:
        _relaunch(nproc)

    from speedtronic.api import Trainer
    from speedtronic.engine.logs import setup_logging

    rank = int(os.environ.get("RANK", "0"))
    # Under torchrun only rank 0 reports; the others log warnings and errors only.
    setup_logging(cfg.logging.level if rank == 0 else "WARNING", cfg.logging.file if rank == 0 else None)
    if rank == 0:
        _announce_log_dirs(cfg)
    result = Trainer(cfg).train(max_steps=max_steps)
    if rank != 0:
        raise typer.Exit(130 if result.interrupted else 0)
    if json_:
        emit_json(result.as_dict())
    else:
        _print_result(result, cfg, max_steps)
    if result.interrupted:
        raise typer.Exit(130)


def _train_config(
    config: Path,
    set_: list[str] | None,
    device: str | None,
    resume: bool | None,
    tensorboard: bool,
    wandb: bool,
) -> Config:
    """The config with the flags applied (as --set overrides: --device, --resume, the logging hooks)."""
    extra = []
    if device is not None:
        extra.append(f"run.device={device}")
    if resume is not None:
        extra.append(f"checkpoint.resume={str(resume).lower()}")
    cfg = load_cli_config(config, set_, extra)
    if tensorboard or wandb:
        wanted = [
            *cfg.logging.hooks,
            *(["tensorboard"] if tensorboard else []),
            *(["wandb"] if wandb else []),
        ]
        extra.append(f"logging.hooks=[{', '.join(dict.fromkeys(wanted))}]")
        cfg = load_cli_config(config, set_, extra)
    return cfg


def _print_result(result: TrainResult, cfg: Config, max_steps: int | None) -> None:
    """The one line a person reads at the end: done or interrupted, or why there was nothing to train."""
    if result.complete and result.steps < cfg.max_steps():
        typer.echo(
            f"nothing to train: run {cfg.run.name} is already at step {result.steps} (--max-steps "
            f"{max_steps}); pass a larger --max-steps (at most run.max_steps={cfg.max_steps()}), or none"
        )
    elif result.complete:
        total = cfg.max_steps()
        typer.echo(
            f"complete: run {cfg.run.name} is at step {result.steps} of run.max_steps={total}; nothing to "
            f"train (checkpoint {result.checkpoint}). Extend it with `--set run.max_steps={2 * total}` "
            f"(any N > {result.steps}), or set another run.name for a new run"
        )
    else:
        val = f" · val loss {result.val_loss:.4f}" if result.val_loss is not None else ""
        loss = f"{result.final_loss:.4f}" if result.final_loss is not None else "n/a"
        typer.echo(
            f"{'interrupted' if result.interrupted else 'done'}: step {result.steps} · loss {loss}{val} · "
            f"{result.tokens_per_s:,.0f} tok/s · {result.elapsed_s:.1f}s · checkpoint {result.checkpoint or 'none'}"
        )


def _announce_log_dirs(cfg: object) -> None:
    """Say where the metrics go, before the run starts (the end summary says it again). Logged, so
    the lines are timestamped like every other event when stderr is a file."""
    import logging
    from pathlib import Path

    log = logging.getLogger("speedtronic.train")
    hooks = cfg.logging.hooks  # type: ignore[attr-defined]
    out = Path(cfg.output_dir())  # type: ignore[attr-defined]
    if "jsonl" in hooks:
        log.info("metrics: %s (speedtronic runs / speedtronic runs plot)", cfg.metrics_file())  # type: ignore[attr-defined]
    if "tensorboard" in hooks:
        log.info("tensorboard: %s (tensorboard --logdir %s)", out / "tensorboard", out / "tensorboard")
    if "wandb" in hooks:
        log.info("wandb: run files under %s", out / "wandb")


def check_plain_run(cfg: Config, max_steps: int | None) -> None:
    """What `train` refuses before starting: a DiLoCo node's config (it would train alone) and a
    --max-steps past the run's end."""
    from speedtronic.errors import ConfigError
    from speedtronic.plan import check_stop

    if cfg.distributed.enabled:
        raise ConfigError(
            "distributed.enabled is true, but `train` does not join a DiLoCo run: start this node with "
            "`speedtronic master CONFIG` or `speedtronic worker CONFIG --repo REPO`, or set "
            "distributed.enabled: false to train alone"
        )
    if max_steps is not None:
        check_stop(cfg, max_steps)


def _relaunch(nproc: int) -> None:
    """Run this same command on `nproc` ranks through torch's launcher and exit with its code."""
    from speedtronic.engine.parallel.distributed import launch

    argv = list(sys.argv[1:])
    for i, arg in enumerate(argv):  # drop --nproc N / --nproc=N so the ranks do not relaunch
        if arg == "--nproc":
            del argv[i : i + 2]
            break
        if arg.startswith("--nproc="):
            del argv[i]
            break
    raise typer.Exit(launch(nproc, argv))


def register(app: typer.Typer) -> None:
    app.command("train", rich_help_panel="Training")(train)
