"""Signals during start-up (speedtronic/interrupts.py): each ends with exit 130 and "interrupted",
never an abort inside torch's import, never lost. The signals are sent by the process itself at an
exact point (an audit hook on an import), so nothing depends on timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import SRC_DIR

SIGNAL_AT_IMPORT = """
import os, signal, sys
sent = []
def hook(event, args):
    if event == "import" and args[0] == {module!r} and not sent:
        sent.append(1)
        os.kill(os.getpid(), signal.{signal})
sys.addaudithook(hook)
sys.argv = ["speedtronic", *{argv!r}]
from speedtronic.__main__ import main
main()
"""


def _run(tmp_path: Path, module: str, signal_name: str, argv: list[str]) -> subprocess.CompletedProcess[str]:
    code = SIGNAL_AT_IMPORT.format(module=module, signal=signal_name, argv=argv)
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(SRC_DIR)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_sigint_inside_torch_distributed_import_exits_130_not_an_abort(tmp_path: Path) -> None:
    result = _run(tmp_path, "torch.distributed", "SIGINT", ["train", "smoke", "--json"])
    assert "terminate called" not in result.stderr, result.stderr[-3000:]
    assert result.returncode == 130, (result.returncode, result.stderr[-3000:])
    assert "interrupted" in result.stderr and "Traceback" not in result.stderr
    last = json.loads(result.stdout.strip().splitlines()[-1])
    assert last.get("exit_code") == 130 or last.get("interrupted") is True, last
    assert not (tmp_path / "runs" / "smoke" / "checkpoints").exists()  # it never started training


DEFERRED_IMPORT = """
import json, os, signal, sys
from speedtronic import interrupts
interrupts.install()
sent = []
def hook(event, args):
    if event == "import" and args[0] == "torch.distributed.rendezvous" and not sent:
        sent.append(1)  # deep inside `import torch` (which imports torch.distributed)
        os.kill(os.getpid(), signal.SIGINT)
sys.addaudithook(hook)
where = "not interrupted"
try:
    import torch
    where = "after the import"
    import time
    time.sleep(30)  # the re-delivered interrupt lands here, at a safe point
except KeyboardInterrupt:
    where = where if where != "not interrupted" else "inside the import"
dist = sys.modules.get("torch.distributed")
print(json.dumps({"sent": bool(sent), "where": where,
                  "complete": dist is not None and hasattr(dist, "init_process_group")}))
"""


def test_a_signal_inside_torch_import_is_delivered_after_it(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", DEFERRED_IMPORT],
        env={**os.environ, "PYTHONPATH": str(SRC_DIR)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out == {"sent": True, "where": "after the import", "complete": True}, out


def test_sigterm_before_the_command_suite_is_imported_exits_130(tmp_path: Path) -> None:
    # typer is imported by the command suite, after speedtronic/__main__.py installed the handlers.
    result = _run(tmp_path, "typer", "SIGTERM", ["validate", "smoke"])
    assert result.returncode == 130, (result.returncode, result.stderr[-3000:])
    assert "interrupted" in result.stderr and "Traceback" not in result.stderr


def test_a_signal_swallowed_during_start_up_still_stops_the_training_loop() -> None:
    from speedtronic import interrupts
    from speedtronic.engine.signals import GracefulStop

    interrupts.pending[:] = ["SIGTERM"]  # recorded by the handler; its KeyboardInterrupt was caught
    try:
        with GracefulStop() as stop:
            assert stop.requested and stop.signal_name == "SIGTERM"
        assert interrupts.pending == []  # acted on once
        with GracefulStop() as stop:
            assert not stop.requested
    finally:
        interrupts.pending.clear()
