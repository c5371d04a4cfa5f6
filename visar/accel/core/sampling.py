"""The one place where logits become the target distribution, and where tokens are drawn from it.

Plain sampling and every verifier call `logits_to_probs`, so that a method that claims to be
lossless is measured against exactly the distribution plain AR samples from.

Order of operations follows LlamaGen's `generate`: CFG mix on raw logits
(uncond + (cond - uncond) * scale), then temperature, then top-k, then top-p, then softmax. With an
entropy temperature (`entropy_temperature`) the order is its official code's: CFG, top-k, top-p, then
each position's own temperature, then softmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ...errors import VisarError

# Bounds that keep guided, tempered logits finite in float32 (a model's logits are at most a few
# hundred apart): guidance of 1e4 and temperature 1e-4 scale them by 1e8, far from float32's 3e38.
MAX_GUIDANCE = 1e4
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-4, 1e4


def is_number(value) -> bool:
    """A finite real number (not a bool, which Python counts as an int)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """guidance_scale 1.0 means no CFG (the unconditional pass is skipped); top_k None = off;
    entropy_temperature None = off, else T0 of each position's temperature T0 (2.5 exp(-H/3) + 0.6)
    (`entropy_temperature`), which takes the place of `temperature` (then left at 1)."""

    guidance_scale: float = 1.0
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    entropy_temperature: float | None = None

    def __post_init__(self):
        if not (is_number(self.guidance_scale) and 0 <= self.guidance_scale <= MAX_GUIDANCE):
            raise VisarError(f"guidance_scale must be a number from 0 to {MAX_GUIDANCE:g}, got {self.guidance_scale!r}")
        if not (is_number(self.temperature) and MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE):
            bounds = f"{MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}"
            raise VisarError(f"temperature must be a number from {bounds}, got {self.temperature!r}")
        top_k = self.top_k
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise VisarError(f"top_k must be an integer >= 1 (or None for no top-k), got {self.top_k!r}")
        if not (is_number(self.top_p) and 0 < self.top_p <= 1):
            raise VisarError(f"top_p must be in (0, 1], got {self.top_p!r}")
        self.check_entropy_temperature()

    def check_entropy_temperature(self):
        t0 = self.entropy_temperature
        if t0 is None:
            return
        if not (is_number(t0) and MIN_TEMPERATURE <= t0 <= MAX_TEMPERATURE):
            bounds = f"{MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}"
            raise VisarError(f"entropy_temperature must be a number from {bounds} (or None for none), got {t0!r}")
        if self.temperature != 1.0:
            raise VisarError(
                f"temperature {self.temperature!r} and entropy_temperature {t0!r} are two temperatures for one "
                "draw: the entropy temperature sets each position's own (T0 (2.5 exp(-H/3) + 0.6)), so give one "
                "of them (temperature 1 with it)"
            )

    @property
    def uses_cfg(self) -> bool:
        return self.guidance_scale != 1.0


def cfg_mix(cond_logits: Tensor, uncond_logits: Tensor, scale: float | Tensor) -> Tensor:
    return uncond_logits + (cond_logits - uncond_logits) * scale


def split_cfg(logits: Tensor, params: SamplingParams, scale: Tensor | None = None) -> Tensor:
    """Logits of a batch laid out [cond ; uncond] (when CFG is on) -> guided logits of the cond half;
    scale: the guidance scale of each output ([L, 1] or [B, L, 1], a model's own schedule), else the params'."""
    if not params.uses_cfg:
        return logits
    cond, uncond = logits.chunk(2, dim=0)
    return cfg_mix(cond, uncond, params.guidance_scale if scale is None else scale)


def logits_to_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """Guided logits [..., V] -> target probabilities [..., V] (float32): temperature, top-k, top-p; with an
    entropy temperature: top-k, top-p, then each position's temperature (`entropy_temperature`)."""
    if params.entropy_temperature is not None:
        # Filter first, as the official code does: the nucleus is top-p's at temperature 1 (a temperature
        # first would move mass across the top_p line and keep another set of tokens), and H is the
        # entropy of what is left. Each position's T is a function of its own guided logits only, so the
        # target stays one fixed law per prefix, which every lossless method verifies against.
        logits = top_k_top_p(logits.float(), params.top_k, params.top_p)
        return (logits / entropy_temperature(logits, params.entropy_temperature)).softmax(-1)
    return top_k_top_p(logits.float() / params.temperature, params.top_k, params.top_p).softmax(-1)


def top_k_top_p(logits: Tensor, top_k: int | None, top_p: float) -> Tensor:
    """Logits [..., V] (float32) with -inf outside the top-k tokens and outside the top-p nucleus."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass before it already exceeds top_p (the top token always stays).
        drop_sorted = (cum - sorted_logits.softmax(-1)) > top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, -math.inf)
    return logits


def entropy_temperature(filtered_logits: Tensor, t0: float) -> Tensor:
    """Entropy-informed temperature (Ma et al., NeurIPS 2025; krennic999/ARsample,
    LlamaGen/autoregressive/models/generate.py `sample` and `entropy_filtering`): filtered logits
    [..., V] (-inf where filtered out) -> each position's temperature [..., 1],

        T = T0 (2.5 exp(-H / 3) + 0.6),   H = -sum_v p_v log(p_v + 1e-12),   p = softmax(filtered logits)

    (nats): a confident position (H near 0) is sampled hotter, up to 3.1 T0, an uncertain one cooler,
    down to 0.6 T0. The 1e-12 is upstream's: a filtered token (p = 0) adds 0 rather than 0 * -inf."""
    probs = filtered_logits.softmax(-1)
    entropy = -(probs * torch.log(probs + 1e-12)).sum(-1, keepdim=True)
    return t0 * (2.5 * torch.exp(-entropy / 3) + 0.6)


