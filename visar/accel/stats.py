"""The statistics every decoding method reports, under one set of names.

Every method's stats hold COMMON_STATS (so `visar bench` and the demo read them without asking
which method ran), then what is particular to the method (its options, window, ...):

- forward_passes: target forward passes of the batch (until its slowest image is done);
  forward_passes_per_image: each image's; tokens_per_forward: mean over images of tokens / passes;
- latency_s: token-sampling wall time (device synchronised);
- draft_tokens / accepted_tokens: drafts the target tested / accepted, over the batch;
  acceptance_rate: accepted / tested (None for a method that tests no drafts);
  draft_tokens_by_row / accepted_tokens_by_row: the same counts by grid row of the drafted token;
  draft_tokens_by_slot / accepted_tokens_by_slot: by slot, how many tokens past the committed
  prefix the draft sat (slot 0 = the next token; empty for a method without drafts);
- draft_forward_passes: passes of a draft model (0 without one);
- commit_pass: LongTensor [B, N] (Pipeline.generate: [B, h, w]), the target forward pass at which
  each image token was committed (1 = the first pass, the condition prefill).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .timing import synchronized_clock

COMMON_STATS = (
    "forward_passes",
    "forward_passes_per_image",
    "tokens_per_forward",
    "latency_s",
    "draft_tokens",
    "accepted_tokens",
    "acceptance_rate",
    "draft_tokens_by_row",
    "accepted_tokens_by_row",
    "draft_tokens_by_slot",
    "accepted_tokens_by_slot",
    "draft_forward_passes",
    "commit_pass",
)


class CommitLog:
    """The target forward pass (1-based) at which each image token was committed."""

    def __init__(self, batch: int, num_tokens: int, device: torch.device):
        self.num_tokens = num_tokens
        self.passes = torch.zeros(batch, num_tokens + 1, dtype=torch.long, device=device)  # column N: scratch

    def record(self, index: Tensor, committed: Tensor, forward_pass: int):
        """index [B, M] image-token indices; committed [B, M] bool: which of them this pass committed."""
        self.passes.scatter_(1, torch.where(committed, index, self.num_tokens).clamp(max=self.num_tokens), forward_pass)


class DraftTally:
    """Drafts tested and accepted, counted by the grid row of the token drafted and by slot."""

    def __init__(self, grid_size: tuple[int, int], max_slots: int, device: torch.device):
        self.width = grid_size[1]
        self.tested_by_row = torch.zeros(grid_size[0], dtype=torch.long, device=device)
        self.accepted_by_row = torch.zeros_like(self.tested_by_row)
        self.tested_by_slot = torch.zeros(max_slots, dtype=torch.long, device=device)
        self.accepted_by_slot = torch.zeros_like(self.tested_by_slot)

    def add(self, index: Tensor, slot: Tensor, tested: Tensor, accepted: Tensor):
        """index: image-token index each draft is for; slot: its distance past the committed prefix;
        tested / accepted: bool masks, all of one shape ([B, M])."""
        rows = (index // self.width).clamp(0, len(self.tested_by_row) - 1).flatten()
        slots = slot.clamp(0, len(self.tested_by_slot) - 1).flatten()
        tested, accepted = tested.flatten().long(), (accepted & tested).flatten().long()
        self.tested_by_row.scatter_add_(0, rows, tested)
        self.accepted_by_row.scatter_add_(0, rows, accepted)
        self.tested_by_slot.scatter_add_(0, slots, tested)
        self.accepted_by_slot.scatter_add_(0, slots, accepted)


def decode_stats(
    *,
    start: float,
    device: torch.device,
    num_tokens: int,
    passes_per_image: Tensor,
    forward_passes: int,
    commits: CommitLog,
    tally: DraftTally | None = None,
    grid_rows: int = 0,
    draft_forward_passes: int = 0,
) -> dict:
    """The COMMON_STATS of a finished decode (start: `synchronized_clock` when it began)."""
    latency = synchronized_clock(device) - start
    if tally is None:
        tested = accepted = 0
        by_row = [0] * grid_rows
        by_row_accepted, by_slot, by_slot_accepted = list(by_row), [], []
    else:
        tested, accepted = int(tally.tested_by_row.sum()), int(tally.accepted_by_row.sum())
        by_row, by_row_accepted = tally.tested_by_row.tolist(), tally.accepted_by_row.tolist()
        by_slot, by_slot_accepted = tally.tested_by_slot.tolist(), tally.accepted_by_slot.tolist()
    return {
        "forward_passes": forward_passes,
        "forward_passes_per_image": passes_per_image.tolist(),
        "tokens_per_forward": float((num_tokens / passes_per_image.double()).mean()),
        "latency_s": latency,
        "draft_tokens": tested,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / tested if tested else None,
        "draft_tokens_by_row": by_row,
        "accepted_tokens_by_row": by_row_accepted,
        "draft_tokens_by_slot": by_slot,
        "accepted_tokens_by_slot": by_slot_accepted,
        "draft_forward_passes": draft_forward_passes,
        "commit_pass": commits.passes[:, : commits.num_tokens].cpu(),
    }
