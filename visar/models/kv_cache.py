"""What a raster model's KV cache lets a query see: the valid condition positions, the slots written
and not forgotten since (`CacheKeys`), and the default causal mask over them (`causal_visibility`);
with kv_keep < 1, the slot table of a compressed cache (`CompressedCache`, made by `compressed_cache`)
and a call's visibility over its physical slots (`compressed_visibility`), which LlamaGen and the
Hugging Face adapters share.

Helpers of the models that implement `RasterModel` (LlamaGen, the Hugging Face decoders) and of
training, which hides padded captions the same way; a decoding method never reads them: it passes
positions and masks through the interface (`visar.models.base`).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import Tensor

from ..errors import VisarError
from .base import check_kv_evict


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


def physical_slots(kv_keep: float, num_slots: int) -> int:
    """C = ceil(kv_keep * S): the physical slots a compressed cache of S logical slots keeps per row."""
    return min(num_slots, math.ceil(kv_keep * num_slots - 1e-9))


def check_kv_keep(kv_keep) -> float:
    """kv_keep as a float in (0, 1], or one VisarError."""
    if isinstance(kv_keep, bool) or not isinstance(kv_keep, (int, float)) or not 0 < kv_keep <= 1:
        raise VisarError(f"kv_keep must be a number in (0, 1] (the fraction of KV-cache slots kept), not {kv_keep!r}")
    return float(kv_keep)


RECENT_ROWS = 2  # grid rows before a pass's earliest position a compressed cache evicts last
SCORE_DECAY = 0.8  # kv_evict "h2o": the attention scores decay this much per position advanced


def compressed_cache(
    batch_size: int,
    num_slots: int,
    cond_mask: Tensor | None,
    num_condition: int,
    grid_width: int,
    device,
    kv_keep: float,
    kv_evict: str,
) -> CompressedCache:
    """The slot table of a raster model's compressed cache: ceil(kv_keep * num_slots) physical slots per
    row, the condition (num_condition slots) pinned, the RECENT_ROWS grid rows (of grid_width image
    tokens) before a pass evicted last, and the rest evicted by `kv_evict`'s rule."""
    line = check_kv_evict(kv_evict) == "line"
    return CompressedCache(
        batch_size,
        num_slots,
        physical_slots(check_kv_keep(kv_keep), num_slots),
        cond_mask,
        num_condition,
        RECENT_ROWS * grid_width,
        device,
        decay=1.0 if line else SCORE_DECAY,
        line_width=grid_width if line else None,
    )


def compressed_visibility(
    table: CompressedCache,
    slots: Tensor,
    input_pos: Tensor,
    count: int,
    mask: Tensor | None,
    rows: Tensor | None,
    default_mask,
) -> tuple[Tensor, Tensor]:
    """One call's logical slots [B, L] (positions input_pos [B, L], `count` inputs past the condition;
    for cache rows `rows` [R], None: all) written into a compressed cache's `table` -> (the physical
    slots to write [B, L], what each query may see over the physical slots [B, L, C]): the method's
    mask [B, L, S] read at the logical slot each physical one holds, else `default_mask(input_pos,
    key positions [B, C], held keys [B, C])` (a raster model's `default_mask`)."""
    with table.rows_only(rows):
        slots, key_pos, key_ok = table.write(slots, input_pos, count)  # [B, L], [B, C], [B, C]
        if mask is not None:
            return slots, table.physical_mask(mask) & key_ok[:, None, :]
    return slots, default_mask(input_pos, key_pos, key_ok)


# Eviction classes of a physical slot, taken in this order when a write needs room.
_FREE, _OLD, _RECENT, _PINNED = 0, 1, 2, 3


