"""Acceptance rules of speculative decoding, as small pure functions.

Each function states its rule as math and carries a `lossless` flag: True means that, whatever
the draft distribution q, the token it outputs is distributed exactly as the target p (given
that the draft token x was drawn from q, independently of the uniforms passed in). The engine in
`raster/chain.py` composes them; the tests in tests/accel/core/test_acceptance.py check every lossless rule
against p by chi-square.

Notation (as in the speculative sampling papers cited in raster/chain.py): p = target distribution (the output of
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


@lossless(True)
def rejection_residual(target_probs: Tensor, draft_probs: Tensor) -> Tensor:
    r"""The law left after a rejected candidate, one rung of recursive rejection's ladder (tree_acceptance):

        R' = norm((R - q)+),   computed as norm((R - q)+ + eps R),  eps = 1e-30

    Wherever (R - q)+ has mass (above some 1e-23) eps R is below its float32 rounding, so this is
    speculative_residual's law; where it has none (R = q up to rounding: the candidate's test passes
    for all but a rounding's worth of uniforms) it is R, as there, so that a draw stays in p's
    support. 5 ops a rung instead of speculative_residual's 7 (no mass test, no select).

    target_probs (R), draft_probs (q) [..., V] -> [..., V].
    """
    excess = (target_probs - draft_probs).clamp_(min=0).add_(target_probs, alpha=1e-30)
    return excess / excess.sum(-1, keepdim=True)


def optimal_residual(target_probs: Tensor, draft_probs: Tensor, acceptance: Tensor) -> Tensor:
    r"""The residual of least total variation for a relaxed acceptance (derived in the method brief; COOL-SD's
    "optimal resampling", Li et al. 2026, whose code is unreleased):

        r* = norm((p - q a)+)

    with a(y) the probability that a draft y is accepted. Whatever the residual r, a step outputs
    q a + (1 - sum q a) r >= q a, so its TV to p is at least sum (q a - p)+; r* attains that bound
    (only the accepted excess is left), at the acceptance the test already has. With the exact
    test, a = min(1, p/q) and r* is norm((p - q)+). Where (p - q a)+ has no mass (every draft
    accepted) r* is never drawn from and is set to p.

    target_probs (p, unrelaxed), draft_probs (q), acceptance (a) [..., V] -> [..., V].
    """
    excess = (target_probs - draft_probs * acceptance).clamp(min=0)
    mass = excess.sum(-1, keepdim=True)
    return torch.where(mass > 0, excess / mass.clamp(min=torch.finfo(excess.dtype).tiny), target_probs)


@dataclass(frozen=True)
class AcceptanceRule:
    """A verification rule: `accept(p, q, x, u) -> mask` and the `residual(p, q)` a rejection draws from.

    `relax(p, q, x) -> p~`, when set, replaces the target of the drafted slots before `accept`
    and `residual` see it (LANTERN); the bonus slot still draws from p. `acceptance(p, q) -> a`
    [..., V], when set, is the probability `accept` passes each token y were it drafted (from the
    unrelaxed p), and a rejection draws from `optimal_residual` instead of `residual`.
    """

    accept: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
    residual: Callable[[Tensor, Tensor], Tensor]
    relax: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None
    acceptance: Callable[[Tensor, Tensor], Tensor] | None = None

    def rejected_law(self, p: Tensor, verified_p: Tensor, q: Tensor) -> tuple[Tensor, Tensor | None]:
        """The law a rejection draws from, and the law the slot's token then follows (None: verified_p,
        the relaxed target, as the speculative residual gives it)."""
        if self.acceptance is None:
            return self.residual(verified_p, q), None
        acceptance = self.acceptance(p, q)
        residual, accepted = optimal_residual(p, q, acceptance), q * acceptance  # accepted: q a [..., V]
        return residual, accepted + (1 - accepted.sum(-1, keepdim=True)) * residual

    @property
    def lossless(self) -> bool:
        exact_target = self.relax is None or getattr(self.relax, "lossless", False)
        return all((getattr(self.accept, "lossless", False), getattr(self.residual, "lossless", False), exact_target))


SPECULATIVE = AcceptanceRule(speculative_accept, speculative_residual)


@dataclass
class SlotVerdict:
    """Every slot's output after verification (`verify_slots`)."""

    tokens: Tensor  # [B, L] its draft if accepted, else a draw from the residual (from p where it has no draft)
    accept: Tensor  # [B, G] bool: the slot's draft passed its test
    laws: Tensor  # [B, L, V] the law each token follows: p, or a relaxed rule's p~ at a drafted slot
    p_draws: Tensor | None = None  # [B, L] a draw from p at every slot, where asked for (`verify_slots`)


