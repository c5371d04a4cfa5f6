"""One comparison: the reference decoding and the chosen method on one seed, and what the page shows
of it (the images, the table, the heatmap of commit passes, the tokens committed per pass)."""

from __future__ import annotations

import math
import time
from concurrent.futures import Future

import torch
from PIL import Image, ImageDraw, ImageFont

from ...accel import get_method, reference_method
from ...accel.core.stats import per_image
from ...models.base import model_kind
from ...pipeline.shared_device import BatchImages
from .auto_account import auto_note
from .models import ModelCache
from .options import PageInputs, prepared

DISPLAY_PX = 256  # images and the heatmap are shown at least this large (nearest-neighbour upscaling)
# viridis at 0, 1/4, 1/2, 3/4, 1: the heatmap's colours, early passes dark, late passes yellow
VIRIDIS = ((68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37))


def upscale(image: Image.Image, size: int = DISPLAY_PX) -> Image.Image:
    factor = max(1, math.ceil(size / max(image.size)))
    return image.resize((image.width * factor, image.height * factor), Image.NEAREST)


def colour(fraction: float) -> tuple[int, int, int]:
    fraction = min(max(fraction, 0.0), 1.0) * (len(VIRIDIS) - 1)
    low = min(int(fraction), len(VIRIDIS) - 2)
    t = fraction - low
    return tuple(round(a + (b - a) * t) for a, b in zip(VIRIDIS[low], VIRIDIS[low + 1], strict=True))


def map_lines(shapes: list[tuple[int, int]]) -> list[list[int]]:
    """Maps of these (rows, columns), in order, packed into lines for the picture nearest a square ->
    each line's map indices. Side by side, VAR's ten scales made a strip four times wider than tall,
    which the page squashed to an unreadable band."""
    best_score, best_lines = math.inf, [list(range(len(shapes)))]
    for limit in range(max(c for _, c in shapes), sum(c for _, c in shapes) + 1):
        lines, width = [[]], 0
        for i, (_, columns) in enumerate(shapes):
            if lines[-1] and width + columns > limit:
                lines, width = [*lines, []], 0
            lines[-1].append(i)
            width += columns
        wide = max(sum(shapes[i][1] for i in line) for line in lines)
        tall = sum(max(shapes[i][0] for i in line) for line in lines)
        score = max(wide / tall, tall / wide)
        if score < best_score:
            best_score, best_lines = score, lines
    return best_lines


def commit_heatmap(commit_pass) -> Image.Image:
    """commit_pass [h, w] (1-based passes), or a next-scale model's list of [pn, pn] maps (one per
    scale) -> a picture: one cell per token, coloured by the pass that committed it (dark: early,
    yellow: late), the scales in order in lines (`map_lines`), over a colour bar from pass 1 to the last."""
    grids = [g.long().cpu() for g in (commit_pass if isinstance(commit_pass, (list, tuple)) else [commit_pass])]
    shapes = [tuple(g.shape) for g in grids]
    lines = map_lines(shapes)
    last = max(int(g.max()) for g in grids)
    cell = max(4, math.ceil(DISPLAY_PX / max(grids[-1].shape)))
    try:
        font = ImageFont.load_default(size=12)
    except TypeError:  # Pillow < 10.1: one fixed-size bitmap font
        font = ImageFont.load_default()
    gap, bar = (6 if len(grids) > 1 else 0), 34
    line_heights = [max(shapes[i][0] for i in line) * cell for line in lines]
    width = max(sum(shapes[i][1] * cell for i in line) + gap * (len(line) - 1) for line in lines)
    height = sum(line_heights) + gap * (len(lines) - 1)
    picture = Image.new("RGB", (width, height + bar), "white")
    draw = ImageDraw.Draw(picture)
    palette = [colour((p - 1) / max(last - 1, 1)) for p in range(last + 1)]
    line_top = 0
    for line, line_height in zip(lines, line_heights, strict=True):
        left = 0
        for i in line:
            grid = grids[i]
            top = line_top + line_height - grid.shape[0] * cell  # the maps of a line stand on its baseline
            for r in range(grid.shape[0]):
                for c in range(grid.shape[1]):
                    x, y = left + c * cell, top + r * cell
                    draw.rectangle((x, y, x + cell - 1, y + cell - 1), fill=palette[int(grid[r, c])])
            left += grid.shape[1] * cell + gap
        line_top += line_height + gap
    y = height + 6
    for x in range(width):
        draw.line((x, y, x, y + 8), fill=colour(x / max(width - 1, 1)))
    draw.text((0, y + 10), "pass 1", fill="black", font=font)
    label = f"pass {last}"
    draw.text((width - draw.textlength(label, font=font), y + 10), label, fill="black", font=font)
    return picture


def tokens_per_pass(commit_pass):
    """A table (pandas) of the tokens committed at each forward pass 1..P, for the bar plot (a
    next-scale model's list of maps counts every scale's tokens)."""
    import pandas as pd

    if isinstance(commit_pass, (list, tuple)):
        commit_pass = torch.cat([g.reshape(-1) for g in commit_pass])
    counts = torch.bincount(commit_pass.reshape(-1).long().cpu())[1:]
    return pd.DataFrame({"forward pass": list(range(1, len(counts) + 1)), "tokens committed": counts.tolist()})


