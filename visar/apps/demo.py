"""`visar demo`: a model's reference decoding and an accelerated method side by side, on one seed.

One click samples the chosen class or prompt (with its negative prompt, if one is given) twice,
with the reference of the model's kind (`ar` for raster models) and with the chosen method, each
image from one `torch.Generator` seeded with the seed, and shows both images, their forward passes,
step compression (image tokens / forward passes), sampling time, the measured speed-up (sampling
time against sampling time, bold only where the method was faster; none for the reference against
itself), the one-time set-up apart (auto's AR-step probe on a model's first call), what auto timed
(each candidate's images per second: its first clicks on a model decode with the candidates in
turn, then with the fastest), the class or prompt and negative prompt used, and whether the method is lossless at these
options; then how the method decoded: a heatmap over the token grid of the forward pass that
committed each token (`stats["commit_pass"]`; for a next-scale model every scale's map, in lines)
and the tokens committed per pass (an axis from 0). The note under the images says what the chosen
method guarantees (lossless, or lossy and what it trades). A click checks the inputs first (a bad
one is one message, nothing cleared), then clears the previous result and generates; choosing a
model clears the last model's result, and a text model opens with an example prompt.

Sessions share nothing but the loaded models (one per name and device, never changed after
loading). A model keeps its KV cache between the forward passes of one generation, so the
generations on a device take turns (a lock); Gradio's queue bounds the requests in flight.
User errors (`VisarError`: unknown class, empty prompt, an option out of range, a folder that is
not a model) come back as a message in the page; the server goes on serving.
"""

from __future__ import annotations

import inspect
import ipaddress
import json
import logging
import math
import threading
import time
from typing import NamedTuple

import torch
from PIL import Image, ImageDraw, ImageFont

from ..accel import METHODS, get_method, methods_for, reference_method
from ..accel.core.stats import per_image
from ..errors import VisarError, require
from ..models.base import model_kind
from ..registry import DEFAULT_MODEL, embedded_models, resolve_name

log = logging.getLogger("visar.demo")

DISPLAY_PX = 256  # images and the heatmap are shown at least this large (nearest-neighbour upscaling)
MAX_OPTIONS = max(len(method.options) for method in METHODS.values())
MAX_SEED = 2**63 - 1
MAX_OPTION_TEXT = 200
DEFAULT_METHOD = "auto"
# What the page shows first for each kind: auto on raster models; elsewhere, where `auto` is the
# reference itself, the kind's fastest method that needs no second model (docs/VAR.md: var-prune and
# code, which needs a refiner; docs/MASKED.md: halton, by a little at equal steps; docs/MAR.md).
FIRST_METHODS = {"raster": "auto", "next-scale": "var-prune", "masked": "halton", "continuous": "mar-cache"}
# viridis at 0, 1/4, 1/2, 3/4, 1: the heatmap's colours, early passes dark, late passes yellow
VIRIDIS = ((68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37))


# -- models ------------------------------------------------------------------------------------------


class ModelCache:
    """Pipelines loaded once per (name, device), shared read-only by every session.

    `lock` serialises generation on the device: a model (and a draft model shared by names) keeps
    its KV cache in itself during a generation, so two at once on one model would clobber it.
    """

    def __init__(self, device=None, dtype=None, allow_folders: bool = True):
        self.device, self.dtype, self.allow_folders = device, dtype, allow_folders
        self.pipes: dict[tuple[str, str], object] = {}
        self.loading = threading.Lock()
        self.lock = threading.Lock()

    def get(self, name: str):
        from ..loading import load

        name = resolve_name((name or "").strip() or DEFAULT_MODEL)
        if name not in embedded_models() and not self.allow_folders:
            raise VisarError(
                f"unknown model {name!r}: this server serves only its embedded models "
                f"({', '.join(embedded_models())}); start it with --allow-folders to load model folders"
            )
        key = (name, str(self.device))
        with self.loading:
            if key not in self.pipes:
                self.pipes[key] = load(name, device=self.device, dtype=self.dtype)
            return self.pipes[key]


def model_choices() -> list[str]:
    return list(embedded_models())


def class_choices(pipe) -> list[str]:
    if not pipe.is_class_conditional:
        return []
    names = pipe.class_names or []
    return [names[i] if i < len(names) else str(i) for i in range(pipe.num_classes)]


