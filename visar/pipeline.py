"""The `Pipeline` every command, benchmark and demo goes through (`visar.load` builds it: `visar.loading`).

The pipeline holds a model (implementing its kind's interface, `visar.models.base`), the tokenizer
its family pairs it with, and default sampling settings. It resolves everything a decoding method
must not know about (model names, draft models, tokenizers) before the method runs.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, NamedTuple

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from .accel import Request, get_method, reference_method
from .accel.core.method_registry import consecutive_batches, hand_over_batch
from .accel.core.sampling import MAX_SEED, SamplingParams
from .accel.core.stats import per_image
from .accel.core.timing import synchronized_clock
from .accel.raster.pass_loop import compile_failure
from .errors import VisarError
from .models.base import MaskedModel, NextScaleModel, RasterModel, model_kind
from .models.outputs import output_maps
from .tokenizers.base import TokenGridTokenizer


def out_of_memory(err: Exception, batch: int, method: str, device: torch.device) -> VisarError:
    """The error for a generation that ran out of device memory, naming what lowers it."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return VisarError(
        f"out of {device.type} memory generating {batch} images with {method!r} on {device}: lower the batch size "
        "(--batch-size, or fewer labels / prompts per call), use a smaller window for window methods "
        "(--opt window=4), or a smaller dtype (--dtype bf16)"
    )


@dataclass
class GenerationOutput:
    """images: per output_type (None for "tokens"). tokens, per model kind: raster and masked models
    give the token grid, a LongTensor [B, h, w] (h, w = the model's grid_size); continuous models (MAR) the
    float latent [B, C, h * p, w * p] their VAE decodes (scaled as the model sees it); next-scale
    models (VAR) a list of LongTensors [B, pn, pn], one per scale, small to large. stats: docs/GENERATE.md,
    "`Pipeline.generate`"."""

    images: list[Image.Image] | Tensor | np.ndarray | None
    tokens: Tensor | list[Tensor]
    stats: dict[str, Any] = field(default_factory=dict)


OUTPUT_TYPES = ("pil", "pt", "np", "tokens")


class ImageConditions(NamedTuple):
    """A call's conditions, one row per image: cond [N, ...], cond_mask [N, T] or None, the negative
    prompt's (cond, mask) or None; `items` class labels / prompts, `copies` images of each."""

    cond: Tensor
    cond_mask: Tensor | None
    negative: tuple[Tensor, Tensor] | None
    items: int
    copies: int

    @property
    def count(self) -> int:
        return self.cond.shape[0]


class Run(NamedTuple):
    """One method call's arguments (`Pipeline.run_method`): the method, its request, the negative
    prompt (or None), its second model (draft / refiner, or None) and its options."""

    method: Any
    request: Request
    negative: tuple[Tensor, Tensor] | None
    second: Any
    options: dict

    @property
    def name(self) -> str:
        return self.method.name


def image_generators(generator, seed, images: ImageConditions) -> list[torch.Generator]:
    """One generator per image: generator= as given (one per image, or one for a single image), else image
    j of item i (of P items) seeded seed + j * P + i (`item_seeds`)."""
    if generator is None:
        check_seed(seed, images.count)
        return [torch.Generator().manual_seed(s) for s in item_seeds(images.items, images.copies, seed)]
    generators = [generator] if isinstance(generator, torch.Generator) else list(generator)
    if not all(isinstance(g, torch.Generator) for g in generators):
        raise VisarError("generator= takes a torch.Generator or a list of them, one per image")
    if len(generators) != images.count:
        raise VisarError(f"got {len(generators)} generators for {images.count} images: pass one per image")
    return generators


def same_tokenizer(a: TokenGridTokenizer, b: TokenGridTokenizer) -> bool:
    """Do token ids mean the same images under both? Same object, or equal weights (codebook and decoder).

    Every tensor pair is compared where it lies and the answers are read back once: a check per
    tensor (a VQ has about 180) would make a GPU wait that many times before the first pass."""
    if a is b:
        return True
    if hasattr(a, "codebook") != hasattr(b, "codebook"):
        return False
    state_a, state_b = a.state_dict(), b.state_dict()
    if state_a.keys() != state_b.keys() or (hasattr(a, "codebook") and a.vocab_size != b.vocab_size):
        return False
    pairs = [(state_a[k], state_b[k]) for k in state_a]
    if hasattr(a, "codebook"):
        pairs.append((a.codebook(), b.codebook()))
    if any(x.shape != y.shape for x, y in pairs):
        return False
    equal = [(x.detach() == y.detach().to(x.device)).all() for x, y in pairs]
    return bool(torch.stack(equal).all()) if equal else True


