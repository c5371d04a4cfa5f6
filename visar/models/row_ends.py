"""Raster models whose image rows each end with an end-of-line token the sampler forces (Emu3, Lumina-mGPT).

Both families generate an image as text: visual tokens are a slice of the text vocabulary, and the
sampler forces an end-of-line token after every image row. visar numbers image tokens
0..H*W-1; in the model's sequence token (r, c) sits at r * (W + 1) + c after the prompt and the
end of row r at r * (W + 1) + W. So every input that is the last token of a row is fed with its
end-of-line token in the same call, and the end-of-line token's output is the prediction of the
next row's first token. The end-of-line keys live in extra cache slots, one per row (and one per
draft-tree scratch slot), visible to a query that sees the row's last token (`RowEndLayout`). No
method sees any of this.

Positions start at 0 at each prompt's first real token (transformers counts positions from the
attention mask), and the unconditional half is the family's own unconditional prompt with its own
padding (`null_ids` / `null_mask`), or the negative prompt given for the call (`HFRasterAdapter`).
Image logits are `lm_head` restricted to the visual rows, which is what the families' constraint
(only image tokens inside a row) leaves of the vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .hf_raster import HFRasterAdapter
from .kv_cache import CompressedCache, check_kv_keep, physical_slots


class RowEndLayout:
    """Where visar's positions and cache slots sit in a sequence that has a row end after every W tokens.

    visar slot s < T + N holds the token at position s; slots from T + N on are scratch (draft trees).
    The decoder's cache is [visar's S slots ; a row-end slot per row whose last token has a slot ;
    one per scratch slot ; one trash slot], so the row end written after the last token of row r is
    at S + r, and after a scratch slot s at S + rows + (s - T - N). token_slots: the decoder slots
    visar's S take when fewer (a compressed cache's C physical ones; the row-end slots follow them, kept whole).
    """

    def __init__(self, num_cond: int, grid: tuple[int, int], num_slots: int, device, token_slots: int | None = None):
        self.num_cond, (self.height, self.width) = num_cond, grid
        self.num_tokens = self.height * self.width
        self.num_slots = num_slots
        self.token_slots = num_slots if token_slots is None else token_slots
        # the visar slot each row-end slot follows: the last token of each row that fits, then each scratch slot
        row_ends = num_cond + torch.arange(self.height, device=device) * self.width + self.width - 1
        self.rows = int((row_ends < num_slots).sum())
        scratch = torch.arange(num_cond + self.num_tokens, max(num_slots, num_cond + self.num_tokens), device=device)
        self.row_end_owner = torch.cat([row_ends[: self.rows], scratch])
        self.trash = self.token_slots + len(self.row_end_owner)
        self.decoder_slots = self.trash + 1

    def sequence_position(self, pos: Tensor) -> Tensor:
        """visar position -> the model's sequence position (over the padded prompt)."""
        image = (pos - self.num_cond).clamp(min=0)
        return pos + image // self.width

    def ends_row(self, pos: Tensor) -> Tensor:
        """Inputs at these positions are the last image token of a row (a row end follows)."""
        return (pos >= self.num_cond) & ((pos - self.num_cond) % self.width == self.width - 1)

    def row_end_slot(self, slot: Tensor) -> Tensor:
        """The decoder slot of the row end that follows the token written at visar slot `slot`."""
        image = self.token_slots + (slot - self.num_cond) // self.width
        scratch = self.token_slots + self.rows + (slot - self.num_cond - self.num_tokens)
        return torch.where(slot < self.num_cond + self.num_tokens, image, scratch)


