"""Plots of `visar bench` reports, drawn with PIL (no plotting library needed).

- `plot_sweep`: a `visar bench --sweep` report, step compression (image tokens / forward passes
  per image) on x and each quality column on y: the shapes detector's accuracy and the Frechet
  distance to AR's images in the tokenizer-latent space, with AR's own point (and, for the
  Frechet distance, its noise floor: AR against a second AR sample set).
- `plot_frontier`: a bench report's frontier.png, every method's speed against each quality
  column, lossless methods filled, lossy ones open, the Pareto frontier joined.

This module imports neither `bench` nor `sweep`: both use it.
"""

from __future__ import annotations

import math
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from ..errors import VisarError

QUALITY_COLUMNS = (
    ("detector_accuracy", "detector accuracy"),
    ("geneval_overall", "GenEval-style overall"),
    ("frechet_vs_ar", "Frechet distance vs AR"),
)


# -- panels ------------------------------------------------------------------------------------------


def _font(size: int):
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: one fixed-size bitmap font
        return ImageFont.load_default()


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About `count` round tick values covering [low, high]."""
    if not math.isfinite(low) or not math.isfinite(high):
        return [0.0, 1.0]
    if high - low < 1e-12:
        low, high = low - 0.5 * (abs(low) or 1), high + 0.5 * (abs(high) or 1)
    raw = (high - low) / count
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 2.5, 5, 10) if m * step >= raw)
    first = math.floor(low / step) * step
    ticks = [first + i * step for i in range(int(math.ceil((high - first) / step - 1e-9)) + 1)]
    return [round(t, 10) for t in ticks]


STEP_COMPRESSION = "step compression (tokens / forward pass)"


def _panel(
    draw: ImageDraw.ImageDraw,
    box,
    points,
    reference,
    floor,
    title,
    font,
    small,
    *,
    xlabel: str = STEP_COMPRESSION,
    path: list[int] | None = None,
    hollow: list[bool] | None = None,
):
    """Scatter of (x, y, label), AR's point, an optional horizontal noise floor.

    path: indices of the points joined by a line, in order (default: all of them, the sweep's
    curve); hollow: per point, True draws an open marker (the frontier's lossy methods).
    """
    left, top, right, bottom = box
    plot = (left + 70, top + 30, right - 20, bottom - 50)
    xs = [p[0] for p in points] + [reference[0]]
    ys = [p[1] for p in points] + [reference[1]] + ([floor] if floor is not None else [])
    xt, yt = nice_ticks(min(xs), max(xs)), nice_ticks(min(ys), max(ys))

    def at(x, y):
        fx = (x - xt[0]) / (xt[-1] - xt[0])
        fy = (y - yt[0]) / (yt[-1] - yt[0])
        return plot[0] + fx * (plot[2] - plot[0]), plot[3] - fy * (plot[3] - plot[1])

    draw.text(((left + right) / 2, top + 4), title, fill="black", font=font, anchor="ma")
    draw.rectangle(plot, outline="black")
    for x in xt:
        px, _ = at(x, yt[0])
        draw.line([(px, plot[3]), (px, plot[3] + 5)], fill="black")
        draw.line([(px, plot[1]), (px, plot[3])], fill="#e6e6e6")
        draw.text((px, plot[3] + 8), f"{x:g}", fill="black", font=small, anchor="ma")
    for y in yt:
        _, py = at(xt[0], y)
        draw.line([(plot[0] - 5, py), (plot[0], py)], fill="black")
        draw.line([(plot[0], py), (plot[2], py)], fill="#e6e6e6")
        draw.text((plot[0] - 8, py), f"{y:g}", fill="black", font=small, anchor="rm")
    draw.text(((plot[0] + plot[2]) / 2, plot[3] + 28), xlabel, fill="black", font=small, anchor="ma")
    if floor is not None:
        _, py = at(xt[0], floor)
        for x0 in range(int(plot[0]), int(plot[2]), 12):
            draw.line([(x0, py), (min(x0 + 6, plot[2]), py)], fill="#888888")
        draw.text((plot[0] + 4, py - 3), "AR noise floor", fill="#666666", font=small, anchor="ld")
    pixels = [at(x, y) for x, y, _ in points]
    joined = [pixels[i] for i in (range(len(pixels)) if path is None else path)]
    if len(joined) > 1:
        draw.line(joined, fill="#1f77b4", width=2)
    placed: list[tuple[float, float]] = []
    for i, ((px, py), (_, _, label)) in enumerate(zip(pixels, points, strict=True)):
        if hollow is not None and hollow[i]:
            draw.ellipse([px - 4, py - 4, px + 4, py + 4], fill="white", outline="#1f77b4", width=2)
        else:
            draw.ellipse([px - 4, py - 4, px + 4, py + 4], fill="#1f77b4")
        below = sum(abs(px - qx) < 40 and abs(py - qy) < 14 for qx, qy in placed)  # stack near points' labels
        right = px > plot[2] - 110  # near the right edge: the label goes to the left of its point
        anchor, dx = ("rd", -6) if right else ("ld", 6)
        draw.text((px + dx, py - 6 + 14 * below), label, fill="#1f4e79", font=small, anchor=anchor)
        placed.append((px, py))
    rx, ry = at(*reference)
    draw.rectangle([rx - 4, ry - 4, rx + 4, ry + 4], fill="#d62728")
    draw.text((rx + 6, ry + 6), "AR", fill="#d62728", font=small, anchor="la")


# -- the sweep's plot --------------------------------------------------------------------------------


def plot_sweep(report: dict, path) -> Path:
    """Write the sweep's PNG: one panel per quality column measured, step compression on x."""
    info, rows = report["sweep"], report["rows"]
    ar_row, method_rows = rows[0], rows[1:]
    panels = [
        (key, title)
        for key, title in QUALITY_COLUMNS
        if ar_row.get(key) is not None and all(r.get(key) is not None for r in method_rows)
    ]
    if not panels:
        raise VisarError("nothing to plot: the sweep measured no quality column (run it with --quality-n)")
    width, height = 520 * len(panels), 470
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    font, small = _font(16), _font(12)
    header = f"{report['model']}: {info['method']} over {info['option']} ({report['settings']['quality_n']} images)"
    draw.text((width / 2, 8), header, fill="black", font=font, anchor="ma")
    for i, (key, title) in enumerate(panels):
        points = [(r["step_compression"], r[key], f"{info['option']}={r[info['option']]}") for r in method_rows]
        # AR's Frechet entry is its noise floor (AR against other AR seeds); its own point sits at 0
        reference = (ar_row["step_compression"], 0.0 if key == "frechet_vs_ar" else ar_row[key])
        floor = ar_row[key] if key == "frechet_vs_ar" else None
        _panel(draw, (520 * i, 30, 520 * (i + 1), height), points, reference, floor, title, font, small)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path


# -- the bench report's frontier ---------------------------------------------------------------------

SPEED_UP = "speed-up vs AR (AR latency / method latency)"


def pareto_front(points: list[tuple[float, float, str]], lower_is_better: bool) -> list[int]:
    """Indices of the points that no other point beats on both x (higher is better) and y, by x."""
    sign = -1.0 if lower_is_better else 1.0

    def beaten(i):
        x, y, _ = points[i]
        return any(
            qx >= x and sign * qy >= sign * y and (qx > x or sign * qy > sign * y)
            for j, (qx, qy, _) in enumerate(points)
            if j != i
        )

    return sorted((i for i in range(len(points)) if not beaten(i)), key=lambda i: points[i][0])


def plot_frontier(report: dict, path) -> Path:
    """Write the bench report's PNG: every method's speed against each quality column, AR as reference.

    One panel per (speed axis, quality column): x is the wall-clock speed-up over AR (1 / latency
    ratio) or the step compression, y a quality column the run measured (with no quality column,
    one panel: speed-up against step compression). Filled markers are lossless methods, open
    markers lossy ones; the line joins the methods on the Pareto frontier (no other method both
    faster and better).
    """
    ar_row, method_rows = report["rows"][0], report["rows"][1:]
    columns = [(k, t) for k, t in QUALITY_COLUMNS if all(r.get(k) is not None for r in report["rows"])]
    speed = {"speed_up": lambda r: 1.0 / r["latency_ratio_vs_ar"], "step_compression": lambda r: r["step_compression"]}
    if columns:
        grid = [[(x, key, title) for key, title in columns] for x in ("speed_up", "step_compression")]
    else:
        grid = [[("step_compression", "speed_up", "speed-up vs AR")]]
    width, height = 520 * len(grid[0]), 60 + 440 * len(grid)
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    font, small = _font(16), _font(12)
    s = report["settings"]
    header = f"{report['model']}: {len(method_rows)} methods vs AR ({s['n']} images, batch {s['batch_size']})"
    draw.text((width / 2, 8), header, fill="black", font=font, anchor="ma")
    legend_y = 36
    draw.ellipse([20, legend_y - 4, 28, legend_y + 4], fill="#1f77b4")
    draw.text((34, legend_y), "lossless", fill="black", font=small, anchor="lm")
    draw.ellipse([110, legend_y - 4, 118, legend_y + 4], fill="white", outline="#1f77b4", width=2)
    draw.text((124, legend_y), "lossy", fill="black", font=small, anchor="lm")
    draw.rectangle([190, legend_y - 4, 198, legend_y + 4], fill="#d62728")
    draw.text((204, legend_y), "AR", fill="black", font=small, anchor="lm")
    draw.line([(240, legend_y), (262, legend_y)], fill="#1f77b4", width=2)
    draw.text((268, legend_y), "Pareto frontier", fill="black", font=small, anchor="lm")
    for row_index, row in enumerate(grid):
        for col_index, (x_key, y_key, title) in enumerate(row):
            y_of = speed[y_key] if y_key in speed else (lambda r, key=y_key: r[key])
            points = [(speed[x_key](r), y_of(r), r["method"]) for r in method_rows]
            reference = (speed[x_key](ar_row), 0.0 if y_key == "frechet_vs_ar" else y_of(ar_row))
            floor = ar_row[y_key] if y_key == "frechet_vs_ar" else None
            box = (520 * col_index, 50 + 440 * row_index, 520 * (col_index + 1), 50 + 440 * (row_index + 1))
            _panel(
                draw,
                box,
                points,
                reference,
                floor,
                title,
                font,
                small,
                xlabel=SPEED_UP if x_key == "speed_up" else STEP_COMPRESSION,
                path=pareto_front(points, lower_is_better=y_key == "frechet_vs_ar"),
                hollow=[not r["lossless"] for r in method_rows],
            )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path
