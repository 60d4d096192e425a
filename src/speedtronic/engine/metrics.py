"""Training metrics: throughput over a logging window, memory, and model FLOPs utilisation (MFU).

MFU = tokens/s × FLOPs per token / device peak, with FLOPs per token = 6·N_matmul + 12·L·H·d_head·T
(the PaLM/nanoGPT convention). It is reported only where the device's peak is known.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass, field

import torch
from torch import nn


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """The model's own estimate when it has one, else 6 × parameters (no attention term)."""
    method = getattr(model, "flops_per_token", None)
    if callable(method):
        return float(method(seq_len))
    return 6.0 * sum(p.numel() for p in model.parameters())


def memory_stats(device: torch.device) -> dict[str, float]:
    """Peak memory in MiB: allocator peak on CUDA, process peak RSS elsewhere."""
    if device.type == "cuda":
        return {
            "mem_alloc_mib": torch.cuda.max_memory_allocated(device) / 2**20,
            "mem_reserved_mib": torch.cuda.max_memory_reserved(device) / 2**20,
        }
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
    return {"mem_rss_mib": peak * scale / 2**20}


def reset_memory_peak(device: torch.device) -> None:
    """Start the CUDA allocator's peak afresh, so a run's `mem_alloc_mib` is its own and not the peak of
    an earlier run in the same process (a sweep, bench/gpu.py). What is allocated now still counts."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


@dataclass
class Throughput:
    """Tokens over wall-clock time, by logging window and in total; eval and checkpoints are excluded.

    Timing is wall-clock between points where the caller has synchronised with the device (reading
    the loss with .item() does that), so asynchronous CUDA work is counted where it really happens.
    """

    total_tokens: int = 0
    total_time: float = 0.0
    _window_tokens: int = 0
    _window_steps: int = 0
    _elapsed_window: float = 0.0
    _mark: float | None = field(default=None, repr=False)

    def resume(self) -> None:
        """Start (or restart after a pause) the clock."""
        self._mark = time.perf_counter()

    def pause(self) -> None:
        """Stop the clock (before eval or a checkpoint); the window keeps its tokens."""
        if self._mark is not None:
            self._elapsed_window = self._elapsed_window + time.perf_counter() - self._mark
            self._mark = None

    def add(self, tokens: int) -> None:
        self._window_tokens += tokens
        self._window_steps += 1

    def take_window(self) -> tuple[float, float]:
        """(tokens/s, seconds per step) since the last window; the clock keeps running."""
        self.pause()
        elapsed = self._elapsed_window
        self._elapsed_window = 0.0
        self.resume()
        self.total_tokens += self._window_tokens
        self.total_time += elapsed
        tps = self._window_tokens / elapsed if elapsed > 0 else 0.0
        step_time = elapsed / self._window_steps if self._window_steps else 0.0
        self._window_tokens = self._window_steps = 0
        return tps, step_time

    @property
    def tokens_per_s(self) -> float:
        return self.total_tokens / self.total_time if self.total_time > 0 else 0.0


def peak_memory_bytes(device: torch.device) -> int | None:
    """This process's peak memory: CUDA's allocator peak, else the resident set's high-water mark."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)
    except (ImportError, OSError):
        return None
