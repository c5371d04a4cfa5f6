"""`FrontRecord`: what a decode of row fronts records a pass, raw, in a device buffer grown between
passes (one copy a pass, at a cursor on the device, so that a compiled pass is one graph whatever its
number); the COMMON_STATS follow from it once, at the end.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...core.stats import DecodeLog, first_reaching

PASSES_PER_BLOCK = 64  # the buffer's first size in passes; it doubles when a decode needs more


class FrontRecord:
    """Per pass and front (image b, row r): the row's count before the pass, its commits, its commits
    before a tree's extra token (`valid_commits`' commits), its leading accepted drafts that held
    (good) and its window; each pass's forward pass number on the host.

    The log follows (`stats`): an image works in a pass while its last row is unfinished; a front's
    drafts sit in slots 0 .. window - 2 and form prefixes, tested: the first min(commits before the
    tree, drafts) (its leading accepted drafts and the first stop, if it held), accepted: the first
    min(good, drafts); the tokens a pass commits are count .. count + commits - 1 of each row.
    """

    def __init__(self, batch: int, grid_size: tuple[int, int], max_slots: int, device: torch.device):
        self.log = DecodeLog(batch, grid_size, max_slots, device)  # starts the clock
        self.shape = (PASSES_PER_BLOCK, 5, batch, grid_size[0])
        self.buffer = torch.zeros(self.shape, dtype=torch.long, device=device)
        self.cursor = torch.zeros(1, dtype=torch.long, device=device)  # the next pass's record
        self.forward_pass: list[int] = []  # each record's forward pass number (host ints)

    def reserve(self, forward_pass: int):
        """Between passes: room for the next pass's record, whose forward pass number is `forward_pass`."""
        self.forward_pass.append(forward_pass)
        if len(self.forward_pass) > len(self.buffer):
            self.buffer = torch.cat([self.buffer, torch.zeros_like(self.buffer)])

    def write(self, count: Tensor, commits: Tensor, base_commits: Tensor, good: Tensor, window_len: Tensor):
        """The pass `reserve` made room for: count, commits, base_commits, good, window_len, [B, H] each."""
        self.buffer.index_put_((self.cursor,), torch.stack([count, commits, base_commits, good, window_len])[None])
        self.cursor += 1

    def max_fronts(self) -> int:
        """The most fronts that predicted in one pass of one image."""
        if not self.forward_pass:
            return 0
        return int((self.records()[:, 4] > 0).sum(-1).max())

    def records(self) -> Tensor:
        """[P, 5, B, H] the passes written."""
        return self.buffer[: len(self.forward_pass)]

    def image_commits(self, rows: list[int], start: list[int], end: int) -> tuple[Tensor, Tensor]:
        """The images slots `rows` hold, which started after `start` passes (`end`: the passes so far)
        -> (their passes [R]; the pass of their own that committed each token [R, N], 1 = their first)."""
        records, passes, commit_pass = self.records(), [], []
        for row, first_pass in zip(rows, start, strict=True):
            image_passes, image_commits = self.image_record(records, row, first_pass)
            passes.append(image_passes)
            commit_pass.append(image_commits)
        return torch.stack(passes), torch.stack(commit_pass)

    def image_record(self, records: Tensor, row: int, start: int) -> tuple[Tensor, Tensor]:
        """One image's passes (0-d) and commit passes [N]. An image that started after the decode's first
        pass took a refilled slot, and its first pass ran for its slot alone at the head of the next
        pass (`FrontPasses.start_fresh`), which writes no record: it took row 0 from 0 tokens to 1, so
        its pass k is the record start + k - 2."""
        count, commits = records[start:, 0, row], records[start:, 1, row]  # [P', H]
        reached = count + commits
        active = (count[:, -1] < self.log.width).sum()
        if start > 0:
            first_pass = torch.zeros(1, self.shape[-1], dtype=torch.long, device=records.device)
            first_pass[0, 0] = 1
            reached, active = torch.cat([first_pass, reached]), active + 1
        return active, first_reaching(reached.T, self.log.width).flatten() + 1

    def stats(self, forward_passes: int) -> dict:
        log = self.log
        if not self.forward_pass:
            return log.stats(forward_passes)
        count, commits, base_commits, good, window_len = self.records().unbind(1)  # [P, B, H] each
        log.count_pass((count[..., -1] < log.width).sum(0))
        drafts = (window_len - 1).clamp(min=0)
        tested, accepted = base_commits.minimum(drafts), good.minimum(drafts)  # prefix lengths
        log.tested_by_row += tested.sum((0, 1))
        log.accepted_by_row += accepted.sum((0, 1))
        slots = torch.arange(len(log.tested_by_slot), device=count.device)
        log.tested_by_slot += (tested[..., None] > slots).sum((0, 1, 2))  # fronts whose prefix covers slot j
        log.accepted_by_slot += (accepted[..., None] > slots).sum((0, 1, 2))
        first = first_reaching((count + commits).permute(1, 2, 0).flatten(0, 1), log.width)  # [B * H, W]
        passes = torch.tensor([*self.forward_pass, 0], dtype=torch.long, device=count.device)
        log.commit_pass[:, : log.num_tokens] = passes[first].view(len(log.commit_pass), -1)
        return log.stats(forward_passes)
