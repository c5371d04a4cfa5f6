"""Speculative Jacobi decoding: one engine for SJD, coupled SJD (MC-SJD) and draft-model speculative sampling.

Papers and the upstream code the rules were checked against:
- SJD: Teng et al., "Accelerating Auto-regressive Text-to-Image Generation with Training-free
  Speculative Jacobi Decoding", ICLR 2025 (arXiv 2410.01699); tyshiwo1/Accelerating-T2I-AR-with-SJD,
  `scheduler/jacobi_iteration_lumina_mgpt.py`.
- MC-SJD / SCD: So, Kook, Jang, Park, "Speculative Coupled Decoding" (arXiv 2510.24211); junhyukso/SCD,
  `cosmos/cosmos1/models/autoregressive/sjd/speculative_sampler.py` (maximal coupling at every slot,
  carried q := current p) and the Gumbel-sharing variant of its Lumina/Janus schedulers.
- Speculative sampling with a draft model: Leviathan et al. 2023, Chen et al. 2023; gpt-fast
  `generate.py::speculative_decode`.

One iteration, for every image b of the batch at once:
1. propose a window of L_b slots: the last committed token, then L_b - 1 draft tokens, each with
   the distribution q it was drawn from;
2. one forward pass of the target over the window (a [cond ; uncond] batch under CFG), giving
   the target p at every slot through `logits_to_probs`, the function plain AR samples from;
3. verify left to right with an acceptance rule (acceptance.py); commit the accepted drafts plus
   one token more: the residual draw at the first rejection, or a bonus draw from p: 1..L_b tokens;
4. truncate image b's KV cache back to its own committed length;
5. carry the slots after the commit over as the next drafts, with q = the p that produced them.

Deliberate differences from the upstream code, each needed for exactness at every batch size:
- commits are per image (ragged): upstream SJD advances the whole batch by the shortest
  acceptance and re-verifies the rest against a stale q; here nobody waits and no accepted token
  is verified twice;
- a carried slot's q is always the p that produced its token (SCD's Lumina/Janus paths keep the
  old q on coupled slots, which is biased);
- rejections draw from norm((p - q)+), never from p (the Lumina-mGPT 2.0 bug) nor re-warped;
- random initial drafts are uniform tokens verified against that uniform q (upstream: one-hot q,
  also exact, but accepted with probability p(x) instead of min(1, V p(x))).

Randomness: every image draws one fixed-size block of uniforms per iteration from its own
generator ([4, window]: accept tests, residual/bonus draws, SJD's fresh carry draws, draft
draws), plus one 32-bit key when decoding starts; the Gumbel coupling's noise is keyed to
(key, absolute position). What an image draws depends only on its own trajectory, so its tokens
do not depend on the rest of its batch, unless `budget="auto"` chooses each pass's window for the
batch and device (`decode_with_budget`, `visar.accel.budget`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import VisarError
from ..models.base import RasterModel
from ..progress import progress_bar
from .acceptance import SPECULATIVE, AcceptanceRule, gumbel_coupling, keyed_uniforms, verify_slots
from .ar import sample_tokens
from .budget import (
    AUTO,
    CHAIN_SIZES,
    MAX_AGE,
    PassCosts,
    ProbeBudget,
    SurvivalCounts,
    WindowBudget,
    check_budget,
    cost_key,
    measured_costs,
    scratch_request,
)
from .checks import check_number
from .drafts import DecodeState, FillRequest, resolve_initialiser
from .registry import Request, register_method
from .sampling import SamplingParams, draw_uniforms, sample_from_probs, to_device
from .scoring import GuidedScorer
from .stats import DecodeLog

# Rows of the per-iteration uniform block [B, 4, window] each image draws from its generator.
ACCEPT, RESIDUAL, CARRY, DRAFT = range(4)
NUM_PURPOSES = 4
GUMBEL_NOISE = 1  # purpose id of the position-keyed Gumbel noise


@dataclass
class Window:
    """The shape of one iteration and the randomness each image drew for it."""

    window_len: Tensor  # [B] slots scored for each image: 1 (a plain AR step) .. window, 0 when done
    num_drafts: Tensor  # [B] window_len - 1 (0 for done images)
    uniforms: Tensor  # [B, 4, window]: rows ACCEPT, RESIDUAL, CARRY, DRAFT
    max_drafts: int  # G, the draft slots of the pass (padding past an image's own num_drafts)


class Proposer(Protocol):
    """Where drafts come from. `forward_passes` counts the proposer's own model calls."""

    forward_passes: int

    def start(self, state: DecodeState) -> None: ...

    def propose(self, state: DecodeState, window: Window) -> tuple[Tensor, Tensor]:
        """-> draft_tokens [B, G], draft_probs [B, G, V] for image indices committed + j, G = max_drafts."""
        ...

    def after_commit(
        self, state: DecodeState, window: Window, target_probs: Tensor, slot_tokens: Tensor, commit_count: Tensor
    ) -> None:
        """Called with the pass's p [B, L, V], the output token of every slot [B, L] and the commits [B],
        before `state.committed` moves on."""
        ...

    def close(self) -> None: ...


