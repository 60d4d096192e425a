"""A DiLoCo worker compiles its model before its first step, while its global model downloads
(engine/trainer.py `_compile_ahead`, engine/compiled_step.py `warm`, diloco/worker/prefetch.py): the
steps and losses are those of a compile in the first step, the fetch really overlaps the compilation,
and what the fetch or the model check refuses is refused as before."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from speedtronic import Trainer
from speedtronic.config import load_config
from speedtronic.diloco.worker import Coordinator
from speedtronic.engine.sync import Prefetching
from speedtronic.errors import ConfigError, SpeedtronicError
from test_diloco_coordinator import BASE, setup_run
from test_hybrid_optimizer import Losses

pytestmark = pytest.mark.usefixtures("isolated_env")

RENDEZVOUS_S = 20.0  # how long each side waits for the other: only a broken overlap waits this long


def config(tmp_path: Path) -> Any:
    return load_config(
        {
            "run": {"max_steps": 5, "log_every": 1, "eval_every": 0, "output_dir": str(tmp_path)},
            "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "dropout": 0.2},  # RNG draws in a step
            "data": {
                "synthetic": True,
                "vocab_size": 64,
                "num_tokens": 5000,
                "block_size": 16,
                "micro_batch_size": 2,
                "target_batch_size": 4,  # two micro-batches a step
                "val_batches": 0,
            },
            "precision": {"mode": "fp32"},
            "compile": {"enabled": True},
            "checkpoint": {"enabled": False},
            "logging": {"hooks": []},
        }
    )


class Recorder:
    """A sync that changes nothing and records what the trainer asked of it, and when."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def prefetch(self, model: nn.Module) -> None:
        self.calls.append(f"prefetch frames={torch._dynamo.utils.counters['frames']['total']}")

    def attach(self, model: nn.Module, *, step: int, tokens: int, final_step: int) -> None:
        self.calls.append(f"attach frames={torch._dynamo.utils.counters['frames']['total']}")

    def after_step(self, model: nn.Module, *, step: int, tokens: int) -> bool:
        self.calls.append(f"step {step}")
        return False

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def test_compiling_ahead_keeps_every_loss_and_comes_before_attach(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real dynamo (its eager backend): the sync's run compiles before attach, the other in its first
    step; with dropout and two micro-batches a step, every loss is the same bit for bit (the warm
    pass's gradients, RNG draws and batch are all given back)."""
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: real_compile(model, backend="eager", **kw))
    counters = torch._dynamo.utils.counters
    runs = {}
    for name, sync in (("first-step", None), ("ahead", Recorder())):
        torch._dynamo.reset()
        counters.clear()
        losses = Losses()
        trainer = Trainer(config(tmp_path / name), hooks={"l": losses}, sync=sync, progress=False)
        result = trainer.train()
        assert result.compiled and result.compile_s is not None, name
        runs[name] = (losses.values, result.tokens, trainer.counters.batches_consumed, sync)
    torch._dynamo.reset()
    (eager_losses, tokens, batches, _), (losses, ahead_tokens, ahead_batches, recorder) = runs.values()
    assert isinstance(recorder, Prefetching)
    assert recorder.calls[:2] == ["prefetch frames=0", "attach frames=1"], recorder.calls
    assert recorder.calls[2:] == [f"step {s}" for s in range(1, 6)]
    assert len(losses) == 5 and losses == eager_losses
    assert (ahead_tokens, ahead_batches) == (tokens, batches) == (5 * 4 * 16, 10)


class Rendezvous(nn.Module):
    """Stands in for a compiled model: its first call (the compilation) tells the fetch that it has
    begun and waits until the fetch is under way too."""

    def __init__(self, inner: nn.Module, compiling: threading.Event, fetching: threading.Event) -> None:
        super().__init__()
        self.inner, self.compiling, self.fetching, self.calls = inner, compiling, fetching, 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            self.compiling.set()
            assert self.fetching.wait(RENDEZVOUS_S), "the compilation ran while no fetch was under way"
        return self.inner(*args, **kwargs)


def test_a_fresh_worker_fetches_its_global_while_it_compiles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each side waits for the other to be under way: it passes only when the global's download and
    the compilation overlap. The worker then trains from that global and sends its deltas."""
    cfg, bus, manifest, _ = setup_run(tmp_path, "compile.enabled=true", "checkpoint.enabled=false")
    compiling, fetching = threading.Event(), threading.Event()
    monkeypatch.setattr(torch, "compile", lambda model, **kw: Rendezvous(model, compiling, fetching))
    read_global = bus.read_global_capped

    def slow_read(head: Any, max_bytes: int) -> bytes:
        fetching.set()
        assert compiling.wait(RENDEZVOUS_S), "the global was fetched while nothing compiled"
        return read_global(head, max_bytes)

    monkeypatch.setattr(bus, "read_global_capped", slow_read)
    coordinator = Coordinator(cfg, bus, "w1", manifest)
    trainer = Trainer(cfg, sync=coordinator, progress=False)
    result = trainer.train(max_steps=4)
    assert result.compiled and trainer.compiled_step.model.calls >= 4  # type: ignore[union-attr]
    assert coordinator.outer_step == 0 and coordinator.book.anchor is not None
    assert coordinator.uploaded == ["w1--00000000.safetensors", "w1--00000001.safetensors"]


def test_what_the_fetch_raises_is_raised_and_a_wrong_model_compiles_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiled: list[nn.Module] = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: compiled.append(model) or model)
    # No head on the bus: the prefetch's wait ends at max_wait, and the error reaches train().
    cfg, bus, manifest, _ = setup_run(
        tmp_path / "nohead", "compile.enabled=true", "distributed.rounds.max_wait=0.3"
    )
    (bus.root / "head.json").unlink()
    with pytest.raises(SpeedtronicError, match="no global model was published within"):
        Trainer(cfg, sync=Coordinator(cfg, bus, "w1", manifest), progress=False).train(max_steps=2)
    assert len(compiled) == 1  # it compiled while it waited
    # A model that is not the run's: refused before anything compiles.
    compiled.clear()
    cfg, bus, manifest, _ = setup_run(tmp_path / "wrong", "compile.enabled=true")
    other = load_config(None, [*BASE, f"run.output_dir={tmp_path / 'other'}", "model.d_model=16"])
    with pytest.raises(ConfigError):
        Trainer(other, sync=Coordinator(other, bus, "w1", manifest), progress=False).train(max_steps=2)
    assert compiled == []
