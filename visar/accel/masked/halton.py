"""Halton-order unmasking (Besnier et al., "Halton Scheduler for Masked Generative Image Transformer", ICLR 2025).

Checked against valeoai/Halton-MaskGIT (`Sampler/halton_sampler.py`: build_halton_mask, the
arccos reveal schedule). The order is fixed before decoding and the same for every image: the 2-D
Halton points (radical inverses in base 2 for the row, base 3 for the column) scaled to the grid,
each cell at its first point. Consecutive cells of a low-discrepancy sequence lie far apart, so
each step's tokens spread evenly over the image (pure repulsion: tokens drawn together depend
little on each other). Step t reveals the next cells of the order; the count follows the mask
schedule (default "arccos", the paper's). Unlike the reference sampler, which redraws every
revealed token at every step, revealed tokens stay fixed here, as in MaskGIT.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..core.method_registry import Request, register_method
from .loop import keep_highest, unmask


def radical_inverse(index: int, base: int) -> float:
    """The index-th Halton number in `base` (index >= 1): its digits mirrored after the point."""
    result, scale = 0.0, 1.0 / base
    while index:
        index, digit = divmod(index, base)
        result += digit * scale
        scale /= base
    return result


@functools.cache
def halton_order(height: int, width: int) -> tuple[int, ...]:
    """Every cell of an H x W grid (raster index) once, in the order the 2-D Halton points first reach it."""
    order, seen, index = [], set(), 1
    while len(order) < height * width:
        row = int(radical_inverse(index, 2) * height)
        col = int(radical_inverse(index, 3) * width)
        if (row, col) not in seen:
            seen.add((row, col))
            order.append(row * width + col)
        index += 1
    return tuple(order)


@torch.no_grad()
@register_method(
    "halton",
    lossless=False,
    description="Halton-order unmasking (Besnier et al. 2025): a low-discrepancy order fixed in advance spreads "
    "each step's tokens over the image, arccos schedule, `steps` passes",
    model_kind="masked",
)
def halton(
    request: Request,
    *,
    steps: int = 12,
    mask_schedule: str = "arccos",
) -> tuple[Tensor, dict]:
    """Unmasking in the Halton order in `steps` passes -> (tokens [B, N], stats)."""
    model = request.model
    order = torch.tensor(halton_order(*model.grid_size), device=model.device)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order), device=model.device)
    priority = -rank.float().expand(request.cond.shape[0], -1)  # earlier in the order = revealed sooner

    def select(step, masked, probs, sampled, known):
        return keep_highest(priority, masked)

    return unmask(request, select, steps=steps, mask_schedule=mask_schedule, name="halton")
