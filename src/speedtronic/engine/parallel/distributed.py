"""Data parallel on torch.distributed: the process group, rank-aware helpers, and the `--nproc` launcher.

`torchrun --standalone --nproc-per-node N -m speedtronic train CONFIG` (or `speedtronic train CONFIG
--nproc N`, which runs exactly that through torch's launcher) starts N ranks. Each rank:

- joins the group (gloo on CPU, NCCL on CUDA; rank r uses cuda:LOCAL_RANK);
- reads its own share of the global batch stream: global micro-batch g goes to rank g mod N, so the
  union over ranks of one step's micro-batches is exactly what one process would read with the same
  `data.target_batch_size` — the loss curve matches a single process (up to float summation order);
- wraps the model in DistributedDataParallel (engine/parallel/wrap.py: gradients are averaged, and only
  on the last micro-batch of an accumulation);
- logs, runs hooks and writes checkpoints on rank 0 only. A checkpoint's data position counts the
  global stream, so a run resumes on another number of ranks when the global batch still divides.

Everything here is a no-op in a single process, so the trainer calls it unconditionally.
"""

from __future__ import annotations

import datetime
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger("speedtronic.distributed")


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device(self, device: torch.device) -> torch.device:
        """Each rank's own GPU; CPU ranks share the CPU."""
        if self.enabled and device.type == "cuda":
            return torch.device("cuda", self.local_rank)
        return device

    def all_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Mean of a tensor over ranks (the tensor itself when alone)."""
        if not self.enabled:
            return value
        out = value.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out / self.world_size

    def all_sum(self, value: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return value
        out = value.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    def any(self, flag: bool, device: torch.device) -> bool:
        """True on every rank when it is true on any (e.g. a signal that reached only some ranks)."""
        if not self.enabled:
            return flag
        value = torch.tensor(1.0 if flag else 0.0, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def broadcast_module(self, module: nn.Module, src: int = 0) -> None:
        """Copy rank `src`'s parameters and buffers to every rank (e.g. after installing new weights)."""
        if not self.enabled:
            return
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.data, src=src)

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


@dataclass(frozen=True)
class World:
    """Where this process trains: its place among the ranks and its own device (engine/device.py
    `open_world` joins it)."""

    dist: DistContext
    device: torch.device


def init_distributed(device: torch.device) -> DistContext:
    """Join the process group torchrun describes in the environment; a single process is left alone."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistContext()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    context = DistContext(rank=rank, local_rank=local_rank, world_size=world_size)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30))
        logger.info("rank %d/%d joined the %s process group", rank, world_size, backend)
    return context


def close_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def launch(nproc: int, argv: Sequence[str]) -> int:
    """Run `speedtronic ARGV` on `nproc` local ranks through torch's launcher; returns its exit code."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "speedtronic",
        *argv,
    ]
    logger.info("launching %d ranks: %s", nproc, " ".join(command[1:]))
    return subprocess.call(command)
