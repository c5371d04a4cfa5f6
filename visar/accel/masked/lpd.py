"""Locality-aware orders for masked models, after LPD (Zhang et al. 2025, "Locality-aware Parallel Decoding").

Checked against mit-han-lab/lpd (`orders/lpd_order.py`: lpd_order_schedule, farthest_point_sampling).
LPD's rule for one step's group of g cells, given the cells decoded before it:
1. proximity of an undecoded cell = sum over its decoded 8-neighbours of 1 / distance (1 for an
   edge neighbour, 1/sqrt(2) for a diagonal one); candidates are shuffled, then sorted by it;
2. C1 = candidates with proximity >= `proximity_threshold` (1.0), taken greedily in that order,
   skipping one within Chebyshev distance `repulsion_threshold` (2) of a cell already chosen in
   this step (near decoded tokens, far from each other);
3. if the group is still short, farthest-point sampling over the rest (C2 and the skipped cells),
   distances measured to the cells chosen in this step (a random first cell if there is none).
The first step starts from a random cell. Group sizes come from the mask schedule (LPD ships
tables for 256 tokens; the schedule serves any grid and keeps step counts comparable across methods).

Two methods:
- `lpd-order`: the order is drawn before decoding from each image's generator (LPD precomputes
  its orders offline, one per image), then revealed group by group.
- `lpd-confidence`: the hybrid of the brief's section 5: C1 ranked by MaskGIT's noisy confidence
  (maskgit.py) instead of shuffled, the same repulsion and fallback, and the fallback seeded at the
  most confident cell; chosen each step from the pass's confidences.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...errors import VisarError
from ...models.base import MaskedModel
from ..core.method_registry import Request, register_method
from .loop import check_steps, keep_highest, reveal_counts, unmask
from .maskgit import confidence, noise_temperatures


class Grid:
    """Cell coordinates and LPD's neighbour weights of an H x W grid."""

    def __init__(self, height: int, width: int):
        rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
        self.coords = torch.stack([rows.flatten(), cols.flatten()], 1)  # [N, 2]
        offset = (self.coords[:, None, :] - self.coords[None, :, :]).abs()  # [N, N, 2]
        self.chebyshev = offset.max(-1).values
        distance = offset.float().norm(dim=-1)
        self.neighbour_weight = torch.where((self.chebyshev == 1), 1 / distance, 0.0)  # [N, N]

    def proximity(self, decoded: Tensor) -> Tensor:
        """[N] bool decoded cells -> [N] proximity score of every cell."""
        return self.neighbour_weight @ decoded.float()

    def pick_group(self, size: int, ranked: list[int], rest: list[int], repulsion: int, first) -> list[int]:
        """LPD's step: greedy over `ranked` (C1) with Chebyshev repulsion, then farthest-point
        sampling over `rest` + the skipped; `first(pool)` picks the fallback's seed when nothing
        was chosen."""
        chosen, skipped = [], []
        while ranked and len(chosen) < size:
            cell = ranked.pop(0)
            if chosen and int(self.chebyshev[cell, chosen].min()) <= repulsion:
                skipped.append(cell)
            else:
                chosen.append(cell)
        pool = rest + skipped + ranked
        missing = size - len(chosen)
        if missing >= len(pool):
            return chosen + pool
        for _ in range(missing):
            if not chosen:
                pick = first(pool)
            else:
                gap = (self.coords[pool][:, None, :] - self.coords[chosen][None, :, :]).float().norm(dim=-1)
                pick = pool[int(gap.min(1).values.argmax())]
            chosen.append(pick)
            pool.remove(pick)
        return chosen


def checked_grid(model: MaskedModel, steps, proximity_threshold, repulsion_threshold) -> Grid:
    """The model's LPD grid, after one clear error for an option of either LPD method out of range."""
    if not isinstance(proximity_threshold, (int, float)) or proximity_threshold < 0:
        raise VisarError(f"proximity_threshold must be a number >= 0, got {proximity_threshold!r}")
    if isinstance(repulsion_threshold, bool) or not isinstance(repulsion_threshold, int) or repulsion_threshold < 0:
        raise VisarError(f"repulsion_threshold must be an integer >= 0 (grid cells), got {repulsion_threshold!r}")
    check_steps(steps, model)
    return Grid(*model.grid_size)