# -- carry-over updaters: the next drafts from this pass's p and slot outputs -------------------------


@dataclass
class CarryRequest:
    state: DecodeState
    target_probs: Tensor  # [B, L, V] this pass's p at every slot
    slot_tokens: Tensor  # [B, L] the verified-or-resampled token of every slot (maximal coupling of (q, p))
    slot_laws: Tensor  # [B, L, V] the law each slot token follows: p, or LANTERN's p~ at a verified draft
    slot_index: Tensor  # [B, L] absolute image-token index each slot predicts
    uniforms: Tensor  # [B, L] this iteration's carry uniforms of each image


# An updater returns the next drafts [B, L] and the law each was drawn from [B, L, V]: the next
# pass verifies a draft against the q recorded for it, so that q must be its true law.


def independent_carry(request: CarryRequest) -> tuple[Tensor, Tensor]:
    """SJD: a fresh draw from p at every slot, independent of the old draft."""
    return sample_from_probs(request.target_probs, request.uniforms), request.target_probs


def maximal_coupling_carry(request: CarryRequest) -> tuple[Tensor, Tensor]:
    """MC-SJD (pi_MC): the speculative test at every slot, no break; P(keep old draft) = 1 - TV(p, q).
    Under a relaxed rule (LANTERN) the slot token follows p~, and p~ is recorded as its law."""
    return request.slot_tokens, request.slot_laws


class GumbelCarry:
    """MC-SJD (pi_GS): Gumbel-max with noise keyed to (image key, absolute position).

    The rows of one pass [B, L, V] are kept for the next, whose slots mostly sit at the same
    positions: a row is hashed once while its position stays in a window, and the noise held is
    one pass's, whatever span of positions the engine's window covers (zipar's fronts spread a
    pass over the whole grid, where a ring indexed by position would need a row per position).
    """

    def __init__(self):
        self.noise: Tensor | None = None  # [B, L', V] the rows of the last pass
        self.row_position: Tensor | None = None  # [B, L'] the position of each row

    def __call__(self, request: CarryRequest) -> Tensor:
        vocab = request.target_probs.shape[-1]
        positions = request.slot_index  # [B, L]
        if self.noise is None:
            noise = keyed_uniforms(request.state.keys, positions, GUMBEL_NOISE, vocab)
        else:
            match = positions[:, :, None] == self.row_position[:, None, :]  # [B, L, L']
            noise = self.noise.gather(1, match.long().argmax(-1)[..., None].expand(-1, -1, vocab))
            fresh = ~match.any(-1)  # rows new to the window: hashed for every slot, kept where fresh (no sync)
            rows = keyed_uniforms(request.state.keys, positions, GUMBEL_NOISE, vocab)
            noise = torch.where(fresh[..., None], rows, noise)
        self.noise, self.row_position = noise, positions
        return gumbel_coupling(request.target_probs, noise), request.target_probs


COUPLINGS = {"maximal": maximal_coupling_carry, "gumbel": GumbelCarry}
CARRIES = {"none": independent_carry, **COUPLINGS}  # what a relaxed method may carry over with


def carry_updater(coupling: str, method: str, choices: dict = COUPLINGS) -> Callable:
    """The carry-over updater named by a method's `coupling` option (a fresh one per decode: the
    Gumbel carry keeps its noise rows)."""
    if not isinstance(coupling, str) or coupling not in choices:
        raise VisarError(f"unknown coupling {coupling!r} for {method}; use one of {', '.join(choices)}")
    updater = choices[coupling]
    return updater() if isinstance(updater, type) else updater