# Input shapes a compiled generator compiles before new ones run eagerly (torch's default is 8).
COMPILED_SHAPES = 32


def warn_eager(module: torch.nn.Module, err: Exception):
    warnings.warn(
        f"torch.compile failed on this platform ({compile_failure(err)}); {type(module).__name__} runs "
        "eagerly instead (the same outputs, without the compiled speed-up)",
        RuntimeWarning,
        stacklevel=3,
    )


class EagerFallback:
    """A module's forward compiled with torch.compile, and its eager forward again once compiling fails.

    torch.compile is lazy: a platform where compilation cannot work fails at the first call (or at
    the first call of a new shape), not at torch.compile. That call is rerun eagerly; if the eager
    run succeeds the failure was the compiler's, so the module gets its own forward back, with one
    warning; if it fails too, the error is the model's, and the eager run's error is raised.
    """

    def __init__(self, module: torch.nn.Module, **compile_kwargs):
        self.module, self.eager = module, module.forward
        self.compiled = torch.compile(self.eager, **compile_kwargs)

    def __call__(self, *args, **kwargs):
        try:
            return self.compiled(*args, **kwargs)
        except Exception as err:
            out = self.eager(*args, **kwargs)
            if self.module.__dict__.get("forward") is self:
                del self.module.forward  # the class's forward again, for every later call
            warn_eager(self.module, err)
            return out


LOADED_DRAFTS: dict[tuple, Pipeline] = {}  # (name, device, dtype) -> loaded draft pipeline
# Loads a draft given by name or folder: visar.load, which visar.loading sets here (the loader builds
# Pipelines, so the pipeline cannot import it back; importing this module runs visar/__init__.py,
# which imports the loader first).
DRAFT_LOADER: Callable[..., Pipeline] | None = None


