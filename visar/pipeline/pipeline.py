"""The `Pipeline` every command, benchmark and demo goes through (`visar.load` builds it: `visar.loading`).

The pipeline holds a model (implementing its kind's interface, `visar.models.base`), the tokenizer
its family pairs it with, and default sampling settings. It resolves everything a decoding method
must not know about (model names, draft models, tokenizers) before the method runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from ..accel import Request, get_method, reference_method
from ..accel.core.method_registry import consecutive_batches, hand_over_batch
from ..accel.core.sampling import SamplingParams
from ..accel.core.timing import synchronized_clock
from ..errors import VisarError
from ..models.base import MaskedModel, NextScaleModel, RasterModel, model_kind
from ..models.outputs import output_maps
from ..tokenizers.base import TokenGridTokenizer
from . import drafts
from .compiling import COMPILED_SHAPES, EagerFallback, warn_eager
from .conditions import (
    MAX_IMAGES_PER_CALL,
    ImageConditions,
    check_images_per_item,
    image_generators,
    integer_labels,
    negative_prompt_list,
    prompt_list,
    repeat_items,
)
from .drafts import LOADED_DRAFTS, same_tokenizer
from .runs import Run, check_batch_size, deterministic_algorithms, hand_over_images, out_of_memory, text_models


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
                LOADED_DRAFTS[key] = drafts.DRAFT_LOADER(draft, device=self.device, dtype=self.dtype)
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
