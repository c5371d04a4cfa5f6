"""The registry of decoding methods: each method registers itself beside its code with `@register_method`.

A method is a function `fn(request, *, option=default, ...) -> (tokens, stats)`. `request` holds
what the caller gives every method: the model (implementing the interface of the kind the method
decodes, `visar.models.base`, e.g. `RasterModel`), the condition, the sampling settings, one
generator per image, and the caption mask, progress flag and tokenizer where there are any. The
method's keyword-only parameters are its options: what `Pipeline.generate` and the CLI accept for
it. Tokens are [B, N] for raster models and a list of [B, pn, pn] token maps (one per scale) for
next-scale models, and stats hold `stats.COMMON_STATS`. Anything the method must not resolve
itself (a draft given by name) is resolved by the pipeline before the call.

Lossless is a property of the options: a method registered lossy may name the settings at which
it is exact (`exact_when`, e.g. gsd with group_size=1 is sjd); `Method.is_lossless(options, model)`
says which, and tests/accel/test_method_conformance.py checks each such claim against the exact law.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from ...errors import VisarError
from ...models.base import model_kind
from .sampling import SamplingParams, make_generators
from .stats import concat_batches, merge_batch_stats, per_image

# the seed of an open source's spare slots (`Request.slot_generators`): any will do, their images are dropped
SPARE_SEED = 2**31 - 64


@dataclass(frozen=True)
class Request:
    """What every method is called with besides its own options: the caller's part of a call, not
    the user's, handed on to an engine as one object."""

    model: object
    cond: Tensor
    params: SamplingParams
    generators: list[torch.Generator]
    cond_mask: Tensor | None = None
    progress: bool = False
    # The pipeline's tokenizer, which some methods need: next-scale methods build each scale's input
    # with it, gsd and lantern compare tokens by its code vectors (a codebook [V, C] may stand in).
    tokenizer: object | None = None
    # torch.compile options a compiled pipeline runs each pass of a pass-loop engine under
    # (`pass_loop.decode_passes`); None: eager passes
    compile_passes: dict | None = None
    # A running batch (`pass_loop.RunningBatch`): cond and generators hold a queue of images, `slots` of
    # them decoded at once, each finished image's slot taken by the next; None: all at once. Only a
    # method registered `refills=True` is handed one (`Pipeline.generate` and `run_images` cut the
    # queue into consecutive batches for the others: `consecutive_batches`).
    slots: int | None = None
    # called (image index, tokens [N], {"forward_passes", "commit_pass" [N], the note}) as each image is
    # done (a running batch's as it finishes, another call's as its batch does), through `hand_over`
    on_image: Callable | None = None
    # An open running batch (`core.source.ImageSource`, with `slots`): images join while it decodes, and
    # cond, cond_mask and generators are the source's first images. None: the request's images alone.
    source: object | None = None

    # raster models: the fraction of KV-cache slots the target keeps (`RasterModel.setup_cache`);
    # 1: the whole cache, exact; and below 1, the rule that chooses what it evicts ("h2o" or "line")
    kv_keep: float = 1.0
    kv_evict: str = "h2o"

    # The null conditions guidance pairs each image with where the caller made them (a negative
    # prompt's): (null [Q, ...], null_mask [Q, T] or None), a row per image as `cond`; None: the model's
    # own (`null_condition`). A draft model that reads the same prompts takes them too.
    null: tuple[Tensor, Tensor | None] | None = None

    # Where cond[0] sits in the caller's queue, and what each image's info gains as it is handed over
    # (auto: the candidate that decoded it): a part of the queue decoded as a call of its own (`images`)
    # hands its images over as the queue's, through `hand_over`.
    first_image: int = 0
    note: dict = field(default_factory=dict)

    def hand_over(self, index: int, tokens, info: dict):
        """Image `index` of this request is done -> on_image(its index in the caller's queue, tokens,
        info and the request's note): the one way an image reaches the caller."""
        self.on_image(self.first_image + index, tokens, {**info, **self.note})

    @property
    def batch_size(self) -> int:
        """The images decoded at once: the slots of a running batch, else every image."""
        return self.slots if self.slots is not None else self.cond.shape[0]

    def slot_generators(self) -> list[torch.Generator]:
        """The generators of the images in the first pass's slots: the first `batch_size` images', and
        an open source's spare slots' where it holds fewer images (their draws are never handed over)."""
        generators = self.generators[: self.batch_size]
        if len(generators) < self.batch_size and self.source is not None:
            generators = generators + make_generators(self.batch_size - len(generators), SPARE_SEED)
        return generators

    def images(self, start: int, stop: int) -> Request:
        """The request for the queue's images [start, stop) alone (a running batch keeps its slots, at
        most as many as images; its hand-over tells on_image each image's index in this queue). Not of an open
        source's, whose images are not all known: only a method that refills decodes one."""
        if self.source is not None:
            raise VisarError(
                "an open running batch (source=) is decoded by one method that refills (visar methods: "
                "sjd, mc-sjd, the trees, the zipar fronts, ...); auto and methods that decode consecutive "
                "batches take a fixed list of images"
            )
        return replace(
            self,
            cond=self.cond[start:stop],
            cond_mask=None if self.cond_mask is None else self.cond_mask[start:stop],
            generators=self.generators[start:stop],
            slots=None if self.slots is None else min(self.slots, stop - start),
            first_image=self.first_image + start,
            null=None if self.null is None else tuple(x if x is None else x[start:stop] for x in self.null),
        )


