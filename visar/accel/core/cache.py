"""visar's cache folder, for what is derived once and read by later processes: `auto`'s timings
(policy/cost_store.py) and the relaxed methods' codebook neighbours (codebook.py)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where visar caches derived data: $VISAR_CACHE, else ~/.cache/visar."""
    return Path(os.environ.get("VISAR_CACHE") or Path.home() / ".cache" / "visar")
