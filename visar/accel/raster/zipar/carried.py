"""The drafts Jacobi fronts carry from pass to pass (`CarriedDrafts`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..drafts import FillRequest
from ..proposers import CarryRequest
from ..slots import SlotState
from .plan import PassPlan


class CarriedDrafts:
    """Drafts left by earlier passes, by image-token index, each with the q it was drawn from.

    Tokens and flags are kept by index ([B, N + 1]; column N is scratch, for writes that must go
    nowhere). The laws q are kept only for the live drafts, packed: probs [B, K, V] with
    `entry` [B, N + 1] pointing into it, K the most live drafts of any image. A draft is live
    until its index is generated; it sits in a front's window past the front's commit, so K is
    at most (fronts) x (window - 1), never N: 32 x 256 x 16,384 float32 laws would be 540 MB.
    """

    def __init__(self, batch: int, num_tokens: int, vocab: int, device):
        self.num_tokens = num_tokens
        self.tokens = torch.zeros(batch, num_tokens + 1, dtype=torch.long, device=device)
        self.valid = torch.zeros(batch, num_tokens + 1, dtype=torch.bool, device=device)
        self.entry = torch.zeros(batch, num_tokens + 1, dtype=torch.long, device=device)
        self.probs = torch.zeros(batch, 0, vocab, device=device)  # [B, K, V]
        # the last carry-over's (stored [B, M], laws [B, M, V]), packed before the next pass (`pack`)
        self.unpacked: tuple[Tensor, Tensor] | None = None

    def laws(self, index: Tensor) -> Tensor:
        """index [B, M] -> the carried q at each [B, M, V] (arbitrary where no draft is carried)."""
        batch, vocab = self.probs.shape[0], self.probs.shape[-1]
        if self.probs.shape[1] == 0:
            return self.probs.new_zeros(batch, index.shape[1], vocab)
        return self.probs.gather(1, self.entry.gather(1, index)[..., None].expand(-1, -1, vocab))

    def propose(
        self, plan: PassPlan, state: SlotState, generated: Tensor, initialiser, uniforms: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Drafts for every slot that has one (for the index its input predicts): carried if a pass left
        one, else the initialiser's.

        -> draft_tokens [B, M], draft_probs [B, M, V] (entries of slots without a draft are ignored).
        """
        target = plan.input_index + 1
        carried = plan.has_draft & self.valid.gather(1, target)
        draft_tokens = self.tokens.gather(1, target)
        draft_probs = self.laws(target)
        # filled whether or not a slot needs it: asking would wait for the device inside the pass, and
        # nearly every pass opens new slots at the fronts' ends
        needs_fill = plan.has_draft & ~carried
        request = FillRequest(state, torch.where(needs_fill, target, -1), uniforms, self.canvas(state, generated))
        fill_tokens, fill_probs = initialiser(request)
        draft_tokens = torch.where(needs_fill, fill_tokens, draft_tokens)
        draft_probs = torch.where(needs_fill[..., None], fill_probs.to(draft_probs.dtype), draft_probs)
        return draft_tokens, draft_probs

    def canvas(self, state: SlotState, generated: Tensor) -> Tensor:
        """What a 2-D draft may copy from: generated tokens and carried drafts, -1 elsewhere [B, N + 1]."""
        canvas = torch.where(self.valid, self.tokens, -1)
        canvas[:, : self.num_tokens] = torch.where(generated, state.tokens[:, : self.num_tokens], canvas[:, :-1])
        return canvas

    def carry_over(self, draw, plan: PassPlan, state, target_probs, slot_tokens, lane_commits, uniforms, generated):
        """Store the next drafts (`draw`: `Carry.draw`) at the indices past each front's commit; generated [B, N]:
        the tokens generated once this pass has committed (their drafts are forgotten).

        Slots that leaned on the row above's drafts carry nothing (the initialiser refills them from
        the rows above, which they follow more closely than a draw from a guessed context)."""
        target = plan.input_index + 1
        index = target.clamp(max=self.num_tokens - 1)
        # no relaxed rule on fronts: every slot token follows p
        next_drafts, laws = draw(CarryRequest(state, target_probs, slot_tokens, target_probs, index, uniforms))
        after = plan.predicts & (plan.slot >= lane_commits)
        if plan.leans is not None:
            after &= ~plan.leans
        stored = torch.where(after, target, self.num_tokens)  # [B, M] (N: nowhere)
        self.tokens.scatter_(1, stored, next_drafts)
        self.valid.scatter_(1, stored, True)
        if plan.leans is not None:
            self.valid.scatter_(1, torch.where(plan.leans, target, self.num_tokens), False)
        self.valid &= F.pad(~generated, (0, 1))  # generated indices, and the scratch column N, hold no draft
        self.unpacked = (stored, laws)  # packed at the next plan, which reads K with the pass's shape

    def live_most(self) -> Tensor:
        """The most live drafts of any image (0-d): K of the next `pack`."""
        return self.valid[:, : self.num_tokens].sum(1).max()

    def pack(self, size: int):
        """Rebuild probs with the live drafts only (`size`: `live_most`, read back by the plan): the laws
        the last carry-over stored and the earlier ones still live. Run between passes, so that no
        pass waits for the device to learn K."""
        if self.unpacked is None:
            return
        (stored, laws), self.unpacked = self.unpacked, None
        batch, vocab = laws.shape[0], laws.shape[-1]
        device = laws.device
        live = self.valid[:, : self.num_tokens]
        index = live.long().argsort(dim=1, descending=True, stable=True)[:, :size]  # [B, K] live indices first
        source = torch.full_like(self.tokens, -1)
        source.scatter_(1, stored, torch.arange(stored.shape[1], device=device).expand(batch, -1))
        new_slot = source.gather(1, index)  # [B, K]: the input of this pass that stored it, -1 for older
        # one gather from [earlier laws | this pass's]: an older live draft's law sits at its entry, which
        # is below the earlier K (an index not live may keep a stale entry: clamped, its row is unread)
        earlier = self.probs.shape[1]
        older_entry = self.entry.gather(1, index).clamp(max=max(earlier - 1, 0))
        law_row = torch.where(new_slot >= 0, new_slot + earlier, older_entry)  # [B, K]
        packed = torch.cat([self.probs, laws], 1).gather(1, law_row[..., None].expand(-1, -1, vocab))
        self.entry.scatter_(1, index, torch.arange(size, device=device).expand(batch, -1))
        self.probs = packed
