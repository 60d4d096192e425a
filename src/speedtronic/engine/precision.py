"""The precision plan: which autocast dtype (if any), gradient scaling and parameter dtype a run uses.

auto: bf16 autocast on CUDA that supports it, fp16 + GradScaler on older CUDA; on CPU bf16 autocast
only where the processor has native bf16 (AMX / AVX512-BF16; elsewhere emulated bf16 is slower than
fp32), fp32 otherwise. An explicit mode the device cannot run falls back with a warning.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from speedtronic.engine.device import cpu_has_native_bf16, cuda_supports_bf16


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
    """Choose the precision for `precision.mode`/`precision.dtype` on `device`."""
    warnings: list[str] = []
    kind = device.type
    bf16_ok = cuda_supports_bf16(device) if kind == "cuda" else (kind == "cpu" and cpu_has_native_bf16())
    bf16_possible = bf16_ok or kind in ("cpu", "mps")  # runs, if slowly, without native support
    if mode == "auto":
        if bf16_ok:
            chosen, reason = "bf16", "auto: device has native bf16"
        elif kind == "cuda":
            chosen, reason = "fp16", "auto: this GPU lacks bf16"
        else:
            chosen, reason = "fp32", f"auto: no native bf16 on {kind}"
    else:
        chosen, reason = mode, "requested"
        if mode == "bf16" and not bf16_possible:
            warnings.append(f"precision.mode bf16 is not supported on {device}; falling back to fp32")
            chosen, reason = "fp32", "bf16 unsupported here"
        elif mode == "fp16" and kind == "cpu":
            warnings.append("precision.mode fp16 autocast is not useful on CPU; falling back to fp32")
            chosen, reason = "fp32", "fp16 unsupported on cpu"
    param_dtype = torch.float32
    if dtype == "bfloat16":
        if chosen == "fp16":
            warnings.append(
                "precision.dtype bfloat16 with fp16 autocast is not supported; keeping fp32 parameters"
            )
        else:
            param_dtype = torch.bfloat16
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(chosen)
    if param_dtype == torch.bfloat16 and chosen == "bf16":
        autocast = None  # parameters already bf16: autocast adds only casts
    return PrecisionPlan(
        mode=chosen,
        autocast_dtype=autocast,
        device_type=kind,
        param_dtype=param_dtype,
        use_grad_scaler=chosen == "fp16" and kind == "cuda",
        reason=reason,
        warnings=warnings,
    )
