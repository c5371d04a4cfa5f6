"""What a raster model's KV cache lets a query see: the valid condition positions, the slots written
and not forgotten since (`CacheKeys`), and the default causal mask over them (`causal_visibility`).

Helpers of the models that implement `RasterModel` (LlamaGen, the Hugging Face decoders) and of
training, which hides padded captions the same way; a decoding method never reads them: it passes
positions and masks through the interface (`visar.models.base`).
"""

from __future__ import annotations

import torch
from torch import Tensor


def condition_validity(cond_mask: Tensor | None, batch_size: int, length: int, device) -> Tensor:
    """[B, length] bool over a sequence [condition | ...]: False at the condition positions that
    cond_mask [B, T] marks invalid (padded captions or prompts), True everywhere else."""
    valid = torch.ones(batch_size, length, dtype=torch.bool, device=device)
    if cond_mask is not None:
        valid[:, : cond_mask.shape[1]] = cond_mask.bool()
    return valid


class CacheKeys(torch.nn.Module):
    """Which slots of a raster model's KV cache a query may see: valid condition positions that
    were written and not forgotten since. Truncation only marks slots unwritten, so it costs a
    [B, S] update instead of a pass over every layer's keys and values, and a slot written again
    is visible again.

    A module with (non-persistent) buffers, like the KV cache itself: a model that keeps it as an
    attribute registers it, so a compiled forward sees the flags it updates as module state (static
    addresses, which CUDA graphs need for an input they mutate), not as an unknown input."""

    def __init__(self, batch_size: int, num_slots: int, cond_mask: Tensor | None, device):
        super().__init__()
        valid = condition_validity(cond_mask, batch_size, num_slots, device)  # [B, S]
        self.register_buffer("valid", valid, persistent=False)
        self.register_buffer("written", torch.zeros_like(valid), persistent=False)

    def write(self, slots: Tensor, rows: Tensor | None = None) -> Tensor:
        """Record this call's writes (slots [B, L]) -> the slots its queries may see [B, S]. rows [R]:
        the call is for these cache rows only (slots [R, L]) -> [R, S]."""
        if rows is None:
            self.written.scatter_(1, slots, True)
            return self.valid & self.written
        written = self.written[rows].scatter_(1, slots, True)  # [R, S], a copy
        self.written[rows] = written
        return self.valid[rows] & written

    def reset(self, rows: Tensor, cond_mask: Tensor | None):
        """Forget every slot of cache rows `rows` [R] and take cond_mask [R, T] (None: all valid) as
        their valid condition positions: the rows are free for a new condition."""
        self.written[rows] = False
        self.valid[rows] = condition_validity(cond_mask, len(rows), self.valid.shape[1], self.valid.device)

    def truncate(self, lengths: Tensor):
        """Forget every slot at or beyond lengths[b] in row b."""
        slots = torch.arange(self.written.shape[1], device=lengths.device)
        self.written &= slots[None, :] < lengths[:, None]


def check_rows(rows: Tensor, batch_size: int):
    """Refuse cache rows [R] that are not distinct indices 0 .. batch_size - 1 (this reads them on the
    host): a repeated row would be written twice in one call, an outside one would be another row's."""
    if rows.dim() != 1 or rows.dtype != torch.long:
        raise ValueError(f"rows must be a 1-D long tensor of cache rows, got {rows.dtype} {tuple(rows.shape)}")
    listed = rows.tolist()
    if len(set(listed)) != len(listed) or not all(0 <= row < batch_size for row in listed):
        raise ValueError(f"rows must be distinct cache rows 0 .. {batch_size - 1}, got {listed}")


def causal_visibility(input_pos: Tensor, key_pos: Tensor, key_valid: Tensor | None) -> Tensor:
    """The default mask of a raster model: a query at position p sees the valid keys at positions
    <= p, and itself. input_pos [B, L], key_pos [B, S], key_valid [B, S] bool -> [B, L, S]."""
    visible = key_pos[:, None, :] <= input_pos[:, :, None]
    if key_valid is not None:
        visible = visible & key_valid[:, None, :]
    return visible | (key_pos[:, None, :] == input_pos[:, :, None])
