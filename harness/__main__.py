"""`python -m harness` is the `mxval` command."""
import sys

from .cli import main

sys.exit(main())