def preselected_method(pipe, usable: list[str], wanted: str | None = None) -> str:
    """The method the page shows for this model: `wanted` (--method, or the method the page held) when
    it decodes this model and is not the reference the page compares with; else the kind's entry of
    FIRST_METHODS; else any other usable method; the reference only when nothing else decodes the
    model. A first click must compare two decodings, not the reference with itself."""
    reference = reference_method(pipe.model)
    if wanted in usable and wanted != reference:
        return wanted
    first = FIRST_METHODS.get(model_kind(pipe.model))
    if first in usable:
        return first
    return next((name for name in usable if name != reference), reference)


def default_options(method_name: str, model_name: str) -> dict[str, str]:
    """The option fields' texts: each default as JSON ("" for None); for a method that needs a second
    model, the embedded MODEL-draft (or MODEL-refiner for code's `refiner`) when there is one."""
    method = get_method(method_name)
    texts = {}
    for name, value in method.defaults.items():
        texts[name] = "" if value is None else json.dumps(value)
    option = method.draft_option
    if method.needs_draft and not texts.get(option):
        # an embedded companion by name: MODEL-draft for a draft, MODEL-refiner for CoDe's refiner
        companion = f"{resolve_name(model_name or DEFAULT_MODEL)}-{option}"
        texts[option] = companion if companion in embedded_models() else ""
    return texts


def parse_options(method_name: str, texts) -> dict:
    """Option field texts -> method options: JSON where it parses (numbers, true, null), else the text;
    an empty field keeps the method's default."""
    method = get_method(method_name)
    options = {}
    for name, text in zip(method.options, texts, strict=False):
        text = "" if text is None else str(text).strip()
        if not text:
            continue
        if len(text) > MAX_OPTION_TEXT:
            raise VisarError(f"option {name}: at most {MAX_OPTION_TEXT} characters")
        try:
            options[name] = json.loads(text)
        except json.JSONDecodeError:
            options[name] = text
    return options


# -- pictures ----------------------------------------------------------------------------------------


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


# -- one comparison ----------------------------------------------------------------------------------


def check_number(name: str, value, low: float, high: float, integer: bool = False):
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        raise VisarError(f"{name} must be a number")
    if integer and int(value) != value:
        raise VisarError(f"{name} must be a whole number, got {value}")
    if not low <= value <= high:
        raise VisarError(f"{name} must be between {low:g} and {high:g}, got {value:g}")


def check_sizes(pipe, options: dict):
    """No whole-number option of any method means more than the model's vocabulary or token count
    (windows, lags, neighbours, group sizes): a larger one is a typo that could ask for memory the
    server has not got, so it is refused here rather than tried."""
    vocab = getattr(pipe.model, "vocab_size", 0)  # a continuous-token model (MAR) has none
    limit = max(vocab, pipe.model.num_image_tokens)
    for name, value in options.items():
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > limit:
            raise VisarError(
                f"option {name}={value} is larger than anything {pipe.name} has (vocabulary {vocab}, "
                f"{pipe.model.num_image_tokens} image tokens): at most {limit}"
            )


def condition_of(pipe, class_value, prompt) -> dict:
    from .batch import resolve_class

    if pipe.is_class_conditional:
        if class_value is None or not str(class_value).strip():
            raise VisarError("choose a class")
        item = resolve_class(pipe, str(class_value).strip())
        return {"class_labels": [item.condition]}
    if not prompt or not str(prompt).strip():
        raise VisarError(f"{pipe.name} is text-conditional: enter a prompt")
    if len(prompt) > 1000:
        raise VisarError("the prompt is longer than 1,000 characters")
    return {"prompts": [str(prompt).strip()]}


def negative_of(pipe, negative_prompt) -> dict:
    """The negative prompt field -> generate's keyword (empty: none, the model's own unconditional branch)."""
    if negative_prompt is None or not str(negative_prompt).strip():
        return {}
    if len(negative_prompt) > 1000:
        raise VisarError("the negative prompt is longer than 1,000 characters")
    return {"negative_prompt": str(negative_prompt).strip()}


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
            "tuning": {key: out.stats[key] for key in ("auto_tuning", "auto_reason") if key in out.stats},
            "options": {k: v for k, v in options.items()},
        },
    }


