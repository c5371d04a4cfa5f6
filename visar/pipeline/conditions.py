"""What a `generate` call conditions on, checked and laid out one row per image: class ids, prompts,
negative prompts, how many images of each, and each image's seed.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from ..accel.core.sampling import MAX_SEED
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