class JacobiProposer:
    """Drafts from the previous pass (carried over by `updater`), new slots from `initialiser`."""

    def __init__(self, initialiser: Callable, updater: Callable):
        self.initialiser, self.updater = initialiser, updater
        self.forward_passes = 0

    def start(self, state: DecodeState):
        batch, vocab, device = state.tokens.shape[0], state.vocab_size, state.tokens.device
        self.window = state.window
        self.carry_tokens = torch.zeros(batch, self.window, dtype=torch.long, device=device)
        self.carry_probs = torch.zeros(batch, self.window, vocab, device=device)
        self.carry_count = torch.zeros(batch, dtype=torch.long, device=device)
        # passes each carried draft has been through (its age; a new slot's draft is 0), for the budget
        self.carry_age = torch.zeros(batch, self.window, dtype=torch.long, device=device)
        self.draft_age = self.carry_age[:, :0]  # [B, G] of the last proposal

    def canvas(self, state: DecodeState) -> Tensor:
        slots = torch.arange(state.tokens.shape[1], device=state.tokens.device)
        canvas = torch.where(slots < state.committed[:, None], state.tokens, -1)
        index = state.committed[:, None] + torch.arange(self.window, device=slots.device)  # < N + window
        carried = torch.arange(self.window, device=slots.device) < self.carry_count[:, None]
        return canvas.scatter(1, index, torch.where(carried, self.carry_tokens, canvas.gather(1, index)))

    def propose(self, state: DecodeState, window: Window) -> tuple[Tensor, Tensor]:
        num_slots = window.max_drafts
        slots = torch.arange(num_slots, device=state.tokens.device)
        from_carry = slots < self.carry_count[:, None]  # [B, G]
        draft_tokens = self.carry_tokens[:, :num_slots]
        draft_probs = self.carry_probs[:, :num_slots]
        self.draft_age = torch.where(from_carry, self.carry_age[:, :num_slots], 0)
        if num_slots == 0:  # a pass of plain AR steps: no draft slots
            return draft_tokens, draft_probs
        needs_fill = (slots < window.num_drafts[:, None]) & ~from_carry
        # Filled unconditionally (asking whether any slot needs it would wait for the device); where
        # none does, every slot keeps its carried draft, as if the initialiser had not run.
        keep = from_carry | ~needs_fill.any()
        request = FillRequest(
            state,
            state.committed[:, None] + slots,
            window.uniforms[:, DRAFT, :num_slots],
            self.canvas(state),
        )
        fill_tokens, fill_probs = self.initialiser(request)
        draft_tokens = torch.where(keep, draft_tokens, fill_tokens)
        draft_probs = torch.where(keep[..., None], draft_probs, fill_probs.to(draft_probs.dtype))
        return draft_tokens, draft_probs

    def after_commit(self, state, window, target_probs, slot_tokens, commit_count, slot_laws):
        length = target_probs.shape[1]
        slot_index = state.committed[:, None] + torch.arange(length, device=target_probs.device)
        uniforms = window.uniforms[:, CARRY, :length]
        carry, law = self.updater(CarryRequest(state, target_probs, slot_tokens, slot_laws, slot_index, uniforms))
        # Slots commit_count .. window_len - 1 become drafts for the indices right after the new commit.
        shift = (commit_count[:, None] + torch.arange(length, device=carry.device)).clamp(max=length - 1)
        self.carry_tokens[:, :length] = carry.gather(1, shift)
        vocab = target_probs.shape[-1]
        self.carry_probs[:, :length] = law.gather(1, shift[..., None].expand(-1, -1, vocab))
        self.carry_count = (window.window_len - commit_count).clamp(min=0)
        slot_age = F.pad(self.draft_age, (0, length - self.draft_age.shape[1])) + 1  # the bonus slot: a new draw
        self.carry_age[:, :length] = slot_age.gather(1, shift)

    def close(self):
        pass


