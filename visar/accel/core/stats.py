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


# DecodeLog.drafts counts its passes this many at a time: few ops a pass, and a long running batch's
# pending passes stay small
DRAFT_PASSES_AT_ONCE = 64


class DecodeLog:
    """What a decode records for its statistics: its start time, each image's passes, the pass that
    committed each token, and the drafts tested and accepted by grid row and by slot."""

    def __init__(self, batch: int, grid_size: tuple[int, int], max_slots: int, device: torch.device):
        self.device = device
        self.start = synchronized_clock(device)
        height, self.width = grid_size
        self.num_tokens = height * self.width
        self.passes_per_image = torch.zeros(batch, dtype=torch.long, device=device)
        self.commit_pass = torch.zeros(batch, self.num_tokens + 1, dtype=torch.long, device=device)  # col N: scratch
        self.tested_by_row = torch.zeros(height, dtype=torch.long, device=device)
        self.accepted_by_row = torch.zeros_like(self.tested_by_row)
        self.tested_by_slot = torch.zeros(max_slots, dtype=torch.long, device=device)
        self.accepted_by_slot = torch.zeros_like(self.tested_by_slot)
        self.pending_drafts: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []  # `drafts`' passes not yet counted
        # count each pass's drafts as it hands them over: a compiled pass's engine sets it, since a
        # pending list that grows by a pass would make torch.compile trace the pass again at each length
        self.count_at_once = False

    def count_pass(self, active: Tensor):
        """active [B] bool: the images this pass worked for."""
        self.passes_per_image += active.long()

    def commit(self, index: Tensor, committed: Tensor, forward_pass: int):
        """index [B, M] image-token indices; committed [B, M] bool: which of them this pass committed."""
        index = torch.where(committed, index, self.num_tokens).clamp(max=self.num_tokens)
        self.commit_pass.scatter_(1, index, forward_pass)

    def drafts(self, index: Tensor, slot: Tensor, tested: Tensor, accepted: Tensor):
        """index: the image-token index each draft is for; slot: its distance past the committed
        prefix; tested / accepted: bool masks, all of one shape ([B, M]). Kept as handed over and
        counted DRAFT_PASSES_AT_ONCE passes at a time (and at `stats`): integer counts, the same
        in any order, in a dozen ops for many passes instead of a dozen a pass."""
        self.pending_drafts.append((index, slot, tested, accepted))
        if self.count_at_once or len(self.pending_drafts) == DRAFT_PASSES_AT_ONCE:
            self.count_drafts()

    def count_drafts(self):
        if not self.pending_drafts:
            return
        index, slot, tested, accepted = (
            torch.cat([part.flatten() for part in parts]) for parts in zip(*self.pending_drafts, strict=True)
        )
        self.pending_drafts.clear()
        rows = (index // self.width).clamp(0, len(self.tested_by_row) - 1)
        slots = slot.clamp(0, len(self.tested_by_slot) - 1)
        tested, accepted = tested.long(), (accepted & tested).long()
        self.tested_by_row.scatter_add_(0, rows, tested)
        self.accepted_by_row.scatter_add_(0, rows, accepted)
        self.tested_by_slot.scatter_add_(0, slots, tested)
        self.accepted_by_slot.scatter_add_(0, slots, accepted)

    def image_commits(self, rows: list[int], start: list[int], end: int) -> tuple[Tensor, Tensor]:
        """A running batch's slots `rows`, whose images started after `start` passes (`end`: the passes
        so far) -> (their passes [R], the pass of their own that committed each token [R, N], 1 = their
        first)."""
        index, start = (torch.tensor(x, device=self.device) for x in (rows, start))
        return self.passes_per_image[index], self.commit_pass[index, : self.num_tokens] - start[:, None]

    def admit(self, rows: Tensor, images: Tensor):
        """Slots `rows` [R] start new images: no passes, no commits."""
        self.passes_per_image[rows] = 0
        self.commit_pass[rows] = 0

    def stats(self, forward_passes: int, draft_forward_passes: int = 0) -> dict:
        """The COMMON_STATS of the finished decode."""
        latency = synchronized_clock(self.device) - self.start
        self.count_drafts()
        tested, accepted = int(self.tested_by_row.sum()), int(self.accepted_by_row.sum())
        return {
            "forward_passes": forward_passes,
            "forward_passes_per_image": self.passes_per_image.tolist(),
            "tokens_per_forward": float((self.num_tokens / self.passes_per_image.double()).mean()),
            "latency_s": latency,
            "draft_tokens": tested,
            "accepted_tokens": accepted,
            "acceptance_rate": accepted / tested if tested else None,
            "draft_tokens_by_row": self.tested_by_row.tolist(),
            "accepted_tokens_by_row": self.accepted_by_row.tolist(),
            "draft_tokens_by_slot": self.tested_by_slot.tolist() if tested else [],
            "accepted_tokens_by_slot": self.accepted_by_slot.tolist() if tested else [],
            "draft_forward_passes": draft_forward_passes,
            "commit_pass": self.commit_pass[:, : self.num_tokens].cpu(),
        }


class ChainRecord:
    """What a chain decode (each pass verifies one window right after each image's committed prefix)
    records a pass: where each image's window started, how many slots it held (drafts and the bonus
    slot) and how many of its drafts
    it accepted, copied into a preallocated device buffer ([passes, 3, B]) at a cursor kept on the
    device, so that writing a pass depends on no host number (a compiled pass need not be traced
    again for each pass). The COMMON_STATS follow from these once, at the end (`stats`): the draft
    in slot j is for image index committed + j, tested when j <= accepted, accepted when j <
    accepted; every active image commits accepted + 1 tokens; pass p is forward pass p + 1 (one
    target call a pass, the first with the condition)."""

    def __init__(self, batch: int, grid_size: tuple[int, int], max_slots: int, device: torch.device):
        self.log = DecodeLog(batch, grid_size, max_slots, device)  # starts the clock
        # each active pass commits at least one token of every image it works for: at most N passes
        self.records = torch.zeros(self.log.num_tokens, 3, batch, dtype=torch.long, device=device)
        self.cursor = torch.zeros(1, dtype=torch.long, device=device)  # the next pass's row

    def write(self, committed: Tensor, window_len: Tensor, num_accepted: Tensor):
        """committed [B]: the image's committed tokens before the pass (N: done); window_len [B]: its
        slots, its drafts and the bonus slot (0 for a done image); num_accepted [B]: its leading
        accepted drafts."""
        self.records.index_put_((self.cursor,), torch.stack([committed, window_len, num_accepted]))
        self.cursor += 1

    def reserve(self, passes: int):
        """Room for `passes` passes (a running batch decodes more than N; grown by doubling)."""
        if passes > len(self.records):
            more = max(passes, 2 * len(self.records)) - len(self.records)
            self.records = torch.cat([self.records, self.records.new_zeros(more, *self.records.shape[1:])])

    def image_commits(self, rows: list[int], start: list[int], end: int) -> tuple[Tensor, Tensor]:
        """The images slots `rows` decoded in passes start .. end - 1 -> (their passes [R]; the pass of
        their own that committed each token [R, N], 1 = their first)."""
        num_tokens, passes, commit_pass = self.log.num_tokens, [], []
        for row, first_pass in zip(rows, start, strict=True):
            committed, _, num_accepted = self.records[first_pass:end, :, row].unbind(1)  # [P]
            active = committed < num_tokens
            reached = committed + torch.where(active, num_accepted + 1, 0)
            first = first_reaching(reached[None], num_tokens)[0]
            passes.append(active.sum())
            commit_pass.append(first + 1)
        return torch.stack(passes), torch.stack(commit_pass)

    def stats(self, forward_passes: int, draft_forward_passes: int = 0) -> dict:
        log, num_tokens = self.log, self.log.num_tokens
        passes = int(self.cursor)
        committed, window_len, num_accepted = self.records[:passes].unbind(1)  # [P, B]
        num_drafts = (window_len - 1).clamp(min=0)
        active = committed < num_tokens
        log.count_pass(active.sum(0))
        slots = torch.arange(len(log.tested_by_slot), device=committed.device)
        tested = (slots < num_drafts[..., None]) & (slots <= num_accepted[..., None])  # [P, B, S]
        log.drafts(committed[..., None] + slots, slots.expand_as(tested), tested, slots < num_accepted[..., None])
        # token i of image b came in the first pass whose commit reached past i (pass p: forward pass p + 1)
        reached = (committed + torch.where(active, num_accepted + 1, 0)).T  # [B, P]
        first = first_reaching(reached, num_tokens)  # P where no pass reached it (a stopped probe)
        log.commit_pass[:, :num_tokens] = torch.where(first < passes, first + 1, 0)
        return log.stats(forward_passes, draft_forward_passes)


def first_reaching(reached: Tensor, length: int) -> Tensor:
    """reached [R, P]: each row's count after each pass -> [R, length] the pass (from 0) whose commit
    took the row past each index: token i came in it (P where no pass reached it)."""
    index = torch.arange(length, device=reached.device).expand(len(reached), -1).contiguous()
    return torch.searchsorted(reached.contiguous(), index, right=True)


SUMMED_STATS = ("forward_passes", "latency_s", "draft_tokens", "accepted_tokens", "draft_forward_passes")
PER_ROW_STATS = ("draft_tokens_by_row", "accepted_tokens_by_row", "draft_tokens_by_slot", "accepted_tokens_by_slot")


def add_lists(lists: list[list]) -> list:
    """Element-wise sums of count lists that may differ in length (an empty one: no drafts)."""
    length = max(len(x) for x in lists)
    return [sum(x[i] for x in lists if i < len(x)) for i in range(length)]


def same_value(a, b) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and torch.equal(a, b)
    return a == b


def per_image(batch) -> list:
    """A batch as methods and `Pipeline.generate` return it -> one entry per image: a tensor [B, ...]
    gives its rows ([h, w] token grids, latents), a next-scale model's list of [B, pn, pn] maps (one
    per scale) each image's list of maps."""
    if isinstance(batch, (list, tuple)):
        return [list(maps) for maps in zip(*batch, strict=True)]
    return list(batch)


def batch_of_one(image):
    """One entry of `per_image` -> a batch of that image alone ([1, ...], or a list of [1, ...] per scale)."""
    if isinstance(image, (list, tuple)):
        return [part[None] for part in image]
    return image[None]


def concat_batches(parts: list):
    """Consecutive batches of one queue ([B, ...] each, or lists of [B, ...] per scale) -> the queue's."""
    if isinstance(parts[0], (list, tuple)):
        return [torch.cat(scale) for scale in zip(*parts, strict=True)]
    return torch.cat(parts)


def merge_batch_stats(parts: list[dict]) -> dict:
    """The stats of consecutive batches of one call's images -> the call's: counts summed, per-image
    entries in image order, rates recomputed; another entry is kept where every batch has the same,
    else listed per batch (e.g. what `auto` chose for each)."""
    merged = {}
    for key in parts[0]:
        values = [part[key] for part in parts]
        if key in SUMMED_STATS:
            merged[key] = sum(values)
        elif key in PER_ROW_STATS:
            merged[key] = add_lists(values)
        elif key == "forward_passes_per_image":
            merged[key] = [passes for value in values for passes in value]
        elif key == "commit_pass":  # [B, ...], or a list of [B, pn, pn] per scale
            merged[key] = concat_batches(values)
        elif key == "tokens_per_forward":  # a mean over images
            sizes = [len(part["forward_passes_per_image"]) for part in parts]
            merged[key] = sum(v * n for v, n in zip(values, sizes, strict=True)) / sum(sizes)
        else:
            merged[key] = values[0] if all(same_value(v, values[0]) for v in values) else values
    tested = merged.get("draft_tokens", 0)
    if "acceptance_rate" in merged:
        merged["acceptance_rate"] = merged["accepted_tokens"] / tested if tested else None
    return merged