class PageInputs(NamedTuple):
    """What the page sends for one comparison, in the order of its controls."""

    model_name: str
    class_value: str | None
    prompt: str | None
    negative_prompt: str | None
    method: str
    seed: float
    cfg: float
    temperature: float
    top_k: float
    top_p: float
    texts: tuple  # the method's option fields, in `visar methods` order


def compare(cache: ModelCache, *values):
    """AR and `method` on one seed -> (AR image, method image, summary markdown, heatmap, per-pass table, stats)."""
    inputs = PageInputs(*values)
    pipe, condition, sampling, options = prepared(cache, inputs)
    method, seed = inputs.method, inputs.seed
    # the reference of the model's kind: plain AR for raster models, MaskGIT's loop for masked ones
    reference = reference_method(pipe.model)
    with cache.lock:
        ar = run_side(pipe, reference, int(seed), condition, sampling, {})
        fast = run_side(pipe, method, int(seed), condition, sampling, options)
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


def prepared(cache: ModelCache, inputs: PageInputs):
    """The page's inputs checked, each bad one a VisarError -> (pipeline, condition, sampling, options)."""
    model_name, class_value, prompt, negative_prompt, method, seed, cfg, temperature, top_k, top_p, texts = inputs
    pipe = cache.get(model_name)
    if method not in METHODS:
        raise VisarError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
    check_number("seed", seed, 0, MAX_SEED, integer=True)
    check_number("guidance scale", cfg, 0, 100)
    check_number("temperature", temperature, 1e-3, 100)
    check_number("top-k", top_k, 0, getattr(pipe.model, "vocab_size", 0), integer=True)
    check_number("top-p", top_p, 1e-6, 1)
    condition = {**condition_of(pipe, class_value, prompt), **negative_of(pipe, negative_prompt)}
    options = parse_options(method, texts)
    check_sizes(pipe, options)
    sampling = {"guidance_scale": float(cfg), "temperature": float(temperature), "top_k": int(top_k) or None}
    sampling["top_p"] = float(top_p)
    return pipe, condition, sampling, options


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
    name = fast["method"] if fast["ran"] == fast["method"] else f"{fast['method']} (ran {fast['ran']})"
    speedup = speedup_text(stats["speedup"])

    def acceptance(side):
        return "-" if side["acceptance_rate"] is None else f"{side['acceptance_rate']:.1%}"

    rows = [
        ("forward passes", f"{ar['forward_passes']}", f"{fast['forward_passes']}"),
        ("step compression (tokens / passes)", f"{ar['step_compression']:.2f}x", f"{fast['step_compression']:.2f}x"),
        ("sampling time", f"{ar['sampling_s']:.2f} s", f"{fast['sampling_s']:.2f} s"),
        ("measured speed-up (sampling time)", "1.00x", speedup),
        ("one-time set-up (not in the speed-up)", f"{ar['setup_s']:.2f} s", f"{fast['setup_s']:.2f} s"),
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
    if fast.get("tuning"):  # what auto timed: the candidates' images per second on this machine
        text += f"\n\nauto: {fast['tuning']['auto_reason']}"
    return text


def speedup_text(speedup: float | None) -> str:
    """The table's speed-up: bold where the method was faster, said plainly where it was slower."""
    if speedup is None:
        return "- (the same decoding)"
    return f"**{speedup:.2f}x**" if speedup >= 1 else f"{speedup:.2f}x (slower)"


# -- the page ----------------------------------------------------------------------------------------


def build_demo(
    *,
    model: str = "default",
    method: str = DEFAULT_METHOD,
    device=None,
    dtype=None,
    concurrency: int = 1,
    max_queue: int = 32,
    allow_folders: bool = True,
):
    """The Gradio Blocks of the demo (not launched). Loads `model` to fill the page's defaults."""
    gr = require("gradio", "demo")
    cache = ModelCache(device=device, dtype=dtype, allow_folders=allow_folders)
    first = cache.get(model)
    methods = methods_for(first.model)
    method = preselected_method(first, methods, method)
    handlers = page_handlers(gr, cache)
    with gr.Blocks(title="visar demo", analytics_enabled=False) as demo:
        gr.Markdown(
            "## visar: a model's reference decoding against an accelerated method\n"
            "One click samples the same class or prompt with the reference decoding of the model's kind (plain "
            "autoregressive decoding for raster models; var, maskgit or mar for the others) and with the chosen "
            "method, on the same seed (each image from its own generator), and shows how the method decoded."
        )
        with gr.Row():
            with gr.Column(scale=1, min_width=320):
                controls = input_controls(gr, first, methods, method, allow_folders)
            with gr.Column(scale=2):
                views, controls["note"] = output_views(gr, reference_label(reference_method(first.model)), method)
        connect_events(controls, views, handlers, concurrency)
    demo.queue(max_size=max_queue)
    return demo


def method_info(method_name) -> str:
    """The line under the method box: its name, whether it is lossless, what it is."""
    method = METHODS.get(method_name)
    if method is None:
        return ""
    return f"**{method.name}** ({method.lossless_label}): {method.description}"


def guarantee_note(method_name) -> str:
    """The note under the images: what the chosen method guarantees, at its default options."""
    method = METHODS.get(method_name)
    if method is None:
        return ""
    if method.lossless:
        return (
            f"**{method.name}** is lossless: it samples the model's own distribution, as plain AR does; it spends "
            "the random numbers differently, so on one seed the two images may still differ."
        )
    exact = f" It is exact when {method.exact_when_text}." if method.exact_when_text else ""
    return (
        f"**{method.name}** is lossy: it trades exactness for speed ({method.description}), so "
        f"its images come from another distribution than the model's own, not only other random draws.{exact} "
        "The table says whether it was exact at the options you gave."
    )


def option_updates(gr, method_name, model_name) -> list:
    """The option boxes for a method: one per option, labelled and filled with its default; the rest hidden."""
    texts = default_options(method_name, model_name)
    names = list(texts)
    return [
        gr.update(label=names[i], value=texts[names[i]], visible=True)
        if i < len(names)
        else gr.update(label=f"option {i + 1}", value="", visible=False)
        for i in range(MAX_OPTIONS)
    ]


def page_handlers(gr, cache: ModelCache) -> dict:
    """What the page's events run: choosing a model, choosing a method, and generating."""

    def select_model(model_name, method_name):
        try:
            pipe = cache.get(model_name)
        except VisarError as err:
            gr.Warning(str(err))
            return [gr.update()] * (9 + MAX_OPTIONS + len(EMPTY_VIEWS))
        usable = methods_for(pipe.model)
        method_name = preselected_method(pipe, usable, method_name)
        names = class_choices(pipe)
        d = pipe.defaults
        text = not pipe.is_class_conditional
        return [
            gr.update(choices=names, value=names[0] if names else None, visible=pipe.is_class_conditional),
            gr.update(visible=text, value=example_prompt(pipe) if text else ""),
            gr.update(visible=text, value=None if text else ""),  # the negative prompt: kept for a text model
            gr.update(choices=usable, value=method_name),
            gr.update(value=d["guidance_scale"]),
            gr.update(value=d["temperature"]),
            gr.update(value=d["top_k"] or 0),
            gr.update(value=d["top_p"]),
            model_info(pipe),
            *option_updates(gr, method_name, model_name),
            # the last model's result goes: its images and figures are not this model's
            gr.update(value=None, label=reference_label(reference_method(pipe.model))),
            *EMPTY_VIEWS[1:],
        ]

    def select_method(method_name, model_name):
        if method_name not in METHODS:
            return ["", ""] + [gr.update()] * MAX_OPTIONS
        return [method_info(method_name), guarantee_note(method_name), *option_updates(gr, method_name, model_name)]

    def clear_result():
        """The page's result emptied when a generation starts, so no figure of the last one stays up."""
        return [*EMPTY_VIEWS[:-1], "generating ..."]

    def check_inputs(*values):
        """Before anything is cleared: a bad input is one toast, not an error on every output."""
        try:
            prepared(cache, PageInputs(*values[:10], values[10:]))
        except VisarError as err:
            raise gr.Error(str(err), print_exception=False) from None

    def generate(
        model_name, class_value, prompt, negative_prompt, method_name, seed, cfg, temperature, top_k, top_p, *texts
    ):
        try:
            ar, fast, summary, heatmap, commit_pass, stats = compare(
                cache, model_name, class_value, prompt, negative_prompt, method_name, seed, cfg, temperature, top_k,
                top_p, texts,
            )  # fmt: skip
        except VisarError as err:
            raise gr.Error(str(err), print_exception=False) from None
        except Exception as err:  # a bug, or the machine (out of memory): logged here, one line in the page
            log.exception("generation failed")
            raise gr.Error(f"generation failed: {type(err).__name__}: {err}", print_exception=False) from None
        fast_s, ar_s = stats["method"]["wall_s"], stats["ar"]["wall_s"]
        reference = reference_label(stats["ar"]["method"])
        status = f"done: {stats['method']['method']} {fast_s:.2f} s, {reference} {ar_s:.2f} s"
        return ar, fast, summary, heatmap, tokens_per_pass(commit_pass), stats, status

    def generate_with_progress(*values):
        """Gradio finds its progress tracker by a parameter's default (see the signature below): the last value."""
        return generate(*values[:-1])

    names = ["model", "class_name", "prompt", "negative_prompt", "method", "seed", "guidance_scale", "temperature"]
    names += ["top_k", "top_p"]
    names += [f"option_{i + 1}" for i in range(MAX_OPTIONS)]  # the method's options, in `visar methods` order
    generate_with_progress.__signature__ = inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in names]
        + [inspect.Parameter("progress", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=gr.Progress(track_tqdm=True))]
    )
    return {
        "select_model": select_model,
        "select_method": select_method,
        "clear_result": clear_result,
        "check_inputs": check_inputs,
        "generate": generate_with_progress,
    }


