"""`python -m speedtronic` and the `speedtronic` console script: the command suite (and what torchrun
launches). The interrupt handlers go in first, before the suite, typer, rich or torch is imported, so a
signal at any point of start-up ends with the documented exit code (speedtronic/interrupts.py)."""

import os
import sys

from speedtronic import interrupts

interrupts.install()

try:
    from speedtronic.cli import main
except KeyboardInterrupt:  # a signal while the command suite itself was being imported
    sys.stderr.write("interrupted\n")
    if "--json" in sys.argv:
        sys.stdout.write('{"error": "interrupted", "exit_code": 130}\n')
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)

__all__ = ["main"]

if __name__ == "__main__":
    main()
