"""The demo's page: its Gradio layout, the handlers of its events, and the server."""

from __future__ import annotations

import inspect
import ipaddress
import logging
from functools import partial

from ...accel import METHODS, methods_for, reference_method
from ...errors import VisarError, require
from ...models.base import model_kind
from .comparison import compare, reference_label, status_line, tokens_per_pass
from .models import ModelCache, class_choices, example_prompt, model_choices, model_info
from .options import MAX_OPTIONS, PageInputs, default_options, prepared

log = logging.getLogger("visar.demo")

DEFAULT_METHOD = "auto"
# What the page shows first for each kind: auto on raster models; elsewhere, where `auto` is the
# reference itself, the kind's fastest method that needs no second model (docs/VAR.md: var-prune and
# code, which needs a refiner; docs/MASKED.md: halton, by a little at equal steps; docs/MAR.md).
FIRST_METHODS = {"raster": "auto", "next-scale": "var-prune", "masked": "halton", "continuous": "mar-cache"}
# What the result views show before a generation: images, summary, heatmap, plot, figures, status.
EMPTY_VIEWS = [None, None, "", None, None, None, ""]


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


def build_demo(
    *,
    model: str = "default",
    method: str = DEFAULT_METHOD,
    device=None,
    dtype=None,
    concurrency: int = 4,
    max_queue: int = 32,
    allow_folders: bool = True,
):
    """The Gradio Blocks of the demo (not launched). Loads `model` to fill the page's defaults.
    concurrency: the clicks served at once, whose method sides share a running batch of that many slots."""
    gr = require("gradio", "demo")
    cache = ModelCache(device=device, dtype=dtype, allow_folders=allow_folders, slots=concurrency)
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

    def generate_with_progress(*values):
        """Gradio finds its progress tracker by a parameter's default (see the signature below): the last value."""
        return generate(gr, cache, *values[:-1])

    names = ["model", "class_name", "prompt", "negative_prompt", "method", "seed", "guidance_scale", "temperature"]
    names += ["top_k", "top_p"]
    names += [f"option_{i + 1}" for i in range(MAX_OPTIONS)]  # the method's options, in `visar methods` order
    generate_with_progress.__signature__ = inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in names]
        + [inspect.Parameter("progress", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=gr.Progress(track_tqdm=True))]
    )
    return {
        "select_model": partial(select_model, gr, cache),
        "select_method": partial(select_method, gr),
        "clear_result": clear_result,
        "check_inputs": partial(check_inputs, gr, cache),
        "generate": generate_with_progress,
    }


def select_model(gr, cache: ModelCache, model_name, method_name) -> list:
    """A model chosen: the page refilled from its defaults (classes or an example prompt, its methods,
    sampling settings, the method's options) and the last model's result emptied."""
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


def select_method(gr, method_name, model_name) -> list:
    """A method chosen: what it is, what it guarantees, and its option fields."""
    if method_name not in METHODS:
        return ["", ""] + [gr.update()] * MAX_OPTIONS
    return [method_info(method_name), guarantee_note(method_name), *option_updates(gr, method_name, model_name)]


def clear_result() -> list:
    """The page's result emptied when a generation starts, so no figure of the last one stays up."""
    return [*EMPTY_VIEWS[:-1], "generating ..."]


def check_inputs(gr, cache: ModelCache, *values):
    """Before anything is cleared: a bad input is one toast, not an error on every output."""
    try:
        prepared(cache, PageInputs(*values[:10], values[10:]))
    except VisarError as err:
        raise gr.Error(str(err), print_exception=False) from None


def generate(
    gr, cache: ModelCache, model_name, class_value, prompt, negative_prompt, method_name, seed, cfg, temperature,
    top_k, top_p, *texts,
) -> tuple:  # fmt: skip
    """The comparison for the page's inputs -> the views' values and a status line; a user error is one
    message in the page, anything else logged here and one line there."""
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
    return ar, fast, summary, heatmap, tokens_per_pass(commit_pass), stats, status_line(stats)


