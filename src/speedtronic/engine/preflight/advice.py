"""The start-up advisory: what the callers of `build_run` (the CLI's `train`, the public API, a DiLoCo
node) check on a run built from its config before it trains. `build_run` itself only builds.

Today that is the shape advisory (shapes.py): each dimension that misses the device's tensor-core
alignment is logged once, with the `--set` that fixes it. It never fails a run.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from speedtronic.engine.preflight import shapes

if TYPE_CHECKING:
    from torch import nn

    from speedtronic.engine.built_run import Run

logger = logging.getLogger("speedtronic.shapes")


def advise_at_startup(run: Run) -> None:
    """Log the start-up advice for `run`, whose model was built from its config (rank 0 only)."""
    if not run.dist.is_main or not run.config.shape_validation.enabled:
        return
    try:
        model = _model_as_built(run)
    except Exception as error:  # advice must never stop training
        logger.debug("shape validation skipped: %s", error)
        return
    shapes.warn_at_startup(
        run.config, model, run.device, run.precision, run.plan.data_vocab_size, run.registries
    )


def _model_as_built(run: Run) -> nn.Module:
    """The model with its full dims: fsdp sharded `raw_model`'s parameters in place, so a sharded run's
    model is built again on the meta device (same config, same factory, no memory)."""
    if not run.fsdp:
        return run.raw_model
    return shapes.build_meta_model(run.config, run.plan.data_vocab_size, run.registries)
