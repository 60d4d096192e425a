"""Tests for speedtronic.engine.checkpoint.files: atomic files, pointer, pruning, safe loading, summaries."""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import speedtronic.engine.checkpoint.files as ckpt_module
from speedtronic.engine.checkpoint.files import (
    CHECKPOINT_FORMAT,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    pack_python_rng,
    resolve_checkpoint,
    save_checkpoint,
    unpack_python_rng,
)
from speedtronic.engine.checkpoint.layout import checkpoint_summary, read_for_inspection
from speedtronic.errors import CheckpointError


class _Custom:
    """A class weights-only loading must refuse to rebuild."""

    def __init__(self) -> None:
        self.value = 3


class _Evil:
    """Unpickling this runs a shell command that creates a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


class _TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: one 10x4 storage under two state_dict keys

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(x)))


def _realistic_payload(model: nn.Module) -> dict[str, Any]:
    """Build the trainer's payload layout after one real optimizer/scheduler step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** (s + 1))
    inputs = torch.randint(0, 10, (2, 3)) if isinstance(model, _TiedLM) else torch.randn(2, 8)
    model(inputs).float().pow(2).mean().backward()
    opt.step()
    sched.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "optimizer_name": "AdamW",
        "scheduler": sched.state_dict(),
        "scheduler_name": "LambdaLR",
        "grad_scaler": None,
        "tokens_seen": 4096,
        "rng": {
            "python": random.getstate(),
            "torch": torch.get_rng_state(),
            "cuda": [torch.get_rng_state()],  # stands in for per-device ByteTensors on CPU-only CI
        },
        "data_state": {"epoch": 0, "offset": 1234, "seed": 7},
        "config": {
            "run": {"name": "tiny", "seed": 7},
            "model": {"name": "gpt", "n_layer": 2, "d_model": 4, "n_head": 2, "vocab_size": 10},
            "optimizer": {"name": "adamw", "lr": 1e-3, "betas": (0.9, 0.95)},
            "data": {"block_size": 3, "micro_batch_size": 2},
            "hub": {"token": "***"},
        },
        "precision": "fp32",
        "created_at": "2026-05-09T07:35:25+00:00",
        "coordinator": None,
        "metrics": {"loss": 2.5, "lr": 5e-4},
    }


def _assert_same(a: Any, b: Any, where: str = "payload") -> None:
    """Bitwise structural equality: same container types, same tensors (dtype, shape, bytes)."""
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        as_bytes = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
        assert torch.equal(*as_bytes), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _one_line(exc: pytest.ExceptionInfo[CheckpointError]) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------------------------ round trip


def test_round_trip_realistic_payload_is_bitwise_equal(tmp_path: Path) -> None:
    torch.manual_seed(0)
    payload = _realistic_payload(nn.Linear(8, 4))
    before = dict(payload)
    path = save_checkpoint(tmp_path / "run" / "ckpt", 123, payload)

    assert path == tmp_path / "run" / "ckpt" / "step_00000123.pt"
    assert payload == before, "save_checkpoint must not modify the caller's dict"
    loaded = load_checkpoint(path)
    assert loaded["format"] == CHECKPOINT_FORMAT
    assert loaded["step"] == 123
    _assert_same({k: v for k, v in loaded.items() if k not in ("format", "step")}, payload)
    assert loaded["rng"]["torch"].dtype == torch.uint8

    # The restored RNG states reproduce the exact same streams.
    random.setstate(unpack_python_rng(loaded["rng"]["python"]))
    torch.set_rng_state(loaded["rng"]["torch"])
    resumed = (random.random(), torch.rand(3))
    random.setstate(payload["rng"]["python"])
    torch.set_rng_state(payload["rng"]["torch"])
    assert resumed[0] == random.random()
    assert torch.equal(resumed[1], torch.rand(3))


def test_python_rng_helpers_normalise_and_validate() -> None:
    state = random.getstate()
    assert pack_python_rng(state) == state
    as_lists = [state[0], list(state[1]), state[2]]
    restored = unpack_python_rng(as_lists)
    random.setstate(restored)  # would raise TypeError if a list slipped through
    assert restored == state
    with pytest.raises(CheckpointError, match="RNG state is malformed"):
        unpack_python_rng({"not": "a state"})


def test_save_refuses_payload_that_could_not_be_loaded(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"payload\['metrics'\]\['obj'\] is a .*_Custom") as exc:
        save_checkpoint(tmp_path, 1, {"metrics": {"obj": _Custom()}})
    assert "step_00000001.pt" in _one_line(exc)
    assert list(tmp_path.iterdir()) == []


def test_unwritable_directory_gives_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with pytest.raises(
        CheckpointError, match=r"could not write checkpoint .*not-a-dir/step_00000001.pt"
    ) as exc:
        save_checkpoint(blocker, 1, {})
    assert "checkpoint.directory is a writable directory" in _one_line(exc)


