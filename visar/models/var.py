"""VAR (Tian et al. 2024, "Visual Autoregressive Modeling"): next-scale prediction with AdaLN transformer blocks.

Checked against FoundationVision/VAR @ 78b9539 (`models/var.py`, `models/basic_var.py`) through
tests/fixtures/var/tiny_var*.*: identical state_dict keys, teacher-forced logits and greedy
inference, with and without shared AdaLN (VAR-d36). Official checkpoints are bare state_dicts and
load strictly; the VQVAE is a separate file (`visar/tokenizers/msvq.py`).

Implements `NextScaleModel` (visar/models/base.py): the caller feeds scales in order; a KV cache
holds every earlier scale; inside one call attention is block-causal (an input sees its own and
earlier scales). What upstream does only in training is left out: dropout, drop-path, and the
random replacement of labels by the null class (`cond_drop_rate`, applied upstream even in eval
mode), so a forward pass here is deterministic.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..configs import config_from_dict
from ..errors import VisarError
from .base import ConditionLayout

SCALES_256 = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)
SCALES_512 = (1, 2, 3, 4, 6, 9, 13, 18, 24, 32)


@dataclass(frozen=True)
class VARConfig:
    """The official `VAR` constructor arguments, plus what upstream reads from the VQVAE it is given
    (`vocab_size` V and `z_channels` Cvae). Training-only arguments are accepted and unused."""

    vocab_size: int = 4096
    z_channels: int = 32
    num_classes: int = 1000
    depth: int = 16
    embed_dim: int = 1024
    num_heads: int = 16
    mlp_ratio: float = 4.0
    drop_rate: float = 0.0
    attn_drop_rate: float = 0.0
    drop_path_rate: float = 0.0
    norm_eps: float = 1e-6
    shared_aln: bool = False
    cond_drop_rate: float = 0.1
    attn_l2_norm: bool = False  # upstream's constructor default; every release sets True
    patch_nums: tuple[int, ...] = SCALES_256
    flash_if_available: bool = True
    fused_if_available: bool = True

    @classmethod
    def from_dict(cls, args: dict) -> VARConfig:
        config = config_from_dict(cls, args, "VAR model_args", convert={"patch_nums": tuple})
        if config.embed_dim % config.num_heads:
            raise VisarError("VAR embed_dim must be a multiple of num_heads")
        return config

    def to_dict(self) -> dict:
        return asdict(self)


def preset_config(depth: int, shared_aln: bool = False, patch_nums=SCALES_256) -> VARConfig:
    """A released size, as upstream's `build_vae_var` makes it: width 64 * depth, one head per 64."""
    return VARConfig(
        depth=depth,
        embed_dim=64 * depth,
        num_heads=depth,
        drop_path_rate=0.1 * depth / 24,
        shared_aln=shared_aln,
        attn_l2_norm=True,
        patch_nums=tuple(patch_nums),
    )


def scale_levels(patch_nums: tuple[int, ...]) -> Tensor:
    """The scale index of every input of the sequence [L]."""
    return torch.cat([torch.full((pn * pn,), k) for k, pn in enumerate(patch_nums)])


