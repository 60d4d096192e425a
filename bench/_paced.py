"""A paced `speedtronic` process: the real command line, each training step taking at least `--step-s`.

    PYTHONPATH=src python bench/_paced.py --step-s 0.25 [--first-step FILE] -- worker CONFIG --repo ... --json

Why: a soak (bench/chaos.py) or an uneven-peers bench compares swarms whose processes share a few
cores. Paced to a fixed step rate well under each process's share of the CPU, a worker's throughput is
its pace, not what the others leave it: a killed peer's freed CPU does not flatter the survivors, and
1×/2×/4× peers are 1×/2×/4× whatever else runs. The pace is kept by sleeping before a step until
`--step-s` has passed since the previous one began (a step that took longer is not made up for).

`--first-step FILE`: the wall-clock time (time.time()) of this process's first training step is written
there, for a joiner's time from its first step to its first applied delta.

It runs the normal command line in this process (the interrupt handlers first, as `python -m
speedtronic` does) with `Trainer.train_step` wrapped; nothing else changes. It lives outside src/ on
purpose: pacing is a bench's need, not a user's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any


def install(step_s: float, first_step: Path | None) -> None:
    from speedtronic.engine.trainer import Trainer

    real = Trainer.train_step
    last = [0.0]

    def paced(self: Trainer) -> Any:
        now = time.monotonic()
        if last[0]:
            wait = last[0] + step_s - now
            if wait > 0:
                time.sleep(wait)
        elif first_step is not None:
            first_step.write_text(f"{time.time():.3f}\n")
        last[0] = time.monotonic()
        return real(self)

    Trainer.train_step = paced  # type: ignore[method-assign]


def main() -> None:
    argv = sys.argv[1:]
    if "--" not in argv:
        raise SystemExit("usage: _paced.py --step-s S [--first-step FILE] -- worker|master ...")
    split = argv.index("--")
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--step-s", type=float, required=True, help="the least seconds per training step")
    parser.add_argument("--first-step", type=Path, default=None, help="write the first step's wall time here")
    args = parser.parse_args(argv[:split])

    from speedtronic import interrupts

    interrupts.install()
    install(args.step_s, args.first_step)
    from speedtronic.cli import main as cli_main

    sys.argv = ["speedtronic", *argv[split + 1 :]]
    cli_main()


if __name__ == "__main__":
    main()