@pytest.mark.parametrize("bad", [-1, 1.0, True])
def test_save_rejects_bad_step(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(ValueError, match="step"):
        save_checkpoint(tmp_path, bad, {})


# ------------------------------------------------------------------- pointer, pruning, resolution


def test_latest_pointer_and_keep_last(tmp_path: Path) -> None:
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, {"marker": torch.tensor([step])}, keep_last=2)
    assert (tmp_path / "latest").read_text() == "step_00000005.pt\n"
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5]
    assert resolve_checkpoint(tmp_path) == tmp_path / "step_00000005.pt"
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000005.pt"
    assert load_checkpoint(tmp_path)["marker"].item() == 5

    save_checkpoint(tmp_path, 6, {}, keep_last=None)
    save_checkpoint(tmp_path, 7, {}, keep_last=0)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5, 6, 7]
    save_checkpoint(tmp_path, 8, {}, keep_last=1)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [8]


def test_keep_last_never_removes_the_file_just_written(tmp_path: Path) -> None:
    # A run resumed from an earlier step saves below the numbers an abandoned run left behind. Those
    # files are above the one written: they neither count toward keep_last nor get deleted (a junk
    # step_99999999.pt must not push the run's own checkpoints out); the ones below it are pruned.
    for step in (100, 120, 200, 300):
        save_checkpoint(tmp_path, step, {})
    written = save_checkpoint(tmp_path, 150, {}, keep_last=2)
    assert written.exists()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [120, 150, 200, 300]
    assert resolve_checkpoint(tmp_path) == written


def test_stale_tmp_files_removed(tmp_path: Path) -> None:
    stale = [tmp_path / ".step_00000009.pt.deadbeef.tmp", tmp_path / ".latest.0123abcd.tmp"]
    for path in stale:
        path.write_bytes(b"half a checkpoint")
    unrelated = tmp_path / "notes.tmp"
    unrelated.write_text("mine")
    save_checkpoint(tmp_path, 10, {})
    assert not any(p.exists() for p in stale)
    assert unrelated.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "notes.tmp", "step_00000010.pt"]


@pytest.mark.parametrize("pointer", [None, "step_00000099.pt\n", "../outside.pt\n", b"\xff\xfe\x00", ""])
def test_resolution_falls_back_when_pointer_is_unusable(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, pointer: str | bytes | None
) -> None:
    save_checkpoint(tmp_path, 1, {}).rename(tmp_path / "outside.pt")  # a real file the pointer must not reach
    tmp_path = tmp_path / "ckpt"
    for step in (3, 12, 7):
        save_checkpoint(tmp_path, step, {})
    if pointer is None:
        (tmp_path / "latest").unlink()
    elif isinstance(pointer, bytes):
        (tmp_path / "latest").write_bytes(pointer)
    else:
        (tmp_path / "latest").write_text(pointer)
    with caplog.at_level(logging.WARNING, logger=ckpt_module.__name__):
        assert resolve_checkpoint(tmp_path) == tmp_path / "step_00000012.pt"
    assert "latest" in caplog.text and "step_00000012.pt" in caplog.text
    assert load_checkpoint(tmp_path)["step"] == 12


def test_pointer_is_trusted_over_higher_numbers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    save_checkpoint(tmp_path, 50, {})
    save_checkpoint(tmp_path, 20, {})
    with caplog.at_level(logging.WARNING):
        assert resolve_checkpoint(tmp_path) == tmp_path / "step_00000020.pt"
    assert caplog.text == ""


def test_resolution_of_files_and_empty_places(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path / "a", 1, {})
    assert resolve_checkpoint(path) == path
    assert latest_checkpoint(path) == path

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "latest").write_text("step_00000001.pt\n")  # dangling and nothing to fall back to
    assert latest_checkpoint(empty) is None
    assert latest_checkpoint(tmp_path / "missing") is None
    assert list_checkpoints(tmp_path / "missing") == []
    with pytest.raises(CheckpointError, match=r"no checkpoint in .*empty; train with checkpoint.enabled"):
        resolve_checkpoint(empty)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "missing")


# ---------------------------------------------------------------------------- corrupt and unsafe


@pytest.mark.parametrize("damage", ["truncated", "random", "empty"])
def test_corrupt_files_give_clear_error(tmp_path: Path, damage: str) -> None:
    path = save_checkpoint(tmp_path, 5, {"w": torch.randn(1000)})
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "random":
        junk = bytearray(random.Random(5).randbytes(4096))
        junk[0] = 0x42  # not "PK" (zip) and not 0x80 (pickle)
        path.write_bytes(bytes(junk))
    else:
        path.write_bytes(b"")
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(tmp_path)
    message = _one_line(exc)
    assert message.startswith(f"checkpoint {path} is truncated or corrupt (")
    assert message.endswith("delete it or resume from an earlier step_*.pt")
    reason = {"truncated": "zip archive", "random": "not a torch.save zip archive", "empty": "empty file"}
    assert reason[damage] in message


