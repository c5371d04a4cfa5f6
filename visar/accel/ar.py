"""Plain autoregressive sampling: the reference every acceleration method is measured against.

One forward pass per image token (the prefill over the condition yields the first token), KV
cache, CFG with a [cond ; uncond] batch, and one uniform per position from each image's own
generator: an image's tokens do not depend on what else is in its batch.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor
from tqdm.auto import tqdm

from .sampling import SamplingParams, draw_uniforms, logits_to_probs, sample_from_probs, split_cfg


def with_null_condition(model, cond: Tensor, cond_mask: Tensor | None, params: SamplingParams):
    """Batch layout for CFG: [cond ; null]; the caption mask is shared by both halves."""
    if not params.uses_cfg:
        return cond, cond_mask
    cond = torch.cat([cond, model.null_condition(cond)])
    if cond_mask is not None:
        cond_mask = torch.cat([cond_mask, cond_mask])
    return cond, cond_mask


@torch.no_grad()
def generate(
    model,
    cond: Tensor,
    params: SamplingParams,
    generators: list[torch.Generator],
    *,
    cond_mask: Tensor | None = None,
    progress: bool = False,
) -> tuple[Tensor, dict]:
    """Sample image tokens [B, N] in raster order; returns (tokens, stats)."""
    start = time.perf_counter()
    batch = cond.shape[0]
    n_cond, n_tokens = model.num_condition_tokens, model.num_image_tokens
    device = model.output.weight.device
    full_cond, full_mask = with_null_condition(model, cond, cond_mask, params)
    model.setup_cache(full_cond.shape[0], n_cond + n_tokens, full_mask)
    try:
        logits = model(cond=full_cond, input_pos=torch.arange(n_cond, device=device))[:, -1]  # [B(x2), V]
        tokens = torch.empty(batch, n_tokens, dtype=torch.long, device=device)
        for i in tqdm(range(n_tokens), disable=not progress, desc="ar", leave=False):
            probs = logits_to_probs(split_cfg(logits, params), params)
            tokens[:, i] = sample_from_probs(probs, draw_uniforms(generators)[:, 0])
            if i + 1 < n_tokens:
                step = tokens[:, i : i + 1]
                step = torch.cat([step, step]) if params.uses_cfg else step
                logits = model(step, input_pos=torch.tensor([n_cond + i], device=device))[:, -1]
    finally:
        model.clear_cache()
    elapsed = time.perf_counter() - start
    stats = {"forward_passes": n_tokens, "tokens_per_forward": 1.0, "latency_s": elapsed}
    return tokens, stats
