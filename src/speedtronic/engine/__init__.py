"""The training engine: model, data, precision, trainer, checkpoints and metrics."""
