"""The unmasking loop every masked-model method runs (MaskGIT, aMUSEd): schedule, sampling, reveal.

Start from a grid of mask ids. At step t of T: one full bidirectional pass (CFG through
`scoring.MaskedScorer`) gives the target law of every position; every unknown position draws a
token; a selection policy (the method) chooses which of them stay, the rest go back to the mask
id. The count left masked after step t follows the mask schedule, as aMUSEd's `AmusedScheduler`
computes it:

    masked_t = max(1, min(unknown_t - 1, floor(N * m((t + 1) / T))))   for t < T - 1, and 0 at t = T - 1

with m(r) = cos(pi r / 2) ("cosine", MaskGIT and aMUSEd), 1 - r ("linear"), or arccos(r) / (pi / 2)
("arccos", Halton-MaskGIT's reveal schedule). N is the whole grid (aMUSEd's convention; MaskGIT's
U0, the unknown count at the start, is the same number when generation starts from a blank grid).

Randomness follows aMUSEd's `AmusedScheduler.step` call for call, per image: `torch.multinomial`
over the image's [N, V] law, then (selection policies that use noise) `uniform_` over [1, N] for
the Gumbel noise, each from the image's own generator. So an image's tokens do not depend on its
batch, and image b with seed s equals `AmusedPipeline(..., generator=Generator().manual_seed(s))`
run on that image alone (aMUSEd draws one batch from a single generator, so its batches of more
than one image differ from visar's: tests/models/test_amused.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from ...errors import VisarError
from ...models.base import MaskedModel
from ...progress import progress_bar
from ..core.method_registry import Request
from ..core.scoring import MaskedScorer
from ..core.stats import DecodeLog

MASK_SCHEDULES = ("cosine", "linear", "arccos")

# (step, masked_after [B], probs [B, N, V], sampled [B, N], known [B, N]) -> known after the step [B, N]
SelectFn = Callable[[int, Tensor, Tensor, Tensor, Tensor], Tensor]


def check_steps(steps, model: MaskedModel) -> int:
    """steps must be a whole number in 1 .. N (more passes than tokens would reveal nothing new)."""
    num_tokens = model.num_image_tokens
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= num_tokens:
        raise VisarError(f"steps must be an integer from 1 to the number of image tokens ({num_tokens}), got {steps!r}")
    return steps


def mask_ratio(step: int, steps: int, schedule: str) -> Tensor:
    """m((step + 1) / steps) as a float32 scalar tensor, computed as `AmusedScheduler.step` does."""
    ratio = torch.tensor(step + 1) / steps  # float32, as aMUSEd's (step_idx + 1) / len(timesteps)
    if schedule == "cosine":
        return torch.cos(ratio * math.pi / 2)
    if schedule == "linear":
        return 1 - ratio
    if schedule == "arccos":
        return torch.arccos(ratio) / (math.pi / 2)
    raise VisarError(f"mask_schedule must be one of {', '.join(MASK_SCHEDULES)}, got {schedule!r}")


def masked_after(step: int, steps: int, num_tokens: int, unknown: Tensor, schedule: str) -> Tensor:
    """How many positions each image leaves masked after `step` ([B] long), given its unknown count [B]."""
    if step == steps - 1:
        return torch.zeros_like(unknown)
    count = (num_tokens * mask_ratio(step, steps, schedule)).floor().long()
    return torch.clamp(torch.minimum(unknown - 1, count), min=1)


def reveal_counts(steps: int, num_tokens: int, schedule: str) -> list[int]:
    """Tokens revealed at each step from a blank grid when every step reveals exactly its count."""
    counts, unknown = [], torch.tensor([num_tokens])
    for step in range(steps):
        left = masked_after(step, steps, num_tokens, unknown, schedule)
        counts.append(int(unknown - left))
        unknown = left
    return counts


def sample_positions(probs: Tensor, generators: list[torch.Generator]) -> Tensor:
    """One token per position, [B, N, V] -> [B, N]: `torch.multinomial` on each image's [N, V] law with
    its own generator (on the generator's device, as aMUSEd draws)."""
    rows = []
    for law, generator in zip(probs, generators, strict=True):
        law = law.to(generator.device).float()
        rows.append(torch.multinomial(law, 1, generator=generator)[:, 0])
    return torch.stack(rows).to(probs.device)


def gumbel_noise(generators: list[torch.Generator], num_tokens: int, device) -> Tensor:
    """[B, N] standard Gumbel noise, row b from generators[b], as aMUSEd's `gumbel_noise` draws it."""
    rows = []
    for generator in generators:
        uniform = torch.zeros(1, num_tokens, device=generator.device).uniform_(0, 1, generator=generator)
        rows.append(-torch.log((-torch.log(uniform.clamp(1e-20))).clamp(1e-20))[0])
    return torch.stack(rows).to(device)


def keep_highest(priority: Tensor, masked: Tensor) -> Tensor:
    """Positions that stay known [B, N]: all but the `masked` [B] lowest priorities of each row.

    aMUSEd's rule (`mask_by_random_topk`): cut at the masked-th smallest value, re-mask what lies
    strictly below it (ties at the cut stay known)."""
    cut_off = torch.sort(priority, dim=-1).values.gather(1, masked[:, None])
    return ~(priority < cut_off)


@torch.no_grad()
def unmask(request: Request, select: SelectFn, *, steps: int, mask_schedule: str, name: str) -> tuple[Tensor, dict]:
    """The loop, with `select` choosing which sampled tokens stay at each step -> (tokens [B, N], stats)."""
    model, cond, generators = request.model, request.cond, request.generators
    check_steps(steps, model)
    mask_ratio(0, steps, mask_schedule)  # one clear error for an unknown schedule, before any pass
    device, batch, num_tokens = model.device, cond.shape[0], model.num_image_tokens
    if len(generators) != batch:
        raise VisarError(f"got {len(generators)} generators for {batch} images: pass one per image")
    scorer = MaskedScorer(model, cond, request.cond_mask, request.params, request.null)
    log = DecodeLog(batch, model.grid_size, 0, device)
    tokens = torch.full((batch, num_tokens), model.mask_token_id, dtype=torch.long, device=device)
    known = torch.zeros(batch, num_tokens, dtype=torch.bool, device=device)
    index = torch.arange(num_tokens, device=device).expand(batch, -1)
    for step in progress_bar(range(steps), enabled=request.progress, desc=name):
        probs = scorer.target_probs(tokens)  # [B, N, V]
        sampled = torch.where(known, tokens, sample_positions(probs, generators))
        left = masked_after(step, steps, num_tokens, (~known).sum(1), mask_schedule)
        now_known = known | select(step, left, probs, sampled, known) if step < steps - 1 else torch.ones_like(known)
        log.count_pass(torch.ones(batch, dtype=torch.bool, device=device))
        log.commit(index, now_known & ~known, step + 1)
        tokens = torch.where(now_known, sampled, model.mask_token_id)
        known = now_known
    return tokens, {**log.stats(forward_passes=scorer.forward_passes), "steps": steps}
