"""LlamaGen raster autoregressive transformer (class- and text-conditional).

Paper: Sun et al. 2024, "Autoregressive Model Beats Diffusion: Llama for Scalable Image Generation".
Checked against FoundationVision/LlamaGen @ ce98ec4 (`autoregressive/models/gpt.py`) through the
fixtures in tests/fixtures/llamagen: same state_dict keys and shapes, same logits.

Differences from the official module, all on the inference side:
- the KV cache is gpt-fast's (preallocated [B, H, S, D], written at explicit `input_pos`), but
  `input_pos` may be per sample ([B, L]) so one batch can hold ragged sequences;
- every forward takes an optional boolean visibility mask [B, L, S], so a call can score many
  query positions at once with any dependency pattern (speculative windows, multi-row fronts);
- the cache can be truncated per sample (`truncate_cache`), which speculative methods need;
- `key_valid` in the cache replaces the official in-place edit of `causal_mask` for t2i caption
  padding (`emb_masks`): padded caption keys are invisible to every query but themselves.

Sequence layout: [T condition positions | image tokens in raster order]. c2i: T = 1 class
embedding; t2i: T = cls_token_num caption positions. Image token i sits at position T + i.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..configs import config_from_dict
from ..errors import VisarError
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
)
from .negative_prompt import NegativePrompt, holding


@dataclass(frozen=True)
class LlamaGenConfig:
    """LlamaGen's `ModelArgs`, field for field, so official constructor arguments load as-is."""

    dim: int = 4096
    n_layer: int = 32
    n_head: int = 32
    n_kv_head: int | None = None
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    rope_base: float = 10000
    norm_eps: float = 1e-5
    initializer_range: float = 0.02
    token_dropout_p: float = 0.1
    attn_dropout_p: float = 0.0
    resid_dropout_p: float = 0.1
    ffn_dropout_p: float = 0.1
    drop_path_rate: float = 0.0
    num_classes: int = 1000
    caption_dim: int = 2048
    class_dropout_prob: float = 0.1
    model_type: str = "c2i"
    vocab_size: int = 16384
    cls_token_num: int = 1
    block_size: int = 256
    max_batch_size: int = 32
    max_seq_len: int = 2048

    @classmethod
    def from_dict(cls, args: dict) -> LlamaGenConfig:
        return config_from_dict(cls, args, "LlamaGen model_args")

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def grid_size(self) -> int:
        return math.isqrt(self.block_size)

    @property
    def ffn_hidden_dim(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return -(-hidden // self.multiple_of) * self.multiple_of

    @property
    def num_condition_tokens(self) -> int:
        return self.cls_token_num


# Official sizes (LlamaGen's GPT_models table). c2i uses cls_token_num 1; t2i 120 caption positions.
GPT_SIZES = {
    "GPT-B": dict(dim=768, n_layer=12, n_head=12),
    "GPT-L": dict(dim=1024, n_layer=24, n_head=16),
    "GPT-XL": dict(dim=1280, n_layer=36, n_head=20),
    "GPT-XXL": dict(dim=1536, n_layer=48, n_head=24),
    "GPT-3B": dict(dim=3200, n_layer=24, n_head=32),
}


def preset_config(size: str, model_type: str = "c2i", image_tokens: int = 256, **overrides) -> LlamaGenConfig:
    """The config of an official release: `size` in GPT_SIZES, 256 or 576 (384 px) image tokens."""
    if size not in GPT_SIZES:
        raise VisarError(f"unknown LlamaGen size {size!r}; known: {sorted(GPT_SIZES)}")
    args = dict(GPT_SIZES[size], vocab_size=16384, block_size=image_tokens, model_type=model_type)
    if model_type == "c2i":
        args.update(num_classes=1000, cls_token_num=1)
    else:
        args.update(cls_token_num=120, caption_dim=2048)
    args.update(overrides)
    return LlamaGenConfig(**args)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32 whatever the model dtype, as the official code does.
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class ClassEmbedding(nn.Module):
    """Class label -> one condition vector. Row `num_classes` is the null class used by CFG."""

    def __init__(self, num_classes: int, dim: int, dropout_prob: float):
        super().__init__()
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob
        self.embedding_table = nn.Embedding(num_classes + int(dropout_prob > 0), dim)

    def forward(self, labels: Tensor) -> Tensor:  # [B] -> [B, 1, D]
        if self.training and self.dropout_prob > 0:
            drop = torch.rand(labels.shape, device=labels.device) < self.dropout_prob
            labels = torch.where(drop, torch.full_like(labels, self.num_classes), labels)
        return self.embedding_table(labels).unsqueeze(1)

    def null_condition(self, labels: Tensor) -> Tensor:
        return torch.full_like(labels, self.num_classes)


class CaptionMLP(nn.Module):
    def __init__(self, in_features: int, hidden: int, out_features: int):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, out_features, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class CaptionEmbedding(nn.Module):
    """Caption embeddings [B, T, caption_dim] -> condition vectors [B, T, D].

    The null caption is the learned-at-init buffer `uncond_embedding` (part of the state_dict);
    its 120 rows are fixed by the official class, whatever cls_token_num is.
    """

    OFFICIAL_TOKEN_NUM = 120

    def __init__(self, caption_dim: int, dim: int, dropout_prob: float, token_num: int = OFFICIAL_TOKEN_NUM):
        super().__init__()
        self.dropout_prob = dropout_prob
        self.cap_proj = CaptionMLP(caption_dim, dim, dim)
        self.register_buffer("uncond_embedding", torch.randn(token_num, caption_dim) / caption_dim**0.5)

    def forward(self, captions: Tensor) -> Tensor:
        if self.training and self.dropout_prob > 0:
            drop = torch.rand(captions.shape[0], device=captions.device) < self.dropout_prob
            null = self.uncond_embedding[: captions.shape[1]].to(captions.dtype)
            captions = torch.where(drop[:, None, None], null, captions)
        return self.cap_proj(captions)

    def null_condition(self, captions: Tensor) -> Tensor:
        return torch.zeros_like(captions) + self.uncond_embedding[: captions.shape[1]].to(captions.dtype)


class KVCache(nn.Module):
    """Preallocated keys and values [B, H, S, D]. With a compressed cache (kv_keep < 1), S is the
    physical slot count and `table` the `CompressedCache` every layer shares: `update` then takes
    physical slots, and the layer reports its attention to the table."""

    def __init__(self, batch_size: int, max_seq_len: int, n_kv_head: int, head_dim: int, dtype, device, table=None):
        super().__init__()
        self.table: CompressedCache | None = table
        shape = (batch_size, n_kv_head, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Write k, v [B, H, L, D] at slots input_pos [B, L] -> the whole cache [B, H, S, D]; with rows
        [R] (B = R), into those cache rows only -> a copy of those rows [R, H, S, D]."""
        # Advanced indexing puts (B, L) first: value [B, L, H, D].
        batch = torch.arange(k.shape[0], device=k.device)[:, None] if rows is None else rows[:, None]
        self.k_cache[batch, :, input_pos] = k.transpose(1, 2)
        self.v_cache[batch, :, input_pos] = v.transpose(1, 2)
        if rows is None:
            return self.k_cache, self.v_cache
        return self.k_cache[rows], self.v_cache[rows]


class Attention(nn.Module):
    def __init__(self, config: LlamaGenConfig):
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head or config.n_head
        self.head_dim = config.dim // config.n_head
        kv_dim = self.n_kv_head * self.head_dim
        self.wqkv = nn.Linear(config.dim, config.dim + 2 * kv_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)
        self.attn_dropout_p = config.attn_dropout_p
        self.resid_dropout = nn.Dropout(config.resid_dropout_p)
        self.kv_cache: KVCache | None = None

    def forward(
        self, x: Tensor, rope: Tensor, input_pos: Tensor, mask: Tensor | None, rows: Tensor | None = None
    ) -> Tensor:
        bsz, seqlen, _ = x.shape
        kv_dim = self.n_kv_head * self.head_dim
        q, k, v = self.wqkv(x).split([self.n_head * self.head_dim, kv_dim, kv_dim], dim=-1)
        q = apply_rope(q.view(bsz, seqlen, self.n_head, self.head_dim), rope).transpose(1, 2)
        k = apply_rope(k.view(bsz, seqlen, self.n_kv_head, self.head_dim), rope).transpose(1, 2)
        v = v.view(bsz, seqlen, self.n_kv_head, self.head_dim).transpose(1, 2)
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(input_pos, k, v, rows)
        if self.n_kv_head != self.n_head:
            k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
            v = v.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        dropout = self.attn_dropout_p if self.training else 0.0
        if self.kv_cache is not None and self.kv_cache.table is not None:
            out = self.attend_observed(q, k, v, mask, rows)
        elif mask is None:  # plain causal over the positions fed (training): the fused kernel path
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], dropout_p=dropout)
        return self.resid_dropout(self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1)))

    def attend_observed(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, rows: Tensor | None = None) -> Tensor:
        """Attention with explicit probabilities, which the compressed cache's eviction reads
        (the math SDPA does; only when kv_keep < 1). q [B, H, L, D], k, v [B, H, C, D], mask [B, L, C]."""
        scores = (q @ k.transpose(-2, -1)) * self.head_dim**-0.5
        probs = scores.float().masked_fill(~mask[:, None], float("-inf")).softmax(-1)  # [B, H, L, C]
        self.kv_cache.table.observe(probs, rows)
        return probs.to(v.dtype) @ v


class FeedForward(nn.Module):
    def __init__(self, config: LlamaGenConfig):
        super().__init__()
        hidden = config.ffn_hidden_dim
        self.w1 = nn.Linear(config.dim, hidden, bias=False)
        self.w3 = nn.Linear(config.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, config.dim, bias=False)
        self.ffn_dropout = nn.Dropout(config.ffn_dropout_p)

    def forward(self, x: Tensor) -> Tensor:
        return self.ffn_dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaGenConfig):
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(
        self, x: Tensor, rope: Tensor, input_pos: Tensor, mask: Tensor | None, rows: Tensor | None = None
    ) -> Tensor:
        h = x + self.attention(self.attention_norm(x), rope, input_pos, mask, rows)
        return h + self.feed_forward(self.ffn_norm(h))


def rope_table_2d(grid_size: int, head_dim: int, base: float, cls_token_num: int) -> Tensor:
    """cos/sin table [cls_token_num + grid^2, head_dim // 2, 2] for LlamaGen's 2-D RoPE.

    Pairs 0..d/4-1 rotate by row * f_j and pairs d/4..d/2-1 by column * f_j, with
    f_j = base^(-2j / (d/2)). Condition positions get all-zero cos and sin: the official code
    thereby zeroes their queries and keys (they attend uniformly and are attended with logit 0).
    """
    half_dim = head_dim // 2
    cpu = torch.device("cpu")  # explicit, so a model built under torch.device("meta") still gets a real table
    freqs = 1.0 / (base ** (torch.arange(0, half_dim, 2, device=cpu)[: half_dim // 2].float() / half_dim))
    angles = torch.outer(torch.arange(grid_size, dtype=torch.float32, device=cpu), freqs)  # [grid, d/4]
    grid_angles = torch.cat(
        [angles[:, None, :].expand(-1, grid_size, -1), angles[None, :, :].expand(grid_size, -1, -1)], dim=-1
    )  # [grid(row), grid(col), d/2]
    table = torch.stack([torch.cos(grid_angles), torch.sin(grid_angles)], dim=-1).flatten(0, 1)
    return torch.cat([torch.zeros(cls_token_num, half_dim, 2, device=cpu), table])


def apply_rope(x: Tensor, rope: Tensor) -> Tensor:
    """x [B, L, H, D], rope [B, L, D/2, 2]: rotate interleaved pairs (2i, 2i+1), in float32."""
    xp = x.float().reshape(*x.shape[:-1], -1, 2)
    cos, sin = rope[:, :, None, :, 0], rope[:, :, None, :, 1]
    out = torch.stack([xp[..., 0] * cos - xp[..., 1] * sin, xp[..., 1] * cos + xp[..., 0] * sin], dim=-1)
    return out.flatten(3).type_as(x)


class LlamaGen(nn.Module):
    """The LlamaGen GPT, with state_dict keys identical to the official `Transformer`.

    Implements `visar.models.base.RasterModel`, the interface every raster decoding method uses.
    """

    model_kind = "raster"

    def __init__(self, config: LlamaGenConfig):
        super().__init__()
        if config.model_type not in ("c2i", "t2i"):
            raise VisarError(f"model_type must be 'c2i' or 't2i', got {config.model_type!r}")
        self.config = config
        if config.model_type == "c2i":
            self.cls_embedding = ClassEmbedding(config.num_classes, config.dim, config.class_dropout_prob)
        else:
            self.cls_embedding = CaptionEmbedding(config.caption_dim, config.dim, config.class_dropout_prob)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.tok_dropout = nn.Dropout(config.token_dropout_p)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        # A plain attribute, not a buffer: kept in float32 whatever the model dtype, and not in
        # the state_dict (as in the official code). Moved to the input's device on use.
        self._rope = rope_table_2d(
            config.grid_size, config.dim // config.n_head, config.rope_base, config.cls_token_num
        )
        # the slots a query may see, set by setup_cache (kv_keep < 1: the compressed cache's slot table)
        self.cache_keys: CacheKeys | CompressedCache | None = None
        self.negative: NegativePrompt | None = None  # t2i: the negative caption of the call under way, if any

    # -- the RasterModel interface ----------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.output.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.output.weight.dtype

    @property
    def condition_layout(self) -> ConditionLayout:
        config = self.config
        if config.model_type == "c2i":
            return ConditionLayout("class", config.cls_token_num, num_classes=config.num_classes)
        return ConditionLayout("text", config.cls_token_num, embed_dim=config.caption_dim)

    @property
    def num_condition_tokens(self) -> int:
        return self.config.cls_token_num

    @property
    def grid_size(self) -> tuple[int, int]:
        return (self.config.grid_size, self.config.grid_size)

    @property
    def num_image_tokens(self) -> int:
        return self.config.grid_size**2

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.num_condition_tokens + self.num_image_tokens

    def null_condition(self, cond: Tensor) -> Tensor:
        """The null class, or (t2i) the call's negative caption embeddings, else the null caption."""
        if self.negative is not None:
            return self.negative.condition(cond).to(cond.dtype)
        return self.cls_embedding.null_condition(cond)

    def null_condition_mask(self, cond_mask: Tensor | None) -> Tensor | None:
        if self.negative is not None:
            return self.negative.mask  # a negative caption has its own padding
        return cond_mask  # the null caption keeps the caption's padding

    def negative_prompt(self, cond: Tensor, mask: Tensor):
        """t2i: a block in which the unconditional branch is this negative caption: embeddings
        [B, T, caption_dim], left-padded as captions are, with their valid positions mask [B, T]."""
        return holding(self, cond, mask)

    # -- KV cache ---------------------------------------------------------------------------
    def setup_cache(
        self,
        batch_size: int,
        max_seq_len: int | None = None,
        cond_mask: Tensor | None = None,
        kv_keep: float = 1.0,
        kv_evict: str = "h2o",
    ):
        """Preallocate the KV cache. cond_mask [B, T] bool: valid caption positions (t2i padding).
        kv_keep < 1: keys and values of ceil(kv_keep * max_seq_len) slots per row, the condition
        and the last two grid rows kept whole, older image slots evicted by attention under the
        rule kv_evict ("h2o" or "line": `CompressedCache`); 1: the whole cache, exact."""
        max_seq_len = max_seq_len or self.max_seq_len
        param = self.output.weight
        table = None
        if check_kv_keep(kv_keep) < 1:
            table = compressed_cache(
                batch_size,
                max_seq_len,
                cond_mask,
                self.num_condition_tokens,
                self.config.grid_size,
                param.device,
                kv_keep,
                kv_evict,
            )
            max_seq_len = table.num_physical
        for layer in self.layers:
            attn = layer.attention
            attn.kv_cache = KVCache(
                batch_size, max_seq_len, attn.n_kv_head, attn.head_dim, param.dtype, param.device, table
            )
        self.cache_keys = table if table is not None else CacheKeys(batch_size, max_seq_len, cond_mask, param.device)

    def clear_cache(self):
        for layer in self.layers:
            layer.attention.kv_cache = None
        self.cache_keys = None

    @torch.no_grad()
    def truncate_cache(self, lengths: Tensor):
        """Forget every cached slot at or beyond lengths[b] for sample b: hidden from every query
        until a call writes it again (`CacheKeys`: cheaper than zeroing the keys and values of
        every layer)."""
        self.cache_keys.truncate(lengths)

    @torch.no_grad()
    def reset_cache_rows(self, rows: Tensor, cond_mask: Tensor | None = None):
        """Free cache rows `rows` [R] for a new condition whose valid positions are cond_mask [R, T]
        (None: all valid): their slots are forgotten (the keys and values stay, hidden until written
        again, as `truncate_cache` leaves them); the other rows are unchanged."""
        check_rows(rows, self.cache_keys.valid.shape[0])
        self.cache_keys.reset(rows, cond_mask)

    # -- forward ----------------------------------------------------------------------------
    def embed(self, tokens: Tensor | None = None, cond: Tensor | None = None) -> Tensor:
        """[condition embeddings (if cond) ; token embeddings (if tokens)] -> [B, L, D]."""
        parts = []
        if cond is not None:
            parts.append(self.cls_embedding(cond)[:, : self.config.cls_token_num])
        if tokens is not None:
            parts.append(self.tok_embeddings(tokens))
        return self.tok_dropout(torch.cat(parts, dim=1))

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
        """Logits [B, L, V] (float32) for the L positions fed.

        tokens [B, N] image-token ids; cond: class ids [B] or caption embeddings [B, T, caption_dim].
        The positions fed are [condition (if cond) ; tokens]; input_pos ([L] or [B, L]) gives
        their absolute sequence positions (default 0..L-1 with cond, else T..T+N-1), which
        select both the RoPE entry and, with a cache, the slot written.
        mask [B, L, S] bool (True = visible): S is the cache length with a cache, else L; with a
        cache, the invalid caption keys of `setup_cache`'s cond_mask are hidden from it too.
        Default: causal by position, minus invalid caption keys (cond_mask [B, T] without a
        cache; the cache's own `key_valid` with one). Row l predicts the token after position
        input_pos[l]. cache_pos ([L] or [B, L]): the cache slots to write instead of input_pos,
        for inputs that share a position (the nodes of a draft tree at one depth); give a mask
        with it, since the default one reads slots as positions. rows [R] (distinct cache rows, with a
        cache only): the call is for those rows of the cache, B = R; the other rows are untouched.
        """
        cached = self.layers[0].attention.kv_cache is not None
        if rows is not None:
            if not cached:
                raise ValueError("rows select cache rows: call setup_cache before a call with rows")
            check_rows(rows, self.cache_keys.valid.shape[0])
        h = self.embed(tokens, cond)
        bsz, seqlen, _ = h.shape
        if input_pos is None:
            start = 0 if cond is not None else self.config.cls_token_num
            input_pos = torch.arange(start, start + seqlen, device=h.device)
        # Without a cache, increasing positions shared by the batch make the default mask plain
        # lower-triangular: leave it to SDPA's fused causal kernel (the training path).
        plain_causal = (
            mask is None
            and not cached
            and cond_mask is None
            and input_pos.dim() == 1
            and bool((input_pos.diff() > 0).all())
        )
        if input_pos.dim() == 1:
            input_pos = input_pos[None].expand(bsz, -1)
        slots = input_pos if cache_pos is None else cache_pos.expand(bsz, -1) if cache_pos.dim() == 1 else cache_pos
        if cached and isinstance(self.cache_keys, CompressedCache):
            # logical slots -> physical ones (evicting by attention where a write needs room)
            count = seqlen - (self.config.cls_token_num if cond is not None else 0)
            slots, mask = compressed_visibility(
                self.cache_keys, slots, input_pos, count, mask, rows, self.default_mask
            )  # [B, L], [B, L, C]
        elif cached:
            # A query sees only slots written and not forgotten since (this call's own included),
            # never the padded caption positions.
            key_ok = self.cache_keys.write(slots, rows)  # [B, S]
            if mask is not None:
                mask = mask & key_ok[:, None, :]
        if mask is None and not plain_causal:
            if cached:
                key_pos = torch.arange(key_ok.shape[1], device=h.device)[None].expand(bsz, -1)
                mask = self.default_mask(input_pos, key_pos, key_ok)
            else:
                key_valid = None if cond_mask is None else condition_validity(cond_mask, bsz, seqlen, h.device)
                mask = self.default_mask(input_pos, input_pos, key_valid)
        if self._rope.device != h.device:
            self._rope = self._rope.to(h.device)
        rope = self._rope[input_pos]  # [B, L, D/2, 2]
        for layer in self.layers:
            h = layer(h, rope, slots, mask, rows)
        return self.output(self.norm(h)).float()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
