"""What this machine's processors can do: the CPU's flags, the forced CPU precision profile and native
bf16 on the CPU or a CUDA device. Below the engine and the optimizers, which both ask (the run's
precision, Muon's Newton-Schulz dtype); torch is imported only inside `cuda_supports_bf16`.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING

from speedtronic.errors import ConfigError

if TYPE_CHECKING:
    import torch


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


# Forces the CPU precision profile: `native` behaves as a CPU with AMX/AVX512-BF16, `none` as one
# without (unset or `auto`: read /proc/cpuinfo). Tests and CI use it to run both CPU precision paths —
# `precision: auto`, the compile choice and Muon's iteration dtype — on any machine.
CPU_BF16_ENV = "SPEEDTRONIC_CPU_BF16"
CPU_BF16_PROFILES = ("auto", "native", "none")


def forced_cpu_bf16() -> bool | None:
    """The profile forced by SPEEDTRONIC_CPU_BF16: True (native), False (none) or None (not forced)."""
    value = os.environ.get(CPU_BF16_ENV, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in CPU_BF16_PROFILES:
        raise ConfigError(f"{CPU_BF16_ENV}={value!r}: use one of {', '.join(CPU_BF16_PROFILES)}")
    return value == "native"


def cpu_flags_have_bf16() -> bool:
    """AMX or AVX512-BF16 in /proc/cpuinfo: what this CPU really has, whatever is forced."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


def cpu_has_native_bf16() -> bool:
    """AMX or AVX512-BF16: the CPU computes bf16 matmuls natively, so autocast to bf16 pays off
    (SPEEDTRONIC_CPU_BF16=native|none overrides what /proc/cpuinfo says)."""
    forced = forced_cpu_bf16()
    return cpu_flags_have_bf16() if forced is None else forced


def cuda_supports_bf16(device: torch.device) -> bool:
    import torch

    return device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