def verify_slots(
    rule: AcceptanceRule,
    target_probs: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor,
    has_draft: Tensor | None,
    accept_uniforms: Tensor,
    draw_uniforms: Tensor,
    draws_from_p: bool = False,
) -> SlotVerdict:
    """Verify every drafted slot of a pass at once, each on its own test (the caller decides which
    outputs commit: the run of leading accepts, for a Jacobi window or a zipar front).

    target_probs [B, L, V]; the first G <= L slots may hold drafts: draft_tokens [B, G], draft_probs
    [B, G, V] (the law each was drawn from), has_draft [B, G] (None: every one of the G slots);
    accept_uniforms [B, G] and draw_uniforms [B, L] are the slots' test and draw uniforms. A slot
    with a draft outputs it if accepted, else a draw from `rule.residual`; a slot without one draws
    from p. draws_from_p: a draw from p at every slot too (SJD's fresh carry-over), made in the same
    cumsum and search as the slots' draws, with the last L of draw_uniforms [B, 2L].
    """
    num_drafted, num_slots = draft_tokens.shape[1], target_probs.shape[1]
    drafted_p = target_probs[:, :num_drafted]
    # A relaxed rule (LANTERN) verifies against p~; slots without a draft keep p.
    verified_p = drafted_p if rule.relax is None else rule.relax(drafted_p, draft_probs, draft_tokens)
    accept = rule.accept(verified_p, draft_probs, draft_tokens, accept_uniforms)
    residual, output_law = rule.rejected_law(drafted_p, verified_p, draft_probs)
    if output_law is not None:  # the law of a slot's token under the optimal residual
        verified_p = output_law
    if has_draft is not None:
        accept, residual = has_draft & accept, torch.where(has_draft[..., None], residual, drafted_p)
    undrafted_p = target_probs[:, num_drafted:]
    laws_drawn = [residual, *([undrafted_p] if num_slots > num_drafted else [])]
    if draws_from_p:
        laws_drawn.append(target_probs)
    drawn = sample_from_probs(torch.cat(laws_drawn, 1) if len(laws_drawn) > 1 else residual, draw_uniforms)
    drafted = drawn[:, :num_drafted]
    drafted.copy_(torch.where(accept, draft_tokens, drafted))  # an accepted slot outputs its draft
    tokens, p_draws = (drawn[:, :num_slots], drawn[:, num_slots:]) if draws_from_p else (drawn, None)
    laws = target_probs
    if rule.relax is not None or output_law is not None:  # the verified slots follow p~ (or r*'s law), not p:
        # a coupled carry must record that
        drafted_laws = verified_p if has_draft is None else torch.where(has_draft[..., None], verified_p, drafted_p)
        laws = torch.cat([drafted_laws, undrafted_p], 1)
    return SlotVerdict(tokens, accept, laws, p_draws)


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


# -- relaxed (lossy) rules for visual tokens: GSD and LANTERN ------------------------------------------