def run_images(request: Request, name: str, options: dict, start: int, stop: int) -> tuple:
    """Method `name` with `options` on the request's images [start, stop), as a call of their own
    (`decode_queue`)."""
    return decode_queue(request.images(start, stop), get_method(name), options)


def decode_queue(request: Request, method: Method, options: dict) -> tuple:
    """The method on the request's images, each handed to `request.on_image` once, as it is done: a
    running batch of `request.slots` for a method that refills (`Method.refills`), consecutive batches
    of them for the others, else one call whose images are handed over at its end."""
    if request.slots is not None and method.refills:
        return method.fn(request, **options)
    if request.slots is not None:
        return consecutive_batches(request, request.slots, lambda batch: method.fn(batch, **options))
    tokens, stats = method.fn(replace(request, on_image=None), **options)
    if request.on_image is not None:
        hand_over_images(request, 0, tokens, stats)
    return tokens, stats


def consecutive_batches(request: Request, size: int | None, decode: Callable) -> tuple:
    """The request's images as consecutive batches of at most `size` (None: one batch): decode(the
    request of images [start, stop) alone) -> their (tokens, stats), each batch's images handed to
    request.on_image when it is done -> the batches' tokens concatenated, their stats merged. How a
    method that does not refill decodes a running batch: ar's slots all free at once anyway."""
    images = request.cond.shape[0]
    size = min(size or images, images)
    parts = []
    for start in range(0, images, size):
        stop = min(start + size, images)
        parts.append(decode(replace(request.images(start, stop), slots=None, on_image=None)))
        if request.on_image is not None:
            hand_over_images(request, start, *parts[-1])
    if len(parts) == 1:
        return parts[0]
    return concat_batches([tokens for tokens, _ in parts]), merge_batch_stats([stats for _, stats in parts])


def hand_over_images(request: Request, start: int, tokens, stats: dict):
    """A finished batch of the request's images [start, ...): its tokens and stats -> each image's
    `Request.hand_over` (its tokens, {"forward_passes", "commit_pass"}, each other NAME_per_image
    statistic as NAME and, under auto, what auto ran), as a running batch hands over each image."""
    counted = [key for key in stats if key.endswith("_per_image")]  # forward_passes_per_image among them
    images = zip(per_image(tokens), per_image(stats["commit_pass"]), strict=True)
    for i, (image_tokens, commit_pass) in enumerate(images):
        info = {key.removesuffix("_per_image"): stats[key][i] for key in counted} | {"commit_pass": commit_pass}
        if "auto" in stats:
            info["auto"] = stats["auto"]
        request.hand_over(start + i, image_tokens, info)


