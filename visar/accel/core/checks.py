"""Checks of method options shared by the methods of every kind: one VisarError naming the option."""

from __future__ import annotations

import math

from ...errors import VisarError


def check_number(
    name: str, value, minimum: float, *, maximum: float | None = None, integer: bool = False, allow_none: bool = False
):
    if value is None and allow_none:
        return
    kinds = (int,) if integer else (int, float)
    ok = isinstance(value, kinds) and not isinstance(value, bool) and math.isfinite(value) and value >= minimum
    if not ok or (maximum is not None and value > maximum):
        kind = "an integer" if integer else "a number"
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise VisarError(f"{name} must be {kind} {bounds}, got {value!r}")


def check_flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise VisarError(f"{name} must be true or false, got {value!r}")
    return value


def check_choice(name: str, value, choices) -> None:
    if not isinstance(value, str) or value not in choices:
        raise VisarError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def check_budget(budget, method: str, number: str = "rows per pass") -> int | None:
    """A method's `budget`: None (its own size) or a whole number of `number` >= 1, the size of every
    pass; else one VisarError. Every pass has the same size: a per-pass choice ("auto") lost to the
    best fixed size on every method it ran (docs/SPEED.md), and `method="auto"` times fixed sizes."""
    if budget is None or (isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1):
        return budget
    if budget == "auto":
        raise VisarError(
            f"budget='auto' is gone (a size chosen per pass lost to the best fixed size, docs/SPEED.md): give "
            f"{method} a whole number of {number} >= 1, or use method='auto', which times fixed sizes on your machine"
        )
    raise VisarError(f"budget for {method} must be a whole number of {number} >= 1, or None; got {budget!r}")
