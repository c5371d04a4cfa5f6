"""What a `generate` call conditions on, checked and laid out one row per image: class ids, prompts,
negative prompts, how many images of each, each image's seed, and the sampling settings.

The functions take the model (its condition layout, device and dtype), the pipeline's name (for the
messages) and its text encoder; `image_conditions` takes the pipeline and goes through its public
`condition` and `negative_condition`.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from ..accel.core.sampling import MAX_SEED, SamplingParams
from ..errors import VisarError


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


def condition(model, name: str, text_encoder, class_labels, prompts, caption_embeds, caption_mask):
    """The condition of class_labels= or of prompts= / caption_embeds=, and its valid positions (None for
    class ids): `class_condition`, `text_condition`."""
    if class_labels is not None:
        return class_condition(model, name, class_labels), None
    if prompts is not None or caption_embeds is not None:
        return text_condition(model, name, text_encoder, prompts, caption_embeds, caption_mask)
    raise VisarError("nothing to condition on: pass class_labels= or prompts=")


def class_condition(model, name: str, class_labels) -> Tensor:
    """class_labels= -> class ids [B] on the model's device, each checked against its classes (`name`:
    the pipeline's, for the message)."""
    layout = model.condition_layout
    if layout.kind != "class":
        raise VisarError(f"{name} is text-conditional: pass prompts=, not class_labels=")
    labels = integer_labels(class_labels)
    bad = labels[(labels < 0) | (labels >= layout.num_classes)]
    if bad.numel():
        raise VisarError(f"class id {bad[0].item()} out of range: {name} has classes 0..{layout.num_classes - 1}")
    return labels.to(model.device)


def text_condition(
    model, name: str, text_encoder, prompts, caption_embeds, caption_mask
) -> tuple[Tensor, Tensor | None]:
    """prompts= encoded by the text encoder, or caption_embeds= (and caption_mask=) as given -> the
    condition [B, T, ...] on the model's device and its valid positions [B, T] (or None)."""
    if model.condition_layout.kind == "class":
        raise VisarError(f"{name} is class-conditional: pass class_labels=, not prompts=")
    if caption_embeds is not None:
        mask = None if caption_mask is None else torch.as_tensor(caption_mask).bool().to(model.device)
        return torch.as_tensor(caption_embeds).to(model.device, model.dtype), mask
    if prompts is None:
        raise VisarError("a text-conditional model needs prompts= (or caption_embeds=)")
    if text_encoder is None:
        layout = model.condition_layout
        raise VisarError(
            f"{name} has no text encoder: load it with text_encoder= (a T5 folder or Hub name, e.g. "
            f"google/flan-t5-xl), or pass caption_embeds= [B, {layout.num_tokens}, {layout.embed_dim}]"
        )
    embeds, mask = text_encoder.encode(prompt_list(prompts))
    return on_model(embeds, model), mask.to(model.device)


def null_rows(model, images: ImageConditions, guided: bool, own: bool = False) -> tuple | None:
    """The null conditions guidance pairs the images with, one row each, made by the model under their
    negative prompt -> (null [N, ...], null_mask [N, T] or None); None without guidance, or where the
    images have no negative prompt and the model makes its own at the decode (unless `own`: its own then)."""
    if not guided or (images.negative is None and not own):
        return None
    with ExitStack() as held:
        if images.negative is not None:
            held.enter_context(model.negative_prompt(*images.negative))
        null, null_mask = model.null_condition(images.cond), model.null_condition_mask(images.cond_mask)
    return null, None if null_mask is None else null_mask.expand(images.count, -1)


