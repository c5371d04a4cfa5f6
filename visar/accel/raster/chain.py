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

One pass per image: propose a window of drafts (proposers.py), score it in one target pass,
verify left to right (acceptance.py), commit 1..L tokens per image (ragged), truncate its KV
cache, carry the rest over. docs/RASTER.md has the iteration step by step, the deliberate
differences from the upstream code (each needed for exactness at every batch size) and the
randomness, which makes an image's tokens independent of its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.acceptance import SPECULATIVE, AcceptanceRule, verify_slots
from ..core.checks import check_number
from ..core.method_registry import Request
from ..core.sampling import sample_from_probs
from ..core.scoring import GuidedScorer
from ..core.stats import ChainRecord
from .pass_loop import decode_passes, power_of_two, score_first_passes_apart
from .proposers import ACCEPT, NUM_PURPOSES, RESIDUAL, Proposer, Window
from .slots import SlotState


def check_spans(window, warmup, tail):
    for name, value, minimum in (("window", window, 1), ("warmup", warmup, 0), ("tail", tail, 0)):
        check_number(name, value, minimum, integer=True)


def window_lengths(committed: Tensor, window: int, warmup: int, tail: int, num_tokens: int) -> Tensor:
    """[B] slots per image: 1 (plain AR) in the warm-up and tail spans, else the window clipped so it
    ends before the tail; 0 for finished images."""
    remaining = num_tokens - committed
    if warmup == 0 and tail == 0:  # the default: the window clipped to the image (0 when done)
        return remaining.clamp(max=window)
    jacobi = (num_tokens - tail - committed).clamp(1, window)  # 1 past the Jacobi span, in the tail
    return torch.where(committed >= warmup, jacobi, 1).minimum(remaining)


@dataclass
class Verdict:
    """The outcome of verifying one window."""

    slot_tokens: Tensor  # [B, L] every slot's output: its draft if accepted, else a residual (or p) draw
    slot_laws: Tensor  # [B, L, V] the law each slot token follows: p, or a relaxed rule's p~ at a verified draft
    num_accepted: Tensor  # [B] leading accepted drafts
    p_draws: Tensor | None = None  # [B, L] a draw from p at every slot (with the CARRY uniforms), where asked for


def verify_window(
    rule: AcceptanceRule,
    target_probs: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor,
    pass_window: Window,
    draws_from_p: bool = False,
) -> Verdict:
    """Verify every drafted slot at once (`acceptance.verify_slots`); only the run of leading
    accepts commits, with one token more (a residual draw, or a draw from p at the bonus slot).
    draws_from_p: also draw from p at every slot with the CARRY uniforms, in the same draw
    (`Proposer.draws_from_p`)."""
    num_drafts, row = pass_window.max_drafts, pass_window.row
    if num_drafts == 0:  # a pass of plain AR steps (what verify_slots draws there, without its bookkeeping)
        tokens = sample_from_probs(target_probs, row(RESIDUAL, 1))
        return Verdict(tokens, target_probs, torch.zeros_like(pass_window.window_len))
    # [B, G] slot j holds a draft of image b (slot window_len[b] - 1 is its bonus slot); a full pass: every slot
    has_draft = None
    if not pass_window.full:
        has_draft = torch.arange(1, num_drafts + 1, device=draft_tokens.device) < pass_window.window_len[:, None]
    verdict = verify_slots(
        rule, target_probs, draft_tokens, draft_probs, has_draft, row(ACCEPT, num_drafts),
        pass_window.draw_rows(num_drafts + 1) if draws_from_p else row(RESIDUAL, num_drafts + 1), draws_from_p,
    )  # fmt: skip
    num_accepted = verdict.accept.cumprod(1).sum(1)  # bool cumprod: long
    return Verdict(verdict.tokens, verdict.laws, num_accepted, verdict.p_draws)


