"""User-facing entry points: the `visar` CLI (and later the batch script and the demo)."""