class CompressedCache(torch.nn.Module):
    """The slot table of a KV cache that keeps C of its S logical slots per row (`kv_keep` < 1).

    A method addresses logical slots 0..S-1 (positions, `cache_pos`, masks [B, L, S], truncation
    lengths) as with the full cache; keys and values live in C physical slots ([B, H, C, D], a
    fixed shape, so a compiled pass sees static shapes). The table maps each way:
    `physical` [B, S + 1] (the physical slot of a logical one, -1 when not held; column S is a
    scratch column for masked scatters) and `logical` [B, C] (the logical slot held, -1 when free),
    which is also the key position the causal mask reads.

    When a call writes logical slots that are not held, it takes free physical slots first, then
    evicts the held image slots with the least attention accumulated so far (`observe`: the
    softmax mass each slot received, summed over layers, heads and queries; H2O's rule), one
    choice per row shared by every layer and head. The sum decays by `decay` per position the
    calls' earliest position advances: undecayed, the first image slots outscore every later one
    for good (they have been attended longest), so the held set freezes on the first rows, and
    mc-sjd, whose 16-slot window leaves fewer old slots, lost most of its quality with it (53%
    detector accuracy at kv_keep=0.25 against AR's 73%, docs/SPEED.md). Never evicted: the
    condition slots and this call's slots; evicted last (oldest first, only when nothing else is
    left): the `recent` slots before the call's earliest position (the last grid rows, LineAR's
    local context) and any held slot past it. `truncate` frees the physical slots of forgotten logical ones.
    Every step is a device tensor op (sort, gather, scatter): no host read-back per call.

    line_width (LineAR's rule, lines of that many image slots; None: the rule above): `observe` adds to
    a window instead, and when a row's calls reach a new line (their earliest position crosses a line
    boundary) the window, the mass the last completed line's queries gave each slot, becomes the score
    and the least-scored old image slots are evicted until a whole line's slots are free. A write
    then takes those free slots, evicting (by the same scores) only when a pass needs more than the
    boundary freed (a drafting pass reaching into the next line, or a budget with too few old slots).
    """

    def __init__(
        self,
        batch_size: int,
        num_slots: int,
        num_physical: int,
        cond_mask: Tensor | None,
        num_condition: int,
        recent: int,
        device,
        decay: float = 1.0,
        line_width: int | None = None,
    ):
        super().__init__()
        self.num_slots, self.num_physical = num_slots, num_physical
        self.num_condition, self.recent, self.decay = num_condition, recent, decay
        self.line_width = line_width
        if num_physical < num_condition + recent + 1:
            raise VisarError(too_small(num_physical, num_condition, recent, 1))
        valid = condition_validity(cond_mask, batch_size, num_slots + 1, device)  # [B, S + 1]
        self.register_buffer("valid", valid, persistent=False)
        physical = torch.full((batch_size, num_slots + 1), -1, dtype=torch.long, device=device)
        self.register_buffer("physical", physical, persistent=False)
        logical = torch.full((batch_size, num_physical), -1, dtype=torch.long, device=device)
        self.register_buffer("logical", logical, persistent=False)
        self.register_buffer("score", torch.zeros(batch_size, num_physical, device=device), persistent=False)
        # the line rule: the attention the current line's queries gave each physical slot so far
        self.register_buffer("window", torch.zeros(batch_size, num_physical, device=device), persistent=False)
        # [B]: the furthest earliest position of a call so far, from which the scores decay (the line
        # rule: whose line is the current one)
        self.register_buffer("front", torch.zeros(batch_size, dtype=torch.long, device=device), persistent=False)

    def write(self, slots: Tensor, input_pos: Tensor, count: int) -> tuple[Tensor, Tensor, Tensor]:
        """Make room for this call's logical slots [B, L] (positions input_pos [B, L]; `count` of
        them past the condition) -> (physical slots to write [B, L], key positions [B, C] (-1
        where free), keys a query may see [B, C])."""
        # host numbers, no sync; a cache that holds every slot never evicts, so any pass fits
        if self.num_physical < self.num_slots and self.num_condition + self.recent + count > self.num_physical:
            raise VisarError(too_small(self.num_physical, self.num_condition, self.recent, count))
        front = torch.maximum(self.front, input_pos.min(1).values)
        if self.decay < 1:  # per position advanced, so a pass of many tokens decays as far as AR's steps
            self.score *= self.decay ** (front - self.front)[:, None].float()
        if self.line_width is not None:
            self.close_lines(front)
        self.front.copy_(front)
        held = self.physical.gather(1, slots)  # [B, L]
        missing = held < 0
        # each logical slot to place once (a call may write one slot twice: padding to a trash slot)
        need = torch.zeros_like(self.valid).scatter_(1, torch.where(missing, slots, self.num_slots), True)
        need[:, self.num_slots] = False
        rank = need.long().cumsum(1) - 1  # [B, S + 1]: the order of each slot to place
        order = self.eviction_order(slots, input_pos)  # [B, C]: physical slots, first to take first
        taken = order.gather(1, rank.gather(1, slots).clamp(0, self.num_physical - 1))  # [B, L]
        taken = torch.where(missing, taken, held.clamp(min=0))
        # evict what the taken slots held, then map the new ones
        evicted = self.logical.gather(1, taken)
        evicted = torch.where(missing & (evicted >= 0), evicted, self.num_slots)
        self.physical.scatter_(1, evicted, -1)
        self.physical.scatter_(1, slots, taken)
        self.score.scatter_(1, taken, torch.where(missing, 0.0, self.score.gather(1, taken)))
        if self.line_width is not None:
            self.window.scatter_(1, taken, torch.where(missing, 0.0, self.window.gather(1, taken)))
        self.logical.scatter_(1, taken, slots)
        key_ok = (self.logical >= 0) & self.valid.gather(1, self.logical.clamp(min=0))
        return taken, self.logical, key_ok

    def close_lines(self, front: Tensor):
        """The line rule, for the rows whose earliest position moves to a later line (front [B], the
        new one): the last line's window becomes the score, and the least-scored old image slots are
        evicted until a line's worth of physical slots is free."""
        lines = (torch.stack([self.front, front]) - self.num_condition).clamp(min=0) // self.line_width
        crossed = lines[1] > lines[0]  # [B]
        self.score.copy_(torch.where(crossed[:, None], self.window, self.score))
        self.window.masked_fill_(crossed[:, None], 0.0)
        logical = self.logical
        old = (logical >= self.num_condition) & (logical < front[:, None] - self.recent)
        room = (self.line_width - (logical < 0).sum(1)).clamp(min=0) * crossed  # [B]: slots to free
        rank = torch.where(old, self.score, math.inf).argsort(dim=1, stable=True).argsort(dim=1)
        evict = old & (rank < room[:, None])
        self.physical.scatter_(1, torch.where(evict, logical, self.num_slots), -1)
        self.logical.masked_fill_(evict, -1)

    def eviction_order(self, slots: Tensor, input_pos: Tensor) -> Tensor:
        """[B, C] physical slots in the order a write takes them: free, then old image slots by
        accumulated attention (least first), then recent ones (oldest first); pinned ones last."""
        logical = self.logical
        front = input_pos.min(1, keepdim=True).values  # [B, 1]: the call's earliest position
        pinned = (logical >= 0) & (logical < self.num_condition)
        in_call = torch.zeros_like(self.valid).scatter_(1, slots, True)
        pinned |= in_call.gather(1, logical.clamp(min=0)) & (logical >= 0)
        kind = torch.where(logical < 0, _FREE, torch.where(logical < front - self.recent, _OLD, _RECENT))
        kind = torch.where(pinned, _PINNED, kind)
        # old slots by score, recent ones by position; sorted stably on the class afterwards
        within = torch.where(kind == _OLD, self.score, logical.float())
        by_value = within.argsort(dim=1, stable=True)
        return by_value.gather(1, kind.gather(1, by_value).argsort(dim=1, stable=True))

    @contextmanager
    def rows_only(self, rows: Tensor | None):
        """Within the block the table is cache rows `rows` [R] only (a model call for a subset of the
        batch: `RasterModel.__call__(rows=)`), written back to those rows after it; None: all rows."""
        if rows is None:
            yield
            return
        whole = {name: getattr(self, name) for name in ROW_TABLES}
        for name in ROW_TABLES:
            setattr(self, name, whole[name][rows])
        try:
            yield
        finally:
            for name in ROW_TABLES:
                whole[name][rows] = getattr(self, name)
                setattr(self, name, whole[name])

    def reset(self, rows: Tensor, cond_mask: Tensor | None):
        """Free every slot of cache rows `rows` [R] and take cond_mask [R, T] as their valid condition
        positions (a running batch's new image in those rows)."""
        self.physical[rows] = -1
        self.logical[rows] = -1
        self.score[rows] = 0.0
        self.window[rows] = 0.0
        self.front[rows] = 0
        self.valid[rows] = condition_validity(cond_mask, len(rows), self.valid.shape[1], self.valid.device)

    def physical_mask(self, mask: Tensor) -> Tensor:
        """A method's mask over logical slots [B, L, S] -> over the physical slots [B, L, C]."""
        columns = self.logical.clamp(min=0)[:, None, :].expand(-1, mask.shape[1], -1)
        return mask.gather(2, columns)

    def observe(self, attention: Tensor, rows: Tensor | None = None):
        """Add one layer's attention probabilities [B, H, L, C] (rows [R]: of those cache rows) to
        each slot's score (the line rule: to the current line's window)."""
        total = self.score if self.line_width is None else self.window
        mass = attention.sum((1, 2), dtype=total.dtype)  # [B, C], float32 whatever the model's dtype
        if rows is None:
            total += mass
        else:
            total.index_add_(0, rows, mass)

    def truncate(self, lengths: Tensor):
        """Forget every logical slot at or beyond lengths[b] in row b, freeing its physical slot."""
        slots = torch.arange(self.num_slots + 1, device=lengths.device)
        self.physical.masked_fill_(slots[None, :] >= lengths[:, None], -1)
        self.logical.masked_fill_(self.logical >= lengths[:, None], -1)


ROW_TABLES = ("valid", "physical", "logical", "score", "window", "front")  # CompressedCache's per-row tables


def too_small(num_physical: int, num_condition: int, recent: int, count: int) -> str:
    return (
        f"kv_keep leaves {num_physical} KV-cache slots per row, fewer than a pass needs: the {num_condition} "
        f"condition slots, the {recent} most recent and the pass's {count}; raise kv_keep"
    )