class ChainPasses:
    """The chain engine's passes: each image scores a window right after its committed prefix
    ([last committed token, drafts]), verifies the drafts left to right, commits the leading
    accepted ones and one token more (ragged), and carries the rest over (`Proposer`). Every pass
    has `window` slots (fewer where an image's window reaches its end)."""

    def __init__(self, request: Request, state: SlotState, proposer: Proposer, warmup, tail, rule):
        model = request.model
        self.state, self.proposer, self.rule = state, proposer, rule
        self.spans = (warmup, tail)  # the plain-AR spans at the start and end
        self.batch, self.device = request.batch_size, model.device
        self.num_cond, self.total = model.num_condition_tokens, model.num_image_tokens
        self.window = state.window
        self.record = ChainRecord(self.batch, model.grid_size, self.window, self.device)
        self.slot_range = torch.arange(self.window, device=self.device)
        self.position_offsets = self.num_cond - 1 + self.slot_range  # slot j's position past the commit
        self.scorer = GuidedScorer.for_request(request)
        state.record, state.parts = self.record, [self.scorer]  # and the proposer's (`Proposer.start`)
        self.full_lengths: dict[int, Tensor] = {}  # slots -> window_len [B] of a pass of full windows
        # Compiled passes draft padded windows: slots past an image's window are padding (never
        # tested, after every real slot, forgotten with the cache), so the tokens are the same.
        self.compiled = request.compile_passes is not None

    def __enter__(self):
        self.scorer.open_cache(self.num_cond + self.total)
        self.proposer.start(self.state)
        return self

    def __exit__(self, *exc):
        try:
            self.proposer.close()
        finally:
            self.scorer.close_cache()

    def plan(self) -> Window | None:
        """Each image's window this pass (its uniforms included), or None when the decode is over."""
        window_len, num_slots, least, full, catch_up = self.pass_shape()
        if num_slots == 0:
            return None
        uniforms = self.state.uniforms.take(NUM_PURPOSES * self.window)  # [B, 4 * window] (`Window.row`)
        fresh = self.state.next_pass()
        self.record.reserve(self.state.passes)
        scored = min(power_of_two(num_slots), self.window)  # slots scored, padding included
        slots = self.slot_range if scored == self.window else self.slot_range[:scored]
        slot_index = self.state.committed[:, None] + slots  # [B, scored]: the image index of each
        return Window(window_len, uniforms, num_slots - 1, fresh, full, least, slot_index, catch_up)

    def pass_shape(self) -> tuple[Tensor, int, int, bool, int]:
        """The one host sync of the loop the engine needs -> (window_len [B], the pass's slots, the
        fewest tokens any image has committed, whether every image's window has all the slots, and
        what the proposer asked to know: a draft model's positions to catch up on, else 0).
        Without spans, the fewest and most committed give the rest (window_len = min(N - committed,
        window)), and a pass of full windows takes its window_len made once; with spans or compiled
        passes (a power of two of slots, as scoring pads anyway: a few shapes to compile, each of
        the general graph) only the slots are read."""
        committed, need, window = self.state.committed, self.proposer.catch_up_need(self.state), self.window
        if self.spans != (0, 0) or self.compiled:
            window_len = window_lengths(committed, window, *self.spans, self.total)
            if need is None:
                num_slots, catch_up = int(window_len.max()), 0
            else:
                num_slots, catch_up = torch.stack([window_len.max(), need]).tolist()
            if self.compiled and num_slots:
                num_slots = min(power_of_two(num_slots), self.window)
            return window_len, num_slots, 0, False, catch_up
        # B numbers: read whole, as the least and most would cost two ops more
        counts = committed.tolist() if need is None else torch.cat([committed, need[None]]).tolist()
        catch_up = 0 if need is None else counts.pop()
        least, most = min(counts), max(counts)
        num_slots = min(self.total - least, window)
        if min(self.total - most, window) < num_slots:
            return window_lengths(committed, window, 0, 0, self.total), num_slots, least, False, catch_up
        if num_slots not in self.full_lengths:
            self.full_lengths[num_slots] = torch.full_like(committed, num_slots)
        return self.full_lengths[num_slots], num_slots, least, True, catch_up

    def step(self, plan: Window):
        drafts = self.proposer.propose(self.state, plan)  # [B, G], [B, G, V]
        probs = self.score(plan, drafts)
        verdict = verify_window(self.rule, probs, *drafts, plan, self.proposer.draws_from_p)
        self.commit(plan, probs, verdict)

    def score(self, plan: Window, drafts) -> Tensor:
        """One target forward over [last committed token, drafts] of every image -> p [B, G + 1, V].
        Slot j sits at image index committed + j; the window is padded to the plan's power of two of
        slots (a compiled model meets a few shapes), padding after the real slots (clamped to the
        last position: no real query sees it, the truncation forgets it). An image's first pass
        feeds its condition: a pass where only some slots do (`plan.fresh`) scores them apart."""
        needed, num_slots = plan.max_drafts + 1, plan.slot_index.shape[1]
        draft_tokens = drafts[0] if num_slots == needed else F.pad(drafts[0], (0, num_slots - needed))
        last_position = self.num_cond + self.total - 1
        if len(plan.fresh) == self.batch:
            logits = self.first_window_logits(draft_tokens)
        elif not plan.fresh:
            input_pos = plan.slot_index + (self.num_cond - 1)
            if not plan.full or num_slots > needed:  # padding may pass the image
                input_pos = input_pos.clamp(max=last_position)
            logits = self.next_window_logits(draft_tokens, input_pos)
        else:

            def score(rows, first):
                if first:
                    return self.first_window_logits(draft_tokens[rows], rows)
                committed = self.state.committed[rows]  # the positions from the rows' own counts
                input_pos = (committed[:, None] + self.position_offsets[:num_slots]).clamp(max=last_position)
                return self.next_window_logits(draft_tokens[rows], input_pos, rows, committed)

            logits = score_first_passes_apart(self.batch, plan.fresh, self.device, score)
        return self.scorer.target_probs(logits[:, :needed])

    def first_window_logits(self, draft_tokens: Tensor, rows=None) -> Tensor:
        """An image's first window: [condition, drafts] at positions 0 .. -> logits [R, slots, V] (the
        condition's last position predicts token 0)."""
        input_pos = torch.arange(self.num_cond + draft_tokens.shape[1], device=self.device)
        tokens = draft_tokens if draft_tokens.shape[1] else None
        return self.scorer.logits(tokens, input_pos, with_condition=True, rows=rows)[:, self.num_cond - 1 :]

    def next_window_logits(self, draft_tokens: Tensor, input_pos: Tensor, rows=None, committed=None) -> Tensor:
        """A later window: [last committed token, drafts] at `input_pos` -> logits [R, slots, V] (rows:
        the slots scored, with their `committed` counts)."""
        committed = self.state.committed if rows is None else committed
        tokens = self.state.tokens if rows is None else self.state.tokens[rows]
        # every image has committed a token since its first pass (a done one all N): committed - 1 >= 0
        last = tokens.gather(1, (committed - 1)[:, None])
        return self.scorer.logits(torch.cat([last, draft_tokens], 1), input_pos, rows=rows)

    def commit(self, plan: Window, probs: Tensor, verdict: Verdict):
        state = self.state
        commit_count = verdict.num_accepted + 1
        if not plan.full:  # 0 for finished images, at most the window for clipped ones
            commit_count = commit_count.minimum(plan.window_len)
        # Write every slot's token after the committed ones; only the first commit_count count
        # (the buffer has `window` spare columns, and what lies past `committed` is scratch).
        slot_index, length = plan.slot_index, plan.max_drafts + 1
        state.tokens.scatter_(
            1, slot_index if slot_index.shape[1] == length else slot_index[:, :length], verdict.slot_tokens
        )
        self.record.write(state.committed, plan.window_len, verdict.num_accepted)
        self.proposer.after_commit(
            state, plan, probs, verdict.slot_tokens, commit_count, verdict.slot_laws, verdict.p_draws
        )
        state.committed = state.committed + commit_count
        # The cache keeps every committed token but the newest, which the next window feeds.
        self.scorer.truncate_cache(state.committed + (self.num_cond - 1))

    def stats(self) -> dict:
        stats = self.record.stats(self.scorer.forward_passes, draft_forward_passes=self.proposer.forward_passes)
        return {**stats, "window": self.window}


def speculative_decode(
    request: Request,
    proposer: Proposer,
    *,
    window: int,
    warmup: int = 0,
    tail: int = 0,
    rule: AcceptanceRule = SPECULATIVE,
) -> tuple[Tensor, dict]:
    """Propose, score, verify, commit (ragged), truncate, carry over, pass after pass
    (`ChainPasses` on the pass loop). -> (tokens [B, N], stats)."""
    check_spans(window, warmup, tail)
    window = min(window, request.model.num_image_tokens)  # a longer window is clipped, here once and for all
    state = SlotState(
        request, window=window, spare=window, keyed=True, block=16 * NUM_PURPOSES * window
    )  # each pass's uniforms, the same numbers as a draw per pass, drawn 16 passes at a time
    engine = ChainPasses(request, state, proposer, warmup, tail, rule)
    return decode_passes(engine, state, request, "speculative")
