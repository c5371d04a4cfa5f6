"""A decoding method's run over a `generate` call's images: alone, as a running batch or in consecutive
batches, with the negative prompt held on the models, and each image handed over as it is done.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..accel import Request
from ..accel.core.stats import per_image
from ..errors import VisarError


def out_of_memory(err: Exception, batch: int, method: str, device: torch.device) -> VisarError:
    """The error for a generation that ran out of device memory, naming what lowers it."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return VisarError(
        f"out of {device.type} memory generating {batch} images with {method!r} on {device}: lower the batch size "
        "(--batch-size, or fewer labels / prompts per call), use a smaller window for window methods "
        "(--opt window=4), or a smaller dtype (--dtype bf16)"
    )


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
