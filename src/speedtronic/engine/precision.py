"""The precision plan: which autocast dtype (if any), gradient scaling and parameter dtype a run uses.

The choice is made by the run plan (`speedtronic.plan.choose_precision`: auto is bf16 autocast on CUDA
that supports it, fp16 + GradScaler on older CUDA, bf16 on a CPU only where it is native — AMX /
AVX512-BF16, elsewhere emulated bf16 is slower than fp32 — else fp32); this module turns it into
torch objects: the autocast context and the grad scaler.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from speedtronic.plan import RunPlan, choose_precision

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class PrecisionPlan:
    mode: str  # what actually runs: fp32 | bf16 | fp16
    autocast_dtype: torch.dtype | None
    device_type: str
    param_dtype: torch.dtype
    use_grad_scaler: bool
    reason: str
    warnings: list[str] = field(default_factory=list)

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype)

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        return torch.amp.GradScaler(self.device_type) if self.use_grad_scaler else None

    def describe(self) -> str:
        params = "bf16" if self.param_dtype == torch.bfloat16 else "fp32"
        return (
            f"{self.mode} autocast, {params} parameters ({self.reason})"
            if self.autocast_dtype
            else (f"{self.mode}, {params} parameters ({self.reason})")
        )


def plan_precision(mode: str, dtype: str, device: torch.device) -> PrecisionPlan:
    """Choose the precision for `precision.mode`/`precision.dtype` on `device` (the rule itself is
    `speedtronic.plan.choose_precision`)."""
    from speedtronic.engine.device import device_facts

    choice = choose_precision(mode, dtype, device_facts(device))
    result = _precision_plan(
        choice.precision, choice.param_dtype, choice.autocast, choice.grad_scaler, choice.reason, device
    )
    result.warnings.extend(choice.warnings)
    return result


def precision_for_run(plan: RunPlan, device: torch.device) -> PrecisionPlan:
    """The torch side (autocast context, grad scaler, parameter dtype) of a run plan's precision."""
    result = _precision_plan(
        plan.precision, plan.param_dtype, plan.autocast, plan.grad_scaler, plan.precision_reason, device
    )
    result.warnings.extend(plan.warnings)
    return result


def _precision_plan(
    precision: str, param_dtype: str, autocast: str | None, scaler: bool, reason: str, device: torch.device
) -> PrecisionPlan:
    return PrecisionPlan(
        mode=precision,
        autocast_dtype=_DTYPES.get(autocast or ""),
        device_type=device.type,
        param_dtype=torch.bfloat16 if param_dtype == "bfloat16" else torch.float32,
        use_grad_scaler=scaler,
        reason=reason,
    )
