"""The `Pipeline` every command, benchmark and demo goes through (`visar.load` builds it: `visar.loading`).

The pipeline holds a model (implementing its kind's interface, `visar.models.base`), the tokenizer
its family pairs it with, and default sampling settings. It resolves everything a decoding method
must not know about (model names, draft models, tokenizers) before the method runs. Its steps are
functions beside it, each taking what it needs: `conditions.py` (what a call conditions on),
`runs.py` (the method's run over the call's images), `images.py` (tokens -> images, the output),
`compiling.py` and `drafts.py`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..errors import VisarError
from ..models.base import MaskedModel, NextScaleModel, RasterModel, check_kv_evict, model_kind
from ..tokenizers.base import TokenGridTokenizer
from .compiling import EagerFallback, compile_forward
from .conditions import (
    class_condition,
    condition,
    image_conditions,
    image_generators,
    negative_condition,
    sampling_params,
    text_condition,
)
from .drafts import check_draft_tokenizer, loaded_draft
from .images import GenerationOutput, check_output_type, generation_output, output_images, tokens_to_images
from .open_batch import OpenBatch
from .runs import (
    Run,
    check_batch_size,
    check_deterministic,
    check_kv_keep,
    checked_method,
    decode_images,
    method_request,
    resolve_method,
    second_model,
    settle_auto,
)


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
        self.recipe = dict(recipe or {})  # config.json's "recipe", for evaluations; the pipeline does not read it
        self.compile_options: dict | None = None  # each engine pass's torch.compile options (None: eager)

    def compile(self, *, whole_passes: bool = False, **compile_kwargs) -> Pipeline:
        """torch.compile the generator's forward in place (compile_kwargs to torch.compile, `dynamic=False`
        by default), and with whole_passes each pass of the raster engines that draft; where compiling fails,
        eager again with one warning. The shapes, whole passes and the fallback: `visar/pipeline/compiling.py`."""
        compile_kwargs.setdefault("dynamic", False)
        self.compile_options = dict(compile_kwargs) if whole_passes else None
        compile_forward(self.model, compile_kwargs)
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

    def condition(self, class_labels=None, prompts=None, caption_embeds=None, caption_mask=None):
        return condition(self.model, self.name, self.text_encoder, class_labels, prompts, caption_embeds, caption_mask)

    def class_condition(self, class_labels) -> Tensor:
        return class_condition(self.model, self.name, class_labels)

    def text_condition(self, prompts, caption_embeds, caption_mask) -> tuple[Tensor, Tensor | None]:
        return text_condition(self.model, self.name, self.text_encoder, prompts, caption_embeds, caption_mask)

    def negative_condition(self, negative_prompt, num_items: int) -> tuple[Tensor, Tensor]:
        return negative_condition(self.model, self.name, self.text_encoder, negative_prompt, num_items)

    def sampling_params(self, guidance_scale=None, temperature=None, top_k=None, top_p=None, entropy_temperature=None):
        return sampling_params(self.defaults, guidance_scale, temperature, top_k, top_p, entropy_temperature)

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
        entropy_temperature: float | None = None,
        output_type: str = "pil",
        caption_embeds=None,
        caption_mask=None,
        progress: bool = False,
        batch_size: int | None = None,
        on_image: Callable[[int, Any, dict], None] | None = None,
        kv_keep: float = 1.0,
        kv_evict: str = "h2o",
        deterministic: bool = False,
        **method_options,
    ) -> GenerationOutput:
        """Generate `num_images_per_prompt` images (default 1) per class label / prompt with `method` (None:
        plain sampling; "auto": the fastest lossless method here, timed on the first calls' own images, or
        chosen before any image with deterministic=True, stats["auto"] naming it) and
        `method_options` for it; sampling settings left None take the model's defaults (`self.defaults`).
        Every argument, the seeds, the stats, the guarantees: docs/GENERATE.md; bad input: one VisarError."""
        check_output_type(output_type)
        method, decoding_method = checked_method(self.model, self.name, method, method_options)
        params = self.sampling_params(guidance_scale, temperature, top_k, top_p, entropy_temperature)
        kv_keep, kv_evict = self.check_kv_keep(kv_keep), check_kv_evict(kv_evict)
        check_deterministic(deterministic)
        images = image_conditions(
            self, class_labels, prompts, caption_embeds, caption_mask, negative_prompt, num_images_per_prompt
        )
        slots = check_batch_size(batch_size, images.count)
        generators = image_generators(generator, seed, images)
        second_model(decoding_method, method_options, self.resolve_draft)  # a draft by name, resolved in place
        request = method_request(self, images, params, generators, progress, kv_keep=kv_keep, kv_evict=kv_evict)
        run = Run(decoding_method, request, method_options)
        tokens, stats = decode_images(self.model, run, slots, deterministic, on_image)
        lossless = decoding_method.is_lossless(method_options, self.model) and kv_keep == 1
        stats = {**stats, "method": method, "lossless": lossless, "batch_size": images.count}
        stats |= {"deterministic": True} if deterministic else {}
        stats |= {"kv_keep": kv_keep, "kv_evict": kv_evict} if kv_keep < 1 else {}
        return generation_output(self, tokens, stats, output_type)

    def open_batch(self, method: str, slots: int, **settings) -> OpenBatch:
        """A running batch of `slots` that images join while it decodes (visar.pipeline.open_batch); settings:
        output_type, kv_keep, kv_evict, progress, the sampling settings and the method's options."""
        return OpenBatch(self, method, slots, **settings)

    def settle_auto(self, class_labels=None, prompts=None, **generate_kwargs) -> tuple[str, str] | None:
        """auto's choice for a run of such generate calls, made before any image (pipeline/runs.py settle_auto)."""
        return settle_auto(self, class_labels, prompts, **generate_kwargs)

    def check_kv_keep(self, kv_keep) -> float:
        return check_kv_keep(self.model, self.name, kv_keep)

    def resolve_method(self, method: str | None) -> str | None:
        return resolve_method(self.model, method)

    def resolve_draft(self, draft) -> RasterModel:
        return resolved_draft(draft, self)

    def decode(self, tokens: Tensor | list[Tensor]) -> Tensor:
        return tokens_to_images(self.tokenizer, self.name, tokens)

    def to_output(self, images: Tensor, output_type: str):
        return output_images(self.tokenizer, images, output_type)

    @torch.no_grad()
    def logits(self, tokens: Tensor, class_labels=None, prompts=None, caption_embeds=None, caption_mask=None) -> Tensor:
        """Teacher-forced conditional next-token logits [B, N, V]: row i predicts tokens[:, i] (raster models)."""
        return teacher_forced_logits(self, tokens, class_labels, prompts, caption_embeds, caption_mask)