def lpd_order(grid: Grid, counts: list[int], generator: torch.Generator, proximity: float, repulsion: int) -> list[int]:
    """One image's order: the cells of each step's group, group after group (a permutation of 0 .. N-1)."""
    num_cells = len(grid.coords)
    decoded = torch.zeros(num_cells, dtype=torch.bool)
    order: list[int] = []

    def random_cell(pool):
        return pool[int(torch.randint(len(pool), (1,), generator=generator))]

    for size in counts:
        candidates = (~decoded).nonzero()[:, 0]
        candidates = candidates[torch.randperm(len(candidates), generator=generator)]  # ties in random order
        score = grid.proximity(decoded)[candidates]
        by_score = torch.sort(score, descending=True, stable=True).indices
        candidates, close = candidates[by_score], score[by_score] >= proximity
        ranked, rest = candidates[close].tolist(), candidates[~close].tolist()
        group = grid.pick_group(size, ranked, rest, repulsion, random_cell)
        decoded[group] = True
        order += group
    return order


def order_priority(orders: list[list[int]], device) -> Tensor:
    """[B, N]: minus each cell's rank in its image's order (earlier = revealed sooner)."""
    order = torch.tensor(orders, device=device)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(order.shape[1], device=device).expand_as(order).contiguous())
    return -rank.float()


@torch.no_grad()
@register_method(
    "lpd-order",
    lossless=False,
    description="LPD's locality-aware order (Zhang et al. 2025) drawn per image: each step's tokens near decoded "
    "ones and apart from each other, farthest-point fallback, `steps` passes",
    model_kind="masked",
)
def lpd_order_method(
    request: Request,
    *,
    steps: int = 12,
    proximity_threshold: float = 1.0,
    repulsion_threshold: int = 2,
    mask_schedule: str = "cosine",
) -> tuple[Tensor, dict]:
    """Unmasking in an LPD order drawn per image -> (tokens [B, N], stats)."""
    model = request.model
    grid = checked_grid(model, steps, proximity_threshold, repulsion_threshold)
    counts = reveal_counts(steps, model.num_image_tokens, mask_schedule)
    orders = [lpd_order(grid, counts, g, proximity_threshold, repulsion_threshold) for g in request.generators]
    priority = order_priority(orders, model.device)

    def select(step, masked, probs, sampled, known):
        return keep_highest(priority, masked)

    return unmask(request, select, steps=steps, mask_schedule=mask_schedule, name="lpd-order")


@torch.no_grad()
@register_method(
    "lpd-confidence",
    lossless=False,
    description="MaskGIT confidence ranked inside LPD's locality rule (near decoded tokens, repulsion within the "
    "step, farthest-point fallback), `steps` passes",
    model_kind="masked",
)
def lpd_confidence(
    request: Request,
    *,
    steps: int = 12,
    choice_temperature: float | list = (2.0, 0.0),
    proximity_threshold: float = 1.0,
    repulsion_threshold: int = 2,
    mask_schedule: str = "cosine",
) -> tuple[Tensor, dict]:
    """Confidence ranked within LPD's locality rule, per step -> (tokens [B, N], stats)."""
    grid = checked_grid(request.model, steps, proximity_threshold, repulsion_threshold)
    taus = noise_temperatures(choice_temperature, steps).to(request.model.device)

    def select(step, masked, probs, sampled, known):
        scores = confidence(probs, sampled, known, taus[step], request.generators).cpu()
        known_cpu, keep = known.cpu(), known.cpu().clone()
        for b in range(len(scores)):
            size = int((~known_cpu[b]).sum()) - int(masked[b])
            candidates = (~known_cpu[b]).nonzero()[:, 0]
            candidates = candidates[torch.sort(scores[b, candidates], descending=True, stable=True).indices]
            close = grid.proximity(known_cpu[b])[candidates] >= proximity_threshold
            ranked, rest = candidates[close].tolist(), candidates[~close].tolist()
            rest.sort(key=lambda cell: -float(scores[b, cell]))
            group = grid.pick_group(size, ranked, rest, repulsion_threshold, lambda pool: pool[0])
            keep[b, group] = True
        return keep.to(known.device)

    return unmask(request, select, steps=steps, mask_schedule=mask_schedule, name="lpd-confidence")
