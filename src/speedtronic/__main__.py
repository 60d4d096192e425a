"""`python -m speedtronic` runs the command suite (and is what torchrun launches)."""

from speedtronic.cli import main

if __name__ == "__main__":
    main()
