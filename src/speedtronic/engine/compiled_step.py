"""The model the training loop calls: torch.compile'd when the plan says so, with an eager fallback.

    step = CompiledStep(run.model, config.compile, run.counters, run.optimizer)
    step.start(plan.compile)                    # compile once the step range is final
    loss, grad_norm, tokens = step.run(trainer.train_step, meter)

A compiled step that fails — the first compilation or a recompilation at any later step — is retried
eagerly with the same batches and RNG state, and the run goes on eagerly: nothing is lost. For that
the step records the batches it draws while compiled (`take_batch`) and hands them to the retry. The
first compiled step is timed on its own (compile_s), so compilation never enters the throughput.

`warm` compiles ahead of the first step instead (a DiLoCo worker, whose global model downloads
meanwhile: engine/trainer.py): one forward and backward of the first batch, whose gradients and RNG
draws are then undone and whose batch the first step takes again, so the steps and their losses are
those of a run that compiled in its first step.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from speedtronic.engine.checkpoint.stateful import TrainCounters
from speedtronic.engine.compile_plan import compile_model
from speedtronic.engine.metrics import Throughput

logger = logging.getLogger("speedtronic.train")

StepResult = tuple[torch.Tensor, torch.Tensor | None, int]


class CompiledStep:
    """The compile state of one run: the model to call, whether it is compiled, and why not."""

    def __init__(
        self, eager: nn.Module, options: Any, counters: TrainCounters, optimizer: torch.optim.Optimizer
    ) -> None:
        self.eager = eager  # the parallel wrap (DDP) or the model itself
        self.model: nn.Module = eager
        self.options = options  # the config's compile section
        self.counters = counters
        self.optimizer = optimizer
        self.compiled = False
        self.compile_s: float | None = None  # the first compiled step, compilation included
        self.failure: str | None = None  # why the run trains eagerly after asking to compile
        self._recording: list[Any] | None = None  # this step's batches, kept while compiled
        self._replay: deque[Any] = deque()

    def start(self, wanted: bool) -> None:
        """Compile the model (once) when the plan says so; a compile that fails at once is logged. A
        compilation that failed (here, in `warm` or in a step) is not tried again."""
        if not wanted or self.compiled or self.failure is not None:
            return
        compiled = compile_model(self.eager, self.options)
        if compiled is not None:
            self.model, self.compiled = compiled, True
        else:
            self.failure = "torch.compile failed: trained eagerly"

    def warm(
        self, forward_backward: Callable[[Any], torch.Tensor], fetch: Callable[[], Any], device: torch.device
    ) -> None:
        """Compile now rather than in the first step (see the module's docstring); a compilation that
        fails leaves the run eager, as one that fails in a step does."""
        if not self.compiled or self.compile_s is not None:
            return
        logger.info("torch.compile: compiling ahead of the first step (this can take a minute)…")
        batch = fetch()
        self._replay.append(batch)  # the first step's batch (take_batch): the data is where it was
        started = time.perf_counter()
        cuda = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda, device_type=device.type):  # dropout's draws undone
            try:
                forward_backward(batch).item()  # .item(): wait for the device, the time is complete
            except Exception as error:
                logger.warning(
                    "torch.compile failed before the first step (%s: %s); training eagerly",
                    type(error).__name__,
                    (str(error).splitlines() or [""])[0][:200],
                )
                self.model, self.compiled = self.eager, False
                self.failure = "torch.compile failed before the first step: trained eagerly"
            finally:  # every gradient the pass made, also of parameters no optimizer steps
                for param in self.eager.parameters():
                    param.grad = None
        if self.compiled:
            self.compile_s = time.perf_counter() - started
            logger.info("torch.compile: compiled ahead of the first step in %.1f s", self.compile_s)

    def take_batch(self, fetch: Callable[[], Any]) -> Any:
        """The next batch: a failed compiled step's again (for its eager retry), else `fetch()`'s."""
        batch = self._replay.popleft() if self._replay else fetch()
        if self._recording is not None:
            self._recording.append(batch)
        return batch

    def run(self, train_step: Callable[[], StepResult], meter: Throughput) -> StepResult:
        """One step; compiled steps are guarded so that a failing compilation falls back to eager."""
        if not self.compiled:
            result = train_step()
            meter.add(result[2])
            return result
        first = self.compile_s is None
        if first:  # timed on its own: compilation is reported as compile_s, not in the throughput
            meter.pause()
            started = time.perf_counter()
        result = self._guarded(train_step)
        if first:
            result[0].item()  # wait for the device, so the compile time is complete
            if self.compiled:
                self.compile_s = time.perf_counter() - started
                logger.info("torch.compile: first step took %.1f s (compilation included)", self.compile_s)
            meter.resume()
        else:
            meter.add(result[2])
        return result

    def _guarded(self, train_step: Callable[[], StepResult]) -> StepResult:
        before = (self.counters.state_dict(), torch.get_rng_state())
        self._recording = []
        try:
            return train_step()
        except Exception as error:  # a compilation (or recompilation) failed inside the step
            step = before[0]["step"] + 1
            logger.warning(
                "torch.compile failed at step %d (%s: %s); continuing eagerly from that step",
                step,
                type(error).__name__,
                (str(error).splitlines() or [""])[0][:200],
            )
            self.model, self.compiled = self.eager, False
            self.failure = f"torch.compile failed at step {step}: trained eagerly from there"
            # The optimizer has not stepped (it runs after every forward/backward): undo the step's
            # gradients, counters and RNG draws, and give the eager retry the very same batches.
            self.optimizer.zero_grad(set_to_none=True)
            self.counters.load_state_dict(before[0])
            torch.set_rng_state(before[1])
            self._replay.extend(self._recording)
            self._recording = None
            return train_step()
        finally:
            self._recording = None

    def reason(self, planned: str) -> str:
        """Why the run is (not) compiled: a failure, else the plan's reason."""
        return self.failure or planned

    def describe(self, wanted: bool, planned: str) -> str:
        """The summary's word on compilation."""
        return self.failure or f"torch.compile {'on' if wanted else 'off'} ({planned})"
