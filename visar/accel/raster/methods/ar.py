"""Plain autoregressive sampling: the reference every acceleration method is measured against.

One forward pass per image token (the prefill over the condition yields the first token), KV
cache, CFG through the guided scorer, and one uniform per position from each image's own
generator: an image's tokens do not depend on what else is in its batch. ar does not refill a
running batch: every image takes N passes, so all of a batch's slots free at once, and refilling
them all is starting the next batch; `Pipeline.generate(batch_size=)` (and `auto`'s rounds) decode
ar's queue as consecutive batches (`method_registry.consecutive_batches`).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from ....progress import progress_bar
from ...core.method_registry import Request, register_method
from ...core.sampling import draw_uniforms, sample_from_probs, to_device
from ...core.scoring import GuidedScorer
from ...core.stats import DecodeLog
from ...core.timing import StepTimer


@torch.no_grad()
@register_method("ar", lossless=True, description="plain next-token sampling (the reference)")
def autoregressive(request: Request) -> tuple[Tensor, dict]:
    """Sample image tokens [B, N] in raster order, every image of the request at once; returns (tokens, stats)."""
    scorer = GuidedScorer.for_request(replace(request, slots=None))
    return sample_batch(request, scorer, request.generators)


def sample_tokens(request: Request, timer: StepTimer) -> tuple[Tensor, dict]:
    """The AR loop, timed by `timer` (AR steps for `auto`), which may stop it early; a running batch's
    request times its first `slots` images (the scorer made for its whole queue, as the refilling
    methods make theirs)."""
    scorer = GuidedScorer.for_request(request)
    return sample_batch(request, scorer, request.generators[: scorer.batch], timer)


def sample_batch(
    request: Request, scorer: GuidedScorer, generators: list, timer: StepTimer | None = None
) -> tuple[Tensor, dict]:
    """The AR loop over `scorer`'s batch, one generator per image."""
    model = request.model
    device = model.device
    batch = len(generators)
    log = DecodeLog(batch, model.grid_size, 0, device)
    num_cond, num_tokens = model.num_condition_tokens, model.num_image_tokens
    tokens = torch.empty(batch, num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_cond, num_cond + num_tokens, device=device)  # made once, not copied per step
    # every step's uniform drawn at once: the same numbers as one draw per step (`UniformStream`)
    uniforms = to_device(draw_uniforms(generators, num_tokens), device)
    with scorer.cache(num_cond + num_tokens):
        probs = scorer.prefill()  # [B, V]
        for i in progress_bar(range(num_tokens), enabled=request.progress, desc="ar"):
            if timer is not None and not timer.tick():
                break
            tokens[:, i] = sample_from_probs(probs, uniforms[:, i])
            if i + 1 < num_tokens:
                probs = scorer.target_probs(scorer.logits(tokens[:, i : i + 1], positions[i : i + 1])[:, -1])
    log.passes_per_image[:] = num_tokens
    log.commit_pass[:, :num_tokens] = torch.arange(1, num_tokens + 1, device=device)  # token i from pass i + 1
    return tokens, log.stats(forward_passes=num_tokens)