def test_torch_saved_custom_class_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "custom.pt"
    torch.save({"format": 1, "model": {}, "extra": _Custom()}, path)
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(path)
    message = _one_line(exc)
    assert f"checkpoint {path} contains arbitrary Python objects and was refused" in message
    assert "only tensors and plain data are loaded" in message and "_Custom" in message


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("container", ["pickle-2", "pickle-4", "torch-zip"])
def test_code_executing_pickle_is_refused_and_never_runs(tmp_path: Path, container: str) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    evil = {"format": 1, "model": _Evil(marker)}
    if container == "torch-zip":
        torch.save(evil, path)
    else:
        path.write_bytes(pickle.dumps(evil, protocol=int(container[-1])))
    with pytest.raises(CheckpointError, match="contains arbitrary Python objects and was refused"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="was refused"):
        read_for_inspection(path)
    assert not marker.exists()


def test_files_that_are_not_speedtronic_checkpoints(tmp_path: Path) -> None:
    cases = {
        "list.pt": ([1, 2], "holds a list, not a speedtronic checkpoint"),
        "noformat.pt": ({"model": {}}, "has no 'format' field"),
        "future.pt": ({"format": CHECKPOINT_FORMAT + 1}, "newer than this speedtronic reads"),
        "badformat.pt": ({"format": "one"}, "invalid format"),
    }
    for name, (obj, expected) in cases.items():
        torch.save(obj, tmp_path / name)
        with pytest.raises(CheckpointError, match=expected) as exc:
            load_checkpoint(tmp_path / name)
        assert name in _one_line(exc)


# -------------------------------------------------------------------------------------- summary


def test_checkpoint_summary_of_a_format_1_payload(tmp_path: Path) -> None:
    """The previous release's flat layout is upgraded when read (engine/checkpoint/layout.py)."""
    torch.manual_seed(0)
    model = _TiedLM()
    payload = _realistic_payload(model)
    assert payload["model"]["embed.weight"].data_ptr() == payload["model"]["head.weight"].data_ptr()
    path = tmp_path / "step_00000042.pt"
    torch.save({**payload, "format": 1, "step": 42}, path)

    summary = checkpoint_summary(read_for_inspection(tmp_path))
    json.dumps(summary)  # must be JSON-serialisable as-is
    unique = sum(p.numel() for p in model.parameters())
    assert unique == 10 * 4 + 4 + 4
    assert summary["parameter_count"] == unique  # the tied 10x4 matrix counted once, not twice
    assert summary["path"] == str(path)
    assert summary["size_bytes"] == path.stat().st_size
    assert summary["format"] == 1
    assert summary["step"] == 42
    assert summary["tokens_seen"] == 4096
    assert summary["parameter_dtypes"] == ["float32"]
    assert summary["optimizer"] == {"name": "adamw", "state_entries": 3, "param_groups": 1, "lr": 2.5e-4}
    assert summary["scheduler"] == {"name": None, "last_lr": [2.5e-4], "last_epoch": 1}
    assert summary["plan"] is None and summary["precision"] is None  # format 1 stored no plan
    assert summary["parts"] == ["model", "optimizer", "scheduler", "data", "rng", "counters"]
    assert summary["data_position"] == {"epoch": 0, "offset": 1234, "seed": 7}
    assert summary["created"] == "2026-05-09T07:35:25+00:00"
    assert summary["metrics"] == {"loss": 2.5, "lr": 5e-4}
    assert summary["config"] == {
        "run.name": "tiny",
        "model.name": "gpt",
        "model.n_layer": 2,
        "model.d_model": 4,
        "model.n_head": 2,
        "optimizer.name": "adamw",
        "optimizer.lr": 1e-3,
        "data.block_size": 3,
        "data.micro_batch_size": 2,
    }


def test_checkpoint_summary_tolerates_missing_parts(tmp_path: Path) -> None:
    weights = {"w": torch.zeros(3, dtype=torch.bfloat16)}
    save_checkpoint(tmp_path, 1, {"parts": {"model": weights}, "config": {}})
    summary = checkpoint_summary(read_for_inspection(tmp_path))
    json.dumps(summary)
    assert summary["parameter_count"] == 3
    assert summary["parameter_dtypes"] == ["bfloat16"]
    assert summary["config"]["model.n_layer"] is None
    for key in ("tokens_seen", "optimizer", "scheduler", "precision", "data_position", "created", "plan"):
        assert summary[key] is None, key
    assert summary["metrics"] == {} and summary["parts"] == ["model"]