def input_controls(gr, first, methods: list[str], method: str, allow_folders: bool) -> dict:
    """The left column: model, class or prompt, method and its options, seed and sampling settings, the
    button; filled from the first model's defaults."""
    classes = class_choices(first)
    options = default_options(method, first.name)
    defaults = first.defaults
    model_box = gr.Dropdown(
        choices=model_choices(),
        value=first.name,
        allow_custom_value=allow_folders,
        label="model" + (" (or a model folder path)" if allow_folders else ""),
        elem_id="model",
    )
    info = gr.Markdown(model_info(first), elem_id="model-info")
    class_box = gr.Dropdown(
        choices=classes,
        value=classes[0] if classes else None,
        allow_custom_value=True,
        label="class (a name or an id)",
        visible=first.is_class_conditional,
        elem_id="class",
    )
    prompt_box = gr.Textbox(
        label="prompt",
        value=None if first.is_class_conditional else example_prompt(first),
        visible=not first.is_class_conditional,
        elem_id="prompt",
    )
    negative_box = gr.Textbox(
        label="negative prompt (empty: the model's own unconditional branch; used when guidance is not 1)",
        visible=not first.is_class_conditional,
        elem_id="negative-prompt",
    )
    method_box = gr.Dropdown(choices=methods, value=method, label="method", elem_id="method")
    about = gr.Markdown(method_info(method))
    with gr.Accordion("method options (empty: the method's default; JSON or text)", open=True):
        names = list(options)
        option_boxes = [
            gr.Textbox(
                label=names[i] if i < len(names) else f"option {i + 1}",
                value=options[names[i]] if i < len(names) else "",
                visible=i < len(names),
                max_lines=1,
            )
            for i in range(MAX_OPTIONS)
        ]
    with gr.Row():
        seed_box = gr.Number(value=0, precision=0, label="seed", minimum=0)
        cfg_box = gr.Number(value=defaults["guidance_scale"], label="guidance scale (1 = off)", minimum=0)
    with gr.Row():
        temperature_box = gr.Number(value=defaults["temperature"], label="temperature")
        top_k_box = gr.Number(value=defaults["top_k"] or 0, precision=0, label="top-k (0 = off)")
        top_p_box = gr.Number(value=defaults["top_p"], label="top-p")
    button = gr.Button("Generate", variant="primary", elem_id="generate")
    return {
        "model": model_box,
        "info": info,
        "class": class_box,
        "prompt": prompt_box,
        "negative_prompt": negative_box,
        "method": method_box,
        "about": about,
        "options": option_boxes,
        "seed": seed_box,
        "cfg": cfg_box,
        "temperature": temperature_box,
        "top_k": top_k_box,
        "top_p": top_p_box,
        "button": button,
    }