class DraftModelProposer:
    """Classic speculative sampling: a smaller model of the same family drafts autoregressively.

    The draft keeps its own ragged KV cache; after each pass it is truncated to the tokens it saw
    that were committed, and the next proposal first feeds it what it has not seen.
    """

    def __init__(self, draft: RasterModel, cond: Tensor, cond_mask: Tensor | None, params: SamplingParams):
        self.scorer = GuidedScorer(draft, cond, cond_mask, params)
        self.num_cond = draft.num_condition_tokens

    @property
    def forward_passes(self) -> int:
        return self.scorer.forward_passes

    def start(self, state: DecodeState):
        self.max_pos = self.num_cond + state.num_tokens - 1
        self.scorer.open_cache(self.max_pos + 1)
        self.draft_len: Tensor | None = None  # [B] valid cache length; None before the prefill
        self.pending: Tensor | None = None  # [B, V] the prefill's law of image token 0

    def catch_up(self, state: DecodeState) -> Tensor:
        """Feed the draft what it has not seen (positions draft_len .. T + committed - 1).

        -> q of the next token [B, V]."""
        device = state.tokens.device
        catch_up = self.num_cond + state.committed - self.draft_len  # [B] >= 0
        if not bool((catch_up > 0).any()):
            return self.pending
        steps = int(catch_up.max())
        positions = self.draft_len[:, None] + torch.arange(steps, device=device)  # [B, C]
        feed = state.tokens.gather(1, (positions - self.num_cond).clamp(0, state.tokens.shape[1] - 1))
        logits = self.scorer.logits(feed, positions.clamp(max=self.max_pos))
        last = logits[torch.arange(len(catch_up), device=device), (catch_up - 1).clamp(min=0)]  # [B, V]
        return torch.where((catch_up > 0)[:, None], self.scorer.target_probs(last), self.pending)

    def propose(self, state: DecodeState, window: Window) -> tuple[Tensor, Tensor]:
        batch, device = state.tokens.shape[0], state.tokens.device
        num_drafts = window.max_drafts
        if num_drafts == 0:
            return state.tokens[:, :0], torch.zeros(batch, 0, state.vocab_size, device=device)
        if self.draft_len is None:  # prefill the condition once
            self.pending = self.scorer.prefill()
            self.draft_len = torch.full((batch,), self.num_cond, dtype=torch.long, device=device)
        self.base = state.committed.clone()
        draft_q = self.catch_up(state)
        draft_tokens, draft_probs = [], []
        for k in range(num_drafts):
            token = sample_from_probs(draft_q, window.uniforms[:, DRAFT, k])
            draft_tokens.append(token)
            draft_probs.append(draft_q)
            if k + 1 < num_drafts:
                position = (self.num_cond + state.committed + k).clamp(max=self.max_pos)
                draft_q = self.scorer.target_probs(self.scorer.logits(token[:, None], position[:, None])[:, -1])
        return torch.stack(draft_tokens, 1), torch.stack(draft_probs, 1)

    def after_commit(self, state, window, target_probs, slot_tokens, commit_count, slot_laws):
        num_drafts = window.max_drafts
        if num_drafts == 0 or self.draft_len is None:
            return
        # Fed this pass: everything up to the last committed token, then drafts 0 .. num_drafts - 2.
        # The fed drafts that were accepted stay valid.
        accepted = (commit_count - 1).clamp(min=0, max=num_drafts - 1)
        valid = self.num_cond + self.base + accepted
        self.draft_len = torch.where(commit_count > 0, valid, self.draft_len)
        self.scorer.truncate_cache(self.draft_len)

    def close(self):
        self.scorer.close_cache()


# -- the engine ----------------------------------------------------------------------------------------


def check_spans(window, warmup, tail):
    for name, value, minimum in (("window", window, 1), ("warmup", warmup, 0), ("tail", tail, 0)):
        check_number(name, value, minimum, integer=True)


def window_lengths(committed: Tensor, window: int, warmup: int, tail: int, num_tokens: int) -> Tensor:
    """[B] slots per image: 1 (plain AR) in the warm-up and tail spans, else the window clipped so it
    ends before the tail; 0 for finished images."""
    jacobi_end = num_tokens - tail
    in_jacobi = (committed >= warmup) & (committed < jacobi_end)
    length = torch.where(in_jacobi, (jacobi_end - committed).clamp(max=window), torch.ones_like(committed))
    return torch.where(committed < num_tokens, length, torch.zeros_like(committed))


