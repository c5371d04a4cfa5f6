"""Classic speculative sampling's proposer for the chain engine: a smaller model of the same family
drafts each window autoregressively (Leviathan et al. 2023, Chen et al. 2023)."""

from __future__ import annotations

import torch
from torch import Tensor

from ...models.base import RasterModel
from ..core.method_registry import Request
from ..core.sampling import sample_from_probs
from ..core.scoring import GuidedScorer
from .proposers import DRAFT, Window
from .slots import SlotState


class DraftModelProposer:
    """The draft keeps its own ragged KV cache; after each pass it is truncated to the tokens it saw
    that were committed, and the next proposal first feeds it what it has not seen."""

    def __init__(self, draft: RasterModel, request: Request):
        self.scorer = GuidedScorer.for_request(request, draft)
        self.num_cond = draft.num_condition_tokens

    draws_from_p = False

    @property
    def forward_passes(self) -> int:
        return self.scorer.forward_passes

    def start(self, state: SlotState):
        self.max_pos = self.num_cond + state.num_tokens - 1
        self.scorer.open_cache(self.max_pos + 1)
        self.draft_len: Tensor | None = None  # [B] valid cache length; None before the prefill
        self.pending: Tensor | None = None  # [B, V] the prefill's law of image token 0
        state.parts.append(self)  # a new image is prefilled (`admit`)

    def catch_up_need(self, state: SlotState) -> Tensor:
        """The most positions any image's draft has not seen (before the prefill: every committed token)."""
        if self.draft_len is None:
            return state.committed.max()
        return (self.num_cond + state.committed - self.draft_len).max()

    def catch_up(self, state: SlotState, steps: int) -> Tensor:
        """Feed the draft what it has not seen (positions draft_len .. T + committed - 1; steps: the
        most of any image, `catch_up_need` as the plan read it).

        -> q of the next token [B, V]."""
        device = state.tokens.device
        catch_up = self.num_cond + state.committed - self.draft_len  # [B] >= 0
        if steps == 0:
            return self.pending
        positions = self.draft_len[:, None] + torch.arange(steps, device=device)  # [B, C]
        feed = state.tokens.gather(1, (positions - self.num_cond).clamp(0, state.tokens.shape[1] - 1))
        logits = self.scorer.logits(feed, positions.clamp(max=self.max_pos))
        last = logits[torch.arange(len(catch_up), device=device), (catch_up - 1).clamp(min=0)]  # [B, V]
        return torch.where((catch_up > 0)[:, None], self.scorer.target_probs(last), self.pending)

    def propose(self, state: SlotState, window: Window) -> tuple[Tensor, Tensor]:
        batch, device = state.tokens.shape[0], state.tokens.device
        num_drafts = window.max_drafts
        if num_drafts == 0:
            return state.tokens[:, :0], torch.zeros(batch, 0, state.vocab_size, device=device)
        if self.draft_len is None:  # prefill the condition once
            self.pending = self.scorer.prefill()
            self.draft_len = torch.full((batch,), self.num_cond, dtype=torch.long, device=device)
        self.base = state.committed.clone()
        draft_q = self.catch_up(state, window.catch_up)
        draft_tokens, draft_probs = [], []
        draft_u = window.row(DRAFT, num_drafts)
        for k in range(num_drafts):
            token = sample_from_probs(draft_q, draft_u[:, k])
            draft_tokens.append(token)
            draft_probs.append(draft_q)
            if k + 1 < num_drafts:
                position = (self.num_cond + state.committed + k).clamp(max=self.max_pos)
                draft_q = self.scorer.target_probs(self.scorer.logits(token[:, None], position[:, None])[:, -1])
        return torch.stack(draft_tokens, 1), torch.stack(draft_probs, 1)

    def after_commit(self, state, window, target_probs, slot_tokens, commit_count, slot_laws, p_draws=None):
        num_drafts = window.max_drafts
        if num_drafts == 0 or self.draft_len is None:
            return
        # Fed this pass: everything up to the last committed token, then drafts 0 .. num_drafts - 2.
        # The fed drafts that were accepted stay valid.
        accepted = (commit_count - 1).clamp(min=0, max=num_drafts - 1)
        valid = self.num_cond + self.base + accepted
        self.draft_len = torch.where(commit_count > 0, valid, self.draft_len)
        self.scorer.truncate_cache(self.draft_len)

    def admit(self, rows: Tensor, images: Tensor):
        """Slots `rows` start queue images `images`: their conditions, prefilled once the draft has been."""
        self.scorer.admit(rows, images)
        if self.draft_len is not None:  # else the first proposal prefills every slot
            self.pending[rows] = self.scorer.prefill(rows)
            self.draft_len[rows] = self.num_cond

    def close(self):
        self.scorer.close_cache()
