"""Third-party lines that tell the user nothing to act on, kept out of their terminal.

`torch.compile` on a machine without a CUDA runtime — a CPU machine with a CUDA build of torch and a
CUDA toolkit installed (CUDA_HOME or /usr/local/cuda) — logs "No CUDA runtime is found, using
CUDA_HOME=..." from torch.utils.cpp_extension on every compile. It is not a problem: the compile is for
the CPU and the toolkit is simply not used. `quiet_third_party()` (called by engine/logs.setup_logging,
i.e. at every CLI entry point) drops that line and says once, in our words and at debug level, what it
meant. Every other record of those loggers passes unchanged.

Never imports torch: a filter on a logger by name works before (and without) torch being imported.
"""

from __future__ import annotations

import logging

# logger name -> (the start of the line dropped, what it means in our words)
NOISE: dict[str, tuple[str, str]] = {
    "torch.utils.cpp_extension": (
        "No CUDA runtime is found",
        "torch: no CUDA runtime on this machine, so the CUDA toolkit at %s is not used; compiling for "
        "the CPU (nothing to fix)",
    ),
}


class _Noise(logging.Filter):
    """Drops one known line of one third-party logger; explains it once on the speedtronic logger."""

    def __init__(self, start: str, meaning: str) -> None:
        super().__init__()
        self.start, self.meaning, self.said = start, meaning, False

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.start):
            return True
        if not self.said:
            self.said = True
            where = record.args[0] if isinstance(record.args, tuple) and record.args else "CUDA_HOME"
            logging.getLogger("speedtronic").debug(self.meaning, where)
        return False


def quiet_third_party() -> None:
    """Install the filters (once per logger, however often it is called)."""
    for name, (start, meaning) in NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Noise) for f in logger.filters):
            logger.addFilter(_Noise(start, meaning))