def run_side(pipe, method: str, seed: int, condition: dict, sampling: dict, options: dict) -> dict:
    start = time.perf_counter()
    out = pipe.generate(
        **condition,
        method=method,
        generator=[torch.Generator().manual_seed(seed)],
        progress=True,
        **sampling,
        **options,
    )
    wall = time.perf_counter() - start
    passes = out.stats["forward_passes_per_image"][0]
    return {
        "image": out.images[0],
        "commit_pass": per_image(out.stats["commit_pass"])[0],  # [h, w], or one map per scale
        "summary": {
            "method": method,
            "forward_passes": passes,
            "step_compression": pipe.model.num_image_tokens / passes,
            "wall_s": wall,
            "sampling_s": out.stats["latency_s"],
            # the call's wall time besides sampling and the VQ decode: what runs once (auto's AR-step
            # probe, once a process) and the call's own bookkeeping
            "setup_s": max(0.0, wall - out.stats["latency_s"] - out.stats.get("decode_s", 0.0)),
            "lossless": bool(out.stats["lossless"]),
            "acceptance_rate": out.stats["acceptance_rate"],
            "ran": out.stats.get("auto", method) if method == "auto" else method,  # what auto chose
            # auto: each candidate's images per second as timed on this machine, and what the choice rests on
            "tuning": {key: value for key, value in out.stats.items() if key.startswith("auto_")},
            "options": {k: v for k, v in options.items()},
        },
    }


def shares_a_batch(pipe, method: str) -> bool:
    """The method side joins the running batch of the sessions that click with its settings: a raster
    method that refills its slots (auto walks its candidates on a fixed list, one call each)."""
    return model_kind(pipe.model) == "raster" and get_method(method).refills and method != "auto"


def run_shared(cache: ModelCache, pipe, method: str, seed: int, condition: dict, sampling: dict, options: dict):
    """`run_side`'s image and figures, the image decoded in the device's running batch for these settings
    (its tokens those of its decode alone, whoever shares its passes). Its sampling time runs from its
    joining the batch to its hand-over (the VQ decode included: a running batch decodes each image as it
    is done), so it counts the passes it shared; `shared_with`: the images in the batch as it joined."""
    done, joined = Future(), {}

    def accepted(count):
        joined["at"], joined["with"] = time.perf_counter(), cache.shared.in_flight()[0] - count

    def image(position, picture, info):
        done.set_result((picture, info, time.perf_counter()))

    start = time.perf_counter()
    add = {**condition, "seed": seed}
    job = BatchImages(pipe, method, {**options, **sampling}, add, on_image=image, on_accepted=accepted)
    job.on_error = done.set_exception
    cache.shared.submit(job)
    picture, info, end = done.result()
    passes = int(info["forward_passes"])
    return {
        "image": picture,
        "commit_pass": info["commit_pass"],  # [h, w]
        "summary": {
            "method": method,
            "forward_passes": passes,
            "step_compression": pipe.model.num_image_tokens / passes,
            "wall_s": end - start,
            "sampling_s": end - joined["at"],
            "setup_s": 0.0,  # nothing runs once: the batch is opened as it comes
            "waited_s": joined["at"] - start,  # for the device (a load, another batch, a reference)
            "lossless": bool(get_method(method).is_lossless(options, pipe.model)),
            "acceptance_rate": None,  # a running batch counts drafts for the batch, not for each image
            "ran": method,
            "tuning": {},
            "options": dict(options),
            "shared_with": joined["with"],
        },
    }


def compare(cache: ModelCache, *values):
    """AR and `method` on one seed -> (AR image, method image, summary markdown, heatmap, per-pass table, stats).
    Both run in the device's thread (`ModelCache.shared`): the method side first, in the running batch of
    its settings where it refills (sessions that click together share its passes), then the reference,
    on its own, as the method does where it does not refill."""
    inputs = PageInputs(*values)
    pipe, condition, sampling, options = prepared(cache, inputs)
    method, seed = inputs.method, int(inputs.seed)
    # the reference of the model's kind: plain AR for raster models, MaskGIT's loop for masked ones
    reference = reference_method(pipe.model)
    if shares_a_batch(pipe, method):
        fast = run_shared(cache, pipe, method, seed, condition, sampling, options)
    else:
        fast = cache.shared.call(run_side, pipe, method, seed, condition, sampling, options).result()
    ar = cache.shared.call(run_side, pipe, reference, seed, condition, sampling, {}).result()
    # the reference against itself (chosen, or what auto ran) is the same work twice: two timings of
    # it differ by noise, which a speed-up would report as a gain or a loss. Sampling is timed against
    # sampling: a first call's one-time set-up (auto's AR-step probe) is shown apart, not in the ratio.
    same_work = fast["summary"]["ran"] == reference
    stats = {
        "ar": ar["summary"],
        "method": fast["summary"],
        "speedup": None if same_work else ar["summary"]["sampling_s"] / fast["summary"]["sampling_s"],
    }
    stats["model"], stats["seed"], stats["sampling"] = pipe.name, int(seed), sampling
    stats["condition"] = condition_text(pipe, condition)
    if "negative_prompt" in condition:
        stats["negative_prompt"] = condition["negative_prompt"]
    heatmap = commit_heatmap(fast["commit_pass"])
    return upscale(ar["image"]), upscale(fast["image"]), summary_markdown(stats), heatmap, fast["commit_pass"], stats