def output_views(gr, reference: str, method: str) -> tuple[list, object]:
    """The right column: the two images (the left one labelled `reference`), the note on the chosen
    method, the figures, the heatmap and the tokens committed per pass; returned as the views in the
    order `generate` fills them, and the note."""
    with gr.Row():
        ar_image = gr.Image(label=reference, format="png", interactive=False, elem_id="ar-image")
        fast_image = gr.Image(
            label="the chosen method, same seed", format="png", interactive=False, elem_id="method-image"
        )
    note = gr.Markdown(guarantee_note(method), elem_id="note")
    summary = gr.Markdown(elem_id="summary")
    status = gr.Markdown(elem_id="status")
    with gr.Row():
        heatmap = gr.Image(label="the method: forward pass that committed each token", format="png", interactive=False)
        per_pass = gr.BarPlot(
            x="forward pass",
            y="tokens committed",
            label="the method: tokens committed per forward pass",
            y_lim=[0, None],  # from 0: a bar's height is its count
            height=300,
        )
    with gr.Accordion("all figures (JSON)", open=False):
        stats_box = gr.JSON()
    return [ar_image, fast_image, summary, heatmap, per_pass, stats_box, status], note


def connect_events(controls: dict, views: list, handlers: dict, concurrency: int):
    """Choosing a model refills the page from its defaults, choosing a method shows its options and what it
    guarantees, and the button clears the last result, then generates (each with an API name, for
    gradio_client; the clearing has none)."""
    model, method, options = controls["model"], controls["method"], controls["options"]
    sampling = [controls[name] for name in ("cfg", "temperature", "top_k", "top_p")]
    condition = [controls["class"], controls["prompt"], controls["negative_prompt"]]
    model.change(
        handlers["select_model"],
        [model, method],
        [*condition, method, *sampling, controls["info"], *options, *views],
        api_name="select_model",
    )
    method.change(
        handlers["select_method"],
        [method, model],
        [controls["about"], controls["note"], *options],
        api_name="select_method",
    )
    inputs = [model, *condition, method, controls["seed"], *sampling, *options]
    checked = controls["button"].click(handlers["check_inputs"], inputs, None, api_visibility="private")
    checked.success(handlers["clear_result"], None, views, queue=False, api_visibility="private").then(
        handlers["generate"],
        inputs,
        views,
        api_name="generate",
        concurrency_limit=concurrency,
        concurrency_id="generate",
    )


