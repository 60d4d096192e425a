"""Both CPU precision paths, on any machine: SPEEDTRONIC_CPU_BF16=native|none forces the CPU profile.

On a CPU without AMX/AVX512-BF16 the "native" profile still runs bf16 (emulated, slowly), so the bf16
paths — `precision: auto` choosing bf16, the compile choice, Muon iterating in bf16 — are exercised
everywhere. `.ci/run` runs the precision-sensitive test files once more with the other profile forced.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from speedtronic import Trainer, hardware
from speedtronic.engine import device as device_mod
from speedtronic.errors import ConfigError
from speedtronic.optim.muon import newton_schulz_dtype
from speedtronic.plan import DataFacts, plan_run
from test_engine_parts import small

CPU = torch.device("cpu")


@pytest.mark.parametrize(("value", "native"), [("native", True), ("NONE", False), ("none", False)])
def test_forced_profile_overrides_cpuinfo(monkeypatch: pytest.MonkeyPatch, value: str, native: bool) -> None:
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2"} if native else {"avx512_bf16"}))
    monkeypatch.setenv(hardware.CPU_BF16_ENV, value)
    assert hardware.cpu_has_native_bf16() is native
    assert device_mod.device_facts(CPU).native_bf16 is native
    assert newton_schulz_dtype(CPU) == (torch.bfloat16 if native else torch.float32)
    plan = plan_run(small(Path("unused")), data=DataFacts(64), device=device_mod.device_facts(CPU))
    assert plan.precision == ("bf16" if native else "fp32") and plan.native_bf16 is native


@pytest.mark.parametrize("value", ["", "auto"])
def test_unforced_profile_reads_cpuinfo(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(hardware.CPU_BF16_ENV, value)
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"amx_bf16"}))
    assert hardware.cpu_has_native_bf16()
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2"}))
    assert not hardware.cpu_has_native_bf16()


def test_unknown_profile_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(hardware.CPU_BF16_ENV, "maybe")
    with pytest.raises(ConfigError, match="SPEEDTRONIC_CPU_BF16='maybe': use one of auto, native, none"):
        hardware.cpu_has_native_bf16()


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_auto_precision_trains_in_bf16_under_the_native_profile(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, optimizer: str
) -> None:
    monkeypatch.setenv(hardware.CPU_BF16_ENV, "native")
    trainer = Trainer(small(tmp_path, optimizer={"name": optimizer}), progress=False)
    assert trainer.plan.precision == "bf16" and trainer.plan.autocast == "bf16"
    assert "native bf16" in trainer.summary_lines()[0]
    result = trainer.train()
    assert result.precision == "bf16" and math.isfinite(result.final_loss)


def test_auto_precision_trains_in_fp32_under_the_none_profile(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(hardware.CPU_BF16_ENV, "none")
    trainer = Trainer(small(tmp_path, optimizer={"name": "muon"}), progress=False)
    assert trainer.plan.precision == "fp32" and trainer.plan.autocast is None
    assert newton_schulz_dtype(CPU) == torch.float32
    assert math.isfinite(trainer.train().final_loss)


def test_bf16_resume_is_bitwise_on_one_thread(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """bf16 on CPU is exact run to run on one thread (multithreaded bf16 kernels are not)."""
    monkeypatch.setenv(hardware.CPU_BF16_ENV, "native")
    torch.set_num_threads(1)

    def config(where: str) -> Any:
        return small(tmp_path / where, run={"max_steps": 4}, checkpoint={"enabled": True, "every_steps": 2})

    straight = Trainer(config("a"), progress=False)
    straight.train()
    Trainer(config("b"), progress=False).train(max_steps=2)
    resumed = Trainer(config("b"), progress=False)
    assert resumed.step == 2 and resumed.plan.precision == "bf16"
    resumed.train()
    for (name, a), b in zip(
        straight.raw_model.state_dict().items(), resumed.raw_model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
