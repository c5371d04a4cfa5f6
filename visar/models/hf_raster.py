"""What every Hugging Face raster adapter shares: a slot cache transformers' decoder layers write to,
explicit 4-D masks, and the `RasterModel` call on top of a transformers decoder.

transformers' `StaticCache` writes the inputs of one forward pass at one `cache_position` shared by
the batch; visar's methods commit a ragged number of tokens per image and truncate each image's
cache on its own. `SlotCache` is the cache transformers' attention layers see instead (it only
needs `update(key_states, value_states, layer_idx, ...)`): preallocated keys and values
[B, H_kv, S, D] per layer, written at per-sample slots (gpt-fast's cache, as in
`visar.models.llamagen.KVCache`); which slots a query may see, and truncation, are
`visar.models.kv_cache.CacheKeys`, as for LlamaGen. The decoder is called with `position_ids` [B, L] and a ready
4-D additive mask [B, 1, L, S], which transformers' mask builder passes through unchanged
(`masking_utils._preprocess_mask_arguments`: "If the mask is already 4D, simply return as-is").

With kv_keep < 1 the slots are those of a compressed cache (`visar.models.kv_cache.CompressedCache`, as
for LlamaGen): [B, H_kv, C, D], the table mapping visar's logical slots onto them. Its eviction reads
each layer's attention probabilities, which transformers' SDPA path never forms: the decoder's calls
then run under `OBSERVED_ATTENTION`, transformers' own eager attention registered in its
`AttentionInterface`, which hands the probabilities to the cache (`SlotCache.observe`) through the
keyword arguments transformers passes down to every attention function. kv_keep = 1 runs as before.

A family's adapter (`hf_janus.py`) says how a condition and image tokens are embedded and how a
hidden state becomes image-token logits; the cache, masks, positions and padding are here.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor, nn

from .base import ConditionLayout
from .kv_cache import (
    CacheKeys,
    CompressedCache,
    causal_visibility,
    check_kv_keep,
    check_rows,
    compressed_cache,
    compressed_visibility,
    condition_validity,
    physical_slots,
)
from .negative_prompt import NegativePrompt, holding

OBSERVED_ATTENTION = "visar_observed"  # the attention implementation a compressed cache's calls run under


class SlotCache:
    """Keys and values [B, H_kv, S, D] per layer, written at `write_slots` [B, L] of the cache rows
    `write_rows` ([R], None: all; both set before each call). With a compressed cache's `table`, the
    slots are physical ones, the first `table.num_physical` of them the table's."""

    def __init__(
        self, num_layers: int, batch_size: int, slots: int, kv_heads: int, head_dim: int, dtype, device, table=None
    ):
        shape = (batch_size, kv_heads, slots, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.write_slots: Tensor | None = None  # [B, L]
        self.write_rows: Tensor | None = None  # [R]
        self.batch_index = torch.arange(batch_size, device=device)[:, None]
        self.table: CompressedCache | None = table

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """transformers' Cache.update: write this call's keys/values [B, H_kv, L, D], return the whole
        cache, or with write_rows a copy of those rows [R, H_kv, S, D]."""
        rows = self.write_rows
        batch = self.batch_index if rows is None else rows[:, None]
        # Advanced indexing puts (B, L) first: the written value is [B, L, H_kv, D].
        self.keys[layer_idx][batch, :, self.write_slots] = key_states.transpose(1, 2)
        self.values[layer_idx][batch, :, self.write_slots] = value_states.transpose(1, 2)
        if rows is None:
            return self.keys[layer_idx], self.values[layer_idx]
        return self.keys[layer_idx][rows], self.values[layer_idx][rows]

    def observe(self, attention: Tensor):
        """One layer's attention probabilities [B, H, L, S] of this call -> the table's eviction scores
        (the table's slots only: a family's extra slots, such as row ends, are never evicted)."""
        self.table.observe(attention[..., : self.table.num_physical], self.write_rows)


def register_observed_attention():
    """Register `OBSERVED_ATTENTION` with transformers: its eager attention (the same function in every
    Llama-like model file), whose probabilities go to the call's `slot_cache`."""
    from transformers import AttentionInterface
    from transformers.models.llama.modeling_llama import eager_attention_forward

    def observed_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, *, slot_cache, **kwargs):
        out, probs = eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        slot_cache.observe(probs)
        return out, probs

    AttentionInterface.register(OBSERVED_ATTENTION, observed_attention)


@contextmanager
def attention_implementation(config, name: str):
    """Within the block, the attention layers that read `config` run transformers' implementation `name`."""
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def additive_mask(visible: Tensor, dtype: torch.dtype) -> Tensor:
    """Boolean visibility [B, L, S] -> transformers' additive 4-D mask [B, 1, L, S] (0 or the dtype's min).

    The minimum rather than -inf, so that a row that sees nothing (a padding query) gives a uniform
    average instead of NaN, as transformers' own masks do.
    """
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill(~visible, torch.finfo(dtype).min)[:, None]


