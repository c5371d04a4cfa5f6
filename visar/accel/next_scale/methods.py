"""Next-scale decoding (VAR): plain sampling, collaborative decoding (CoDe) and cached token pruning (FastVAR).

- `var`: Tian et al. 2024, "Visual Autoregressive Modeling", FoundationVision/VAR @ 78b9539
  (`autoregressive_infer_cfg`): one pass per scale over a KV cache; the tokens of a scale are
  drawn independently given the earlier scales.
- `code`: Chen et al. 2025, "Collaborative Decoding Makes Visual Auto-Regressive Modeling
  Efficient", czg1225/CoDe (`autoregressive_infer_cfg_draft` / `_refine`): a large "drafter"
  decodes scales 0 .. N - 1, a small "refiner" builds its cache for those scales in one
  block-causal prefill and decodes scales N .. S - 1.
- `var-prune`: Guo et al. 2025, "FastVAR: Linear Visual Autoregressive Modeling via Cached Token
  Pruning", csguoh/FastVAR: at the largest scales only a fraction of each scale's inputs go through
  the layers; the rest take the previous scale's layer outputs (the model's `keep_fraction`).

Guidance follows VAR's ramp: the weight on the conditional logits grows linearly from 1 at the
first scale to `guidance_scale` at the last, mixed by `sampling.cfg_mix` and turned into the target
law by `sampling.logits_to_probs`, the function every raster method samples from. Upstream's "cfg
c" is guidance_scale = 1 + c (the FID setting cfg 1.5 is guidance_scale 2.5).

Randomness: image b draws pn_k^2 uniforms from generators[b] for scale k, after those of scales
0 .. k - 1, whichever model decodes the scale. CoDe's refiner prefill draws none: upstream samples
throwaway tokens for the drafted scales there (consuming its generator); here it only reads the
logits of scale N, so N = S is the drafter alone and N = 0 the refiner alone, draw for draw.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from ...errors import VisarError
from ...models.base import NextScaleModel, model_kind
from ...progress import progress_bar
from ...tokenizers.base import MultiScaleTokenizer
from ..core.method_registry import Request, register_method
from ..core.sampling import SamplingParams, cfg_mix, draw_uniforms, logits_to_probs, sample_from_probs
from ..core.timing import synchronized_clock


def ramped_guidance(guidance_scale: float, k: int, num_scales: int) -> float:
    """VAR's guidance weight at scale k: w_k = 1 + (g - 1) k / (S - 1), so no guidance at scale 0 and g at
    the last (upstream: logits = (1 + t) cond - t uncond with t = cfg k / (S - 1), cfg = g - 1)."""
    if num_scales == 1:
        return guidance_scale
    return 1 + (guidance_scale - 1) * k / (num_scales - 1)


class ScaleScorer:
    """A next-scale model, a batch of B class conditions and the sampling settings: one call -> the target
    law of the last scale it covers. Under CFG the batch is [cond ; null condition], as in GuidedScorer."""

    def __init__(self, model: NextScaleModel, cond: Tensor, params: SamplingParams):
        self.model, self.params = model, params
        self.guided = params.uses_cfg
        self.cond = torch.cat([cond, model.null_condition(cond)]) if self.guided else cond
        self.num_scales = len(model.scale_sizes)
        self.forward_passes = 0
        self.layer_tokens = 0  # per image: the inputs that went through the layers (pruned ones do not)

    @contextmanager
    def cache(self, pruning: bool = False):
        self.model.setup_cache(self.cond.shape[0], pruning=pruning)
        try:
            yield self
        finally:
            self.model.clear_cache()

    def scale_probs(self, latents: Tensor | None, first_scale: int, k: int, keep_fraction: float = 1.0) -> Tensor:
        """Feed scales first_scale .. k (latents [B, l, C] for those past scale 0) -> scale k's law [B, pn^2, V]."""
        if latents is not None and self.guided:
            latents = torch.cat([latents, latents])
        logits = self.model(
            self.cond, latents, first_scale=first_scale, keep_fraction=keep_fraction, last_scale_only=True
        )
        self.forward_passes += 1
        fed = (first_scale == 0) + (0 if latents is None else latents.shape[1])
        self.layer_tokens += math.ceil(keep_fraction * fed)  # the model's own rounding (VAR.tokens_kept)
        weight = ramped_guidance(self.params.guidance_scale, k, self.num_scales)
        if self.guided:
            cond, uncond = logits.chunk(2)
            logits = cond if weight == 1 else cfg_mix(cond, uncond, weight)  # scale 0: exactly cond, as upstream
        return logits_to_probs(logits, self.params)


