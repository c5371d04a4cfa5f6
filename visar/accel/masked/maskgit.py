"""MaskGIT confidence unmasking (Chang et al. 2022), as aMUSEd runs it (Patil et al. 2024).

Checked against google-research/maskgit (`libml/parallel_decode.py`: decode, mask_by_random_topk)
and diffusers' `AmusedScheduler` / `AmusedPipeline` (0.42, `pipelines/deprecated/amused`), which
tests/models/test_amused.py reproduces token for token.

At each step every unknown position draws a token; its confidence is the log-probability of what
it drew plus annealed Gumbel noise,

    c_i = log p_i(x_i) + tau_t * g_i,   g_i ~ Gumbel(0, 1),

known positions count as certain, and the `masked_t` lowest confidences go back to the mask id
(the schedule in `loop.py`). tau_t anneals to 0: a pair [start, end] is aMUSEd's
`temperature=(start, end)`, linspace(start, end, T)[t] (default [2, 0]; aMUSEd's scalar v is
[v, 0.01]); a number c is MaskGIT's c * (1 - (t + 1) / T) (its config: 4.5).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...errors import VisarError
from ..core.checks import check_number
from ..core.method_registry import Request, register_method
from .loop import check_steps, gumbel_noise, keep_highest, unmask

MAX_CHOICE_TEMPERATURE = 1e4  # the Gumbel noise's scale on log-probabilities; beyond it only noise orders


def noise_temperatures(choice_temperature, steps: int) -> Tensor:
    """tau_t for t = 0 .. T - 1 (float32 [T]); each temperature a number from 0 to MAX_CHOICE_TEMPERATURE."""
    if isinstance(choice_temperature, (list, tuple)) and len(choice_temperature) == 2:
        for value in choice_temperature:
            check_number("choice_temperature", value, 0, maximum=MAX_CHOICE_TEMPERATURE)
        start, end = (float(v) for v in choice_temperature)
        return torch.linspace(start, end, steps)
    if isinstance(choice_temperature, (int, float)) and not isinstance(choice_temperature, bool):
        check_number("choice_temperature", choice_temperature, 0, maximum=MAX_CHOICE_TEMPERATURE)
        fraction = torch.arange(1, steps + 1, dtype=torch.float32) / steps
        return float(choice_temperature) * (1 - fraction)
    raise VisarError(
        f"choice_temperature must be a number (MaskGIT's annealing) or a pair [start, end] (aMUSEd's), "
        f"got {choice_temperature!r}"
    )


def confidence(probs: Tensor, sampled: Tensor, known: Tensor, tau: Tensor, generators) -> Tensor:
    """log p(drawn token) + tau * Gumbel noise [B, N]; known positions count as certain (aMUSEd's finfo.max)."""
    chosen = probs.gather(-1, sampled[..., None])[..., 0]
    chosen = torch.where(known, torch.finfo(chosen.dtype).max, chosen)
    return torch.log(chosen.clamp(1e-20)) + tau * gumbel_noise(generators, probs.shape[1], probs.device)


@torch.no_grad()
@register_method(
    "maskgit",
    lossless=False,
    description="MaskGIT confidence unmasking (Chang et al. 2022) as aMUSEd runs it: cosine mask schedule, "
    "annealed Gumbel noise on the drawn tokens' log-probabilities, `steps` passes",
    model_kind="masked",
)
def maskgit(
    request: Request,
    *,
    steps: int = 12,
    choice_temperature: float | list = (2.0, 0.0),
    mask_schedule: str = "cosine",
) -> tuple[Tensor, dict]:
    """Confidence-based unmasking in `steps` passes -> (tokens [B, N], stats)."""
    check_steps(steps, request.model)
    taus = noise_temperatures(choice_temperature, steps).to(request.model.device)

    def select(step, masked, probs, sampled, known):
        return keep_highest(confidence(probs, sampled, known, taus[step], request.generators), masked)

    return unmask(request, select, steps=steps, mask_schedule=mask_schedule, name="maskgit")
