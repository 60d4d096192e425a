"""`speedtronic hub init|add-collaborator|status`: create and inspect a DiLoCo run (a Hub repo, a
directory or an S3 prefix: any bus speedtronic.diloco.bus.registry serves).

Never imports torch or huggingface_hub at import time; never prints a token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from speedtronic.cli.common import JsonOption, SetOption, emit_json

hub_app = typer.Typer(
    help="Create and inspect a DiLoCo run on the Hugging Face Hub (or a file:// directory, an s3:// prefix).",
    no_args_is_help=True,
)
RepoArgument = Annotated[
    str,
    typer.Argument(
        help="The run: owner/name (Hub), file://PATH (directory) or s3://BUCKET/PREFIX.",
        metavar="REPO",
        show_default=False,
    ),
]
EndpointOption = Annotated[
    str | None,
    typer.Option(
        "--endpoint",
        help="Hub or S3 endpoint URL (default HF_ENDPOINT or huggingface.co; for s3://, AWS_ENDPOINT_URL or AWS).",
    ),
]


@hub_app.command("init")
def init(
    repo: RepoArgument,
    config: Annotated[
        Path | None,
        typer.Argument(
            help="The run config (defines the model): a YAML file or a shipped config's name.",
            metavar="CONFIG",
            show_default=False,
        ),
    ] = None,
    config_option: Annotated[
        Path | None,
        typer.Option("--config", "-c", help="The same as CONFIG (the older spelling).", show_default=False),
    ] = None,
    set_: SetOption = None,
    gated: Annotated[
        bool,
        typer.Option(
            "--gated",
            help="Public behind a manual access gate; add-collaborator grants read access (the default).",
        ),
    ] = False,
    private: Annotated[
        bool,
        typer.Option(
            "--private",
            help="Private and ungated: only the owner (an organisation: its members) can read the run.",
        ),
    ] = False,
    public: Annotated[bool, typer.Option("--public", help="Public and ungated: anyone can read.")] = False,
    endpoint: EndpointOption = None,
    json_: JsonOption = False,
) -> None:
    """Create the run repo with its manifest and the global model of outer step 0.

    On the Hub the repo is gated unless --private or --public says otherwise.

    Example: `speedtronic hub init you/run diloco-hub`, or a directory bus:
    `speedtronic hub init file://runs/diloco-local/bus diloco-local`.
    """
    from speedtronic.diloco.launch import init_run
    from speedtronic.errors import ConfigError

    if config is not None and config_option is not None and config != config_option:
        raise ConfigError(f"hub init: CONFIG {config} and --config {config_option} differ; give one")
    config = config or config_option
    if config is None:
        raise ConfigError("hub init: name the run config: speedtronic hub init REPO CONFIG")

    if gated + private + public > 1:
        raise ConfigError("hub init: give one of --gated (the default), --private, --public")
    out = init_run(repo, config, set_, endpoint, private, not (private or public))
    if json_:
        emit_json(out)
    else:
        typer.echo(f"created DiLoCo run {repo} (fingerprint {out['fingerprint'][:19]}…)")


@hub_app.command("add-collaborator")
def add_collaborator(
    repo: RepoArgument,
    user: Annotated[
        str, typer.Argument(help="Hub user name of the collaborator.", metavar="USER", show_default=False)
    ],
    delta_repo: Annotated[
        str | None,
        typer.Option("--delta-repo", help="Where their deltas go (default USER/<run name>-deltas, theirs)."),
    ] = None,
    node_id: Annotated[str | None, typer.Option("--node-id", help="Their node id (default USER).")] = None,
    record_only: Annotated[
        bool,
        typer.Option(
            "--record-only",
            help="List USER even where they cannot read the run yet (a private, ungated Hub repo).",
        ),
    ] = False,
    endpoint: EndpointOption = None,
    json_: JsonOption = False,
) -> None:
    """List USER in the run's manifest (the master accepts deltas only from listed collaborators).

    On a gated Hub run repo this also grants USER read access; on a private, ungated one that USER
    cannot read it refuses (exit 2) unless --record-only.

    Example: `speedtronic hub add-collaborator you/run friend`.
    """
    from speedtronic.diloco.launch import add_collaborator_to_run

    out = add_collaborator_to_run(repo, user, node_id, delta_repo, endpoint, record_only)
    if out.get("warning"):
        typer.echo(f"warning: {out['warning']}", err=True)  # they were added, but cannot take part yet
    if json_:
        emit_json(out)
    else:
        extra = " · granted read access" if out["granted_read_access"] else ""
        typer.echo(
            f"added {user} as node {out['node']} (deltas: {out['delta_repo'] or 'run directory'}){extra}"
        )


@hub_app.command("status")
def status(
    repo: RepoArgument,
    endpoint: EndpointOption = None,
    watch: Annotated[
        bool, typer.Option("--watch", help="Refresh every --interval seconds until interrupted.")
    ] = False,
    interval: Annotated[
        float, typer.Option("--interval", help="Seconds between refreshes with --watch.")
    ] = 30.0,
    retry_budget: Annotated[
        float, typer.Option("--retry-budget", help="Seconds a Hub request may spend on retries.")
    ] = 10.0,
    json_: JsonOption = False,
) -> None:
    """What the master published: outer step, applied, rejected (with reasons), pending and finished,
    in total and per node (last seen, lag, tokens), plus delta files on the bus newer than that.

    Example: `speedtronic hub status file://runs/diloco-local/bus --json`, or `--watch` to follow it.
    """
    import sys
    import time

    from speedtronic.diloco.launch import run_status
    from speedtronic.errors import TransientBusError

    while True:
        try:
            out = run_status(repo, endpoint, retry_budget)
        except TransientBusError as error:
            if not watch:
                raise
            typer.echo(f"{time.strftime('%H:%M:%S')} {error} (next try in {interval:g}s)")
            time.sleep(interval)
            continue
        if json_:
            emit_json(out)
        else:
            _print_status(repo, out, stamp=time.strftime("%H:%M:%S") if watch else None)
        if not watch:
            return
        sys.stdout.flush()
        time.sleep(interval)


def _print_status(repo: str, out: dict, stamp: str | None) -> None:
    end = f" of {out['end']}" if out.get("end") else ""
    prefix = f"[{stamp}] " if stamp else ""
    typer.echo(
        f"{prefix}{repo}: outer step {out['outer_step']}{end} · updated {out['updated_at'] or 'never'} · "
        f"{out['applied']} applied · {out['rejected']} rejected · {out['pending']} pending · "
        f"{len(out['finished'])} finished"
        + (f" · {out['new_on_bus']} new on the bus" if out["new_on_bus"] else "")
    )
    lease, rnd = out.get("lease") or {}, out.get("round") or {}
    if out.get("epoch") is not None:
        holder = f" · lease {lease.get('holder', '?')}" if lease else ""
        typer.echo(f"  master epoch {out['epoch']}{holder}")
    if rnd:
        typer.echo(
            f"  round {rnd.get('outer_step')}: {rnd.get('rule')} · quorum {rnd.get('quorum_nodes')} of "
            f"{len(rnd.get('expected') or [])} · grace {rnd.get('grace_s')}s ({rnd.get('grace_from')}) · "
            f"waiting on {', '.join(rnd.get('waiting_on') or []) or 'nobody'} · not waited for: "
            f"{', '.join(rnd.get('not_waited_for') or []) or 'none'}"
        )
    untrusted = out.get("untrusted_only")
    if isinstance(untrusted, list) and untrusted:
        from speedtronic.diloco import codec

        shown = [n for n in untrusted if isinstance(n, str) and codec.NODE_RE.match(n)][:20]
        typer.echo(
            f"  WARNING: only nodes that cannot weigh are left: {', '.join(shown)} (quarantined, probed out)"
        )
    if out.get("end_reason"):
        typer.echo(f"  ended: {out['end_reason']}")
    if out.get("global_eval"):
        typer.echo(f"  {'global model':<20} {_eval_line(out['global_eval'], 'outer step')}")
    for c in out["collaborators"]:
        lag = "-" if c["lag"] is None else c["lag"]
        seen = "never" if c.get("last_seen_s_ago") is None else f"{c['last_seen_s_ago']:.0f}s ago"
        new = f" · {len(c['new_on_bus'])} new on the bus" if c["new_on_bus"] else ""
        done = " · finished" if c["finished"] else ""
        typer.echo(
            f"  {c['node']:<20} last seen {seen:>10} · last applied #{c['latest_applied_seq']} at outer step "
            f"{c['latest_applied_outer_step']} · lag {lag} · {c.get('tokens', 0):,} tokens · "
            f"{c['applied']} applied · {c['rejected']} rejected · {c['pending_count']} pending{new}{done}"
        )
        if c.get("eval"):
            typer.echo(f"  {'':<20} own eval {_eval_line(c['eval'], 'step')}")
        if c.get("last_rejection"):
            typer.echo(f"  {'':<20} last rejected: {c['last_rejection'][0]}: {c['last_rejection'][1]}")


def _eval_line(summary: dict, step: str) -> str:
    """One evaluation summary (diloco/node_eval.py): val loss, CORE and each task's accuracy."""
    parts = [f"at {step} {summary['step']}"]
    if summary.get("val_loss") is not None:
        parts.append(f"val loss {summary['val_loss']:.4f}")
    if summary.get("core") is not None:
        parts.append(f"CORE {summary['core']:+.4f}")
    parts += [f"{name} {acc:.4f}" for name, acc in summary.get("tasks", {}).items() if acc is not None]
    return " · ".join(parts)


def register(app: typer.Typer) -> None:
    app.add_typer(hub_app, name="hub", rich_help_panel="DiLoCo")