# -------------------------------------------------------------------------------- crash safety

# Imports torch once, then forks one saver per "go" so each kill round costs milliseconds, not an import.
_ZYGOTE = r"""
import os, sys
sys.path.insert(0, sys.argv[1])
import torch
from speedtronic.engine.checkpoint.files import list_checkpoints, save_checkpoint

directory = sys.argv[2]
weights = torch.arange(2 * 1024 * 1024, dtype=torch.float32)  # 8 MB, so a save takes a while


def say(line):
    os.write(1, (line + "\n").encode())


def saver(parent):
    steps = list_checkpoints(directory)
    step = steps[-1][0] + 1 if steps else 1
    for _ in range(300):
        if os.getppid() != parent:  # the zygote died: do not outlive the test
            return
        save_checkpoint(directory, step, {"model": {"w": weights, "marker": torch.tensor([step])}}, keep_last=3)
        say(f"saved {step}")
        step += 1


say("ready")
while sys.stdin.readline().strip() == "go":
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            saver(parent)
        finally:
            os._exit(0)
    say(f"pid {pid}")
    os.waitpid(pid, 0)
    say(f"reaped {pid}")
"""


class _LineReader:
    """Reads lines from a pipe with a deadline, so a stuck child fails the test instead of hanging it."""

    def __init__(self, fd: int, deadline: float) -> None:
        self.fd, self.deadline, self.buffer, self.saved = fd, deadline, b"", []

    def wait_for(self, prefix: str) -> str:
        while True:
            while b"\n" in self.buffer:
                raw, self.buffer = self.buffer.split(b"\n", 1)
                line = raw.decode()
                if line.startswith("saved "):
                    self.saved.append(int(line.split()[1]))
                if line.startswith(prefix):
                    return line
            remaining = self.deadline - time.monotonic()
            assert remaining > 0, f"timed out waiting for {prefix!r}"
            if select.select([self.fd], [], [], remaining)[0]:
                chunk = os.read(self.fd, 65536)
                assert chunk, f"child exited while waiting for {prefix!r}"
                self.buffer += chunk


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_sigkill_during_saves_never_leaves_a_partial_checkpoint(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    script = tmp_path / "zygote.py"
    script.write_text(_ZYGOTE)
    src = Path(ckpt_module.__file__).resolve().parents[3]
    expected = torch.arange(2 * 1024 * 1024, dtype=torch.float32)
    delays = [0.05, *(random.Random(1234).uniform(0.05, 0.5) for _ in range(5))]

    with open(tmp_path / "zygote.err", "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(src), str(directory)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
        )
    assert proc.stdin is not None and proc.stdout is not None
    reader = _LineReader(proc.stdout.fileno(), time.monotonic() + 25)
    pid = None
    try:
        reader.wait_for("ready")
        for delay in delays:
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
            pid = int(reader.wait_for("pid ").split()[1])
            time.sleep(delay)
            os.kill(pid, signal.SIGKILL)
            reader.wait_for(f"reaped {pid}")
            pid = None

            steps = list_checkpoints(directory)
            assert len(steps) <= 4  # keep_last=3, plus one when killed between rename and prune
            for step, path in steps:  # every visible step file is complete
                payload = load_checkpoint(path)
                assert payload["step"] == step == payload["model"]["marker"].item()
                assert torch.equal(payload["model"]["w"], expected)
            if reader.saved:
                # The pointer moves after the file and before "saved" is printed.
                assert load_checkpoint(directory)["step"] in (reader.saved[-1], reader.saved[-1] + 1)
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        proc.stdin.close()
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()

    assert reader.saved, "no save completed in any round; the test proved nothing"
    final = save_checkpoint(directory, reader.saved[-1] + 10, {}, keep_last=3)
    assert not list(directory.glob("*.tmp"))
    assert resolve_checkpoint(directory) == final


def test_saves_killed_before_pruning_in_a_row_do_not_pile_up(tmp_path: Path, monkeypatch) -> None:
    for step in range(1, 6):  # five files, as if earlier saves had died between rename and prune
        save_checkpoint(tmp_path, step, {"model": {"w": torch.zeros(1)}})
    real_write = ckpt_module.atomic_write

    def die_at_pointer(final: Path, write) -> None:
        if final.name == ckpt_module.LATEST_POINTER:
            raise RuntimeError("killed")
        real_write(final, write)

    monkeypatch.setattr(ckpt_module, "atomic_write", die_at_pointer)
    for step in (6, 7):
        with pytest.raises(RuntimeError):
            save_checkpoint(tmp_path, step, {"model": {"w": torch.zeros(1)}}, keep_last=3)
        # The prune before the write already leaves room for the new file: keep_last files, not one more.
        assert [s for s, _ in list_checkpoints(tmp_path)] == [step - 2, step - 1, step]
