"""`python -m harness` is the `mxval` command."""
import sys

from harness.commands.cli import main

sys.exit(main())