@dataclass
class ScaleState:
    """What a decode has made so far: f_hat, each scale's tokens, and the latents of scales 1 .. k + 1."""

    f_hat: Tensor
    tokens: list[Tensor] = field(default_factory=list)  # [B, pn, pn] per decoded scale
    inputs: list[Tensor] = field(default_factory=list)  # inputs[j]: the latents of scale j + 1 [B, pn^2, C]


def sample_scales(
    scorer: ScaleScorer,
    tokenizer: MultiScaleTokenizer,
    generators: list[torch.Generator],
    state: ScaleState,
    scales: range,
    keep_fraction=lambda k: 1.0,
    progress: bool = False,
):
    """Decode `scales` (consecutive, in order) with one model into `state`.

    The model's first call is a block-causal prefill over every earlier scale's inputs (CoDe's refiner
    entry; just scale 0 for a model that starts the image) and yields the law of scale scales[0]."""
    sizes = scorer.model.scale_sizes
    batch = state.f_hat.shape[0]
    for k in progress_bar(scales, enabled=progress, desc="scales"):
        if k == scales.start:
            earlier = torch.cat(state.inputs[:k], dim=1) if k else None  # the inputs of scales 1 .. k
            probs = scorer.scale_probs(earlier, 0, k)
        else:
            probs = scorer.scale_probs(state.inputs[k - 1], k, k, keep_fraction(k))
        side = sizes[k]
        tokens = sample_from_probs(probs, draw_uniforms(generators, side * side).to(probs.device))
        tokens = tokens.reshape(batch, side, side)
        state.f_hat, next_inputs = tokenizer.next_scale_input(state.f_hat, tokens, k)
        state.tokens.append(tokens)
        if next_inputs is not None:
            state.inputs.append(next_inputs.to(scorer.model.dtype))


def check_pair(model: NextScaleModel, tokenizer: MultiScaleTokenizer | None):
    """One clear error when the tokenizer cannot make this model's inputs."""
    if tokenizer is None:
        raise VisarError(
            "next-scale decoding needs the model's multi-scale VQVAE (each scale's input is made from the "
            "scales before it): load it with vq_checkpoint="
        )
    if tuple(tokenizer.scale_sizes) != tuple(model.scale_sizes):
        raise VisarError(
            f"the VQVAE's scales {list(tokenizer.scale_sizes)} differ from the model's {list(model.scale_sizes)}"
        )
    if tokenizer.vocab_size != model.vocab_size or tokenizer.latent_dim != model.latent_dim:
        raise VisarError(
            f"the VQVAE (vocabulary {tokenizer.vocab_size}, latent width {tokenizer.latent_dim}) does not fit the "
            f"model (vocabulary {model.vocab_size}, latent width {model.latent_dim})"
        )


def scale_stats(
    start: float, model: NextScaleModel, batch: int, scorer: ScaleScorer, refiner: ScaleScorer | None = None
) -> dict:
    """The common statistics (visar.accel.core.stats.COMMON_STATS) of a next-scale decode: no drafts are
    tested; "rows" are scales; commit_pass holds, per scale, the pass [B, pn, pn] that made each token.
    layer_tokens / draft_layer_tokens: per image, the inputs that went through the model's / the
    refiner's layers (the cost that pruning and the refiner's smaller width cut)."""
    passes = scorer.forward_passes + (refiner.forward_passes if refiner else 0)
    draft_passes = refiner.forward_passes if refiner else 0
    sizes = model.scale_sizes
    scales = len(sizes)
    num_tokens = sum(side * side for side in sizes)
    pass_of_scale = [k + 1 for k in range(scales)]  # one pass per scale, whichever model made it
    return {
        "forward_passes": passes,
        "forward_passes_per_image": [passes] * batch,
        "tokens_per_forward": num_tokens / passes,
        "latency_s": synchronized_clock(model.device) - start,
        "draft_tokens": 0,
        "accepted_tokens": 0,
        "acceptance_rate": None,
        "draft_tokens_by_row": [0] * scales,
        "accepted_tokens_by_row": [0] * scales,
        "draft_tokens_by_slot": [],
        "accepted_tokens_by_slot": [],
        "draft_forward_passes": draft_passes,
        "layer_tokens": scorer.layer_tokens,
        "draft_layer_tokens": refiner.layer_tokens if refiner else 0,
        "commit_pass": [torch.full((batch, side, side), pass_of_scale[k]) for k, side in enumerate(sizes)],
    }


