"""MAR's KL-regularised VAE (KL-16): continuous latents, no codebook.

Checked against LTH14/mar @ fe470ac (`models/vae.py`) through tests/fixtures/mar/tiny_vae_kl.*:
identical keys, posterior and decoded images. The official class hard-codes the base width (128)
and resolution (256); here they are config fields, so that the fixtures (32, 32) load too.
diffusers' `AutoencoderKL` computes the same network, but under other key names and module
order, so loading official files into it would need a key map; the blocks are LlamaGen's VQ
blocks (visar.tokenizers.vq), which are the same taming-transformers code.

MAR models latents scaled by `scale_factor` (0.2325): `decode(tokens)` divides by it first.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from ..configs import config_from_dict
from .vq import AttnBlock, Downsample, ResnetBlock, Upsample, group_norm


@dataclass(frozen=True)
class KLConfig:
    """The official `AutoencoderKL(embed_dim, ch_mult, use_variational)` plus what it hard-codes."""

    embed_dim: int = 16
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    use_variational: bool = True
    ch: int = 128
    resolution: int = 256
    num_res_blocks: int = 2
    attn_resolutions: tuple[int, ...] = (16,)  # the encoder's; the decoder attends only in the middle
    scale_factor: float = 0.2325  # MAR's latent scale

    @classmethod
    def from_dict(cls, args: dict) -> KLConfig:
        return config_from_dict(
            cls,
            args,
            "KL VAE vae_args",
            renamed={"encoder_decoder_ch": "ch", "encoder_decoder_resolution": "resolution"},  # the fixtures' names
            convert={"ch_mult": tuple, "attn_resolutions": tuple},
        )

    def to_dict(self) -> dict:
        return asdict(self)


KL16 = KLConfig()


class Encoder(nn.Module):
    def __init__(self, c: KLConfig):
        super().__init__()
        self.conv_in = nn.Conv2d(3, c.ch, 3, padding=1)
        self.down = nn.ModuleList()
        block_in, resolution = c.ch, c.resolution
        for level, mult in enumerate(c.ch_mult):
            down = nn.Module()
            down.block, down.attn = nn.ModuleList(), nn.ModuleList()
            for _ in range(c.num_res_blocks):
                down.block.append(ResnetBlock(block_in, c.ch * mult, 0.0))
                block_in = c.ch * mult
                if resolution in c.attn_resolutions:
                    down.attn.append(AttnBlock(block_in))
            if level != len(c.ch_mult) - 1:
                down.downsample = Downsample(block_in)
                resolution //= 2
            self.down.append(down)
        self.mid = nn.Module()
        self.mid.block_1 = ResnetBlock(block_in, block_in, 0.0)
        self.mid.attn_1 = AttnBlock(block_in)
        self.mid.block_2 = ResnetBlock(block_in, block_in, 0.0)
        self.norm_out = group_norm(block_in)
        self.conv_out = nn.Conv2d(block_in, 2 * c.embed_dim, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv_in(x)
        for down in self.down:
            for i, block in enumerate(down.block):
                h = block(h)
                if len(down.attn):
                    h = down.attn[i](h)
            if hasattr(down, "downsample"):
                h = down.downsample(h)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        return self.conv_out(torch.nn.functional.silu(self.norm_out(h)))


class Decoder(nn.Module):
    def __init__(self, c: KLConfig):
        super().__init__()
        block_in = c.ch * c.ch_mult[-1]
        self.conv_in = nn.Conv2d(c.embed_dim, block_in, 3, padding=1)
        self.mid = nn.Module()
        self.mid.block_1 = ResnetBlock(block_in, block_in, 0.0)
        self.mid.attn_1 = AttnBlock(block_in)
        self.mid.block_2 = ResnetBlock(block_in, block_in, 0.0)
        levels = []
        for level in reversed(range(len(c.ch_mult))):
            up = nn.Module()
            up.block, up.attn = nn.ModuleList(), nn.ModuleList()  # no decoder attention in KL-16
            for _ in range(c.num_res_blocks + 1):
                up.block.append(ResnetBlock(block_in, c.ch * c.ch_mult[level], 0.0))
                block_in = c.ch * c.ch_mult[level]
            if level != 0:
                up.upsample = Upsample(block_in)
            levels.insert(0, up)  # up.0 is the highest resolution, as upstream
        self.up = nn.ModuleList(levels)
        self.norm_out = group_norm(block_in)
        self.conv_out = nn.Conv2d(block_in, 3, 3, padding=1)

    def forward(self, z: Tensor) -> Tensor:
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(self.conv_in(z))))
        for up in reversed(self.up):
            for block in up.block:
                h = block(h)
            if hasattr(up, "upsample"):
                h = up.upsample(h)
        return self.conv_out(torch.nn.functional.silu(self.norm_out(h)))


@dataclass
class Posterior:
    mean: Tensor
    logvar: Tensor

    @property
    def std(self) -> Tensor:
        return torch.exp(0.5 * self.logvar)


class AutoencoderKL(nn.Module):
    """Images in [-1, 1] <-> latents [B, embed_dim, H / 2^(levels-1), W / 2^(levels-1)]."""

    def __init__(self, config: KLConfig):
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        moments = 2 if config.use_variational else 1
        self.quant_conv = nn.Conv2d(2 * config.embed_dim, moments * config.embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(config.embed_dim, config.embed_dim, 1)

    @property
    def latent_dim(self) -> int:
        return self.config.embed_dim

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.config.ch_mult) - 1)

    def encode(self, images: Tensor) -> Posterior:
        moments = self.quant_conv(self.encoder(images))
        if not self.config.use_variational:
            return Posterior(moments, torch.ones_like(moments))  # upstream pads the moments with ones
        mean, logvar = moments.chunk(2, dim=1)
        return Posterior(mean, logvar.clamp(-30.0, 20.0))

    def pre_quant(self, images: Tensor) -> Tensor:
        """The posterior mean (unscaled): the latent an image is encoded to, as the VQ tokenizers'
        pre-quantisation latents (visar.eval.bench pools them into Frechet features)."""
        return self.encode(images).mean

    def decode_latent(self, latent: Tensor) -> Tensor:
        """Unscaled latents [B, E, h, w] -> images [B, 3, H, W] in about [-1, 1]."""
        return self.decoder(self.post_quant_conv(latent))

    def decode(self, tokens: Tensor) -> Tensor:
        """MAR's scaled latents [B, E, h, w] (GenerationOutput.tokens) -> images in about [-1, 1]."""
        return self.decode_latent(tokens.to(self.post_quant_conv.weight.dtype) / self.config.scale_factor)
