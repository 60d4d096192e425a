"""`speedtronic dashboard SOURCE...`: a local, read-only web page for runs folders and DiLoCo swarms
(speedtronic/dashboard). Never imports torch at import time; never prints a token."""

from __future__ import annotations

from typing import Annotated

import typer

from speedtronic.cli.common import console


def dashboard(
    sources: Annotated[
        list[str] | None,
        typer.Argument(
            help="What to show: a folder of runs (runs/), a DiLoCo run's bus (file://PATH, s3://BUCKET/PREFIX, "
            "owner/name on the Hub) or its directory; several at once. Default: runs.",
            metavar="SOURCE...",
            show_default=False,
        ),
    ] = None,
    port: Annotated[int, typer.Option("--port", "-p", help="Port to listen on (0: any free port).")] = 8765,
    host: Annotated[
        str,
        typer.Option(
            "--host",
            help="Address to listen on. The default answers this machine only; another address shows the "
            "page (read-only, no secrets) to anyone who can reach it.",
        ),
    ] = "127.0.0.1",
    interval: Annotated[
        float | None,
        typer.Option(
            "--interval",
            help="Seconds between reads of each source (default 2 for a directory bus, 5 for a runs folder, "
            "30 for the Hub or S3, where every read costs requests).",
            show_default=False,
        ),
    ] = None,
    endpoint: Annotated[
        str | None,
        typer.Option("--endpoint", help="Hub or S3 endpoint URL (default HF_ENDPOINT or huggingface.co)."),
    ] = None,
) -> None:
    """Serve a live page of runs and swarms: loss curves, eval tasks, and for a swarm the global and
    nodes' losses, tokens/s, rounds, the node table, rejections with the check that made them, the
    master's lease. It prints the URL and refreshes by itself until interrupted (Ctrl-C).

    Example: `speedtronic dashboard runs/ file://runs/diloco-local/bus --port 8765`.
    """
    import sys

    from speedtronic.dashboard.collect import Collector, classify
    from speedtronic.dashboard.server import LOOPBACK, serve
    from speedtronic.errors import ConfigError

    if interval is not None and not 0.1 <= interval <= 86400:
        raise ConfigError("dashboard: --interval must be between 0.1 and 86400 seconds")
    if not 0 <= port <= 65535:
        raise ConfigError("dashboard: --port must be between 0 and 65535")
    found = [classify(arg, endpoint, interval) for arg in (sources or ["runs"])]
    collector = Collector(found)
    try:
        server = serve(collector, host, port)
    except OSError as error:
        raise ConfigError(
            f"dashboard: cannot listen on {host}:{port} ({error.strerror or error}); "
            "choose another --port (0: any free one)"
        ) from None
    if host not in LOOPBACK:
        console.print(
            f"[yellow]warning:[/yellow] the dashboard listens on {host}: anyone who can reach this machine "
            "can read the page (read-only; no token or secret is shown)",
            soft_wrap=True,
        )
    collector.start()
    sys.stdout.write(f"speedtronic dashboard: {server.url}\n")
    sys.stdout.flush()
    console.print(f"showing {', '.join(s.label for s in found)}; Ctrl-C stops", soft_wrap=True)
    try:
        server.serve_forever(poll_interval=0.25)
    finally:
        collector.close()
        server.server_close()


def register(app: typer.Typer) -> None:
    app.command("dashboard", rich_help_panel="Training")(dashboard)
