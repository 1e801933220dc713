"""`python -m harness` is the `mxval` command."""
import sys

from harness.commands.cli import main

if __name__ == "__main__":   # not when a worker process imports it
    sys.exit(main())
