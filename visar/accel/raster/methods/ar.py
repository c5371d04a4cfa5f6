"""Plain autoregressive sampling: the reference every acceleration method is measured against.

One forward pass per image token (the prefill over the condition yields the first token), KV
cache, CFG through the guided scorer, and one uniform per position from each image's own
generator: an image's tokens do not depend on what else is in its batch. A running batch
(`Request.slots`) is consecutive batches of that many images: every image takes N passes, so all
of a batch's slots are free at once, and refilling them all is starting the next batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ....progress import progress_bar
from ...core.method_registry import Request, register_method
from ...core.sampling import draw_uniforms, sample_from_probs, to_device
from ...core.scoring import GuidedScorer
from ...core.stats import DecodeLog, merge_batch_stats
from ...core.timing import StepTimer


@torch.no_grad()
@register_method("ar", lossless=True, description="plain next-token sampling (the reference)", refills=True)
def generate(request: Request) -> tuple[Tensor, dict]:
    """Sample image tokens [B, N] in raster order; returns (tokens, stats)."""
    return sample_tokens(request)


def sample_tokens(request: Request, timer: StepTimer | None = None) -> tuple[Tensor, dict]:
    """The AR loop; `timer` (timing AR steps for `auto`) may stop it early. A running batch's queue
    is decoded `slots` images at a time (`sample_queue`)."""
    if request.slots is not None and timer is None:
        return sample_queue(request)
    # a timer of a running batch times its first slots' images
    scorer = GuidedScorer(
        request.model, request.cond, request.cond_mask, request.params, slots=request.slots, kv_keep=request.kv_keep
    )
    return sample_batch(request, scorer, request.generators[: scorer.batch], timer)


def sample_queue(request: Request) -> tuple[Tensor, dict]:
    """A running batch's queue as consecutive batches of `slots` images, each image handed to
    `request.on_image` when its batch is done; stats merged (`batch_passes`: the batches' passes)."""
    queue, slots, num_tokens = request.cond.shape[0], request.slots, request.model.num_image_tokens
    parts, scorers = [], {}
    for start in range(0, queue, slots):
        images = torch.arange(start, min(start + slots, queue), device=request.cond.device)
        # the queue's scorer (its null conditions made for every queued image, as a negative prompt
        # held for the call needs), its slots given this batch's images: one a batch size (the
        # last batch may be smaller), so the queue's null conditions are made once or twice
        size = len(images)
        if size not in scorers:
            scorers[size] = GuidedScorer(
                request.model, request.cond, request.cond_mask, request.params, slots=size, kv_keep=request.kv_keep
            )
        scorer = scorers[size]
        generators = request.generators[start : start + len(images)]
        tokens, stats = sample_batch(request, scorer, generators, admit=images if start else None)
        if request.on_image is not None:
            for image, (image_tokens, commit_pass) in enumerate(zip(tokens, stats["commit_pass"], strict=True)):
                request.on_image(
                    start + image, image_tokens, {"forward_passes": num_tokens, "commit_pass": commit_pass}
                )
        parts.append((tokens, stats))
    stats = merge_batch_stats([stats for _, stats in parts])
    stats.update(slots=slots, refills=queue - len(parts[0][0]), batch_passes=stats["forward_passes"])
    return torch.cat([tokens for tokens, _ in parts]), stats


def sample_batch(
    request: Request,
    scorer: GuidedScorer,
    generators: list,
    timer: StepTimer | None = None,
    admit: Tensor | None = None,
) -> tuple[Tensor, dict]:
    """The AR loop over `scorer`'s batch (admit: the queue images its slots take first)."""
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
        if admit is not None:
            scorer.admit(torch.arange(batch, device=device), admit)
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
