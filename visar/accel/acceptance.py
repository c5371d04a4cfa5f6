"""Acceptance rules of speculative decoding, as small pure functions.

Each function states its rule as math and carries a `lossless` flag: True means that, whatever
the draft distribution q, the token it outputs is distributed exactly as the target p (given
that the draft token x was drawn from q, independently of the uniforms passed in). The engine in
`jacobi.py` composes them; the tests in tests/test_acceptance.py check every lossless rule
against p by chi-square.

Notation (as in ../shared/research/jacobi_family.md): p = target distribution (the output of
`sampling.logits_to_probs`), q = the distribution the draft token x was drawn from,
(v)+ = max(v, 0), norm(v) = v / sum(v), TV(p, q) = 1/2 sum |p - q|.

Everything is vectorised over any leading shape [...] (typically [B, L]) with the vocabulary V
last. Randomness comes in as uniforms so that the caller owns it (per-image generators, or
noise keyed to absolute positions by `keyed_uniforms`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .sampling import sample_from_probs


def lossless(flag: bool):
    """Mark a rule as lossless (output law = p for every q) or not."""

    def mark(fn):
        fn.lossless = flag
        return fn

    return mark


@lossless(True)
def speculative_accept(target_probs: Tensor, draft_probs: Tensor, draft_tokens: Tensor, uniforms: Tensor) -> Tensor:
    r"""Standard speculative acceptance (Leviathan et al. 2023; Chen et al. 2023).

        accept x  <=>  u < min(1, p(x) / q(x)),   u ~ U[0, 1)

    computed as u * q(x) < p(x), which needs no division. With the residual below the output is
    distributed as p and P(accept) = sum_x min(p(x), q(x)) = 1 - TV(p, q).

    target_probs, draft_probs [..., V]; draft_tokens, uniforms [...] -> accept_mask [...] bool.
    """
    index = draft_tokens.unsqueeze(-1)
    p_x = target_probs.gather(-1, index).squeeze(-1)
    q_x = draft_probs.gather(-1, index).squeeze(-1)
    return uniforms.to(p_x.device) * q_x < p_x


@lossless(True)
def speculative_residual(target_probs: Tensor, draft_probs: Tensor) -> Tensor:
    r"""The distribution a rejected position is resampled from:

        r = norm((p - q)+)

    and nothing else: re-applying top-k/top-p/temperature to r would change the output law
    (the Lumina-mGPT 2.0 port resamples from p instead, which is biased). Where (p - q)+ is all
    zero (p = q) acceptance is certain, so r is never drawn from; it is then set to p so that it
    is still a distribution.

    target_probs, draft_probs [..., V] -> residual_probs [..., V].
    """
    excess = (target_probs - draft_probs).clamp(min=0)
    mass = excess.sum(-1, keepdim=True)
    return torch.where(mass > 0, excess / mass.clamp(min=torch.finfo(excess.dtype).tiny), target_probs)


@dataclass(frozen=True)
class AcceptanceRule:
    """A verification rule: `accept(p, q, x, u) -> mask` and the `residual(p, q)` a rejection draws from."""

    accept: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
    residual: Callable[[Tensor, Tensor], Tensor]

    @property
    def lossless(self) -> bool:
        return bool(getattr(self.accept, "lossless", False) and getattr(self.residual, "lossless", False))


SPECULATIVE = AcceptanceRule(speculative_accept, speculative_residual)


@lossless(True)
def maximal_coupling(
    target_probs: Tensor,
    draft_probs: Tensor,
    draft_tokens: Tensor,
    accept_uniforms: Tensor,
    residual_uniforms: Tensor,
    rule: AcceptanceRule = SPECULATIVE,
) -> tuple[Tensor, Tensor]:
    r"""Modified rejection sampling as a coupling of (q, p): the carry-over of MC-SJD / SCD.

        y = x            if u < min(1, p(x) / q(x))
        y ~ norm((p - q)+)   otherwise

    Given x ~ q, y ~ p, and P(y = x) = 1 - TV(p, q): the largest collision probability of any
    coupling with these marginals (So et al. 2025, "pi_MC"). Applied at every window slot, not
    only up to the first rejection, it turns a stale draft into a fresh one that keeps the old
    token as often as possible; the q recorded for y must then be p.

    target_probs, draft_probs [..., V]; draft_tokens, accept_uniforms, residual_uniforms [...]
    -> (tokens [...], accept_mask [...]).
    """
    accept_mask = rule.accept(target_probs, draft_probs, draft_tokens, accept_uniforms)
    resampled = sample_from_probs(rule.residual(target_probs, draft_probs), residual_uniforms)
    return torch.where(accept_mask, draft_tokens, resampled), accept_mask


@lossless(True)
def gumbel_coupling(target_probs: Tensor, noise_uniforms: Tensor) -> Tensor:
    r"""Gumbel-max sampling with shared noise (So et al. 2025, "pi_GS").

        y = argmax_v [ log p(v) + g_v ],   g_v = -log(-log u_v),  u_v ~ U(0, 1) i.i.d.

    y ~ p for any fixed p. Two draws with the same noise u (keyed to the same image and absolute
    position, see `keyed_uniforms`) from p and p' agree with probability >= (1 - TV)/(1 + TV),
    which is what makes carried-over drafts survive. Tokens with p(v) = 0 are never drawn.
    Computed as the equivalent exponential race argmax_v p(v) / e_v with e_v = -log u_v
    (log of it is log p(v) + g_v), which costs one log instead of three.

    target_probs [..., V], noise_uniforms [..., V] in (0, 1) -> tokens [...].
    """
    exponential = -torch.log(noise_uniforms.to(target_probs.device))
    return (target_probs / exponential).argmax(-1)


# -- randomness keyed to (image key, absolute position, purpose) ---------------------------------

_MASK32 = 0xFFFFFFFF


def _pcg_hash(x: Tensor) -> Tensor:
    """PCG-RXS-M-XS 32-bit hash (Jarzynski & Olano 2020) of int64 values in [0, 2^32).

    Every product stays below 2^62, so int64 arithmetic never overflows.
    """
    state = (x * 747796405 + 2891336453) & _MASK32
    word = (((state >> ((state >> 28) + 4)) ^ state) * 277803737) & _MASK32
    return (word >> 22) ^ word


def keyed_uniforms(keys: Tensor, positions: Tensor, purpose: int, size: int) -> Tensor:
    """Uniforms in (0, 1) that depend only on (key, absolute position, purpose, column).

    keys [B] (int, one per image, e.g. drawn once from the image's generator), positions [B, L]
    -> [B, L, size] float32 with 24 random bits each (as torch.rand). The same image, position
    and purpose always get the same noise, whatever the batch or the window it is drawn in.
    """
    # Each input is hashed before it is combined (xor), so that two rows never see shifted
    # copies of each other's noise, as they could with h(row) + column.
    keys = keys.to(positions.device).long() & _MASK32
    h = _pcg_hash(_pcg_hash(keys) ^ _pcg_hash(torch.full_like(keys, purpose)))  # [B]
    h = _pcg_hash(h[:, None] ^ _pcg_hash(positions.long() & _MASK32))  # [B, L]
    column = _pcg_hash(torch.arange(size, device=positions.device))
    bits = _pcg_hash(h[..., None] ^ column) >> 8  # [B, L, size], 24 bits
    return (bits.float() + 0.5) / float(1 << 24)