class Pipeline:
    """A generator (a model of a registered family) with its tokenizer and default sampling settings."""

    def __init__(
        self,
        model: RasterModel | NextScaleModel | MaskedModel,
        tokenizer: TokenGridTokenizer | None,
        *,
        name: str,
        defaults: dict | None = None,
        class_names: list[str] | None = None,
        text_encoder=None,
        recipe: dict | None = None,
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer.eval() if tokenizer is not None else None
        self.name = name
        self.defaults = {"guidance_scale": 1.0, "temperature": 1.0, "top_k": None, "top_p": 1.0, **(defaults or {})}
        self.class_names = class_names
        self.text_encoder = text_encoder
        # The recipe the model was trained by (config.json "recipe"), for evaluations that compare
        # with its training data; the pipeline itself does not read it.
        self.recipe = dict(recipe or {})
        # torch.compile options each pass of a pass-loop engine runs under (`compile(whole_passes=True)`);
        # None: eager passes
        self.compile_options: dict | None = None

    def compile(self, *, whole_passes: bool = False, **compile_kwargs) -> Pipeline:
        """torch.compile the generator's forward in place, so every method's forward passes use it.

        Static shapes by default (`dynamic=False`): each input shape compiles once, on its first
        call, and the engines keep to few shapes (the prefill, one token, Jacobi windows padded to
        1, 2, 4, 8 or 16 slots); zipar's passes vary in width and recompile per width up to
        `COMPILED_SHAPES`, then run eagerly. Outputs match eager mode up to kernel numerics.
        compile_kwargs go to torch.compile (e.g. mode="reduce-overhead" for CUDA graphs on a GPU).
        whole_passes: the raster engines that draft (`visar.accel.raster.pass_loop`: chains, trees, zipar's
        fronts, lantern++'s static trees) also run each whole pass, their bookkeeping with the model
        call, under torch.compile with these options: one graph a pass (tests/test_compile.py),
        windows and front passes padded to powers of two, so that on a GPU a pass can replay as one
        CUDA graph. Off by default: on a CPU it measured slower than eager passes
        (docs/SPEED.md), and it is not yet measured on a GPU.
        Where compiling fails (no C++ compiler, an unsupported platform or Python), the generator
        runs eagerly from that call on, rerunning it, with one warning saying why (`EagerFallback`).
        """
        compile_kwargs.setdefault("dynamic", False)
        self.compile_options = dict(compile_kwargs) if whole_passes else None
        dynamo = torch._dynamo.config
        limit = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
        setattr(dynamo, limit, max(getattr(dynamo, limit), COMPILED_SHAPES))
        try:
            self.model.forward = EagerFallback(self.model, **compile_kwargs)
        except Exception as err:  # torch.compile refusing outright (e.g. a Python it does not support)
            warn_eager(self.model, err)
        return self

    @property
    def is_compiled(self) -> bool:
        """The generator runs through torch.compile (False again after a compile failure fell back)."""
        return isinstance(self.model.__dict__.get("forward"), EagerFallback)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def is_class_conditional(self) -> bool:
        return self.model.condition_layout.kind == "class"

    @property
    def num_classes(self) -> int:
        return self.model.condition_layout.num_classes

    # -- conditions -------------------------------------------------------------------------
    def class_condition(self, class_labels) -> Tensor:
        if not self.is_class_conditional:
            raise VisarError(f"{self.name} is text-conditional: pass prompts=, not class_labels=")
        labels = integer_labels(class_labels)
        bad = labels[(labels < 0) | (labels >= self.num_classes)]
        if bad.numel():
            raise VisarError(
                f"class id {bad[0].item()} out of range: {self.name} has classes 0..{self.num_classes - 1}"
            )
        return labels.to(self.device)

    def text_condition(self, prompts, caption_embeds, caption_mask) -> tuple[Tensor, Tensor | None]:
        if self.is_class_conditional:
            raise VisarError(f"{self.name} is class-conditional: pass class_labels=, not prompts=")
        if caption_embeds is not None:
            mask = None if caption_mask is None else torch.as_tensor(caption_mask).bool().to(self.device)
            return torch.as_tensor(caption_embeds).to(self.device, self.dtype), mask
        if prompts is None:
            raise VisarError("a text-conditional model needs prompts= (or caption_embeds=)")
        if self.text_encoder is None:
            layout = self.model.condition_layout
            raise VisarError(
                f"{self.name} has no text encoder: load it with text_encoder= (a T5 folder or Hub name, e.g. "
                f"google/flan-t5-xl), or pass caption_embeds= [B, {layout.num_tokens}, {layout.embed_dim}]"
            )
        prompts = prompt_list(prompts)
        embeds, mask = self.text_encoder.encode(prompts)
        # Caption embeddings take the model's dtype; token ids (a Hugging Face model's prompt) stay ids.
        embeds = embeds.to(self.device, self.dtype) if embeds.is_floating_point() else embeds.to(self.device)
        return embeds, mask.to(self.device)

    def negative_condition(self, negative_prompt, num_items: int) -> tuple[Tensor, Tensor]:
        """generate's negative_prompt= (one for every item, or one per item) -> the encoded negative prompt
        of each item: the condition [num_items, T, ...] the model's null_condition returns in its place,
        and its valid positions [num_items, T]."""
        if self.is_class_conditional:
            raise VisarError(
                f"{self.name} is class-conditional: a negative prompt replaces the unconditional prompt of a "
                "text-conditional model, and this one has no prompt (its null class is its unconditional branch)"
            )
        negatives = negative_prompt_list(negative_prompt, num_items)
        if self.text_encoder is None:
            raise VisarError(
                f"{self.name} has no text encoder to encode negative_prompt= with: load it with text_encoder= (a T5 "
                "folder or Hub name)"
            )
        embeds, mask = self.text_encoder.encode_negative(negatives)
        embeds = embeds.to(self.device, self.dtype) if embeds.is_floating_point() else embeds.to(self.device)
        # one negative prompt for every item is encoded once
        return embeds.expand(num_items, *embeds.shape[1:]), mask.to(self.device).expand(num_items, -1)

    def condition(self, class_labels=None, prompts=None, caption_embeds=None, caption_mask=None):
        if class_labels is not None:
            return self.class_condition(class_labels), None
        if prompts is not None or caption_embeds is not None:
            return self.text_condition(prompts, caption_embeds, caption_mask)
        raise VisarError("nothing to condition on: pass class_labels= or prompts=")

    def sampling_params(self, guidance_scale=None, temperature=None, top_k=None, top_p=None) -> SamplingParams:
        given = {"guidance_scale": guidance_scale, "temperature": temperature, "top_k": top_k, "top_p": top_p}
        merged = {k: (self.defaults[k] if v is None else v) for k, v in given.items()}
        if merged["top_k"] == 0:  # 0 is the CLI's "off"
            merged["top_k"] = None
        return SamplingParams(**merged)

    # -- generation -------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        class_labels=None,
        prompts=None,
        *,
        negative_prompt: str | list[str] | None = None,
        num_images_per_prompt: int = 1,
        method: str | None = None,
        seed: int = 0,
        generator: torch.Generator | list[torch.Generator] | None = None,
        guidance_scale: float | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        output_type: str = "pil",
        caption_embeds=None,
        caption_mask=None,
        progress: bool = False,
        batch_size: int | None = None,
        on_image: Callable[[int, Any, dict], None] | None = None,
        kv_keep: float = 1.0,
        deterministic: bool = False,
        **method_options,
    ) -> GenerationOutput:
        """Generate `num_images_per_prompt` images (default 1) per class label / prompt with `method`
        (None: plain sampling; "auto": the fastest lossless method here, timed on the first calls' own
        images), and `method_options` for it.
        Sampling settings left None take the model's defaults (`self.defaults`). Every argument, the
        seeds, the stats and what is guaranteed: docs/GENERATE.md, "`Pipeline.generate`"; bad input
        raises one VisarError.
        """
        if output_type not in OUTPUT_TYPES:
            raise VisarError(f"output_type must be 'pil', 'pt', 'np' or 'tokens', got {output_type!r}")
        method, decoding_method = self.checked_method(method, method_options)
        params = self.sampling_params(guidance_scale, temperature, top_k, top_p)
        kv_keep = self.check_kv_keep(kv_keep)
        if not isinstance(deterministic, (bool, np.bool_)):
            raise VisarError(f"deterministic must be True or False, got {deterministic!r}")
        images = self.image_conditions(
            class_labels, prompts, caption_embeds, caption_mask, negative_prompt, num_images_per_prompt
        )
        slots = check_batch_size(batch_size, images.count)
        generators = image_generators(generator, seed, images)
        second = self.second_model(decoding_method, method_options)
        request = self.request(images, params, generators, progress, kv_keep)
        run = Run(decoding_method, request, images.negative, second, method_options)
        tokens, stats = self.decode_images(run, slots, deterministic, on_image)
        lossless = decoding_method.is_lossless(method_options, self.model) and kv_keep == 1
        stats = {**stats, "method": method, "lossless": lossless, "batch_size": images.count}
        stats |= {"deterministic": True} if deterministic else {}
        stats |= {"kv_keep": kv_keep} if kv_keep < 1 else {}
        return self.output(tokens, stats, output_type)

    def checked_method(self, method: str | None, options: dict):
        """(name, registered method) for `method` (None: the kind's plain sampling), its options and this
        model checked against it."""
        name = self.resolve_method(method)
        decoding_method = get_method(name)
        decoding_method.check_options(options)
        decoding_method.check_model(self.model, self.name)
        return name, decoding_method

    def second_model(self, decoding_method, options: dict):
        """The method's second model (option `draft`, or code's `refiner`: a registered name, folder, Pipeline or
        model), resolved to a model in `options`; None when it has none."""
        option = decoding_method.draft_option
        if options.get(option) is not None:
            options[option] = self.resolve_draft(options[option])
        return options.get(option)

    def request(self, images: ImageConditions, params: SamplingParams, generators, progress: bool, kv_keep: float):
        passes = self.compile_options if self.is_compiled else None  # eager again after a compile failure
        return Request(
            self.model,
            images.cond,
            params,
            generators,
            images.cond_mask,
            progress,
            tokenizer=self.tokenizer,
            compile_passes=passes,
            kv_keep=kv_keep,
        )

    def image_conditions(self, class_labels, prompts, caption_embeds, caption_mask, negative_prompt, copies):
        """The call's conditions, one row per image (item i's `copies` images next to each other, as
        diffusers lays out num_images_per_prompt), and the negative prompt's, if any."""
        copies = check_images_per_item(copies)
        cond, cond_mask = self.condition(class_labels, prompts, caption_embeds, caption_mask)
        items = cond.shape[0]
        if items == 0:
            raise VisarError("nothing to generate: the class labels or prompts are empty (one image per entry)")
        if items * copies > MAX_IMAGES_PER_CALL:  # its conditions alone would not fit in memory
            raise VisarError(
                f"one call generates at most {MAX_IMAGES_PER_CALL:,} images, not {items} x {copies:,}: split it "
                "into calls (`visar generate` queues any number)"
            )
        negative = None if negative_prompt is None else self.negative_condition(negative_prompt, items)
        if copies > 1:
            cond, cond_mask = repeat_items(cond, copies), repeat_items(cond_mask, copies)
            negative = None if negative is None else tuple(repeat_items(part, copies) for part in negative)
        return ImageConditions(cond, cond_mask, negative, items, copies)

    def decode_images(self, run: Run, slots: int | None, deterministic: bool, on_image):
        """The method over the call's images: each alone (deterministic), as a running batch of `slots`
        (a method that refills), or in consecutive batches of `slots` (the others, ar among them: its
        slots all free at once) -> tokens and stats in the output's shapes; on_image gets each image as
        it is done (a running batch), as its batch is (consecutive batches, one image alone), or all at the end."""
        running = slots is not None and run.method.refills and not deterministic
        try:
            with deterministic_algorithms(self.device, deterministic):
                if deterministic:  # one image a batch: every model call has the shapes of its decode alone
                    tokens, stats = self.run_batches(*run, 1, self.image_done(on_image))
                elif running:
                    request = replace(run.request, slots=slots, on_image=self.image_callback(on_image))
                    tokens, stats = self.run_method(*run._replace(request=request))
                elif slots is not None:
                    tokens, stats = self.run_batches(*run, slots, self.image_done(on_image))
                    images = run.request.cond.shape[0]  # a running batch's counts: its images start `slots` at a time
                    stats.update(slots=slots, refills=images - slots, batch_passes=stats["forward_passes"])
                else:
                    tokens, stats = self.run_method(*run)
        except torch.OutOfMemoryError as err:
            images = run.request.cond.shape[0]
            raise out_of_memory(err, 1 if deterministic else slots or images, run.name, self.device) from err
        tokens, stats["commit_pass"] = output_maps(self.model, tokens, stats["commit_pass"])
        if on_image is not None and slots is None and not deterministic:
            hand_over_images(on_image, 0, tokens, stats)
        return tokens, stats

    def output(self, tokens, stats: dict, output_type: str) -> GenerationOutput:
        """Tokens -> the output_type's images (timed as decode_s), unless "tokens"."""
        images = None
        if output_type != "tokens":
            start = synchronized_clock(self.device)
            images = self.to_output(self.decode(tokens), output_type)
            stats["decode_s"] = synchronized_clock(self.device) - start
        return GenerationOutput(images=images, tokens=tokens, stats=stats)

    def run_method(self, decoding_method, request: Request, negative, second, method_options: dict):
        """One call of the method, with the negative prompt (if any) held on the model and its draft."""
        request = replace(request, images_runner=partial(self.run_images, negative))
        with ExitStack() as held:
            if negative is not None:  # the model's (and its draft's) null_condition returns it meanwhile
                for model in text_models(self.model, second):
                    held.enter_context(model.negative_prompt(*negative))
            return decoding_method.fn(request, **method_options)

    def run_images(self, negative, request: Request, name: str, options: dict, start: int, stop: int):
        """`Request.images_runner`: method `name` on the request's images [start, stop) as a call of
        their own, their rows of the negative prompt held meanwhile (`auto`'s candidates); a running
        batch of them, for a method that does not refill, as consecutive batches of its slots."""
        method, images = get_method(name), request.images(start, stop)
        rows = None if negative is None else tuple(x[start:stop] for x in negative)
        if images.slots is None or method.refills:
            return self.run_method(method, images, rows, None, options)
        return self.run_batches(method, images, rows, None, options, images.slots, hand_over_batch(images.on_image))

    def run_batches(self, decoding_method, request: Request, negative, second, method_options: dict, size, done=None):
        """The method on consecutive batches of at most `size` images (`consecutive_batches`), each with
        its rows of the negative prompt, stats merged; done(start, tokens, stats), if given, after each."""

        def decode(start: int, stop: int, batch: Request):
            rows = None if negative is None else tuple(x[start:stop] for x in negative)
            return self.run_method(decoding_method, batch, rows, second, method_options)

        return consecutive_batches(request, size, decode, done)

    def image_done(self, on_image):
        """A batch of one image's (index, tokens, stats) -> on_image(index, its output tokens, info), as a
        running batch hands an image over (None without on_image)."""
        if on_image is None:
            return None

        def hand_over(index, tokens, stats):
            tokens, commit_pass = output_maps(self.model, tokens, stats["commit_pass"])
            hand_over_images(on_image, index, tokens, {**stats, "commit_pass": commit_pass})

        return hand_over

    def image_callback(self, on_image):
        """A running batch's (index, tokens [N], info with commit_pass [N]) -> on_image(index, the image's
        output tokens, info with its commit_pass in the output's shape)."""
        if on_image is None:
            return None

        def hand_over(index, tokens, info):
            tokens, commit_pass = output_maps(self.model, tokens[None], info["commit_pass"][None])
            on_image(index, tokens[0], {**info, "commit_pass": commit_pass[0]})

        return hand_over

    def check_kv_keep(self, kv_keep) -> float:
        """kv_keep as a float in (0, 1]; a model of another kind than raster takes only 1."""
        if isinstance(kv_keep, bool) or not isinstance(kv_keep, (int, float)) or not 0 < kv_keep <= 1:
            raise VisarError(
                f"kv_keep must be a number in (0, 1] (the fraction of KV-cache slots kept), not {kv_keep!r}"
            )
        if kv_keep != 1 and model_kind(self.model) != "raster":
            raise VisarError(
                f"kv_keep compresses a raster model's KV cache; {self.name} is a {model_kind(self.model)} model"
            )
        return float(kv_keep)

    def resolve_method(self, method: str | None) -> str | None:
        """The method `generate` runs for `method`: None, the model kind's reference; "auto" on a kind
        other than raster, its reference too (no faster lossless method there without a draft)."""
        if method is None or (method == "auto" and model_kind(self.model) != "raster"):
            return reference_method(self.model)
        return method

    def resolve_draft(self, draft) -> RasterModel:
        """A second model (a draft, or code's refiner) given as a registered name or folder, a Pipeline,
        or a model -> the model.

        Names load once per (name, device, dtype) in this process, so a batch loop does not reload
        the draft. A draft with a tokenizer must share this pipeline's: its token ids mean images.
        """
        draft_tokenizer = None
        if isinstance(draft, (str, os.PathLike)):
            key = (str(draft), str(self.device), self.dtype)
            if key not in LOADED_DRAFTS:
                LOADED_DRAFTS[key] = DRAFT_LOADER(draft, device=self.device, dtype=self.dtype)
            draft = LOADED_DRAFTS[key]
        if isinstance(draft, Pipeline):
            draft, draft_tokenizer = draft.model, draft.tokenizer
        if draft_tokenizer is not None and self.tokenizer is not None:
            if not same_tokenizer(draft_tokenizer, self.tokenizer):
                raise VisarError(
                    "the draft model's tokenizer differs from the target's (codebook or decoder): its token ids "
                    "mean other images, so it cannot draft for this model"
                )
        return draft

    def decode(self, tokens: Tensor | list[Tensor]) -> Tensor:
        """tokens [B, h, w] (a list of [B, pn, pn] per scale for next-scale models) -> images [B, 3, H, W] in [0, 1]."""
        if self.tokenizer is None:
            raise VisarError(f"{self.name} has no tokenizer loaded (pass vq_checkpoint=), or use output_type='tokens'")
        device = next(self.tokenizer.parameters()).device
        tokens = [t.to(device) for t in tokens] if isinstance(tokens, (list, tuple)) else tokens.to(device)
        with torch.no_grad():
            images = self.tokenizer.decode(tokens)
        return ((images.float() + 1) / 2).clamp(0, 1)

    def to_output(self, images: Tensor, output_type: str):
        """Images [B, 3, H, W] in [0, 1] -> the output type; 8-bit pixels rounded, or truncated where the
        tokenizer says its model's own code truncates (`pixel_rounding` "floor": Lumina-mGPT 1.0)."""
        if output_type == "pt":
            return images
        scaled = images * 255
        scaled = scaled.floor() if getattr(self.tokenizer, "pixel_rounding", "round") == "floor" else scaled.round()
        array = scaled.to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        return array if output_type == "np" else [Image.fromarray(a) for a in array]

    @torch.no_grad()
    def logits(self, tokens: Tensor, class_labels=None, prompts=None, caption_embeds=None, caption_mask=None) -> Tensor:
        """Teacher-forced conditional next-token logits [B, N, V]: row i predicts tokens[:, i] (raster models)."""
        if model_kind(self.model) != "raster":
            raise VisarError(
                f"Pipeline.logits is for raster models; {self.name} is a {model_kind(self.model)} model (for VAR: "
                "pipe.model(labels, pipe.tokenizer.teacher_forcing_inputs(scale_tokens)))"
            )
        cond, cond_mask = self.condition(class_labels, prompts, caption_embeds, caption_mask)
        tokens = torch.as_tensor(tokens).reshape(cond.shape[0], -1).to(self.device)
        num_cond = self.model.num_condition_tokens
        length = num_cond + tokens.shape[1] - 1
        self.model.setup_cache(cond.shape[0], length, cond_mask)
        try:
            out = self.model(tokens[:, :-1], cond, input_pos=torch.arange(length, device=self.device))
        finally:
            self.model.clear_cache()
        return out[:, num_cond - 1 :]