class RowEndAdapter(HFRasterAdapter):
    """A transformers decoder (`decoder`, given by the family) and its `lm_head` behind the `RasterModel`
    interface, with a row end after every image row.

    grid_size: (H, W) of the generated image; visual_ids [V]: the text-vocabulary id of visual code k;
    eol_token_id: the end-of-line token; null_ids / null_mask [1, T]: the unconditional prompt
    (left-padded like every prompt), the unconditional half of guidance.
    """

    def __init__(
        self,
        lm_head: nn.Module,
        *,
        max_prompt_tokens: int,
        grid_size: tuple[int, int],
        visual_ids: Tensor,
        eol_token_id: int,
        null_ids: Tensor,
        null_mask: Tensor,
    ):
        super().__init__(max_prompt_tokens)
        self.lm_head = lm_head
        self._grid_size = tuple(grid_size)
        visual_ids = visual_ids.long()
        self.register_buffer("visual_ids", visual_ids, persistent=False)
        self.register_buffer("null_ids", null_ids.long().reshape(1, -1), persistent=False)
        self.register_buffer("null_mask", null_mask.bool().reshape(1, -1), persistent=False)
        self.eol_token_id = int(eol_token_id)
        # The head is a view of lm_head's rows when the visual ids fill one range (Emu3's in code order,
        # Chameleon's in another order, by token name): a reorder of the output then, not a copy of the rows.
        low = int(visual_ids.min())
        span = torch.arange(low, low + len(visual_ids), device=visual_ids.device)
        self.visual_span = slice(low, low + len(visual_ids)) if torch.equal(visual_ids.sort().values, span) else None
        reorder = self.visual_span is not None and not torch.equal(visual_ids, span)
        self.register_buffer("code_order", visual_ids - low if reorder else None, persistent=False)
        self.layout: RowEndLayout | None = None
        self.row_end_at: Tensor | None = None  # [B, S]: the token at visar slot s has a row end after it
        self.prompt_start: Tensor | None = None  # [B]: padding before each prompt (positions start there)

    @property
    def grid_size(self) -> tuple[int, int]:
        return self._grid_size

    @property
    def vocab_size(self) -> int:
        return len(self.visual_ids)

    def default_null_condition(self, cond: Tensor) -> Tensor:
        """The family's unconditional prompt, the same for every sample."""
        return self.null_ids.to(cond.device).expand(cond.shape[0], -1)

    def default_null_condition_mask(self, cond_mask: Tensor | None) -> Tensor:
        """The unconditional prompt's own padding ([B, T], or [1, T] without a cond_mask to match)."""
        return self.null_mask.expand(1 if cond_mask is None else cond_mask.shape[0], -1)

    def embed_condition(self, cond: Tensor) -> Tensor:
        return self.decoder.embed_tokens(cond)

    def embed_image_tokens(self, tokens: Tensor) -> Tensor:
        return self.decoder.embed_tokens(self.visual_ids[tokens])

    def image_logits(self, hidden: Tensor) -> Tensor:
        if self.visual_span is None:  # visual ids scattered over the vocabulary
            return F.linear(hidden, self.lm_head.weight[self.visual_ids])
        logits = F.linear(hidden, self.lm_head.weight[self.visual_span])
        return logits if self.code_order is None else logits[..., self.code_order]

    # -- the cache: visar's slots, then row ends -----------------------------------------------
    def setup_cache(
        self,
        batch_size: int,
        max_seq_len: int | None = None,
        cond_mask: Tensor | None = None,
        kv_keep: float = 1.0,
        kv_evict: str = "h2o",
    ):
        """As `HFRasterAdapter.setup_cache`; a compressed cache keeps the row ends whole (one slot per row)."""
        max_seq_len = max_seq_len or self.max_seq_len
        token_slots = physical_slots(check_kv_keep(kv_keep), max_seq_len)
        self.layout = RowEndLayout(self.num_condition_tokens, self.grid_size, max_seq_len, self.device, token_slots)
        super().setup_cache(batch_size, max_seq_len, cond_mask, kv_keep, kv_evict)
        self.row_end_at = torch.zeros(batch_size, max_seq_len, dtype=torch.bool, device=self.device)
        self.prompt_start = self.padding_before_prompt(cond_mask, batch_size)

    def decoder_slots(self, token_slots: int) -> int:
        return self.layout.decoder_slots

    def clear_cache(self):
        super().clear_cache()
        self.layout = self.row_end_at = self.prompt_start = None

    @torch.no_grad()
    def reset_cache_rows(self, rows: Tensor, cond_mask: Tensor | None = None):
        super().reset_cache_rows(rows, cond_mask)
        self.row_end_at[rows] = False
        self.prompt_start[rows] = self.padding_before_prompt(cond_mask, len(rows))

    def padding_before_prompt(self, cond_mask: Tensor | None, batch_size: int) -> Tensor:
        if cond_mask is None:
            return torch.zeros(batch_size, dtype=torch.long, device=self.device)
        return (~cond_mask.bool()).sum(1).to(self.device)

    def forward(
        self,
        tokens: Tensor | None = None,
        cond: Tensor | None = None,
        *,
        input_pos: Tensor | None = None,
        mask: Tensor | None = None,
        cond_mask: Tensor | None = None,
        cache_pos: Tensor | None = None,
        rows: Tensor | None = None,
    ) -> Tensor:
        """As `HFRasterAdapter.forward`; every input that ends a row is fed with its row end, whose
        output is returned in its place. Without a cache (teacher forcing) a cache lives for the call."""
        self.check_call_rows(rows)
        if self.cache is None:
            return self.forward_without_cache(tokens, cond, input_pos, mask, cond_mask)
        hidden = self.embed_inputs(tokens, cond)
        input_pos, slots, cache_slots, visible = self.visible_keys(
            hidden, cond is not None, input_pos, mask, None, cache_pos, rows
        )
        layout = self.layout
        batch, length, _ = hidden.shape
        ends = layout.ends_row(input_pos)  # [B, L]
        if rows is None:
            self.row_end_at.scatter_(1, slots, ends)
            row_end_at, prompt_start = self.row_end_at, self.prompt_start
        else:  # the call's rows, copied out and written back
            row_end_at = self.row_end_at[rows].scatter_(1, slots, ends)
            self.row_end_at[rows] = row_end_at
            prompt_start = self.prompt_start[rows]
        # Row ends are appended after the L inputs, E of them per sample (the most any sample has);
        # a sample with fewer pads with row ends that write to the trash slot and see only it.
        count = int(ends.sum(1).max())
        end_index = torch.argsort((~ends).to(torch.int8), dim=1, stable=True)[:, :count]  # [B, E]
        end_real = ends.gather(1, end_index)
        end_slots = torch.where(end_real, layout.row_end_slot(slots.gather(1, end_index)), layout.trash)

        # visibility over the decoder's slots: visar's, then row ends (seen with the token they follow)
        owner = layout.row_end_owner
        # a row end written, and not one whose token this call writes again
        end_written = row_end_at[:, None, owner] & (owner[None, None, :] != slots[..., None])
        sees_end = self.sees_owner(visible, rows) & end_written
        trash = torch.zeros(batch, length, 1, dtype=torch.bool, device=hidden.device)
        token_rows = torch.cat([visible, sees_end, trash], dim=2)  # [B, L, S_dec]
        end_rows = token_rows.gather(1, end_index[..., None].expand(-1, -1, token_rows.shape[2])).clone()
        end_rows.scatter_(2, end_slots[..., None], True)  # a row end sees itself
        own_slot = end_slots[..., None] == torch.arange(layout.decoder_slots, device=hidden.device)
        end_rows &= end_real[..., None] | own_slot  # a padding row end sees only the trash slot

        positions = layout.sequence_position(input_pos) - prompt_start[:, None]
        end_positions = positions.gather(1, end_index) + 1
        eol = self.decoder.embed_tokens(torch.full((batch, count), self.eol_token_id, device=hidden.device))
        out = self.run_decoder(
            torch.cat([hidden, eol], dim=1),
            torch.cat([positions, end_positions], dim=1).clamp(min=0),
            torch.cat([cache_slots, end_slots], dim=1),
            torch.cat([token_rows, end_rows], dim=1),
            rows,
        )
        # the output for an input that ends a row is its row end's
        pick = torch.arange(length, device=hidden.device).expand(batch, -1).clone()
        appended = length + torch.arange(count, device=hidden.device)
        pick.scatter_(1, end_index, torch.where(end_real, appended, end_index))
        return self.image_logits(out.gather(1, pick[..., None].expand(-1, -1, out.shape[2]))).float()

    def sees_owner(self, visible: Tensor, rows: Tensor | None) -> Tensor:
        """Whether each query sees the token each row-end slot follows (`RowEndLayout.row_end_owner`) ->
        [B, L, O], from its visibility over the cache [B, L, S]; compressed ([B, L, C]): over the
        owner's physical slot, so a row end is hidden once its token is evicted."""
        owner = self.layout.row_end_owner
        if not isinstance(self.cache_keys, CompressedCache):
            return visible[..., owner]
        table = self.cache_keys.physical if rows is None else self.cache_keys.physical[rows]
        held = table[:, owner]  # [B, O]: the physical slot of each owner, -1 when not held
        seen = visible.gather(2, held.clamp(min=0)[:, None, :].expand(-1, visible.shape[1], -1))
        return seen & (held >= 0)[:, None, :]

    def forward_without_cache(self, tokens, cond, input_pos, mask, cond_mask) -> Tensor:
        """Teacher forcing: a cache for this call only, each input written at its own position."""
        batch = (tokens if tokens is not None else cond).shape[0]
        length = (0 if cond is None else cond.shape[1]) + (0 if tokens is None else tokens.shape[1])
        if input_pos is None:
            start = 0 if cond is not None else self.num_condition_tokens
            input_pos = torch.arange(start, start + length, device=self.device)
        input_pos = input_pos[None].expand(batch, -1) if input_pos.dim() == 1 else input_pos
        slots = int(input_pos.max()) + 1
        if mask is not None:  # over the inputs -> over the slots they are written to
            mask = torch.zeros(batch, length, slots, dtype=torch.bool, device=self.device).scatter(
                2, input_pos[:, None, :].expand(-1, length, -1), mask
            )
        self.setup_cache(batch, slots, cond_mask)
        try:
            return self.forward(tokens, cond, input_pos=input_pos, mask=mask)
        finally:
            self.clear_cache()