def negative_condition(model, name: str, text_encoder, negative_prompt, num_items: int) -> tuple[Tensor, Tensor]:
    """generate's negative_prompt= (one for every item, or one per item) -> the encoded negative prompt
    of each item: the condition [num_items, T, ...] the model's null_condition returns in its place,
    and its valid positions [num_items, T]."""
    if model.condition_layout.kind == "class":
        raise VisarError(
            f"{name} is class-conditional: a negative prompt replaces the unconditional prompt of a "
            "text-conditional model, and this one has no prompt (its null class is its unconditional branch)"
        )
    negatives = negative_prompt_list(negative_prompt, num_items)
    if text_encoder is None:
        raise VisarError(
            f"{name} has no text encoder to encode negative_prompt= with: load it with text_encoder= (a T5 "
            "folder or Hub name)"
        )
    embeds, mask = text_encoder.encode_negative(negatives)
    embeds = on_model(embeds, model)
    # one negative prompt for every item is encoded once
    return embeds.expand(num_items, *embeds.shape[1:]), mask.to(model.device).expand(num_items, -1)


def on_model(embeds: Tensor, model) -> Tensor:
    """Encoded prompts on the model's device: caption embeddings in the model's dtype, token ids (a
    Hugging Face model's prompt) left ids."""
    return embeds.to(model.device, model.dtype) if embeds.is_floating_point() else embeds.to(model.device)


def image_conditions(pipe, class_labels, prompts, caption_embeds, caption_mask, negative_prompt, copies):
    """`pipe`'s conditions for the call, one row per image (item i's `copies` images next to each other,
    as diffusers lays out num_images_per_prompt), and the negative prompt's, if any."""
    copies = check_images_per_item(copies)
    cond, cond_mask = pipe.condition(class_labels, prompts, caption_embeds, caption_mask)
    items = cond.shape[0]
    if items == 0:
        raise VisarError("nothing to generate: the class labels or prompts are empty (one image per entry)")
    if items * copies > MAX_IMAGES_PER_CALL:  # its conditions alone would not fit in memory
        raise VisarError(
            f"one call generates at most {MAX_IMAGES_PER_CALL:,} images, not {items} x {copies:,}: split it "
            "into calls (`visar generate` queues any number)"
        )
    negative = None if negative_prompt is None else pipe.negative_condition(negative_prompt, items)
    if copies > 1:
        cond, cond_mask = repeat_items(cond, copies), repeat_items(cond_mask, copies)
        negative = None if negative is None else tuple(repeat_items(part, copies) for part in negative)
    return ImageConditions(cond, cond_mask, negative, items, copies)


# The sampling settings a call takes by name (Pipeline.generate, open_batch, settle_auto).
SAMPLING_SETTINGS = ("guidance_scale", "temperature", "top_k", "top_p", "entropy_temperature")


def sampling_params(
    defaults: dict, guidance_scale, temperature, top_k, top_p, entropy_temperature=None
) -> SamplingParams:
    """The sampling settings given, the pipeline's `defaults` for those left None. The entropy temperature
    takes the temperature's place: where it is on (given or a default) and no temperature is given, the
    temperature is 1 whatever its default (0.7 gives way to entropy_temperature=1.4); a temperature given
    alone turns a default entropy temperature off; given both, the temperature must be 1."""
    given = {
        "guidance_scale": guidance_scale,
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "entropy_temperature": entropy_temperature,
    }
    merged = {k: (defaults.get(k) if v is None else v) for k, v in given.items()}
    if merged["top_k"] == 0:  # 0 is the CLI's "off"
        merged["top_k"] = None
    if merged["entropy_temperature"] is not None and temperature is None:
        merged["temperature"] = 1.0
    if temperature is not None and entropy_temperature is None:
        merged["entropy_temperature"] = None
    return SamplingParams(**merged)


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


def check_seed(seed, batch: int):
    """seed + i seeds image i's generator: a whole number with seed + batch - 1 within torch's range."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise VisarError(f"seed must be a whole number, got {seed!r}")
    if not 0 <= seed <= MAX_SEED - (batch - 1):
        raise VisarError(f"seed must be between 0 and {MAX_SEED - (batch - 1)} for {batch} images, got {seed}")