def resolved_draft(draft, target: Pipeline) -> RasterModel:
    """A second model (a draft, or code's refiner) given as a registered name or folder (loaded once per
    process: `drafts.loaded_draft`), a Pipeline (whose tokenizer must be the target's), or a model -> the
    model (`Pipeline.resolve_draft`)."""
    if isinstance(draft, (str, os.PathLike)):
        draft = loaded_draft(draft, target.device, target.dtype)
    if not isinstance(draft, Pipeline):
        return draft
    check_draft_tokenizer(draft.tokenizer, target.tokenizer)
    return draft.model


def teacher_forced_logits(pipe: Pipeline, tokens, class_labels, prompts, caption_embeds, caption_mask) -> Tensor:
    """`pipe`'s raster model's next-token logits [B, N, V] for the token grids `tokens` under the condition,
    in one pass with the true tokens as input: row i predicts tokens[:, i] (`Pipeline.logits`)."""
    model = pipe.model
    if model_kind(model) != "raster":
        raise VisarError(
            f"Pipeline.logits is for raster models; {pipe.name} is a {model_kind(model)} model (for VAR: "
            "pipe.model(labels, pipe.tokenizer.teacher_forcing_inputs(scale_tokens)))"
        )
    cond, cond_mask = pipe.condition(class_labels, prompts, caption_embeds, caption_mask)
    tokens = torch.as_tensor(tokens).reshape(cond.shape[0], -1).to(model.device)
    num_cond = model.num_condition_tokens
    length = num_cond + tokens.shape[1] - 1
    model.setup_cache(cond.shape[0], length, cond_mask)
    try:
        out = model(tokens[:, :-1], cond, input_pos=torch.arange(length, device=model.device))
    finally:
        model.clear_cache()
    return out[:, num_cond - 1 :]
