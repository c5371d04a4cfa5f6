"""MAR: masked autoregression over continuous tokens with a diffusion head (Li et al. 2024).

Checked against LTH14/mar @ fe470ac (`models/mar.py`, `models/diffloss.py`, `diffusion/`)
through tests/fixtures/mar: identical state_dict keys (a strict load of `model_ema`), encoder,
decoder and diffusion-head outputs, schedules and seeded samples. Official MAR builds its blocks
from timm's ViT `Block`; timm is not a dependency here: `Block` below keeps timm's key names and
math (pre-norm, fused qkv with bias, SDPA, exact GELU), so official files load into it.

The model implements `ContinuousTokenModel` (visar.models.base); the sampling loop is a decoding
method (visar.accel.continuous.mar), written once against that interface.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..configs import config_from_dict
from .base import BlockReuse, ConditionLayout
from .diffusion import DiffusionSchedule


@dataclass(frozen=True)
class MARConfig:
    """The official `MAR(...)` constructor arguments (training-only ones are kept so that official
    argument dicts load unchanged; they do not change the weights or the sampling)."""

    img_size: int = 256
    vae_stride: int = 16
    patch_size: int = 1
    encoder_embed_dim: int = 1024
    encoder_depth: int = 16
    encoder_num_heads: int = 16
    decoder_embed_dim: int = 1024
    decoder_depth: int = 16
    decoder_num_heads: int = 16
    mlp_ratio: float = 4.0
    vae_embed_dim: int = 16
    mask_ratio_min: float = 0.7
    label_drop_prob: float = 0.1
    class_num: int = 1000
    attn_dropout: float = 0.1
    proj_dropout: float = 0.1
    buffer_size: int = 64
    diffloss_d: int = 3
    diffloss_w: int = 1024
    num_sampling_steps: str = "100"
    diffusion_batch_mul: int = 4
    grad_checkpointing: bool = False
    norm_eps: float = 1e-6  # the official factories' partial(nn.LayerNorm, eps=1e-6)

    @classmethod
    def from_dict(cls, args: dict) -> MARConfig:
        return config_from_dict(
            cls,
            args,
            "MAR model_args",
            convert={"num_sampling_steps": str},
            known_as="known (the official constructor's)",
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def seq_side(self) -> int:
        return self.img_size // self.vae_stride // self.patch_size

    @property
    def token_dim(self) -> int:
        return self.vae_embed_dim * self.patch_size**2


# The official factories (mar_base / mar_large / mar_huge) and the diffusion MLPs of the releases.
MAR_SIZES = {
    "base": dict(encoder_embed_dim=768, encoder_depth=12, encoder_num_heads=12, diffloss_d=6, diffloss_w=1024),
    "large": dict(encoder_embed_dim=1024, encoder_depth=16, encoder_num_heads=16, diffloss_d=8, diffloss_w=1280),
    "huge": dict(encoder_embed_dim=1280, encoder_depth=20, encoder_num_heads=16, diffloss_d=12, diffloss_w=1536),
}


def preset_config(size: str, **overrides) -> MARConfig:
    enc = MAR_SIZES[size]
    width, depth, heads = enc["encoder_embed_dim"], enc["encoder_depth"], enc["encoder_num_heads"]
    args = dict(enc, decoder_embed_dim=width, decoder_depth=depth, decoder_num_heads=heads, img_size=256, vae_stride=16)
    return MARConfig(**{**args, **overrides})


# -- transformer (timm ViT Block layout) ---------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor, key_valid: Tensor | None = None, query_index: Tensor | None = None) -> Tensor:
        """x [B, S, D]; key_valid [B, S] bool (None: all); query_index [B, R]: compute only these rows."""
        batch, length, dim = x.shape
        qkv = self.qkv(x).reshape(batch, length, 3, self.num_heads, dim // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # [B, H, S, d]
        if query_index is not None:
            q = q.gather(2, query_index[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3]))
        mask = None if key_valid is None else key_valid[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(batch, q.shape[2], dim))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """timm's ViT Block at inference: x + attn(LN(x)), then + mlp(LN(x))."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, eps: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x: Tensor, key_valid: Tensor | None = None) -> Tensor:
        x = x + self.attn(self.norm1(x), key_valid)
        return x + self.mlp(self.norm2(x))

    def forward_rows(self, x: Tensor, rows: Tensor, key_valid: Tensor | None = None) -> Tensor:
        """The block's output at rows [B, R] only (every token still serves as a key): [B, R, D]."""
        x_rows = x.gather(1, rows[..., None].expand(-1, -1, x.shape[-1]))
        x_rows = x_rows + self.attn(self.norm1(x), key_valid, query_index=rows)
        return x_rows + self.mlp(self.norm2(x_rows))