def modulate(x: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    return x * (scale + 1) + shift


def upsample_tokens(x: Tensor, side: int) -> Tensor:
    """[B, s*s, C] token map -> [B, side*side, C] ('area' resize, as FastVAR's cached values)."""
    batch, length, channels = x.shape
    small = round(math.sqrt(length))
    grid = x.transpose(1, 2).reshape(batch, channels, small, small)
    return F.interpolate(grid, size=(side, side), mode="area").flatten(2).transpose(1, 2)


class KVCache:
    """Keys and values of the scales fed so far, appended in order ([B, H, S, D] preallocated)."""

    def __init__(self, batch_size: int, heads: int, length: int, head_dim: int, dtype, device):
        shape = (batch_size, heads, length, head_dim)
        # empty, not zeros: only the appended prefix is ever read, so zero-filling every layer's
        # cache would be work for nothing
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.length = 0

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        end = self.length + k.shape[2]
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class SelfAttention(nn.Module):
    def __init__(self, config: VARConfig):
        super().__init__()
        dim, self.heads = config.embed_dim, config.num_heads
        self.head_dim = dim // self.heads
        self.l2_norm = config.attn_l2_norm
        if self.l2_norm:
            # q and k unit-normalised, q scaled per head by exp(min(scale_mul, ln 100)); softmax scale 1.
            self.scale_mul_1H11 = nn.Parameter(torch.full((1, self.heads, 1, 1), math.log(4.0)))
            self.softmax_scale = 1.0
        else:
            self.softmax_scale = 0.25 / math.sqrt(self.head_dim)
        self.mat_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(dim))
        self.v_bias = nn.Parameter(torch.zeros(dim))
        self.register_buffer("zero_k_bias", torch.zeros(dim))  # keys have no bias; a buffer upstream
        self.proj = nn.Linear(dim, dim)
        self.cache: KVCache | None = None

    def forward(self, x: Tensor, visible: Tensor | None, queries_from: int = 0) -> Tensor:
        """x [B, l, C]; visible [l, S] bool over the cached and new keys (None: all) -> the outputs of
        inputs queries_from .. l - 1 (every input's key and value still enters the cache)."""
        batch, length, dim = x.shape
        bias = torch.cat([self.q_bias, self.zero_k_bias, self.v_bias])
        qkv = F.linear(x, self.mat_qkv.weight, bias).view(batch, length, 3, self.heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # [B, H, l, D]
        q = q[:, :, queries_from:]
        if self.l2_norm:
            scale_mul = self.scale_mul_1H11.clamp_max(math.log(100)).exp()
            q, k = F.normalize(q, dim=-1) * scale_mul, F.normalize(k, dim=-1)
        if self.cache is not None:
            k, v = self.cache.append(k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=self.softmax_scale)
        return self.proj(out.transpose(1, 2).reshape(batch, length - queries_from, dim))


class FFN(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


@dataclass
class ScaleRecord:
    """A block's last one-scale call: its input and the two residual updates it added (for pruning)."""

    block_input: Tensor  # [B, l, C]
    attn_update: Tensor
    ffn_update: Tensor


class AdaLNBlock(nn.Module):
    """x += gamma1 * attn(LN(x)(1 + scale1) + shift1); x += gamma2 * ffn(LN(x)(1 + scale2) + shift2).

    The six modulation vectors come from the class embedding: per block (`ada_lin`), or, with shared
    AdaLN, one model-level projection plus this block's `ada_gss`; split gamma1, gamma2, scale1,
    scale2, shift1, shift2 (upstream's order)."""

    def __init__(self, config: VARConfig):
        super().__init__()
        dim = config.embed_dim
        self.attn = SelfAttention(config)
        self.ffn = FFN(dim, round(dim * config.mlp_ratio))
        self.eps = config.norm_eps
        if config.shared_aln:
            self.ada_gss = nn.Parameter(torch.zeros(1, 1, 6, dim))
        else:
            self.ada_lin = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.record: ScaleRecord | None = None

    def norm(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, x.shape[-1:], eps=self.eps)

    def modulation(self, condition: Tensor) -> list[Tensor]:
        """condition: the class embedding [B, D], or with shared AdaLN the shared projection [B, 1, 6, C]."""
        if hasattr(self, "ada_gss"):
            return list((self.ada_gss + condition).unbind(2))
        return list(self.ada_lin(condition).view(condition.shape[0], 1, 6, -1).unbind(2))

    def forward(
        self,
        x: Tensor,
        condition: Tensor,
        visible: Tensor | None,
        keep: int | None = None,
        record_last: int = 0,
        outputs_from: int = 0,
    ) -> Tensor:
        """x [B, l, C] -> the outputs of inputs outputs_from .. l - 1 (the keys and values of all enter
        the cache); visible: the rows of those outputs; keep: prune to that many inputs; record_last:
        keep the updates of this call's last `record_last` inputs (its last scale) for a later pruned
        call (0: keep nothing)."""
        gamma1, gamma2, scale1, scale2, shift1, shift2 = self.modulation(condition)
        if keep is None:
            attn_update = self.attn(modulate(self.norm(x), scale1, shift1), visible, outputs_from) * gamma1
            x = x[:, outputs_from:]
            block_input = x
            x = x + attn_update
            ffn_update = self.ffn(modulate(self.norm(x), scale2, shift2)) * gamma2
            x = x + ffn_update
        else:
            block_input = x
            x, attn_update, ffn_update = self.pruned(x, keep, gamma1, gamma2, scale1, scale2, shift1, shift2)
        self.record = None
        if record_last:
            last = slice(x.shape[1] - record_last, None)
            self.record = ScaleRecord(block_input[:, last], attn_update[:, last], ffn_update[:, last])
        return x

    def pruned(self, x, keep, gamma1, gamma2, scale1, scale2, shift1, shift2):
        """FastVAR's cached token pruning: the `keep` inputs that moved most from the previous scale's
        input (upsampled) go through attention and FFN; the others add the previous scale's updates,
        upsampled. Only the kept inputs' keys and values enter the cache."""
        if self.record is None:
            raise VisarError(
                "token pruning needs the previous scale's layer updates: set up the cache with pruning=True and "
                "feed that scale alone before"
            )
        batch, length, dim = x.shape
        side = round(math.sqrt(length))
        previous = self.record
        change = (x - upsample_tokens(previous.block_input, side)).square().sum(-1)  # [B, l]
        index = change.topk(keep, dim=1).indices.unsqueeze(-1).expand(-1, -1, dim)  # [B, keep, C]
        attn_update = upsample_tokens(previous.attn_update, side).to(x.dtype)
        kept = modulate(self.norm(x.gather(1, index)), scale1, shift1)
        attn_update = attn_update.scatter(1, index, self.attn(kept, None) * gamma1)
        x = x + attn_update
        ffn_update = upsample_tokens(previous.ffn_update, side).to(x.dtype)
        kept = modulate(self.norm(x.gather(1, index)), scale2, shift2)
        ffn_update = ffn_update.scatter(1, index, self.ffn(kept) * gamma2)
        return x + ffn_update, attn_update, ffn_update


class AdaLNHead(nn.Module):
    """LN(x)(1 + scale) + shift from the class embedding, split scale, shift (upstream's head_nm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.ada_lin = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))

    def forward(self, x: Tensor, cond_embedding: Tensor) -> Tensor:
        linear = self.ada_lin[1]
        ada = F.linear(F.silu(cond_embedding.float()), linear.weight.float(), linear.bias.float())
        scale, shift = ada.view(x.shape[0], 1, 2, -1).unbind(2)
        return modulate(F.layer_norm(x.float(), x.shape[-1:], eps=self.eps), scale, shift)


class VAR(nn.Module):
    """A VAR transformer under upstream's key names; implements `NextScaleModel`."""

    model_kind: ClassVar[str] = "next-scale"

    def __init__(self, config: VARConfig):
        super().__init__()
        self.config = config
        dim, patch_nums = config.embed_dim, config.patch_nums
        self.first_l = patch_nums[0] ** 2
        self.total_length = sum(pn * pn for pn in patch_nums)
        self.scale_starts = [sum(pn * pn for pn in patch_nums[:k]) for k in range(len(patch_nums) + 1)]
        self.word_embed = nn.Linear(config.z_channels, dim)
        self.class_emb = nn.Embedding(config.num_classes + 1, dim)  # the last row is the null class
        self.pos_start = nn.Parameter(torch.zeros(1, self.first_l, dim))
        self.pos_1LC = nn.Parameter(torch.zeros(1, self.total_length, dim))
        self.lvl_embed = nn.Embedding(len(patch_nums), dim)
        if config.shared_aln:
            self.shared_ada_lin = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.blocks = nn.ModuleList([AdaLNBlock(config) for _ in range(config.depth)])
        # Upstream's buffers, kept so official files load strictly: the scale of every input, and
        # the block-causal training mask (0 / -inf), which is recomputed here from the levels.
        levels = scale_levels(patch_nums)
        self.register_buffer("lvl_1L", levels[None])
        causal = torch.where(levels[:, None] >= levels[None, :], 0.0, -math.inf)
        self.register_buffer("attn_bias_for_masking", causal.reshape(1, 1, self.total_length, self.total_length))
        self.head_nm = AdaLNHead(dim, config.norm_eps)
        self.head = nn.Linear(dim, config.vocab_size)
        self.recording = False  # see setup_cache

    # -- the NextScaleModel interface --------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.head.weight.dtype

    @property
    def scale_sizes(self) -> tuple[int, ...]:
        return tuple(self.config.patch_nums)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def latent_dim(self) -> int:
        return self.config.z_channels

    @property
    def num_image_tokens(self) -> int:
        return self.total_length

    @property
    def condition_layout(self) -> ConditionLayout:
        # The class enters as scale 0's start token and through AdaLN, not as positions of its own.
        return ConditionLayout("class", 0, self.config.num_classes)

    def null_condition(self, cond: Tensor) -> Tensor:
        return torch.full_like(cond, self.config.num_classes)

    def setup_cache(self, batch_size: int, pruning: bool = False) -> None:
        # pruning: keep each call's last-scale layer updates for a later pruned call (memory: three
        # [B, pn^2, C] tensors per layer), only when a method will prune.
        self.recording = pruning
        heads, head_dim = self.config.num_heads, self.config.embed_dim // self.config.num_heads
        for block in self.blocks:
            block.attn.cache = KVCache(batch_size, heads, self.total_length, head_dim, self.dtype, self.device)
            block.record = None

    def clear_cache(self) -> None:
        self.recording = False
        for block in self.blocks:
            block.attn.cache, block.record = None, None

    # -- forward ------------------------------------------------------------------------------------
    def scales_covered(self, first_scale: int, num_latents: int) -> int:
        """The scale after the last one a call covers: scale `first_scale` and what `num_latents` fill."""
        if not 0 <= first_scale < len(self.scale_sizes):
            raise VisarError(f"scale {first_scale} out of range: this VAR has scales 0..{len(self.scale_sizes) - 1}")
        end = self.scale_starts[first_scale] + (self.first_l if first_scale == 0 else 0) + num_latents
        if end not in self.scale_starts[first_scale + 1 :]:
            raise VisarError(
                f"{num_latents} latents from scale {first_scale} do not end at a scale boundary: scales have "
                f"{[pn * pn for pn in self.scale_sizes]} inputs"
            )
        return self.scale_starts.index(end)

    def embed_inputs(self, cond_embedding: Tensor, latents: Tensor | None, first_scale: int, end_scale: int):
        """[start token (scale 0) ; word_embed(latents)] + level and position embeddings [B, l, C]."""
        parts = []
        if first_scale == 0:
            parts.append(cond_embedding[:, None] + self.pos_start)
        if latents is not None and latents.shape[1]:
            parts.append(self.word_embed(latents.to(self.word_embed.weight.dtype)))
        x = torch.cat(parts, dim=1)
        begin, end = self.scale_starts[first_scale], self.scale_starts[end_scale]
        return x + self.lvl_embed(self.lvl_1L[0, begin:end]) + self.pos_1LC[:, begin:end]

    def visibility(self, first_scale: int, end_scale: int, cached: int) -> Tensor | None:
        """[l, cached + l] bool: cached keys are earlier scales (visible); new ones block-causally."""
        if end_scale - first_scale == 1:
            return None  # one scale: every key is of this scale or an earlier one
        begin, end = self.scale_starts[first_scale], self.scale_starts[end_scale]
        levels = self.lvl_1L[0, begin:end]
        new = levels[:, None] >= levels[None, :]
        return torch.cat([new.new_ones(len(levels), cached), new], dim=1)

    def forward(
        self,
        cond: Tensor,
        latents: Tensor | None = None,
        *,
        first_scale: int = 0,
        keep_fraction: float = 1.0,
        last_scale_only: bool = False,
    ) -> Tensor:
        """cond [B] class ids (num_classes = the null class); latents [B, l', z_channels] -> logits [B, l, V],
        or with last_scale_only those of the call's last scale [B, pn^2, V]."""
        cache = self.blocks[0].attn.cache
        if cache is None and first_scale != 0:
            raise VisarError("a VAR call without a KV cache must start at scale 0 (teacher forcing)")
        end_scale = self.scales_covered(first_scale, 0 if latents is None else latents.shape[1])
        cond_embedding = self.class_emb(cond)  # [B, D]
        x = self.embed_inputs(cond_embedding, latents, first_scale, end_scale)
        condition = cond_embedding
        if self.config.shared_aln:
            condition = self.shared_ada_lin(cond_embedding).view(cond.shape[0], 1, 6, -1)
        keep = self.tokens_kept(keep_fraction, x.shape[1], end_scale - first_scale, cache)
        visible = self.visibility(first_scale, end_scale, 0 if cache is None else cache.length)
        # A multi-scale call (CoDe's refiner prefill) records its last scale: block-causal attention
        # gives that scale's inputs what a one-scale call would, so the next scale can be pruned.
        last_scale = self.scale_sizes[end_scale - 1] ** 2
        record_last = last_scale if self.recording else 0
        # The outputs of earlier scales feed only later blocks' keys and values: the last block can
        # skip them (a prefill's attention and FFN work on those inputs, and its head). The last
        # scale sees every key, so that block needs no mask.
        outputs_from = x.shape[1] - last_scale if last_scale_only else 0
        for block in self.blocks[:-1]:
            x = block(x, condition, visible, keep, record_last=record_last)
        last_visible = None if outputs_from else visible
        x = self.blocks[-1](x, condition, last_visible, keep, record_last=record_last, outputs_from=outputs_from)
        return F.linear(self.head_nm(x, cond_embedding), self.head.weight.float(), self.head.bias.float())

    def tokens_kept(self, keep_fraction: float, length: int, num_scales: int, cache) -> int | None:
        """How many inputs go through the layers under pruning; None: all (no pruning)."""
        if not 0 < keep_fraction <= 1:
            raise VisarError(f"keep_fraction must be in (0, 1], got {keep_fraction}")
        keep = math.ceil(keep_fraction * length)
        if keep >= length:
            return None
        if cache is None or num_scales != 1:
            raise VisarError("token pruning (keep_fraction < 1) works on one scale at a time, with a KV cache")
        return keep
