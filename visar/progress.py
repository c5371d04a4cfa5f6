"""Progress bars: tqdm, hidden unless the caller asks for one (a decode's or an eval run's `progress`)."""

from __future__ import annotations

from tqdm.auto import tqdm


def progress_bar(
    iterable=None, *, enabled: bool, desc: str, total: int | None = None, unit: str = "it", leave: bool = False
):
    """A tqdm bar over `iterable` (or of `total` steps, moved by its update) that shows only when
    `enabled`. leave=False: a decode's bar goes away when it ends; eval runs keep theirs (leave=True)."""
    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=not enabled, leave=leave)