def run_blocks(blocks, x: Tensor, key_valid, positions: Tensor, reuse: BlockReuse | None, name: str) -> Tensor:
    """Apply blocks; with `reuse`, a block runs only for the tokens the policy says changed and the
    others take their output from its record (LazyMAR's token reuse)."""
    for index, block in enumerate(blocks):
        if reuse is None:
            x = block(x, key_valid)
            continue
        key = f"{name}.{index}"
        recompute = reuse.recompute(key, x, positions)  # [B, S] bool
        if bool(recompute.all()):
            out = block(x, key_valid)
        else:
            out = reuse.reused_output(key, x, positions)
            count = int(recompute.sum(1).max())
            if count:
                # Equal row counts keep shapes static: rows with fewer changed tokens recompute extra ones.
                rows = torch.argsort(recompute.float(), dim=1, descending=True, stable=True)[:, :count]
                fresh = block.forward_rows(x, rows, key_valid)
                out = out.scatter(1, rows[..., None].expand(-1, -1, x.shape[-1]), fresh)
        reuse.store(key, positions, x, out)
        x = out
    return x


# -- diffusion head (SimpleMLPAdaLN) -------------------------------------------------------------


def timestep_embedding(t: Tensor, dim: int = 256, max_period: float = 10000.0) -> Tensor:
    """Sinusoidal embedding, cos first then sin (upstream's order)."""
    half = dim // 2
    freqs = torch.exp(-torch.log(torch.tensor(max_period)) * torch.arange(half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs.to(t.device)[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TimestepEmbedder(nn.Module):
    def __init__(self, width: int, frequency_dim: int = 256):
        super().__init__()
        self.frequency_dim = frequency_dim
        self.mlp = nn.Sequential(nn.Linear(frequency_dim, width), nn.SiLU(), nn.Linear(width, width))

    def forward(self, t: Tensor) -> Tensor:
        return self.mlp(timestep_embedding(t, self.frequency_dim).to(self.mlp[0].weight.dtype))


class ResBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.in_ln = nn.LayerNorm(width, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 3 * width))

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        shift, scale, gate = self.adaLN_modulation(y).chunk(3, dim=-1)
        return x + gate * self.mlp(self.in_ln(x) * (1 + scale) + shift)


class FinalLayer(nn.Module):
    def __init__(self, width: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(width, out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 2 * width))

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        shift, scale = self.adaLN_modulation(y).chunk(2, dim=-1)
        return self.linear(self.norm_final(x) * (1 + scale) + shift)


class DiffusionMLP(nn.Module):
    """MAR's SimpleMLPAdaLN: predicts [eps | v] (2C channels) for a noisy token, its timestep and z."""

    def __init__(self, channels: int, width: int, z_channels: int, depth: int):
        super().__init__()
        self.channels = channels
        self.time_embed = TimestepEmbedder(width)
        self.cond_embed = nn.Linear(z_channels, width)
        self.input_proj = nn.Linear(channels, width)
        self.res_blocks = nn.ModuleList(ResBlock(width) for _ in range(depth))
        self.final_layer = FinalLayer(width, 2 * channels)

    def forward(self, x: Tensor, t: Tensor, c: Tensor) -> Tensor:
        return self.forward_embedded(x, self.time_embed(t) + self.cond_embed(c))

    def forward_embedded(self, x: Tensor, y: Tensor) -> Tensor:
        """The head given y = time_embed(t) + cond_embed(c) [N, width]."""
        x = self.input_proj(x)
        for block in self.res_blocks:
            x = block(x, y)
        return self.final_layer(x, y)

    def forward_with_cfg(self, x: Tensor, t: Tensor, c: Tensor, cfg_scale: float) -> Tensor:
        """Upstream's guided call (for the fixtures): the first half of x for both halves of c; eps
        guided, v per half."""
        half = x[: len(x) // 2]
        out = self.forward(torch.cat([half, half]), t, c)
        eps, rest = out[:, : self.channels], out[:, self.channels :]
        cond_eps, uncond_eps = eps.chunk(2)
        guided = uncond_eps + cfg_scale * (cond_eps - uncond_eps)
        return torch.cat([torch.cat([guided, guided]), rest], dim=1)


class DiffLoss(nn.Module):
    """Holds the head as `net`, so that keys read `diffloss.net.*` as upstream."""

    def __init__(self, channels: int, z_channels: int, depth: int, width: int):
        super().__init__()
        self.net = DiffusionMLP(channels, width, z_channels, depth)


# -- the model -----------------------------------------------------------------------------------


class MAR(nn.Module):
    """MAR's MAE-style encoder/decoder over [buffer | tokens] and its diffusion head."""

    model_kind = "continuous"

    def __init__(self, config: MARConfig):
        super().__init__()
        self.config = config
        c = config
        enc, dec = c.encoder_embed_dim, c.decoder_embed_dim
        self.seq_len = c.seq_side**2
        self.class_emb = nn.Embedding(c.class_num, enc)
        self.fake_latent = nn.Parameter(torch.zeros(1, enc))
        self.z_proj = nn.Linear(c.token_dim, enc)
        self.z_proj_ln = nn.LayerNorm(enc, eps=1e-6)
        self.encoder_pos_embed_learned = nn.Parameter(torch.zeros(1, self.seq_len + c.buffer_size, enc))
        self.encoder_blocks = nn.ModuleList(
            Block(enc, c.encoder_num_heads, c.mlp_ratio, c.norm_eps) for _ in range(c.encoder_depth)
        )
        self.encoder_norm = nn.LayerNorm(enc, eps=c.norm_eps)
        self.decoder_embed = nn.Linear(enc, dec)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dec))
        self.decoder_pos_embed_learned = nn.Parameter(torch.zeros(1, self.seq_len + c.buffer_size, dec))
        self.decoder_blocks = nn.ModuleList(
            Block(dec, c.decoder_num_heads, c.mlp_ratio, c.norm_eps) for _ in range(c.decoder_depth)
        )
        self.decoder_norm = nn.LayerNorm(dec, eps=c.norm_eps)
        self.diffusion_pos_embed_learned = nn.Parameter(torch.zeros(1, self.seq_len, dec))
        self.diffloss = DiffLoss(c.token_dim, dec, c.diffloss_d, c.diffloss_w)
        self._schedules: dict[int, DiffusionSchedule] = {}

    # -- ContinuousTokenModel --------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.fake_latent.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fake_latent.dtype

    @property
    def grid_size(self) -> tuple[int, int]:
        return (self.config.seq_side, self.config.seq_side)

    @property
    def num_image_tokens(self) -> int:
        return self.seq_len

    @property
    def token_dim(self) -> int:
        return self.config.token_dim

    @property
    def condition_layout(self) -> ConditionLayout:
        return ConditionLayout("class", self.config.buffer_size, num_classes=self.config.class_num)

    @property
    def num_sampling_steps(self) -> int:
        """The head's reverse steps at the config's respacing ("100", or "ddim25": 25 steps)."""
        return self.diffusion_schedule().num_steps

    def embed_condition(self, cond: Tensor) -> Tensor:
        return self.class_emb(cond)

    def null_embedding(self, batch_size: int) -> Tensor:
        return self.fake_latent.expand(batch_size, -1)

    def diffusion_schedule(self, num_steps: int | None = None) -> DiffusionSchedule:
        # the config's respacing string as upstream reads it; an int respaces evenly to that many
        steps = self.config.num_sampling_steps if num_steps is None else int(num_steps)
        if steps not in self._schedules:
            self._schedules[steps] = DiffusionSchedule.cosine(steps)
        return self._schedules[steps]

    def diffusion_head(self, x: Tensor, timesteps: Tensor, z: Tensor) -> Tensor:
        return self.diffloss.net(x.to(self.dtype), timesteps, z.to(self.dtype)).float()

    def diffusion_chain(self, z: Tensor, timesteps: Tensor) -> Callable[[Tensor, int], Tensor]:
        # A token's chain calls the head once per step with the same z: the timestep and condition
        # embeddings (a sixth of a small head call) are computed once here, not at every call.
        net = self.diffloss.net
        times = net.time_embed(timesteps)  # [T, width]
        cond = net.cond_embed(z.to(self.dtype))  # [N, width]

        def head(x: Tensor, i: int) -> Tensor:
            return net.forward_embedded(x.to(self.dtype), times[i] + cond).float()

        return head

    def condition_features(
        self, tokens: Tensor, visible: Tensor, cond_embedding: Tensor, reuse: BlockReuse | None = None
    ) -> Tensor:
        counts = visible.sum(1)
        if bool((counts != counts[0]).any()):
            # Rows that see different numbers of tokens run in groups of equal count: no padding, so
            # a row's numbers do not depend on the rest of the batch.
            z = None
            for count in counts.unique().tolist():
                rows = (counts == count).nonzero().squeeze(1)
                part = self.condition_features(tokens[rows], visible[rows], cond_embedding[rows])
                z = part.new_zeros(tokens.shape[0], *part.shape[1:]) if z is None else z
                z[rows] = part
            return z
        mask = (~visible.bool()).to(tokens.dtype)
        x = self.forward_mae_encoder(tokens, mask, cond_embedding, reuse)
        return self.forward_mae_decoder(x, mask, reuse)

    # -- upstream's two halves ---------------------------------------------------------------
    def kept_positions(self, mask: Tensor) -> tuple[Tensor, Tensor | None]:
        """mask [B, L] float (1 = masked) -> positions [B, K] of the buffer and the visible tokens in
        order, K the largest count in the batch, and key_valid [B, K] (None when all rows are full)."""
        buffer = torch.zeros(mask.shape[0], self.config.buffer_size, device=mask.device)
        kept = torch.cat([buffer, mask], dim=1) == 0  # [B, buffer + L]
        counts = kept.sum(1)
        width = int(counts.max())
        positions = torch.argsort((~kept).float(), dim=1, stable=True)[:, :width]
        if bool((counts == width).all()):
            return positions, None
        return positions, torch.arange(width, device=mask.device)[None] < counts[:, None]

    def forward_mae_encoder(
        self, tokens: Tensor, mask: Tensor, class_embedding: Tensor, reuse: BlockReuse | None = None
    ) -> Tensor:
        """tokens [B, L, C], mask [B, L] (1 = masked), class_embedding [B, D] -> [B, K, D] over the
        buffer and the visible tokens (rows with fewer visible tokens are padded)."""
        x = self.z_proj(tokens.to(self.dtype))
        batch, _, dim = x.shape
        buffer = class_embedding.to(x.dtype)[:, None, :].expand(batch, self.config.buffer_size, dim)
        x = self.z_proj_ln(torch.cat([buffer, x], dim=1) + self.encoder_pos_embed_learned)
        positions, key_valid = self.kept_positions(mask)
        x = x.gather(1, positions[..., None].expand(-1, -1, dim))
        x = run_blocks(self.encoder_blocks, x, key_valid, positions, None, "encoder")
        return self.encoder_norm(x)

    def forward_mae_decoder(self, x: Tensor, mask: Tensor, reuse: BlockReuse | None = None) -> Tensor:
        """Encoder output [B, K, D] -> the diffusion condition z [B, L, Dz] of every position."""
        x = self.decoder_embed(x)
        positions, key_valid = self.kept_positions(mask)
        batch, dim = x.shape[0], x.shape[-1]
        full = self.mask_token.to(x.dtype).expand(batch, self.seq_len + self.config.buffer_size, dim)
        if key_valid is not None:  # padding rows go to a scratch slot past the end
            positions = torch.where(key_valid, positions, full.shape[1])
            full = torch.cat([full, full[:, :1]], dim=1)
        full = full.scatter(1, positions[..., None].expand(-1, -1, dim), x)[:, : self.seq_len + self.config.buffer_size]
        x = full + self.decoder_pos_embed_learned
        every = torch.arange(x.shape[1], device=x.device).expand(batch, -1)
        x = run_blocks(self.decoder_blocks, x, None, every, reuse, "decoder")
        x = self.decoder_norm(x)[:, self.config.buffer_size :]
        return x + self.diffusion_pos_embed_learned

    def patchify(self, latent: Tensor) -> Tensor:
        """[B, C, H, W] -> [B, h * w, C * p^2], channels outermost inside a patch."""
        b, c, h, w = latent.shape
        p = self.config.patch_size
        x = latent.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(b, (h // p) * (w // p), c * p * p)

    def unpatchify(self, tokens: Tensor) -> Tensor:
        b = tokens.shape[0]
        p, c, side = self.config.patch_size, self.config.vae_embed_dim, self.config.seq_side
        x = tokens.reshape(b, side, side, c, p, p).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(b, c, side * p, side * p)