def score_window(scorer: GuidedScorer, state: DecodeState, draft_tokens: Tensor, first: bool) -> Tensor:
    """One target forward over [last committed token, drafts] for every image -> target probs [B, G + 1, V].

    Slot j predicts image index committed + j. The first pass (nothing committed yet) feeds the
    condition instead of a last token. Slots past an image's window are padding: their positions
    lie after its real ones (clamped to the last position), so no real query sees them, and the
    truncation after the pass forgets them. The pass is padded to a power of two of slots (at
    most `state.window`), so a compiled model meets a handful of shapes (1, 2, 4, 8, 16 for a
    16-slot window) instead of one per length the end of an image leaves; the padding's
    outputs are dropped.
    """
    num_cond = scorer.model.num_condition_tokens
    needed = draft_tokens.shape[1] + 1
    num_slots = min(1 << (needed - 1).bit_length(), max(state.window, needed))
    draft_tokens = F.pad(draft_tokens, (0, num_slots - needed))
    device = draft_tokens.device
    if first:
        input_pos = torch.arange(num_cond + num_slots - 1, device=device)
        tokens = draft_tokens if num_slots > 1 else None
        logits = scorer.logits(tokens, input_pos, with_condition=True)[:, num_cond - 1 :]
    else:
        last = state.tokens.gather(1, (state.committed - 1).clamp(min=0)[:, None])
        tokens = torch.cat([last, draft_tokens], 1)  # [B, L]
        input_pos = (num_cond + state.committed - 1)[:, None] + torch.arange(num_slots, device=device)
        logits = scorer.logits(tokens, input_pos.clamp(max=num_cond + state.num_tokens - 1))
    return scorer.target_probs(logits[:, :needed])


@dataclass
class Verdict:
    """The outcome of verifying one window."""

    slot_tokens: Tensor  # [B, L] every slot's output: its draft if accepted, else a residual (or p) draw
    slot_laws: Tensor  # [B, L, V] the law each slot token follows: p, or a relaxed rule's p~ at a verified draft
    has_draft: Tensor  # [B, G] slot j holds a draft of image b (slot num_drafts[b] is the bonus slot)
    num_accepted: Tensor  # [B] leading accepted drafts


def verify_window(
    rule: AcceptanceRule, target_probs: Tensor, draft_tokens: Tensor, draft_probs: Tensor, pass_window: Window
) -> Verdict:
    """Verify every drafted slot at once (`acceptance.verify_slots`); only the run of leading
    accepts commits, with one token more (a residual draw, or a draw from p at the bonus slot)."""
    num_drafts = pass_window.max_drafts
    has_draft = torch.arange(num_drafts, device=draft_tokens.device) < pass_window.num_drafts[:, None]  # [B, G]
    uniforms = pass_window.uniforms
    if num_drafts == 0:  # a pass of plain AR steps (what verify_slots draws there, without its bookkeeping)
        tokens = sample_from_probs(target_probs, uniforms[:, RESIDUAL, :1])
        return Verdict(tokens, target_probs, has_draft, torch.zeros_like(pass_window.num_drafts))
    verdict = verify_slots(
        rule, target_probs, draft_tokens, draft_probs, has_draft, uniforms[:, ACCEPT, :num_drafts],
        uniforms[:, RESIDUAL, : num_drafts + 1],
    )  # fmt: skip
    return Verdict(verdict.tokens, verdict.laws, has_draft, verdict.accept.long().cumprod(1).sum(1))


def image_keys(generators: list[torch.Generator], device) -> Tensor:
    """[B] one 32-bit key per image, the first draw of its generator (for position-keyed noise)."""
    return to_device(torch.stack([torch.randint(0, 2**32, (1,), generator=g) for g in generators])[:, 0], device)


def new_state(model: RasterModel, generators: list[torch.Generator], window: int, spare: int) -> DecodeState:
    """Nothing committed yet; the token buffer has `spare` scratch columns past the image for a pass's
    tokens beyond the commit."""
    batch, device, num_tokens = len(generators), model.device, model.num_image_tokens
    return DecodeState(
        tokens=torch.zeros(batch, num_tokens + spare, dtype=torch.long, device=device),
        committed=torch.zeros(batch, dtype=torch.long, device=device),
        keys=image_keys(generators, device),
        num_tokens=num_tokens,
        vocab_size=model.vocab_size,
        grid_size=tuple(model.grid_size),
        window=window,
    )