@torch.no_grad()
@register_method(
    "var",
    lossless=True,
    description="plain next-scale sampling (the reference for VAR models): one pass per scale, KV cache",
    model_kind="next-scale",
)
def var(request: Request) -> tuple[list[Tensor], dict]:
    """Sample every scale in order, one pass each; returns ([B, pn, pn] per scale, stats)."""
    model, cond, tokenizer = request.model, request.cond, request.tokenizer
    check_pair(model, tokenizer)
    start = synchronized_clock(model.device)
    scorer = ScaleScorer(model, cond, request.params)
    state = ScaleState(tokenizer.empty_latent(cond.shape[0], model.device))
    with scorer.cache():
        sample_scales(
            scorer, tokenizer, request.generators, state, range(len(model.scale_sizes)), progress=request.progress
        )
    return state.tokens, scale_stats(start, model, cond.shape[0], scorer)


# -- CoDe ------------------------------------------------------------------------------------------------


def check_refiner(model: NextScaleModel, refiner, draft_scales: int | None) -> int:
    """The number of drafted scales N, after one clear error for a refiner that cannot take over."""
    num_scales = len(model.scale_sizes)
    if refiner is None:
        raise VisarError("code needs a refiner: pass refiner= (a smaller next-scale model of the same family)")
    if model_kind(refiner) != "next-scale":
        raise VisarError(f"code's refiner (refiner=) must be a next-scale model; {type(refiner).__name__} is not")
    if tuple(refiner.scale_sizes) != tuple(model.scale_sizes):
        raise VisarError(
            f"the drafter's scales {list(model.scale_sizes)} and the refiner's {list(refiner.scale_sizes)} differ: "
            "CoDe hands over f_hat at a scale both models share"
        )
    if refiner.vocab_size != model.vocab_size or refiner.latent_dim != model.latent_dim:
        raise VisarError(
            "the drafter and the refiner use different tokenizers (vocabulary or latent width differ): "
            "CoDe needs one VQVAE for both"
        )
    if refiner.condition_layout != model.condition_layout:
        raise VisarError("the drafter and the refiner are conditioned differently (class counts differ)")
    if draft_scales is None:
        return max(num_scales - 2, 0)  # CoDe's default: 8 of 10 scales drafted
    if isinstance(draft_scales, bool) or not isinstance(draft_scales, int) or not 0 <= draft_scales <= num_scales:
        raise VisarError(f"draft_scales must be an integer in 0..{num_scales} (this model has {num_scales} scales)")
    return draft_scales


@torch.no_grad()
def code_is_exact(options: dict, model) -> bool:
    """Every scale drafted, none pruned: the drafter (this model) alone."""
    scales = len(model.scale_sizes)
    return options.get("draft_scales") == scales and prune_is_exact({"keep_fraction": 1.0, **options}, model)


@register_method(
    "code",
    lossless=False,
    description="collaborative decoding (CoDe, Chen et al. 2025): this model drafts the first draft_scales "
    "scales, a smaller refiner (refiner=) prefills them in one pass and decodes the rest; keep_fraction < 1 adds "
    "var-prune's token pruning at the prune_scales",
    model_kind="next-scale",
    exact_when=code_is_exact,
    exact_when_text="draft_scales = the number of scales and keep_fraction=1",
    needs_draft=True,
    draft_option="refiner",
)
def code(
    request: Request,
    *,
    refiner: NextScaleModel | None = None,
    draft_scales: int | None = None,
    keep_fraction: float = 1.0,
    prune_scales: int | list[int] = 2,
    refiner_temperature: float | None = None,
) -> tuple[list[Tensor], dict]:
    """CoDe: this model (the drafter) decodes scales 0 .. N - 1, `refiner` the rest.

    N = draft_scales (default S - 2). The refiner enters with one block-causal prefill over the
    inputs of scales 1 .. N and reads scale N's law from it. keep_fraction < 1 adds var-prune's
    cached token pruning at the `prune_scales`, in whichever model decodes them; scale N, read from
    the refiner's prefill, is never pruned. stats: forward_passes counts both models' passes (one
    per scale), draft_forward_passes the refiner's. refiner_temperature: the refiner's sampling
    temperature (None: the call's), as CoDe samples its two models with their own settings (in place of
    the call's entropy temperature, if any)."""
    model, cond, params, tokenizer = request.model, request.cond, request.params, request.tokenizer
    generators, progress = request.generators, request.progress
    num_drafted = check_refiner(model, refiner, draft_scales)
    check_pair(model, tokenizer)
    check_keep_fraction(keep_fraction)
    num_scales = len(model.scale_sizes)
    chosen = pruned_scales(prune_scales, num_scales) - {num_drafted} if keep_fraction < 1 else set()
    start = synchronized_clock(model.device)
    drafter_scorer, refiner_scorer = (
        ScaleScorer(model, cond, params),
        ScaleScorer(
            refiner,
            cond.to(refiner.device),
            params
            if refiner_temperature is None
            else replace(params, temperature=refiner_temperature, entropy_temperature=None),
        ),
    )
    state = ScaleState(tokenizer.empty_latent(cond.shape[0], model.device))
    keep = lambda k: keep_fraction if k in chosen else 1.0  # noqa: E731
    if num_drafted:
        with drafter_scorer.cache(pruning=any(k < num_drafted for k in chosen)):
            sample_scales(drafter_scorer, tokenizer, generators, state, range(num_drafted), keep, progress=progress)
    if num_drafted < num_scales:
        state.inputs = [x.to(refiner.device, refiner.dtype) for x in state.inputs]
        with refiner_scorer.cache(pruning=any(k > num_drafted for k in chosen)):
            sample_scales(
                refiner_scorer, tokenizer, generators, state, range(num_drafted, num_scales), keep, progress=progress
            )
    stats = scale_stats(start, model, cond.shape[0], drafter_scorer, refiner_scorer)
    stats.update(draft_scales=num_drafted, drafter_passes=drafter_scorer.forward_passes)
    if chosen:
        stats.update(keep_fraction=keep_fraction, pruned_scales=sorted(chosen))
    return state.tokens, stats