@lossless(False)
def grouped_accept(
    target_probs: Tensor,
    draft_probs: Tensor,
    draft_tokens: Tensor,
    uniforms: Tensor,
    *,
    codebook: Tensor,
    group_size: int,
    prob_gap: float,
    max_distance: float,
) -> Tensor:
    r"""Grouped acceptance of GSD (So et al. 2025), with its dynamic group.

        accept x  <=>  u < min(1, sum_{y in G(x)} p(y) / sum_{y in G(x)} q(y)),   u ~ U[0, 1)

    computed as u * q(G) < p(G). G(x) holds x and the tokens ranked next to it by target
    probability: ranks r(x) - floor(n/2) .. r(x) - floor(n/2) + n - 1 of p sorted in decreasing
    order (stable), n = group_size, each kept when

        |p(y) - p(x)| <= prob_gap   and   ||e(y) - e(x)||^2 <= max_distance

    with e = the tokenizer's code vectors (`codebook` [V, C], as used for lookup). n = 1 is the
    speculative rule. For a fixed partition of the vocabulary the paper's Theorem 1 gives an
    acceptance rate >= 1 - TV(p, q); the dynamic group depends on p and x, and paired (as
    upstream) with the token-level residual norm((p - q)+) the output law is not p, with no
    bound on the distortion. A draft the target rules out (p(x) = 0: top-k, top-p) is never
    accepted (upstream accepts it when its group holds mass).

    target_probs, draft_probs [..., V]; draft_tokens, uniforms [...]; -> accept_mask [...] bool.
    """
    index = draft_tokens.unsqueeze(-1)
    vocab = target_probs.shape[-1]
    # A group of n >= 2V - 1 around any rank covers the whole vocabulary: larger n adds only
    # out-of-range ranks (dropped below), so it is clipped there rather than allocated.
    group_size = min(group_size, 2 * vocab - 1)
    if group_size == 1:
        group, keep = index, torch.ones_like(index, dtype=torch.bool)
    else:
        group, in_range = ranked_group(target_probs, index, group_size)  # [..., n] in rank order
        p_x = target_probs.gather(-1, index)
        gap = (target_probs.gather(-1, group) - p_x).abs()
        book = codebook.to(target_probs.device, torch.float32)
        distance = (book[group] - book[draft_tokens].unsqueeze(-2)).pow(2).sum(-1)  # [..., n]
        keep = in_range & (gap <= prob_gap) & (distance <= max_distance)
        keep[..., group_size // 2] = True  # the draft itself, whatever rounding says
    p_group = (target_probs.gather(-1, group) * keep).sum(-1)
    q_group = (draft_probs.gather(-1, group) * keep).sum(-1)
    accept = uniforms.to(p_group.device) * q_group < p_group
    return accept & (target_probs.gather(-1, index).squeeze(-1) > 0)


def grouped_acceptance(
    target_probs: Tensor,
    draft_probs: Tensor,
    *,
    codebook: Tensor,
    group_size: int,
    prob_gap: float,
    max_distance: float,
) -> Tensor:
    """`grouped_accept`'s probability of accepting each token y were it drafted -> [..., V]:
    min(1, p(G(y)) / q(G(y))) where p(y) > 0, else 0, every y's group found at once from one sort
    of p (the ranks next to y's, filtered as there). Costs [..., V, n, C] memory (C: code width)."""
    vocab = target_probs.shape[-1]
    size = min(group_size, 2 * vocab - 1)
    order = rank_keys(target_probs).argsort(-1, descending=True)  # [..., V]: the token at each rank
    rank = order.argsort(-1)  # [..., V]: each token's rank
    at = rank.unsqueeze(-1) - size // 2 + torch.arange(size, device=rank.device)  # [..., V, n] ranks of y's group
    in_range = (at >= 0) & (at < vocab)
    group = order.gather(-1, at.clamp(0, vocab - 1).flatten(-2)).view(at.shape)  # [..., V, n] token ids
    p_group = target_probs.gather(-1, group.flatten(-2)).view(group.shape)
    q_group = draft_probs.gather(-1, group.flatten(-2)).view(group.shape)
    book = codebook.to(target_probs.device, torch.float32)
    gap = (p_group - target_probs.unsqueeze(-1)).abs()
    distance = (book[group] - book.unsqueeze(-2)).pow(2).sum(-1)  # [..., V, n]: ||e(g) - e(y)||^2
    keep = in_range & (gap <= prob_gap) & (distance <= max_distance)
    keep[..., size // 2] = True  # y itself
    p_mass, q_mass = (p_group * keep).sum(-1), (q_group * keep).sum(-1)
    ratio = (p_mass / q_mass.clamp(min=torch.finfo(q_mass.dtype).tiny)).clamp(max=1.0)
    return torch.where(target_probs > 0, ratio, 0.0)


def rank_keys(probs: Tensor) -> Tensor:
    """probs [..., V] (float32) -> [..., V] int64 keys with no ties that order tokens as a stable sort by
    decreasing probability does (ties by increasing id): the float32 bits of a non-negative number
    order as the number does, so bits * V + (V - 1 - id)."""
    if probs.dtype != torch.float32:  # the key reads float32 bits (target laws are float32: logits_to_probs)
        raise TypeError(f"ranked groups take float32 probabilities, got {probs.dtype}")
    vocab = probs.shape[-1]
    ids = torch.arange(vocab - 1, -1, -1, device=probs.device)
    return (probs + 0.0).view(torch.int32).long() * vocab + ids  # + 0.0: a -0.0 becomes +0.0


def ranked_group(probs: Tensor, index: Tensor, size: int) -> tuple[Tensor, Tensor]:
    """The tokens at ranks r - floor(n/2) .. r - floor(n/2) + n - 1 of probs [..., V] sorted in
    decreasing order, stable (ties by increasing id), where r is the rank of index [..., 1]; n = size
    (< 2V). -> (tokens [..., n] in rank order, whether each rank lies in 0 .. V - 1).

    The same as sorting, found with two top-k's: the float32 bits of a non-negative number order as
    the number does, so bits * V + (V - 1 - id) is a key with no ties that orders tokens as the
    stable sort does, and the ranks next to r are the nearest keys above and below the draft's (a
    [..., V] sort a draft slot cost GSD about a tenth of its pass on a CPU)."""
    key = rank_keys(probs)
    own = key.gather(-1, index)
    before, after = size // 2, size - 1 - size // 2
    top, bottom = torch.iinfo(torch.int64).max, torch.iinfo(torch.int64).min
    higher = torch.where(key > own, key, top).topk(before, largest=False)  # ranks r - 1, r - 2, ...
    lower = torch.where(key < own, key, bottom).topk(after, largest=True)  # ranks r + 1, r + 2, ...
    group = torch.cat([higher.indices.flip(-1), index, lower.indices], -1)
    draft = torch.ones_like(index, dtype=torch.bool)
    in_range = torch.cat([higher.values.flip(-1) != top, draft, lower.values != bottom], -1)
    return group, in_range


def _prefix_moves(mass_of_neighbours: Tensor, budget: Tensor) -> Tensor:
    """The longest prefix (in distance order) whose cumulative mass stays within `budget`: the
    mass each neighbour gives up [..., k] (zero past the prefix)."""
    within = mass_of_neighbours.cumsum(-1) <= budget
    return mass_of_neighbours * within


def _move_budget(target_probs: Tensor, delta: float, lambda_cap: float | None) -> Tensor:
    """Per receiving token: at most delta in total, and at most (lambda - 1) p(x) (LANTERN++)."""
    budget = torch.full_like(target_probs, float(delta))
    if lambda_cap is not None:
        budget = torch.minimum(budget, (lambda_cap - 1.0) * target_probs)
    return budget


@lossless(False)
def lantern_relax_per_draft(
    target_probs: Tensor,
    draft_probs: Tensor,
    draft_tokens: Tensor,
    *,
    neighbours: Tensor,
    delta: float,
    lambda_cap: float | None = None,
) -> Tensor:
    r"""LANTERN's relaxed target in the paper's form (Jang et al. 2025), one per draft token x:

        A(x) = longest prefix of B_k(x) (k nearest codes of x, by distance) with p(A) <= delta
        p~_x(x) = p(x) + p(A),   p~_x(y) = 0 for y in A(x),   p~_x(y) = p(y) otherwise

    (with lambda_cap: also p(A) <= (lambda - 1) p(x), LANTERN++). TV(p~_x, p) = p(A) <= delta.
    Verified with u < p~_x(x) / q(x) and the residual norm((p~_x - q)+), the output law is
    exactly p~_x when the draft is deterministic (q one-hot, as EAGLE-2 top-k drafts). For a
    sampled draft (q not one-hot: Jacobi carry-overs, draft-model samples) the output law is the
    q-average of per-draft kernels and its TV to p can exceed delta by far (about 0.26 at
    delta = 0.2 on a 7-token example; see tests/accel/raster/test_relaxed.py): `lantern_relax_bounded` keeps it.

    neighbours [V, k] code ids sorted by distance; -> p~ [..., V] for the draft of each slot.
    """
    near = neighbours.to(draft_tokens.device)[draft_tokens]  # [..., k]
    p_near = target_probs.gather(-1, near)
    budget = _move_budget(target_probs, delta, lambda_cap).gather(-1, draft_tokens.unsqueeze(-1))
    moved = _prefix_moves(p_near, budget)
    relaxed = target_probs.scatter(-1, near, p_near - moved)
    return relaxed.scatter_add(-1, draft_tokens.unsqueeze(-1), moved.sum(-1, keepdim=True))


@lossless(False)
def lantern_relax_bounded(
    target_probs: Tensor,
    draft_probs: Tensor,
    draft_tokens: Tensor,
    *,
    neighbours: Tensor,
    delta: float,
    lambda_cap: float | None = None,
) -> Tensor:
    r"""LANTERN's relaxation with its delta bound kept for sampled drafts: one target for every draft.

    Mass moves, as in LANTERN, from a token's nearest codebook neighbours onto it, but only where
    it raises acceptance: onto tokens q over-drafts, from tokens p has in excess.

        s = (p - q)+,  d = (q - p)+                      (surplus, deficit)
        b(z) = min(delta, d(z)) where p(z) > 0, else 0   (and <= (lambda - 1) p(z), LANTERN++)
        pull_z(y_j) = min(s(y_j), (b(z) - s(y_1..y_{j-1}))+)   along B_k(z) = (y_1, .., y_k), nearest first
        c(y) = sum_z pull_z(y);  each claim is served at the rate min(1, s(y) / c(y))
        t(z) = sum_j pull_z(y_j) min(1, s(y_j)/c(y_j)),   r(y) = min(s(y), c(y))   (sum t = sum r = R)
        p^ = p + theta (t - r),   theta = min(1, delta / R)

    p^ >= 0 (r <= s <= p), sums to 1, and does not depend on which draft was drawn, so verifying
    x ~ q with u < p^(x)/q(x) and the residual norm((p^ - q)+) outputs exactly p^, with
    TV(p^, p) = theta R <= delta. Mass lands only where p^ <= q and leaves only where p^ >= q, so
    all of it turns into acceptance: sum_x min(p^, q) = 1 - TV(p, q) + theta R. No rule that keeps
    TV <= delta can gain more than delta. For a deterministic draft (q one-hot at x) this is
    LANTERN's move onto x of min(delta, p(B_k(x))), nearest first, the last neighbour in part (the
    paper moves whole neighbours only, p(A) <= delta). Nothing moves onto a token the target
    rules out (p(z) = 0: top-k, top-p), so the relaxation never overrides the truncation.

    neighbours [V, k] code ids sorted by distance; costs [..., V, k] memory per call.
    """
    shape = target_probs.shape
    vocab = shape[-1]
    # Work on [V, N] (the slots last): gathering whole rows of a [V, N] tensor by the neighbour ids
    # is much faster on CPU than index_select along the last dim of [N, V].
    p = target_probs.reshape(-1, vocab).t().contiguous()
    q = draft_probs.reshape(-1, vocab).t().contiguous()
    surplus = (p - q).clamp(min=0)
    budget = torch.minimum((q - p).clamp(min=0), _move_budget(p, delta, lambda_cap))
    budget = torch.where(p > 0, budget, 0.0)
    near = neighbours.to(p.device)  # [V, k]
    flat, k = near.reshape(-1), near.shape[1]

    def at_neighbours(values: Tensor) -> Tensor:  # [V, N] -> [V, k, N]: the j-th neighbour's value
        return values.index_select(0, flat).view(vocab, k, -1)

    near_surplus = at_neighbours(surplus)  # surplus of the j-th neighbour of z
    before = near_surplus.cumsum(1) - near_surplus
    pull = torch.minimum((budget.unsqueeze(1) - before).clamp(min=0), near_surplus)
    claims = torch.zeros_like(p).index_add_(0, flat, pull.view(vocab * k, -1))  # [V, N]
    rate = torch.where(claims > 0, (surplus / claims.clamp(min=torch.finfo(claims.dtype).tiny)).clamp(max=1), 0.0)
    granted = (pull * at_neighbours(rate)).sum(1)  # t [V, N]
    removed = claims * rate  # r [V, N]
    total = granted.sum(0, keepdim=True)  # R [1, N]
    theta = (delta / total.clamp(min=torch.finfo(total.dtype).tiny)).clamp(max=1.0)
    return (p + theta * (granted - removed)).clamp(min=0).t().reshape(shape)