@torch.no_grad()
def speculative_decode(
    request: Request,
    proposer: Proposer,
    *,
    window: int,
    warmup: int = 0,
    tail: int = 0,
    rule: AcceptanceRule = SPECULATIVE,
    budget: WindowBudget | ProbeBudget | None = None,
) -> tuple[Tensor, dict]:
    """The engine: propose, score, verify, commit (ragged), truncate, carry over. -> (tokens [B, N], stats).

    budget: chooses each pass's window (at most `window`) from what earlier passes committed, or
    stops a probe (`budget.size()` None); None: every pass has `window` slots.
    """
    check_spans(window, warmup, tail)
    model, cond, generators, progress = request.model, request.cond, request.generators, request.progress
    device = model.device
    batch = cond.shape[0]
    num_cond, num_tokens = model.num_condition_tokens, model.num_image_tokens
    window = min(window, num_tokens)  # a longer window is clipped, here once and for all
    log = DecodeLog(batch, model.grid_size, window, device)
    state = new_state(model, generators, window, spare=window)
    scorer = GuidedScorer(model, cond, request.cond_mask, request.params)
    bar = progress_bar(total=num_tokens, enabled=progress, desc="speculative")
    sizes_chosen: dict[int, int] = {}  # window -> passes
    with scorer.cache(num_cond + num_tokens):
        proposer.start(state)
        try:
            while True:
                pass_size = window if budget is None else budget.size()
                if pass_size is None:  # a probe's last timed pass
                    break
                window_len = window_lengths(state.committed, min(pass_size, window), warmup, tail, num_tokens)
                num_slots = int(window_len.max())  # the one host sync of the loop the engine needs
                if num_slots == 0:
                    break
                sizes_chosen[pass_size] = sizes_chosen.get(pass_size, 0) + 1
                uniforms = draw_uniforms(generators, NUM_PURPOSES * window).view(batch, NUM_PURPOSES, window)
                pass_window = Window(
                    window_len, (window_len - 1).clamp(min=0), to_device(uniforms, device), num_slots - 1
                )
                draft_tokens, draft_probs = proposer.propose(state, pass_window)  # [B, G], [B, G, V]
                target_probs = score_window(scorer, state, draft_tokens, first=scorer.forward_passes == 0)
                verdict = verify_window(rule, target_probs, draft_tokens, draft_probs, pass_window)
                commit_count = torch.where(window_len > 0, verdict.num_accepted + 1, 0)

                # Write every slot's token after the committed ones; only the first commit_count count
                # (the buffer has `window` spare columns, and what lies past `committed` is scratch).
                slots = torch.arange(num_slots, device=device)
                state.tokens.scatter_(1, state.committed[:, None] + slots, verdict.slot_tokens)
                if num_slots > 1:
                    drafted = slots[: num_slots - 1].expand(batch, -1)
                    tested = verdict.has_draft & (drafted <= verdict.num_accepted[:, None])  # to the first rejection
                    log.drafts(
                        state.committed[:, None] + drafted, drafted, tested, drafted < verdict.num_accepted[:, None]
                    )
                log.commit(state.committed[:, None] + slots, slots < commit_count[:, None], scorer.forward_passes)
                log.count_pass(window_len > 0)
                if budget is not None:
                    budget.count(
                        verdict.num_accepted,
                        pass_window.num_drafts,
                        window_len > 0,
                        proposer.draft_age,
                        state.committed,
                    )
                proposer.after_commit(
                    state, pass_window, target_probs, verdict.slot_tokens, commit_count, verdict.slot_laws
                )
                state.committed = state.committed + commit_count
                # The cache keeps every committed token but the newest, which the next window feeds.
                scorer.truncate_cache(num_cond + state.committed - 1)
                if progress:
                    bar.update(int(state.committed.min()) - bar.n)
        finally:
            bar.close()
            proposer.close()
    stats = log.stats(scorer.forward_passes, draft_forward_passes=proposer.forward_passes)
    return state.tokens[:, :num_tokens], {**stats, "window": window, "sizes_chosen": dict(sorted(sizes_chosen.items()))}