def input_controls(gr, first, methods: list[str], method: str, allow_folders: bool) -> dict:
    """The left column: model, class or prompt, method and its options, seed and sampling settings, the
    button; filled from the first model's defaults."""
    classes = class_choices(first)
    controls = {
        "model": gr.Dropdown(
            choices=model_choices(),
            value=first.name,
            allow_custom_value=allow_folders,
            label="model" + (" (or a model folder path)" if allow_folders else ""),
            elem_id="model",
        ),
        "info": gr.Markdown(model_info(first), label="model info", elem_id="model-info"),
        "class": gr.Dropdown(
            choices=classes,
            value=classes[0] if classes else None,
            allow_custom_value=True,
            label="class (a name or an id)",
            visible=first.is_class_conditional,
            elem_id="class",
        ),
        "prompt": gr.Textbox(
            label="prompt",
            value=None if first.is_class_conditional else example_prompt(first),
            visible=not first.is_class_conditional,
            elem_id="prompt",
        ),
        "negative_prompt": gr.Textbox(
            label="negative prompt (empty: the model's own unconditional branch; used when guidance is not 1)",
            visible=not first.is_class_conditional,
            elem_id="negative-prompt",
        ),
    }
    controls |= method_controls(gr, methods, method, first.name)
    controls |= sampling_controls(gr, first.defaults)
    controls["button"] = gr.Button("Generate", variant="primary", elem_id="generate")
    return controls


def method_controls(gr, methods: list[str], method: str, model_name: str) -> dict:
    """The method box, the line on the method, and one box per option (as many as the most options a
    method has, those of `method` shown and filled with its defaults)."""
    options = default_options(method, model_name)
    controls = {
        # a method outside the list is let through to the handlers, which refuse it in a sentence or
        # fall back to the model's default: Gradio checks a value against the list this session last
        # showed, so after a VAR model an API call with `auto` failed ("not in the list of choices")
        "method": gr.Dropdown(choices=methods, value=method, label="method", allow_custom_value=True, elem_id="method"),
        "about": gr.Markdown(method_info(method), label="method info"),
    }
    with gr.Accordion("method options (empty: the method's default; JSON or text)", open=True):
        names = list(options)
        controls["options"] = [
            gr.Textbox(
                label=names[i] if i < len(names) else f"option {i + 1}",
                value=options[names[i]] if i < len(names) else "",
                visible=i < len(names),
                max_lines=1,
            )
            for i in range(MAX_OPTIONS)
        ]
    return controls


def sampling_controls(gr, defaults: dict) -> dict:
    """The seed and the sampling settings, filled with the model's defaults."""
    with gr.Row():
        seed = gr.Number(value=0, precision=0, label="seed", minimum=0)
        cfg = gr.Number(value=defaults["guidance_scale"], label="guidance scale (1 = off)", minimum=0)
    with gr.Row():
        temperature = gr.Number(value=defaults["temperature"], label="temperature")
        top_k = gr.Number(value=defaults["top_k"] or 0, precision=0, label="top-k (0 = off)")
        top_p = gr.Number(value=defaults["top_p"], label="top-p")
    return {"seed": seed, "cfg": cfg, "temperature": temperature, "top_k": top_k, "top_p": top_p}


def output_views(gr, reference: str, method: str) -> tuple[list, object]:
    """The right column: the two images (the left one labelled `reference`), the note on the chosen
    method, the figures, the heatmap and the tokens committed per pass; returned as the views in the
    order `generate` fills them, and the note."""
    with gr.Row():
        ar_image = gr.Image(label=reference, format="png", interactive=False, elem_id="ar-image")
        fast_image = gr.Image(
            label="the chosen method, same seed", format="png", interactive=False, elem_id="method-image"
        )
    # labels name the API's outputs (unlabelled ones are `value_NN` there); a Markdown does not show its label
    note = gr.Markdown(guarantee_note(method), label="guarantee note", elem_id="note")
    summary = gr.Markdown(label="figures table", elem_id="summary")
    status = gr.Markdown(label="status", elem_id="status")
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
        stats_box = gr.JSON(label="all figures", show_label=False)
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
