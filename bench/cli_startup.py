"""CLI start-up: wall time of `speedtronic --help` against `python -c "import typer"`, same machine, same run.

    python bench/cli_startup.py [--repeats 7]

Prints the median of each and their ratio; a ratio near 1 means the command suite adds little beyond
Typer itself (no torch import on the --help path).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def median_seconds(command: list[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    baseline = median_seconds([sys.executable, "-c", "import typer"], args.repeats)
    ours = median_seconds([sys.executable, "-m", "speedtronic", "--help"], args.repeats)
    print(f"python -c 'import typer': {baseline * 1000:.0f} ms (median of {args.repeats})")
    print(f"speedtronic --help:        {ours * 1000:.0f} ms (median of {args.repeats})")
    print(f"ratio speedtronic --help / import typer: {ours / baseline:.2f}")


if __name__ == "__main__":
    main()