# -- budgets: the window of each pass matched to the device --------------------------------------------


def chain_costs(request: Request, make_proposer: Callable[[], Proposer]) -> PassCosts | None:
    """Seconds per pass of this engine at each window of CHAIN_SIZES (clipped to the image), and at
    size 0 an AR step (`ar.sample_tokens`), measured in the same rounds (`budget.measured_costs`),
    once per model, device, dtype, batch size and guidance: the one-slot window pays for the
    engine's bookkeeping, which an AR step does not."""
    model = request.model
    sizes = (0, *(s for s in CHAIN_SIZES if s <= model.num_image_tokens))
    key = cost_key("chain", model, request.cond.shape[0], request.params.uses_cfg, (model.num_condition_tokens,))

    def probe(budget: ProbeBudget):
        if budget.fixed == 0:
            sample_tokens(scratch_request(request), budget)
        else:
            speculative_decode(scratch_request(request), make_proposer(), window=max(sizes), budget=budget)

    return measured_costs(model, key, sizes, probe, model.device, lambda size: max(size, 1), warm_up=(0, 1))


def decode_chain_budget(request: Request, proposer: Proposer, costs: PassCosts, **spans) -> tuple[Tensor, dict]:
    """`speculative_decode` with each pass's window chosen by an auto budget over `costs`: window w
    has w - 1 draft slots (size 0, an AR step, is not the engine's to run)."""
    model = request.model
    counts = SurvivalCounts(MAX_AGE, model.device)
    windows = tuple(size for size in costs.sizes if size >= 1)
    controller = WindowBudget(costs, windows, lambda size: size - 1, counts, tuple(model.grid_size))
    tokens, stats = speculative_decode(request, proposer, window=max(windows), budget=controller, **spans)
    return tokens, {**stats, **controller.stats()}


def decode_with_budget(
    request: Request,
    make_proposer: Callable[[], Proposer],
    budget: str | int | None,
    method: str,
    *,
    window: int,
    warmup: int = 0,
    tail: int = 0,
    rule: AcceptanceRule = SPECULATIVE,
) -> tuple[Tensor, dict]:
    """`speculative_decode` under a budget: None, the fixed `window`; a number, that window; "auto",
    each pass's window chosen from the measured pass costs and the decode's own acceptance counts
    (falling back to `window`, said in stats["budget"], when the costs cannot be measured)."""
    budget = check_budget(budget, method)
    spans = {"warmup": warmup, "tail": tail, "rule": rule}
    if budget != AUTO:
        window = window if budget is None else budget
        tokens, stats = speculative_decode(request, make_proposer(), window=window, **spans)
        return tokens, {**stats, "budget": budget if budget is not None else "fixed"}
    costs = chain_costs(request, make_proposer)
    if costs is None:
        tokens, stats = speculative_decode(request, make_proposer(), window=window, **spans)
        return tokens, {**stats, "budget": f"fixed window {window}: the pass costs could not be measured"}
    return decode_chain_budget(request, make_proposer(), costs, **spans)


# -- the registered methods ----------------------------------------------------------------------------


@register_method(
    "sjd",
    lossless=True,
    description="speculative Jacobi decoding (Teng et al. 2024), per-image commits, exact at any batch size",
)
def sjd(
    request: Request,
    *,
    window: int = 16,
    warmup: int = 0,
    tail: int = 0,
    init: str | Callable = "above",
    budget: str | int | None = None,
) -> tuple[Tensor, dict]:
    """Speculative Jacobi decoding (Teng et al. 2024), exact at every batch size.

    window: slots per target pass (the last committed token + window - 1 drafts), so 1..window
    tokens per pass; warmup / tail: the first / last tokens decoded one per pass (plain AR);
    init: the draft initialiser for new slots: "above" (the token one row up; the default, as it
    takes the fewest passes, docs/DEFAULTS.md), "random" (the paper's), "left", "above-left";
    budget: "auto" chooses each pass's window (1 .. 32) for the most tokens per second on this
    device and batch (`visar.accel.budget`), a number is the window, None keeps `window`.
    """
    check_spans(window, warmup, tail)
    initialiser = resolve_initialiser(init)
    return decode_with_budget(
        request,
        lambda: JacobiProposer(initialiser, independent_carry),
        budget,
        "sjd",
        window=window,
        warmup=warmup,
        tail=tail,
    )


