"""Whether a run goes through torch.compile, and why: the `compile.enabled: auto` decision.

`true`/`false` are obeyed. `auto` (the default) compiles where compilation has been measured to pay
for itself and the run is long enough to earn back its start-up cost:

- CUDA: inductor fuses the elementwise work between GEMMs into Triton kernels (the usual 1.3-2×);
- a CPU with native bf16 (AMX/AVX512-BF16) under bf16 autocast: inductor's C++ kernels fuse the
  casts autocast inserts around every op — the peer benchmark's reference machine measured 1.37×
  (bf16 16,740 → 22,886 tok/s, issue 6);
- not a CPU in fp32: measured 1.06× here (bench/peers.py dims) for ~50 s of compilation, which
  takes about a thousand steps to earn back; not MPS (inductor support is partial);
- not runs with fewer than `compile.auto_min_steps` steps left (smoke tests, debugging, the tail of
  a resumed run), nor runs that asked for
  `ooo_backprop`, whose CUDA-stream hooks compile would trace away.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from speedtronic.engine.device import cpu_has_native_bf16
from speedtronic.engine.precision import PrecisionPlan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompilePlan:
    enabled: bool
    reason: str

    def describe(self) -> str:
        return f"torch.compile {'on' if self.enabled else 'off'} ({self.reason})"


def plan_compile(
    config: Any, device: torch.device, precision: PrecisionPlan, steps_left: int | None = None
) -> CompilePlan:
    """Resolve `config.compile.enabled` (true, false or auto) for this device and precision;
    `steps_left` is what remains of the run (all of it unless resuming)."""
    setting = config.compile.enabled
    if setting is True or setting is False:
        return CompilePlan(setting, "requested")
    steps = config.max_steps() if steps_left is None else steps_left
    floor = config.compile.auto_min_steps
    if config.ooo_backprop:
        return CompilePlan(False, "auto: ooo_backprop is on, and compile would bypass its stream hooks")
    if steps < floor:
        return CompilePlan(False, f"auto: {steps} steps is under compile.auto_min_steps={floor}")
    if device.type == "cuda":
        return CompilePlan(True, "auto: CUDA")
    if device.type == "cpu" and precision.mode == "bf16" and cpu_has_native_bf16():
        return CompilePlan(True, "auto: CPU with native bf16")
    if device.type == "cpu":
        return CompilePlan(False, f"auto: {precision.mode} on CPU gains too little to pay for compiling")
    return CompilePlan(False, f"auto: not on {device.type}")


def compile_model(model: nn.Module, options: Any) -> nn.Module | None:
    """`torch.compile(model)` with the config's options, or None (logged) if it fails eagerly."""
    kwargs: dict[str, Any] = {"fullgraph": options.fullgraph}
    if options.mode:
        kwargs["mode"] = options.mode
    if options.dynamic is not None:
        kwargs["dynamic"] = options.dynamic
    try:
        return torch.compile(model, **kwargs)  # type: ignore[return-value]
    except Exception as error:  # compile can fail eagerly on unsupported platforms
        logger.warning("torch.compile failed (%s); training eagerly", error)
        return None