# -- checking what a caller passes ---------------------------------------------------------------------


def hand_over_images(on_image, start: int, tokens, stats: dict):
    """A batch's output tokens and stats (commit_pass in the output's shape) -> on_image(start + i, image
    i's tokens, its {"forward_passes", "commit_pass"} and, under auto, what auto ran)."""
    images = zip(per_image(tokens), per_image(stats["commit_pass"]), strict=True)
    for i, (image_tokens, commit_pass) in enumerate(images):
        info = {"forward_passes": stats["forward_passes_per_image"][i], "commit_pass": commit_pass}
        if "auto" in stats:
            info["auto"] = stats["auto"]
        on_image(start + i, image_tokens, info)


@contextmanager
def deterministic_algorithms(device: torch.device, enabled: bool):
    """torch's deterministic algorithms for a CUDA call made with deterministic=True (the same shapes then
    give the same bits), restored after; cuBLAS's workspace is fixed first, as torch asks. A CPU's
    kernels are deterministic for a given shape and thread count already."""
    if not enabled or device.type != "cuda":
        yield
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # an op without a deterministic kernel warns
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


def integer_labels(class_labels) -> Tensor:
    """Class ids (an int, a sequence of ints, an integer array or tensor) -> LongTensor [B]; anything else
    (names, fractions, None, nested lists, booleans) is a VisarError rather than a silent cast."""
    if isinstance(class_labels, (Tensor, np.ndarray)):
        labels = torch.as_tensor(class_labels)
        if labels.dtype == torch.bool or labels.is_floating_point() or labels.is_complex():
            raise VisarError(f"class_labels must hold integer class ids, got a {labels.dtype} array")
        return labels.long().reshape(-1)
    values = [class_labels] if isinstance(class_labels, (int, np.integer)) else class_labels
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise VisarError(f"class_labels must be a class id or a list of class ids, got {class_labels!r}")
    values = list(values)
    for value in values:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise VisarError(f"class_labels must be integer class ids, got {value!r}")
    if any(abs(int(value)) >= 2**63 for value in values):
        raise VisarError(f"class id {next(v for v in values if abs(int(v)) >= 2**63)} out of range")
    return torch.tensor([int(value) for value in values], dtype=torch.long)


