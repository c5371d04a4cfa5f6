"""Plain autoregressive sampling: the reference every acceleration method is measured against.

One forward pass per image token (the prefill over the condition yields the first token), KV
cache, CFG through the guided scorer, and one uniform per position from each image's own
generator: an image's tokens do not depend on what else is in its batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..progress import progress_bar
from .budget import ProbeBudget
from .registry import Request, register_method
from .sampling import draw_uniforms, sample_from_probs, to_device
from .scoring import GuidedScorer
from .stats import DecodeLog


@torch.no_grad()
@register_method("ar", lossless=True, description="plain next-token sampling (the reference)")
def generate(request: Request) -> tuple[Tensor, dict]:
    """Sample image tokens [B, N] in raster order; returns (tokens, stats)."""
    return sample_tokens(request)


def sample_tokens(request: Request, probe: ProbeBudget | None = None) -> tuple[Tensor, dict]:
    """The AR loop; `probe` (timing an AR step for `jacobi.chain_costs`) may stop it early."""
    model, generators = request.model, request.generators
    device = model.device
    batch = request.cond.shape[0]
    log = DecodeLog(batch, model.grid_size, 0, device)
    num_cond, num_tokens = model.num_condition_tokens, model.num_image_tokens
    scorer = GuidedScorer(model, request.cond, request.cond_mask, request.params, kv_keep=request.kv_keep)
    tokens = torch.empty(batch, num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_cond, num_cond + num_tokens, device=device)  # made once, not copied per step
    # every step's uniform drawn at once: the same numbers as one draw per step (`UniformStream`)
    uniforms = to_device(draw_uniforms(generators, num_tokens), device)
    with scorer.cache(num_cond + num_tokens):
        probs = scorer.prefill()  # [B, V]
        for i in progress_bar(range(num_tokens), enabled=request.progress, desc="ar"):
            if probe is not None and probe.size() is None:
                break
            tokens[:, i] = sample_from_probs(probs, uniforms[:, i])
            if i + 1 < num_tokens:
                probs = scorer.target_probs(scorer.logits(tokens[:, i : i + 1], positions[i : i + 1])[:, -1])
    log.passes_per_image[:] = num_tokens
    log.commit_pass[:, :num_tokens] = torch.arange(1, num_tokens + 1, device=device)  # token i from pass i + 1
    return tokens, log.stats(forward_passes=num_tokens)
