"""Device selection and what the device can do: native bf16, fused kernels, peak FLOP/s for MFU.

torch is imported inside the functions that need it: `validate` plans a CPU run with
`facts_for_spec` alone, and importing torch costs seconds (the CLI's --help and validate stay fast).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from speedtronic.errors import ConfigError
from speedtronic.hardware import cpu_has_native_bf16, cuda_supports_bf16
from speedtronic.plan import DeviceFacts

if TYPE_CHECKING:
    import torch

    from speedtronic.engine.parallel.distributed import World

# Dense bf16 tensor-core peaks (FLOP/s) by GPU name fragment; MFU is only reported where we know it.
_GPU_BF16_PEAK = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 70e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
}


def open_world(spec: str) -> World:
    """Resolve `run.device`, join the process group torchrun describes (if any) and take this rank's
    own device: where the run trains."""
    from speedtronic.engine.parallel.distributed import World, init_distributed

    device = resolve_device(spec)
    dist = init_distributed(device)
    return World(dist, dist.device(device))


def resolve_device(spec: str) -> torch.device:
    """Turn `run.device` (auto | cpu | cuda[:N] | mps) into a torch.device, checking it exists."""
    import torch

    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"run.device: {spec} requested but CUDA is not available here; use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"run.device: {spec} does not exist ({torch.cuda.device_count()} CUDA devices)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("run.device: mps requested but not available here; use --device cpu")
    return device


def device_facts(device: torch.device) -> DeviceFacts:
    """What the run plan needs to know about `device` (see speedtronic.plan)."""
    memory = device_memory(device)
    native = (
        cuda_supports_bf16(device)
        if device.type == "cuda"
        else (device.type == "cpu" and cpu_has_native_bf16())
    )
    return DeviceFacts(str(device), native_bf16=native, memory_bytes=memory)


def facts_for_spec(spec: str) -> DeviceFacts:
    """`device_facts(resolve_device(spec))`, without importing torch when the run is on the CPU for
    sure: `cpu`, or `auto` on a Linux host with no GPU driver (no /dev/nvidia*, no ROCm /dev/kfd), where
    torch would find no CUDA device either."""
    if spec == "cpu" or (spec == "auto" and not _gpu_possible()):
        return DeviceFacts("cpu", native_bf16=cpu_has_native_bf16(), memory_bytes=_host_memory())
    return device_facts(resolve_device(spec))


def _gpu_possible() -> bool:
    if not sys.platform.startswith("linux"):
        return True  # macOS (MPS) or elsewhere: let torch say
    dev = Path("/dev")
    return Path("/proc/driver/nvidia").exists() or (dev / "kfd").exists() or any(dev.glob("nvidia*"))


def _host_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def device_memory(device: torch.device) -> int | None:
    """Total memory of the GPU, or the host's RAM for the CPU (None when unknown)."""
    try:
        if device.type == "cuda":
            import torch

            return int(torch.cuda.get_device_properties(device).total_memory)
        if device.type == "cpu":
            return _host_memory()
    except (ValueError, OSError, RuntimeError, AttributeError):
        pass
    return None


def make_deterministic(device: torch.device) -> None:
    """What run.deterministic costs, for bitwise-identical runs and resumes: torch's deterministic
    algorithms (an error where an op has none), one intra-op compute thread (kernels split their
    reductions by thread count), no cuDNN autotuning; the plan has already chosen fp32 and eager."""
    import torch

    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak FLOP/s of a known GPU, or None (then MFU is not reported)."""
    if device.type != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    for fragment, peak in sorted(_GPU_BF16_PEAK.items(), key=lambda kv: -len(kv[0])):
        if fragment in name:
            return peak
    return None


def describe_device(device: torch.device) -> str:
    import torch

    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    if device.type == "cpu":
        return f"cpu ({torch.get_num_threads()} threads{', native bf16' if cpu_has_native_bf16() else ''})"
    return str(device)
