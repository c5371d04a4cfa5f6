"""The demo's inputs: the option fields' texts (defaults, parsing) and the checks that turn what the
page sends into `Pipeline.generate`'s arguments, each bad input one VisarError."""

from __future__ import annotations

import json
import math
from typing import NamedTuple

from ...accel import METHODS, get_method, methods_for
from ...errors import VisarError
from ...registry import DEFAULT_MODEL, embedded_models, resolve_name
from .models import ModelCache

MAX_OPTIONS = max(len(method.options) for method in METHODS.values())
MAX_SEED = 2**63 - 1
MAX_OPTION_TEXT = 200


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


def check_field(name: str, value, low: float, high: float, integer: bool = False):
    """A number field of the page (seed, guidance, temperature, top-k, top-p): a finite number in
    [low, high], whole where `integer`; else one VisarError naming the field."""
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
    from ..batch import resolve_class

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


def prepared(cache: ModelCache, inputs: PageInputs):
    """The page's inputs checked, each bad one a VisarError -> (pipeline, condition, sampling, options)."""
    model_name, class_value, prompt, negative_prompt, method, seed, cfg, temperature, top_k, top_p, texts = inputs
    pipe = cache.get(model_name)
    usable = methods_for(pipe.model)
    if method not in usable:  # the page's list is the model's; the API may send anything
        what = "unknown method" if method not in METHODS else "a method that does not decode this model:"
        raise VisarError(f"{what} {method!r}; {pipe.name}'s methods: {', '.join(usable)}")
    check_field("seed", seed, 0, MAX_SEED, integer=True)
    check_field("guidance scale", cfg, 0, 100)
    check_field("temperature", temperature, 1e-3, 100)
    check_field("top-k", top_k, 0, getattr(pipe.model, "vocab_size", 0), integer=True)
    check_field("top-p", top_p, 1e-6, 1)
    condition = {**condition_of(pipe, class_value, prompt), **negative_of(pipe, negative_prompt)}
    options = parse_options(method, texts)
    check_sizes(pipe, options)
    sampling = {"guidance_scale": float(cfg), "temperature": float(temperature), "top_k": int(top_k) or None}
    sampling["top_p"] = float(top_p)
    return pipe, condition, sampling, options
