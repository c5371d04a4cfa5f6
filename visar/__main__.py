"""`python -m visar ...`, the same as the `visar` command (and what `torchrun -m visar ...` runs)."""

import sys

from .apps.cli import main

if __name__ == "__main__":
    sys.exit(main())
