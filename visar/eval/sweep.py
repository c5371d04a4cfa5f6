"""`visar bench --sweep`: one method over several values of one option.

Every value is a row of the `visar bench` table (same images, seeds and quality columns, AR run
once as the reference); `visar.eval.plots.plot_sweep` draws the report's speed against quality.
"""

from __future__ import annotations

import json

from ..accel import reference_method
from ..errors import VisarError
from .bench import bench


def parse_sweep(text: str) -> tuple[str, list]:
    """`OPTION=V1,V2,...` -> (option, [values]), each value read as JSON when it parses."""
    if "=" not in text:
        raise VisarError(f"--sweep takes OPTION=V1,V2,... (e.g. delta=0,0.05,0.1), got {text!r}")
    option, raw = text.split("=", 1)
    values = []
    for item in raw.split(","):
        item = item.strip()
        try:
            values.append(json.loads(item))
        except json.JSONDecodeError:
            values.append(item)
    if not option.strip() or not values or values == [""]:
        raise VisarError(f"--sweep needs an option name and at least one value, got {text!r}")
    return option.strip().replace("-", "_"), values


def sweep(
    pipe, method: str, option: str, values: list, *, options: dict | None = None, quality_n: int = 100, **bench_kw
) -> dict:
    """The reference (AR, or one token per step for a masked model), then `method` with option=value
    for each value -> a bench report whose method rows carry the swept value under `option`, plus
    report["sweep"] = {method, option, values}."""
    if method == reference_method(pipe.model):
        raise VisarError(f"--sweep runs one method besides the reference {method} (e.g. --methods lantern)")
    if quality_n < 2:
        raise VisarError("--sweep plots quality: give --quality-n >= 2 (>= 500 for reported figures)")
    base = dict(options or {})
    runs = [(method, {**base, option: value}) for value in values]
    report = bench(pipe, [], runs=runs, quality_n=quality_n, **bench_kw)
    for row, value in zip(report["rows"][1:], values, strict=True):
        row[option] = value
        row["method"] = f"{method} {option}={value}"
    report["sweep"] = {"method": method, "option": option, "values": values, "options": base}
    return report