def sample_from_probs(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Inverse-CDF draw: probs [..., V], uniforms [...] in [0, 1) -> token ids [...].

    Deterministic given the uniforms, so randomness is owned by per-image generators; a token
    of probability 0 is never returned.
    """
    probs = probs.float()
    return draw_index(probs, to_device(uniforms, probs.device).unsqueeze(-1)).squeeze(-1)


# -inf as a 0-d tensor on each device, made once rather than once a draw: nextafter takes no CPU
# scalar beside a CUDA tensor (unlike the arithmetic ops), so each device has its own.
MINUS_INFINITY = {torch.device("cpu"): torch.tensor(-math.inf)}


def minus_infinity(device: torch.device) -> Tensor:
    if device not in MINUS_INFINITY:
        MINUS_INFINITY[device] = torch.tensor(-math.inf, device=device)
    return MINUS_INFINITY[device]


def draw_index(probs: Tensor, uniforms: Tensor) -> Tensor:
    """`sample_from_probs` keeping the last dimension: probs [..., V] float32, uniforms [..., 1] on
    its device -> token ids [..., 1] (the index shape `gather` and `scatter` take)."""
    cdf = probs.cumsum(-1)
    total = cdf[..., -1:]
    # Rounding can push u * total up to the total, past the last bin that adds mass: searching at
    # most the largest float below the total finds that bin (the first whose cumsum reaches it).
    below_total = torch.nextafter(total, minus_infinity(total.device))
    return torch.searchsorted(cdf, torch.minimum(uniforms * total, below_total), right=True)


MAX_SEED = 2**64 - 1  # the largest seed torch.Generator.manual_seed takes


def make_generators(batch_size: int, seed: int) -> list[torch.Generator]:
    """One CPU generator per image, seeded seed + index, so an image's draws are its own."""
    return [torch.Generator().manual_seed(seed + i) for i in range(batch_size)]


def draw_uniforms(generators: list[torch.Generator], count: int = 1) -> Tensor:
    """[B, count] uniforms, row b drawn from generators[b]."""
    return torch.stack([torch.rand(count, generator=g) for g in generators])


def stream_block(per_pass: int, passes: int = 16, most: int = 2**20) -> int:
    """Uniforms a `UniformStream` draws at once: `passes` passes' worth, but no more than `most` an
    image (4 MB) unless one pass takes more: a tree method's candidate keys take V a branching
    position, which for zipar-tree at V = 16384 and 48 rows is 0.8 M a pass. The numbers are the
    same at any block size."""
    return max(per_pass, min(passes * per_pass, most))


class UniformStream:
    """Each image's uniforms, handed out `take(count)` at a time, drawn from its generator in blocks
    of at least `block` values: the same numbers as one `draw_uniforms(generators, count)` per take,
    because a CPU generator's uniforms do not depend on how the draws are split (tested), but B
    draws and one copy to the device per block instead of per pass. What a decode leaves undrawn
    at its end is never read: the generators are the decode's own."""

    def __init__(self, generators: list[torch.Generator], device, block: int, drawn: Tensor | None = None):
        """drawn: each image's next uniforms already drawn from its generator, handed out first."""
        self.generators, self.device, self.block = list(generators), device, block
        self.buffer = to_device(torch.zeros(len(generators), 0), device) if drawn is None else drawn
        self.used = 0

    def take(self, count: int) -> Tensor:
        """-> [B, count] the next `count` uniforms of every image."""
        if self.used + count > self.buffer.shape[1]:
            fresh = to_device(draw_uniforms(self.generators, max(self.block, count)), self.device)
            self.buffer = torch.cat([self.buffer[:, self.used :], fresh], 1)
            self.used = 0
        self.used += count
        return self.buffer[:, self.used - count : self.used]

    def replace(self, rows: list[int], generators: list[torch.Generator]):
        """Rows `rows` draw from these generators from now on (a running batch's new images): their
        uniforms not yet taken are drawn afresh, so each new image's takes start with its generator's
        next numbers, as in a stream of its own."""
        for row, generator in zip(rows, generators, strict=True):
            self.generators[row] = generator
        left = self.buffer.shape[1] - self.used
        if left:
            index = torch.tensor(rows, device=self.buffer.device)
            self.buffer[index, self.used :] = to_device(draw_uniforms(generators, left), self.device)


def to_device(x: Tensor, device) -> Tensor:
    """Host data (uniforms drawn by the CPU generators) onto the model's device without making the host
    wait for the device: to CUDA through pinned memory and an asynchronous copy (a plain copy from
    pageable memory first drains the launch queue). The same values on every device."""
    device = torch.device(device)
    if x.device == device or device.type != "cuda" or x.device.type != "cpu":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)