def prompt_list(prompts) -> list[str]:
    """A prompt or a list of prompts -> a list of non-empty strings (anything else is a VisarError)."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise VisarError(f"prompts must be a string or a list of strings, got {type(prompts).__name__}")
    if not prompts:
        raise VisarError("nothing to generate: the list of prompts is empty (one image per prompt)")
    for prompt in prompts:
        if not isinstance(prompt, str):
            raise VisarError(f"prompts must be strings, got {prompt!r}")
        if not prompt.strip():
            raise VisarError("a prompt is empty: give every image a prompt with some text")
    return list(prompts)


def negative_prompt_list(negative_prompt, num_prompts: int) -> list[str]:
    """negative_prompt= -> a list of one string (for every prompt) or of one per prompt; anything else
    is a VisarError. An empty string passes: whether it can be encoded is the model's encoder's call."""
    negatives = [negative_prompt] if isinstance(negative_prompt, str) else negative_prompt
    if not isinstance(negatives, (list, tuple)) or not all(isinstance(n, str) for n in negatives):
        raise VisarError(f"negative_prompt must be a string or a list of strings, got {type(negative_prompt).__name__}")
    if len(negatives) not in (1, num_prompts):
        raise VisarError(
            f"got {len(negatives)} negative prompts for {num_prompts} prompts: give one for every prompt, or one "
            "per prompt"
        )
    return list(negatives)


# The images one `generate` call takes: their conditions, generators and tokens are held at once.
MAX_IMAGES_PER_CALL = 2**20


def check_images_per_item(num_images_per_prompt) -> int:
    if isinstance(num_images_per_prompt, (bool, np.bool_)) or not isinstance(num_images_per_prompt, (int, np.integer)):
        raise VisarError(f"num_images_per_prompt must be a whole number >= 1, got {num_images_per_prompt!r}")
    if num_images_per_prompt < 1:
        raise VisarError(f"num_images_per_prompt must be at least 1, got {num_images_per_prompt}")
    return int(num_images_per_prompt)


def repeat_items(x: Tensor | None, copies: int) -> Tensor | None:
    """[P, ...] -> [P * copies, ...]: row i repeated `copies` times in place (item-major)."""
    return None if x is None else x.repeat_interleave(copies, dim=0)


def item_seeds(num_items: int, copies: int, seed: int) -> list[int]:
    """The seed of each image of an item-major batch: image j of item i (at i * copies + j) gets
    seed + j * num_items + i, the batch tool's image g = j * P + i (item g mod P, seed SEED + g)."""
    return [seed + j * num_items + i for i in range(num_items) for j in range(copies)]


def text_models(model, draft) -> list:
    """The models a negative prompt is held on: the target, and a draft that reads the same prompts."""
    models = [model]
    if draft is not None and hasattr(draft, "negative_prompt") and draft.condition_layout.kind == "text":
        models.append(draft)
    return models


def check_batch_size(batch_size, num_images: int) -> int | None:
    """batch_size -> the slots to decode at once, None for all; one sentence for a bad value."""
    if batch_size is None:
        return None
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise VisarError(f"batch_size must be a whole number >= 1, got {batch_size!r}")
    if batch_size > num_images:
        raise VisarError(
            f"batch_size {batch_size} is larger than the {num_images} images asked for: give at most {num_images}"
        )
    return batch_size


def check_seed(seed, batch: int):
    """seed + i seeds image i's generator: a whole number with seed + batch - 1 within torch's range."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise VisarError(f"seed must be a whole number, got {seed!r}")
    if not 0 <= seed <= MAX_SEED - (batch - 1):
        raise VisarError(f"seed must be between 0 and {MAX_SEED - (batch - 1)} for {batch} images, got {seed}")