def condition_text(pipe, condition: dict) -> str:
    """What was sampled, as the table names it: the class (with its name) or the prompt."""
    if "prompts" in condition:
        return f"prompt: {condition['prompts'][0]}"
    label = condition["class_labels"][0]
    names = pipe.class_names or []
    return f"class {label}" + (f" ({names[label]})" if label < len(names) else "")


def reference_label(method: str) -> str:
    """How the page names the reference side: "plain AR", or the kind's reference method by name."""
    return "plain AR" if method == "ar" else f"{method} (the reference)"


def summary_markdown(stats: dict) -> str:
    ar, fast = stats["ar"], stats["method"]
    name = method_name(fast)
    speedup = speedup_text(stats["speedup"])

    def acceptance(side):
        return "-" if side["acceptance_rate"] is None else f"{side['acceptance_rate']:.1%}"

    rows = [
        ("forward passes", f"{ar['forward_passes']}", f"{fast['forward_passes']}"),
        ("step compression (tokens / passes)", f"{ar['step_compression']:.2f}x", f"{fast['step_compression']:.2f}x"),
        ("sampling time", seconds_text(ar["sampling_s"]), seconds_text(fast["sampling_s"])),
        ("measured speed-up (sampling time)", "1.00x", speedup),
        ("one-time set-up (not in the speed-up)", seconds_text(ar["setup_s"]), seconds_text(fast["setup_s"])),
        ("lossless", "yes" if ar["lossless"] else "no", "yes" if fast["lossless"] else "no"),
        ("draft acceptance", "-", acceptance(fast)),
    ]
    lines = [f"| {stats['model']}, seed {stats['seed']} | {reference_label(ar['method'])} | {name} |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    said = [stats["condition"]]
    if "negative_prompt" in stats:
        said.append(f"negative prompt: {stats['negative_prompt']}")
    elif stats["condition"].startswith("prompt:"):
        said.append("negative prompt: the model's own")
    text = "\n".join(lines) + "\n\n" + "; ".join(said)
    if "shared_with" in fast:
        text += "\n\n" + shared_note(fast)
    if fast.get("tuning"):  # what auto ran on this click, how far its tuning is, what won
        text += "\n\n" + auto_note(fast)
    return text


def shared_note(side: dict) -> str:
    """What a method side decoded in the device's running batch says of its figures."""
    others = side["shared_with"]
    company = f"with {others} other image{'s' if others != 1 else ''} of other sessions" if others else "alone"
    return (
        f"{side['method']} decoded its image in the device's running batch, {company} when it joined (its tokens "
        "are those of its decode alone): its sampling time runs from joining to the image done, the VQ decode "
        f"included, after {seconds_text(side['waited_s'])} waiting for the device; its draft acceptance is "
        "counted for the batch, not for each image."
    )


def method_name(side: dict) -> str:
    """The method side's name in the table's head and the status line: auto says what it ran."""
    return side["method"] if side["ran"] == side["method"] else f"{side['method']} (ran {side['ran']})"


def seconds_text(seconds: float) -> str:
    """A time as the page shows it, to 3 significant digits (0.384 s, 1.23 s, 12.3 s): at 2 decimals a
    tiny model's 0.38 s could be 0.375 or 0.385, a 2.6% spread in the speed-up beside it."""
    return f"{seconds:.0f} s" if seconds >= 100 else f"{seconds:#.3g} s"


def status_line(stats: dict) -> str:
    """The line under the table: the same sampling times and speed-up as the table (the set-up apart)."""
    ar, fast = stats["ar"], stats["method"]
    name, reference = method_name(fast), reference_label(ar["method"])

    def times(key):
        return f"{name} {seconds_text(fast[key])}, {reference} {seconds_text(ar[key])}"

    line = f"done: sampling time {times('sampling_s')}, speed-up {speedup_text(stats['speedup'])}"
    if max(ar["setup_s"], fast["setup_s"]) >= 0.01:  # auto's AR-step probe on a model's first call
        line += f"; one-time set-up, not in the speed-up: {times('setup_s')}"
    return line


def speedup_text(speedup: float | None) -> str:
    """The table's speed-up: bold where the method was faster, said plainly where it was slower."""
    if speedup is None:
        return "- (the same decoding)"
    return f"**{speedup:.2f}x**" if speedup >= 1 else f"{speedup:.2f}x (slower)"
