"""torch.compile of the model, and the measurements behind the `compile.enabled: auto` decision.

The decision itself is part of the run plan (`speedtronic.plan.choose_compile`), since it weighs the
steps this process will run. `true`/`false` are obeyed. `auto` (the default) compiles where compilation has been measured to pay
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

What is compiled is the model's forward (its backward follows through AOTAutograd) — one graph, no
graph breaks for the reference Transformer; the loss bookkeeping, clipping and the optimizer step
stay eager, as in a hand-written compiled loop (bench/overhead.py measures the two side by side).
Evaluation runs the eager module: under no_grad and eval() a compiled forward is a second graph
(`GLOBAL_STATE changed: grad_mode`). Measured on a CPU with native bf16 (4 layers × 256, 8 batches
of 16×256, one thread): ~40 s of inductor with a cold cache (2.6 s from a warm one) for an eval pass
of 1.9 CPU s against 2.3 eager — about 50 evaluations of 16 batches to earn back a cold compile,
more than a run makes; and an eager eval cannot fail on a (re)compilation mid-run.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)


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
