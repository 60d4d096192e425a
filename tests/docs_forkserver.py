"""A fork server for the documentation tests: import torch once, run each command in a forked child.

On our CI-sized machines `import torch` plus the dynamo import torch's optimizers trigger costs several
seconds per process, which dominates a two-step smoke run; the docs run about twenty such commands.
The server (`python docs_forkserver.py serve SOCKET`) imports them once. A client
(`python docs_forkserver.py cli ARGS...` behind the `speedtronic` shim, or `... python FILE`) sends its
argv, working directory, environment and its stdin/stdout/stderr file descriptors; the server forks, and
the child takes over those descriptors, directory and environment and runs `speedtronic.cli.main(ARGS)`
(what `python -m speedtronic` runs) or the Python file as `__main__`, then reports its exit code. Each
command is therefore still its own process with its own state; only the imports are shared.

The server imports modules and runs a few plain torch operations on one thread (so no OpenMP thread
pool exists to be broken by fork), but no speedtronic code: it never builds the plugin host, logging or
a config, so each child reads SPEEDTRONIC_* and HF_* itself. Children compute on one thread
(`torch.set_num_threads(1)`): on a loaded two-core machine tiny models run tens of times faster so. Client and server are
standard library only; the client costs one bare Python start-up.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

WARM_MODULES = (
    "torch",
    "torch._dynamo",
    "torch.nn.functional",
    "speedtronic.cli",
    "speedtronic.config",
    "speedtronic.engine.trainer",
    "speedtronic.engine.checkpoint.files",
    "speedtronic.engine.data",
)


def _send_message(conn: socket.socket, payload: dict, fds: list[int] = ()) -> None:
    data = json.dumps(payload).encode()
    header = struct.pack("!I", len(data))
    if fds:
        socket.send_fds(conn, [header], list(fds))
        conn.sendall(data)
    else:
        conn.sendall(header + data)


def _recv_exact(conn: socket.socket, size: int) -> bytes:
    chunks = b""
    while len(chunks) < size:
        chunk = conn.recv(size - len(chunks))
        if not chunk:
            raise ConnectionError("peer closed")
        chunks += chunk
    return chunks


def _run_child(request: dict, fds: list[int]) -> int:
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = request["argv"]
    try:
        if request["kind"] == "cli":
            from speedtronic.cli import main

            main(request["argv"][1:])
        else:
            path = request["argv"][0]
            with open(path, encoding="utf-8") as f:
                code = compile(f.read(), path, "exec")
            exec(code, {"__name__": "__main__", "__file__": path})
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if exit_.code is not None and not isinstance(exit_.code, int):
            print(exit_.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    return code


def _warm_up() -> None:
    """Run a few plain torch operations once (one thread: no OpenMP pool exists when we fork), so
    every child skips torch's first-call initialisation. No speedtronic code runs here."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    logits = model(torch.randint(0, 16, (2, 4)))
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.randint(0, 16, (8,))).backward()
    optimizer.step()


def serve(path: str) -> None:
    import importlib

    for name in WARM_MODULES:
        importlib.import_module(name)
    _warm_up()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped automatically
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        try:
            header, fds, _, _ = socket.recv_fds(conn, 4, 3)
            (size,) = struct.unpack("!I", header + _recv_exact(conn, 4 - len(header)))
            request = json.loads(_recv_exact(conn, size))
        except (OSError, ConnectionError, ValueError):
            conn.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:  # the child: become the command, report, exit without unwinding
            server.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            code = _run_child(request, fds)
            try:
                sys.stdout.flush()
                sys.stderr.flush()
                import logging

                logging.shutdown()
                _send_message(conn, {"exit": code})
            finally:
                os._exit(code)
        for fd in fds:
            os.close(fd)
        conn.close()


def client(kind: str, argv: list[str]) -> int:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(os.environ["SPEEDTRONIC_DOCS_FORKSERVER"])
    env = {k: v for k, v in os.environ.items() if k != "SPEEDTRONIC_DOCS_FORKSERVER"}
    request = {"kind": kind, "argv": argv, "cwd": os.getcwd(), "env": env}
    _send_message(conn, request, [0, 1, 2])
    (size,) = struct.unpack("!I", _recv_exact(conn, 4))
    return int(json.loads(_recv_exact(conn, size))["exit"])


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "serve":
        serve(sys.argv[2])
    elif mode == "cli":
        sys.exit(client("cli", ["speedtronic", *sys.argv[2:]]))
    else:
        sys.exit(client("python", sys.argv[2:]))