@dataclass(frozen=True)
class Method:
    name: str
    fn: Callable
    lossless: bool  # exact at every setting of its options
    description: str
    model_kind: str = "raster"  # the model interface it decodes (visar.models.base)
    # (options with defaults filled in, model) -> exact at these settings; with `exact_when_text`
    # saying which, and `exact_example`, options that make it exact on any model (for the tests).
    exact_when: Callable[[dict, object], bool] | None = None
    exact_when_text: str = ""
    exact_example: dict = field(default_factory=dict)
    needs_draft: bool = False  # cannot run without a second model of the same family
    # the option that takes a second model (a name, folder, Pipeline or model, resolved by the
    # pipeline): `draft` for drafters, `refiner` for code's refiner; needed or optional (lantern)
    draft_option: str = "draft"
    requires: tuple[str, ...] = ()  # model attributes it needs beyond its kind's interface
    # an image's tokens do not depend on the rest of its batch (False for `auto`, whose choices are
    # made for the batch size: the same law, other random numbers)
    batch_invariant: bool = True
    # decodes a running batch (`Request.slots`): a finished image's slot is refilled from the queue;
    # False: its running batch is decoded as consecutive batches of `slots` images (`consecutive_batches`)
    refills: bool = False

    @property
    def options(self) -> list[str]:
        """The method's keyword-only parameters (everything after the request)."""
        return list(self.defaults)

    @property
    def defaults(self) -> dict:
        parameters = inspect.signature(self.fn).parameters.values()
        return {p.name: p.default for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}

    @property
    def lossless_label(self) -> str:
        """ "lossless", "lossy", or "lossy (exact when ...)" for listings."""
        if self.lossless:
            return "lossless"
        return f"lossy (exact when {self.exact_when_text})" if self.exact_when else "lossy"

    def is_lossless(self, options: dict, model) -> bool:
        """Whether the method samples the model's exact law with these options on this model."""
        if self.lossless:
            return True
        return self.exact_when is not None and bool(self.exact_when({**self.defaults, **options}, model))

    def check_options(self, options: dict):
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            known = ", ".join(self.options) or "none"
            raise VisarError(f"unknown option(s) {unknown} for method {self.name!r}; its options: {known}")

    def missing(self, model) -> list[str]:
        """The model attributes this method requires (`requires`) that the model does not declare."""
        return [need for need in self.requires if getattr(model, need, None) is None]

    def fits(self, model) -> bool:
        """The method decodes this model: its kind, and every attribute it requires."""
        return model_kind(model) == self.model_kind and not self.missing(model)

    def check_model(self, model, name: str | None = None):
        """One clear error when the model is not of the kind this method decodes; `name`: what the user
        called the model (the pipeline's name), else its class."""
        name = name or type(model).__name__
        kind = model_kind(model)
        if kind != self.model_kind:
            what = f"a {kind} model" if kind else "a model of no declared kind (no model_kind)"
            raise VisarError(
                f"method {self.name!r} decodes {self.model_kind} models; {name} is {what}: "
                f"see `visar methods` for the methods of each kind"
            )
        missing = self.missing(model)
        if missing:
            raise VisarError(
                f"method {self.name!r} needs a model that declares {', '.join(missing)}; {name} does not "
                "(see `visar methods`)"
            )


METHODS: dict[str, Method] = {}


def register_method(name: str, *, lossless: bool, description: str, **properties) -> Callable[[Callable], Callable]:
    """Decorator: register the decorated function as decoding method `name` (`Method`'s fields as keywords)."""

    def register(fn: Callable) -> Callable:
        if name in METHODS:
            raise VisarError(f"method {name!r} is registered twice")
        METHODS[name] = Method(name, fn, lossless, description, **properties)
        return fn

    return register


def get_method(name: str) -> Method:
    if not isinstance(name, str) or name not in METHODS:
        raise VisarError(f"unknown method {name!r}; available: {', '.join(sorted(METHODS))}")
    return METHODS[name]


def list_methods() -> list[str]:
    return sorted(METHODS)


def methods_for(model) -> list[str]:
    """The registered methods that decode `model` (its kind, and what each requires beyond it), in
    registration order: the kind's reference first (`visar.accel` imports it first)."""
    return [name for name, method in METHODS.items() if method.fits(model)]


# The method each kind's accelerated methods are compared with, and what a command runs without --method.
REFERENCE_METHODS = {"raster": "ar", "next-scale": "var", "masked": "maskgit", "continuous": "mar"}


def reference_method(model) -> str:
    """The reference decoding of the model's kind: plain AR, plain next-scale (VAR), MaskGIT's loop, plain MAR."""
    return REFERENCE_METHODS.get(model_kind(model), "ar")