@register_method(
    "mc-sjd",
    lossless=True,
    description="coupled speculative Jacobi decoding (So et al. 2025): maximal or Gumbel coupling of drafts",
)
def mc_sjd(
    request: Request,
    *,
    window: int = 16,
    warmup: int = 0,
    tail: int = 0,
    coupling: str = "maximal",
    init: str | Callable = "above",
    budget: str | int | None = None,
) -> tuple[Tensor, dict]:
    """Coupled speculative Jacobi decoding (So et al. 2025): SJD whose carried drafts are coupled to the old ones.

    coupling: "maximal" (the speculative test at every slot, pi_MC) or "gumbel" (Gumbel-max with
    noise keyed to image and absolute position, pi_GS). Other options as `sjd` (init "above" by
    default: the fewest passes, docs/DEFAULTS.md), budget as `sjd`'s.
    """
    check_spans(window, warmup, tail)
    initialiser = resolve_initialiser(init)
    carry_updater(coupling, "mc-sjd")  # checked before any probe
    tokens, stats = decode_with_budget(
        request,
        lambda: JacobiProposer(initialiser, carry_updater(coupling, "mc-sjd")),
        budget,
        "mc-sjd",
        window=window,
        warmup=warmup,
        tail=tail,
    )
    return tokens, {**stats, "coupling": coupling}


def check_draft(model: RasterModel, draft, method: str = "spec") -> RasterModel:
    """The draft model, or one clear VisarError if it cannot draft for `model` (same vocabulary, grid,
    condition; a separate instance on the same device). Names and folders are resolved before the
    method runs (`Pipeline.generate`, which also checks that both share a tokenizer)."""
    if draft is None:
        raise VisarError(
            f"method {method!r} needs a draft model: draft=<a model of the same family, or (through "
            "Pipeline.generate) a registered model name or folder>"
        )
    if not isinstance(draft, RasterModel):
        raise VisarError(
            f"draft= must be a raster model (resolve a name or folder with Pipeline.generate or visar.load), "
            f"got {type(draft).__name__}"
        )
    if draft is model:
        raise VisarError("the draft model must be a separate model instance from the target (each keeps a KV cache)")
    if draft.device != model.device:
        raise VisarError(f"draft model is on {draft.device}, the target on {model.device}: put both on the same device")
    if draft.vocab_size != model.vocab_size:
        raise VisarError(
            f"draft model vocabulary ({draft.vocab_size} tokens) differs from the target's ({model.vocab_size}): "
            "a draft must use the target's tokenizer"
        )
    if tuple(draft.grid_size) != tuple(model.grid_size):
        raise VisarError(
            f"draft model grid {tuple(draft.grid_size)} differs from the target's {tuple(model.grid_size)}"
        )
    if draft.condition_layout != model.condition_layout:
        raise VisarError(
            f"the draft model's condition {draft.condition_layout} differs from the target's "
            f"{model.condition_layout}: they must share the condition (kind, classes, caption layout)"
        )
    return draft


@register_method(
    "spec",
    lossless=True,
    description="speculative sampling with a draft model of the same family (draft=name, folder or model)",
    needs_draft=True,
)
def spec(
    request: Request,
    *,
    draft: RasterModel | None = None,
    window: int = 5,
    warmup: int = 0,
    tail: int = 0,
) -> tuple[Tensor, dict]:
    """Speculative sampling with a draft model of the same family (Leviathan et al. 2023).

    draft: a model sharing the target's vocabulary, tokenizer, grid and condition (through
    Pipeline.generate also a Pipeline or a registered name / folder). window: target slots per
    pass (the draft proposes window - 1 tokens autoregressively, sampled with the same CFG /
    temperature / top-k / top-p).
    """
    check_spans(window, warmup, tail)
    proposer = DraftModelProposer(check_draft(request.model, draft), request.cond, request.cond_mask, request.params)
    return speculative_decode(request, proposer, window=window, warmup=warmup, tail=tail)