class HFRasterAdapter(nn.Module):
    """A transformers decoder behind visar's `RasterModel` interface (see visar/models/base.py).

    Condition: the prompt's token ids [B, T] of the model's own tokenizer, LEFT-padded to T =
    `max_prompt_tokens` (validity in the `cond_mask` given to `setup_cache`; padded positions are
    hidden from every query). Image token i sits at position T + i; positions are also the cache
    slots and the RoPE positions (transformers' image generation counts positions over the padded
    prompt the same way). Subclasses give `embed_condition`, `embed_image_tokens`, `image_logits`,
    `default_null_condition` (the family's unconditional branch), `decoder` (the transformers decoder
    module) and the grid and vocabulary. A negative prompt given for one call (`negative_prompt`)
    replaces the family's unconditional branch for that call (`visar.models.negative_prompt`).
    """

    model_kind = "raster"

    def __init__(self, max_prompt_tokens: int):
        super().__init__()
        self.max_prompt_tokens = max_prompt_tokens
        self.cache: SlotCache | None = None
        self.cache_keys: CacheKeys | None = None  # the slots a query may see, set by setup_cache
        self.negative: NegativePrompt | None = None  # the negative prompt of the call under way, if it has one

    # -- what a family gives -----------------------------------------------------------------
    @property
    def decoder(self) -> nn.Module:
        raise NotImplementedError

    def embed_condition(self, cond: Tensor) -> Tensor:
        raise NotImplementedError

    def embed_image_tokens(self, tokens: Tensor) -> Tensor:
        raise NotImplementedError

    def image_logits(self, hidden: Tensor) -> Tensor:
        raise NotImplementedError

    def default_null_condition(self, cond: Tensor) -> Tensor:
        raise NotImplementedError

    def default_null_condition_mask(self, cond_mask: Tensor | None) -> Tensor | None:
        """The valid positions of the family's unconditional prompt: the prompt's, unless it has its own."""
        return cond_mask

    # -- the RasterModel interface ------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.decoder.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.decoder.parameters()).dtype

    @property
    def num_condition_tokens(self) -> int:
        return self.max_prompt_tokens

    @property
    def condition_layout(self) -> ConditionLayout:
        return ConditionLayout("text", self.max_prompt_tokens)  # embed_dim 0: token ids of the model's tokenizer

    @property
    def num_image_tokens(self) -> int:
        height, width = self.grid_size
        return height * width

    @property
    def max_seq_len(self) -> int:
        return self.num_condition_tokens + self.num_image_tokens

    def null_condition(self, cond: Tensor) -> Tensor:
        """The unconditional prompt [B, T]: the call's negative prompt, else the family's own."""
        return self.default_null_condition(cond) if self.negative is None else self.negative.condition(cond)

    def null_condition_mask(self, cond_mask: Tensor | None) -> Tensor | None:
        return self.default_null_condition_mask(cond_mask) if self.negative is None else self.negative.mask

    def negative_prompt(self, cond: Tensor, mask: Tensor):
        """A block in which the unconditional prompt is this negative prompt: ids [B, T] of the model's
        tokenizer, left-padded as prompts are, and their valid positions mask [B, T]."""
        return holding(self, cond, mask)

    def setup_cache(
        self,
        batch_size: int,
        max_seq_len: int | None = None,
        cond_mask: Tensor | None = None,
        kv_keep: float = 1.0,
        kv_evict: str = "h2o",
    ):
        """As `visar.models.llamagen.LlamaGen.setup_cache`: kv_keep < 1 keeps ceil(kv_keep * max_seq_len)
        of visar's slots per row (`CompressedCache`, evicting by kv_evict's rule); 1: the whole cache."""
        max_seq_len = max_seq_len or self.max_seq_len
        config = self.decoder.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        table = None
        if check_kv_keep(kv_keep) < 1:
            width = self.grid_size[1]
            table = compressed_cache(
                batch_size, max_seq_len, cond_mask, self.num_condition_tokens, width, self.device, kv_keep, kv_evict
            )
            register_observed_attention()
        self.cache = SlotCache(
            config.num_hidden_layers,
            batch_size,
            self.decoder_slots(physical_slots(kv_keep, max_seq_len)),
            config.num_key_value_heads,
            head_dim,
            self.dtype,
            self.device,
            table,
        )
        self.cache_keys = table if table is not None else CacheKeys(batch_size, max_seq_len, cond_mask, self.device)

    def decoder_slots(self, token_slots: int) -> int:
        """The decoder's cache slots when visar's slots take `token_slots` of them (more when a family
        feeds extra tokens)."""
        return token_slots

    def clear_cache(self):
        self.cache = self.cache_keys = None

    @torch.no_grad()
    def truncate_cache(self, lengths: Tensor):
        self.cache_keys.truncate(lengths)

    @torch.no_grad()
    def reset_cache_rows(self, rows: Tensor, cond_mask: Tensor | None = None):
        """Free cache rows `rows` [R] for a new prompt whose valid positions are cond_mask [R, T] (None:
        all valid); the other rows are unchanged (`visar.models.base.RasterModel`)."""
        check_rows(rows, self.cache_keys.valid.shape[0])
        self.cache_keys.reset(rows, cond_mask)

    def check_call_rows(self, rows: Tensor | None):
        """Refuse rows without a cache, or rows that are not distinct cache rows."""
        if rows is None:
            return
        if self.cache is None:
            raise ValueError("rows select cache rows: call setup_cache before a call with rows")
        check_rows(rows, self.cache_keys.valid.shape[0])

    default_mask = staticmethod(causal_visibility)

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
        """Image-token logits [B, L, V] (float32) for [condition (if cond) ; tokens (if tokens)].

        As `visar.models.llamagen.LlamaGen.forward`: input_pos [L] or [B, L] (default 0.. with cond,
        else T..), mask [B, L, S] over the cache (or over the L inputs without one), cond_mask [B, T]
        without a cache, cache_pos the slots to write when they are not the positions, rows [R] the
        cache rows the call is for (B = R; None: all).
        """
        self.check_call_rows(rows)
        hidden = self.embed_inputs(tokens, cond)
        input_pos, _, cache_slots, visible = self.visible_keys(
            hidden, cond is not None, input_pos, mask, cond_mask, cache_pos, rows
        )
        return self.image_logits(self.run_decoder(hidden, input_pos, cache_slots, visible, rows)).float()

    def embed_inputs(self, tokens: Tensor | None, cond: Tensor | None) -> Tensor:
        """[condition (if cond) ; image tokens (if tokens)] embedded -> [B, L, D]."""
        parts = []
        if cond is not None:
            parts.append(self.embed_condition(cond))
        if tokens is not None:
            parts.append(self.embed_image_tokens(tokens))
        return torch.cat(parts, dim=1)

    def visible_keys(
        self,
        hidden: Tensor,
        with_condition: bool,
        input_pos: Tensor | None,
        mask: Tensor | None,
        cond_mask: Tensor | None,
        cache_pos: Tensor | None,
        rows: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor]:
        """visar's layout of one call (for cache rows `rows`, None: all) -> (positions [B, L], visar's
        slots written [B, L] and the cache slots they are written to [B, L] (the physical ones of a
        compressed cache; both None without a cache), visibility over the cache [B, L, S] (compressed:
        over its physical slots [B, L, C]), or over the inputs [B, L, L])."""
        batch, length, _ = hidden.shape
        if input_pos is None:
            start = 0 if with_condition else self.num_condition_tokens
            input_pos = torch.arange(start, start + length, device=hidden.device)
        if input_pos.dim() == 1:
            input_pos = input_pos[None].expand(batch, -1)
        slots = None
        if self.cache is not None:
            slots = input_pos if cache_pos is None else cache_pos
            slots = slots.expand(batch, -1) if slots.dim() == 1 else slots
        if isinstance(self.cache_keys, CompressedCache):  # logical slots -> physical ones, evicting where needed
            count = length - (self.num_condition_tokens if with_condition else 0)
            cache_slots, visible = compressed_visibility(
                self.cache_keys, slots, input_pos, count, mask, rows, self.default_mask
            )
            return input_pos, slots, cache_slots, visible
        if self.cache is not None:
            key_valid = self.cache_keys.write(slots, rows)  # written, not forgotten, not padding
            key_pos = torch.arange(key_valid.shape[1], device=hidden.device)[None].expand(batch, -1)
        else:
            key_pos = input_pos
            key_valid = None if cond_mask is None else condition_validity(cond_mask, batch, length, hidden.device)
        if mask is None:
            mask = self.default_mask(input_pos, key_pos, key_valid)
        elif key_valid is not None:
            mask = mask & key_valid[:, None, :]  # padded prompt slots stay hidden
        return input_pos, slots, slots, mask

    def run_decoder(
        self, hidden: Tensor, positions: Tensor, slots: Tensor | None, visible: Tensor, rows: Tensor | None = None
    ) -> Tensor:
        """The transformers decoder over inputs [B, L, D] at positions [B, L], written to the cache's
        slots [B, L] (when there is a cache) of its rows `rows` (None: all), seeing `visible` [B, L, S]
        -> last hidden states [B, L, D]."""
        if self.cache is not None:
            self.cache.write_slots, self.cache.write_rows = slots, rows
        inputs = dict(
            inputs_embeds=hidden,
            attention_mask=additive_mask(visible, hidden.dtype),
            position_ids=positions,
            cache=self.cache,
            use_cache=self.cache is not None,
        )
        if self.cache is None or self.cache.table is None:
            return self.decoder(**inputs).last_hidden_state
        # a compressed cache: eager attention, whose probabilities the eviction reads
        with attention_implementation(self.decoder.config, OBSERVED_ATTENTION):
            return self.decoder(**inputs, slot_cache=self.cache).last_hidden_state