# What the result views show before a generation: images, summary, heatmap, plot, figures, status.
EMPTY_VIEWS = [None, None, "", None, None, None, ""]
# A text model opens with the first of these its prompt encoder reads word for word (the shapes
# world's caption encoder knows 30 words; a T5 or a Hugging Face tokenizer reads any).
EXAMPLE_PROMPTS = ("a red fox in the snow", "a photo of a red circle above a blue square")


def example_prompt(pipe) -> str:
    """A prompt to open a text model's page with."""
    known = getattr(pipe.text_encoder, "word_index", None)
    for prompt in EXAMPLE_PROMPTS:
        if known is None or all(word in known for word in prompt.split()):
            return prompt
    return EXAMPLE_PROMPTS[0]


def model_info(pipe) -> str:
    """One line on the model: its conditions, its tokens (a next-scale model: its scales) and its device."""
    kind = f"{pipe.num_classes} classes" if pipe.is_class_conditional else "text prompts"
    sizes = getattr(pipe.model, "scale_sizes", None)
    if sizes:  # a next-scale model has no single grid: scale maps 1x1 .. pn x pn
        tokens = f"{len(sizes)} scales up to {sizes[-1]}x{sizes[-1]} ({pipe.model.num_image_tokens} tokens)"
    else:
        height, width = pipe.model.grid_size
        tokens = f"{height}x{width} tokens"
    return f"`{pipe.name}`: {model_kind(pipe.model)} model, {kind}, {tokens}, on {pipe.device}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def launch(
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    share: bool = False,
    allow_folders: bool | None = None,
    **build_kwargs,
):
    """Build and serve the demo until interrupted. Model folders typed in the page load only on a
    loopback host without --share, unless allow_folders says otherwise."""
    if allow_folders is None:
        allow_folders = is_loopback(host) and not share
    demo = build_demo(allow_folders=allow_folders, **build_kwargs)
    # quiet: Gradio's own start lines tell a user to set `share=True` in launch(); visar's flag is --share
    demo.launch(
        server_name=host,
        server_port=port,
        share=share,
        show_error=False,
        ssr_mode=False,
        quiet=True,
        prevent_thread_lock=True,
    )
    public = f", public link {demo.share_url}" if share and demo.share_url else ""
    print(f"visar demo running on {demo.local_url}{public} (Ctrl-C stops it; --share adds a public link)", flush=True)
    demo.block_thread()
    return demo