# -- FastVAR cached token pruning ------------------------------------------------------------------------


def check_keep_fraction(keep_fraction):
    if isinstance(keep_fraction, bool) or not (isinstance(keep_fraction, (int, float)) and 0 < keep_fraction <= 1):
        raise VisarError(f"keep_fraction must be in (0, 1], got {keep_fraction}")


def pruned_scales(prune_scales: int | list[int], num_scales: int) -> set[int]:
    """An int n: the n largest scales; a list: those scale indices. Scale 0 has nothing to reuse."""
    if isinstance(prune_scales, int) and not isinstance(prune_scales, bool):
        if not 0 <= prune_scales < num_scales:
            raise VisarError(f"prune_scales={prune_scales}: prune 0..{num_scales - 1} of the largest scales")
        return set(range(num_scales - prune_scales, num_scales))
    if not isinstance(prune_scales, (list, tuple)) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in prune_scales
    ):
        raise VisarError(f"prune_scales must be a number of scales or a list of scale indices, got {prune_scales!r}")
    chosen = set(prune_scales)
    if not chosen <= set(range(1, num_scales)):
        raise VisarError(f"prune_scales {sorted(chosen)}: scale indices must be in 1..{num_scales - 1}")
    return chosen


@torch.no_grad()
def prune_is_exact(options: dict, model) -> bool:
    return options.get("keep_fraction", 0) >= 1 or options.get("prune_scales") in (0, [])


@register_method(
    "var-prune",
    lossless=False,
    description="FastVAR cached token pruning (Guo et al. 2025): at the largest scales only keep_fraction of "
    "the tokens go through the transformer, the rest reuse the previous scale's outputs",
    model_kind="next-scale",
    exact_when=prune_is_exact,
    exact_when_text="keep_fraction=1",
    exact_example={"keep_fraction": 1.0},
)
def var_prune(
    request: Request,
    *,
    keep_fraction: float = 0.5,
    prune_scales: int | list[int] = 2,
) -> tuple[list[Tensor], dict]:
    """VAR sampling where, at the `prune_scales` (default the 2 largest), only `keep_fraction` of each
    scale's inputs go through the layers: those whose layer input changed most against the previous
    scale's (upsampled); the others take the previous scale's layer updates. keep_fraction 1 is `var`."""
    model, cond, tokenizer = request.model, request.cond, request.tokenizer
    check_pair(model, tokenizer)
    check_keep_fraction(keep_fraction)
    chosen = pruned_scales(prune_scales, len(model.scale_sizes))
    start = synchronized_clock(model.device)
    scorer = ScaleScorer(model, cond, request.params)
    state = ScaleState(tokenizer.empty_latent(cond.shape[0], model.device))
    with scorer.cache(pruning=bool(chosen) and keep_fraction < 1):
        sample_scales(
            scorer,
            tokenizer,
            request.generators,
            state,
            range(len(model.scale_sizes)),
            keep_fraction=lambda k: keep_fraction if k in chosen else 1.0,
            progress=request.progress,
        )
    stats = scale_stats(start, model, cond.shape[0], scorer)
    stats.update(keep_fraction=keep_fraction, pruned_scales=sorted(chosen))
    return state.tokens, stats
