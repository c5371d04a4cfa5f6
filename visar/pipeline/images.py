"""What `generate` returns: `GenerationOutput`, its output types, and token grids decoded to images."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from ..accel.core.timing import synchronized_clock
from ..errors import VisarError


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


def check_output_type(output_type):
    if output_type not in OUTPUT_TYPES:
        raise VisarError(f"output_type must be 'pil', 'pt', 'np' or 'tokens', got {output_type!r}")


def generation_output(pipe, tokens, stats: dict, output_type: str) -> GenerationOutput:
    """Tokens -> the output_type's images by `pipe`'s decode and to_output (timed as decode_s), unless
    "tokens"."""
    images = None
    if output_type != "tokens":
        start = synchronized_clock(pipe.device)
        images = pipe.to_output(pipe.decode(tokens), output_type)
        stats["decode_s"] = synchronized_clock(pipe.device) - start
    return GenerationOutput(images=images, tokens=tokens, stats=stats)


def tokens_to_images(tokenizer, name: str, tokens: Tensor | list[Tensor]) -> Tensor:
    """tokens [B, h, w] (a list of [B, pn, pn] per scale for next-scale models) -> images [B, 3, H, W] in
    [0, 1] by the tokenizer (`name`: the pipeline's, for the message)."""
    if tokenizer is None:
        raise VisarError(f"{name} has no tokenizer loaded (pass vq_checkpoint=), or use output_type='tokens'")
    device = next(tokenizer.parameters()).device
    tokens = [t.to(device) for t in tokens] if isinstance(tokens, (list, tuple)) else tokens.to(device)
    with torch.no_grad():
        images = tokenizer.decode(tokens)
    return ((images.float() + 1) / 2).clamp(0, 1)


def output_images(tokenizer, images: Tensor, output_type: str):
    """Images [B, 3, H, W] in [0, 1] -> the output type; 8-bit pixels rounded, or truncated where the
    tokenizer says its model's own code truncates (`pixel_rounding` "floor": Lumina-mGPT 1.0)."""
    if output_type == "pt":
        return images
    scaled = images * 255
    scaled = scaled.floor() if getattr(tokenizer, "pixel_rounding", "round") == "floor" else scaled.round()
    array = scaled.to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return array if output_type == "np" else [Image.fromarray(a) for a in array]
