"""Out-of-order backward (`ooo_backprop`): run independent branches of the model on separate CUDA streams.

Autograd runs each backward op on the stream its forward op ran on, and inserts the cross-stream waits
itself when a gradient flows from one stream to another (PyTorch "CUDA semantics: stream semantics of
backward passes"). So if independent forward work is issued on different streams, the backward pass
can overlap the matching backward work too. This module does the forward half:

1. Trace. On the first forward call, hooks on every leaf module with parameters record which tensor
   object each one reads. Modules that read the *same* tensor, each called once, are independent
   branches of one fork (in the reference transformer: q/k/v projections of a block; gate/up of its MLP).
   The trace is generic: plugin models are partitioned from what they actually do, not from names.
   Why not contiguous groups of blocks, one per stream: in a chain each group's backward needs the
   gradient of the group after it, so such stages would only add waits, never overlap.
2. Plan (`plan_streams`). Member j of a fork runs on stream j mod `ooo_streams`; stream 0 is the caller's
   own stream, so the first branch never moves. Forks are disjoint: every module is in at most one.
3. Sync, per side-stream member (the order is what `RecordingStreamOps` shows):
   before its forward   side.wait_stream(caller)      the input was produced on the caller's stream;
                        input.record_stream(side)     the allocator must not reuse the input's memory
                                                      until the side stream is done reading it;
   after its forward    caller.wait_stream(side)      the consumer waits for the producer;
                        output.record_stream(caller)  the output was allocated on the side stream and
                                                      is read (and freed) on the caller's.
   Backward needs nothing more: autograd syncs streams for the gradients it moves, and `loss.backward()`
   returns with the gradients safe to use on the calling stream.

Results equal the sequential path: the same kernels run on the same data, only on other queues. On CPU
the scheduler is exercised with `RecordingStreamOps` (tests/test_streams.py proves losses and gradients
bitwise equal to the plain model and checks the sync order above).

Why it is off by default, honestly: we have not measured a speed-up on a GPU. Forks in a transformer are
small (three projections, two MLP matmuls) and a large GEMM already fills an H100/H200 by itself, so
overlap can only help when each matmul is too small to fill the GPU (small d_model, small micro batch)
and it costs two stream waits per side branch per step in each direction. `python bench/streams.py` on a
GPU measures step time with and without it and prints the ratio; turn it on only where that ratio is
above 1. It is a no-op (with a log line) on CPU and MPS, under torch.compile (stream switches in hooks
break graphs) and with gradient checkpointing (recomputation would replay the switches inside backward).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

logger = logging.getLogger("speedtronic.streams")


class StreamOps(Protocol):
    """The five stream operations the scheduler uses; CUDA issues them, the recorder logs them."""

    def current(self) -> Any: ...
    def new(self, index: int) -> Any: ...
    def use(self, stream: Any) -> None: ...
    def wait(self, consumer: Any, producer: Any) -> None: ...
    def record(self, tensor: torch.Tensor, stream: Any, what: str) -> None: ...


class CudaStreamOps:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def new(self, index: int) -> Any:
        return torch.cuda.Stream(self.device)

    def use(self, stream: Any) -> None:
        torch.cuda.set_stream(stream)

    def wait(self, consumer: Any, producer: Any) -> None:
        consumer.wait_stream(producer)

    def record(self, tensor: torch.Tensor, stream: Any, what: str) -> None:
        if tensor.is_cuda:
            tensor.record_stream(stream)


class RecordingStreamOps:
    """Stream operations that only log what they would do: runs the scheduler's code path on any device.

    Streams are the strings "s0" (the caller's), "s1", ...; `log` holds tuples such as
    ("wait", "s1", "s0"), ("record", "blocks.0.attn.k_proj:in", "s1"), ("use", "s1").
    """

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self._current = "s0"

    def current(self) -> str:
        return self._current

    def new(self, index: int) -> str:
        return f"s{index}"

    def use(self, stream: str) -> None:
        self._current = stream
        self.log.append(("use", stream))

    def wait(self, consumer: str, producer: str) -> None:
        self.log.append(("wait", consumer, producer))

    def record(self, tensor: torch.Tensor, stream: str, what: str) -> None:
        self.log.append(("record", what, stream))


@dataclass
class StreamPlan:
    """Forks found by the trace and the stream each branch runs on (0: the caller's stream)."""

    forks: list[list[str]]
    stream_of: dict[str, int] = field(default_factory=dict)

    @property
    def side_branches(self) -> int:
        return sum(1 for index in self.stream_of.values() if index > 0)

    def describe(self) -> str:
        if not self.forks:
            return "no independent branches found: everything stays on one stream"
        example = ", ".join(f"{name}→s{self.stream_of[name]}" for name in self.forks[0])
        return f"{len(self.forks)} forks, {self.side_branches} branches on side streams (e.g. {example})"


def plan_streams(forks: list[list[str]], n_streams: int) -> StreamPlan:
    """Branch j of each fork runs on stream j mod n_streams; forks must be disjoint."""
    if n_streams < 1:
        raise ValueError(f"n_streams must be >= 1, got {n_streams}")
    seen: set[str] = set()
    plan = StreamPlan(forks=[list(f) for f in forks])
    for fork in forks:
        for j, name in enumerate(fork):
            if name in seen:
                raise ValueError(f"module {name} is in two forks; forks must be disjoint")
            seen.add(name)
            plan.stream_of[name] = j % n_streams
    return plan


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _leaf_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, module in model.named_modules():
        if name and not any(True for _ in module.children()) and any(True for _ in module.parameters(False)):
            yield name, module


class StreamScheduler:
    """Traces forks on the first forward, then runs side branches on side streams (see module doc)."""

    def __init__(self, model: nn.Module, n_streams: int, ops: StreamOps) -> None:
        self.model, self.n_streams, self.ops = model, n_streams, ops
        self.plan: StreamPlan | None = None
        self.streams: list[Any] = []
        self._handles: list[Any] = []
        self._trace_handles: list[Any] = []
        self._calls: dict[str, list[torch.Tensor]] = {}
        self._callers: dict[int, Any] = {}

    # -- tracing ---------------------------------------------------------------------------------
    def attach(self) -> StreamScheduler:
        self._handles.append(self.model.register_forward_pre_hook(self._start_trace))
        self._handles.append(self.model.register_forward_hook(self._finish_trace, always_call=True))
        return self

    def _start_trace(self, module: nn.Module, args: Any) -> None:
        if self.plan is not None or self._trace_handles:
            return
        for name, leaf in _leaf_modules(self.model):
            self._trace_handles.append(leaf.register_forward_pre_hook(self._recorder(name)))

    def _recorder(self, name: str) -> Any:
        def record(module: nn.Module, args: Any) -> None:
            first = next(_tensors(args), None)
            # Keep the tensor itself (not its id) so no id is reused by another tensor during the trace.
            self._calls.setdefault(name, []).append(first)  # type: ignore[arg-type]

        return record

    def _finish_trace(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.plan is not None or not self._trace_handles:
            return
        for handle in self._trace_handles:
            handle.remove()
        self._trace_handles = []
        by_input: dict[int, list[str]] = {}
        for name, inputs in self._calls.items():  # dicts keep call order
            if len(inputs) == 1 and inputs[0] is not None:
                by_input.setdefault(id(inputs[0]), []).append(name)
        self._calls = {}
        self.install(plan_streams([names for names in by_input.values() if len(names) > 1], self.n_streams))
        logger.info("ooo_backprop: %s", self.plan.describe() if self.plan else "")

    # -- scheduling ------------------------------------------------------------------------------
    def install(self, plan: StreamPlan) -> None:
        """Put each side branch of `plan` on its stream (also usable without a trace)."""
        self.plan = plan
        self.streams = [None] + [self.ops.new(i) for i in range(1, self.n_streams)]
        modules = dict(self.model.named_modules())
        for name, index in plan.stream_of.items():
            if index == 0:
                continue
            module = modules[name]
            self._handles.append(module.register_forward_pre_hook(self._enter(name, index)))
            self._handles.append(module.register_forward_hook(self._leave(name, index), always_call=True))

    def _enter(self, name: str, index: int) -> Any:
        ops = self.ops

        def enter(module: nn.Module, args: Any) -> None:
            caller, side = ops.current(), self.streams[index]
            self._callers[id(module)] = caller
            ops.wait(side, caller)  # the input is ready on the caller's stream
            # Don't let the allocator reuse the input's memory before the side stream has read it.
            for tensor in _tensors(args):
                ops.record(tensor, side, f"{name}:in")
            ops.use(side)

        return enter

    def _leave(self, name: str, index: int) -> Any:
        ops = self.ops

        def leave(module: nn.Module, args: Any, output: Any) -> None:
            caller, side = self._callers.pop(id(module)), self.streams[index]
            ops.use(caller)
            ops.wait(caller, side)  # the consumer waits on the producer
            # Allocated on the side stream, read and freed on the caller's.
            for tensor in _tensors(output):
                ops.record(tensor, caller, f"{name}:out")

        return leave

    def detach(self) -> None:
        for handle in self._handles + self._trace_handles:
            handle.remove()
        self._handles, self._trace_handles = [], []


def maybe_enable(
    model: nn.Module, config: Any, device: torch.device, gradient_checkpointing: bool = False
) -> StreamScheduler | None:
    """The trainer's call when `ooo_backprop` is set: a scheduler on CUDA, else a logged no-op."""
    if not config.ooo_backprop:
        return None
    reason = None
    if device.type != "cuda":
        reason = f"CUDA streams only; running sequentially on {device.type}"
    elif config.ooo_streams < 2:
        reason = "ooo_streams is 1: there is no second stream"
    elif config.compile.enabled is True:
        reason = "not combined with torch.compile"
    elif gradient_checkpointing:
        reason = "not combined with gradient checkpointing"
    if reason:
        logger.info("ooo_backprop is a no-op: %s", reason)
        return None
    logger.info(
        "ooo_backprop: %d CUDA streams; independent branches are traced on the first forward",
        config.ooo_streams,
    )
    return StreamScheduler(model, config.ooo_streams, CudaStreamOps(device)).attach()
