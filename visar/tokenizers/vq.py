"""LlamaGen's VQ image tokenizer (VQ-16 / VQ-8): conv encoder, L2-normalised codebook, conv decoder.

Checked against FoundationVision/LlamaGen @ ce98ec4 (`tokenizer/tokenizer_image/vq_model.py`)
through tests/fixtures/llamagen/tiny_vq.*: identical keys, codes and decoded images.

Pixel range is LlamaGen's: images in [-1, 1], decoder output not clamped. The official VQModel
hard-codes the encoder/decoder base width to 128; here it is `ch` in the config, so that the
fixtures (ch 32) and visar's own small tokenizers load into the same class.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..configs import config_from_dict


@dataclass(frozen=True)
class VQConfig:
    """LlamaGen's tokenizer `ModelArgs` plus `ch` and `num_res_blocks` (hard-coded upstream)."""

    codebook_size: int = 16384
    codebook_embed_dim: int = 8
    codebook_l2_norm: bool = True
    codebook_show_usage: bool = True
    commit_loss_beta: float = 0.25
    entropy_loss_ratio: float = 0.0
    encoder_ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    decoder_ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    z_channels: int = 256
    dropout_p: float = 0.0
    ch: int = 128
    num_res_blocks: int = 2

    @classmethod
    def from_dict(cls, args: dict) -> VQConfig:
        return config_from_dict(
            cls,
            args,
            "VQ vq_args",
            renamed={"encoder_decoder_ch": "ch"},  # the fixtures' name for `ch`
            convert={"encoder_ch_mult": tuple, "decoder_ch_mult": tuple},
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.encoder_ch_mult) - 1)


VQ_PRESETS = {
    "VQ-16": VQConfig(encoder_ch_mult=(1, 1, 2, 2, 4), decoder_ch_mult=(1, 1, 2, 2, 4)),
    "VQ-8": VQConfig(encoder_ch_mult=(1, 2, 2, 4), decoder_ch_mult=(1, 2, 2, 4)),
}


def group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, dropout: float):
        super().__init__()
        self.norm1 = group_norm(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.norm2 = group_norm(out_channels)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        if in_channels != out_channels:
            self.nin_shortcut = nn.Conv2d(in_channels, out_channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        shortcut = self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x
        return shortcut + h


class AttnBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.norm = group_norm(channels)
        self.q = nn.Conv2d(channels, channels, 1)
        self.k = nn.Conv2d(channels, channels, 1)
        self.v = nn.Conv2d(channels, channels, 1)
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(x)
        b, c, hh, ww = x.shape
        q = self.q(h).reshape(b, c, hh * ww).transpose(1, 2)  # [B, HW, C]
        k = self.k(h).reshape(b, c, hh * ww)  # [B, C, HW]
        v = self.v(h).reshape(b, c, hh * ww)
        attn = torch.softmax(torch.bmm(q, k) * c**-0.5, dim=2)  # [B, HW(query), HW(key)]
        out = torch.bmm(v, attn.transpose(1, 2)).reshape(b, c, hh, ww)
        return x + self.proj_out(out)


class Downsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=0)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class ConvLevel(nn.Module):
    """One resolution level: res blocks, attention after each (lowest level only), resampling."""

    def __init__(self, in_ch: int, out_ch: int, n_res: int, attn: bool, resample: nn.Module | None, dropout: float):
        super().__init__()
        self.res = nn.ModuleList(ResnetBlock(in_ch if i == 0 else out_ch, out_ch, dropout) for i in range(n_res))
        if attn:
            self.attn = nn.ModuleList(AttnBlock(out_ch) for _ in range(n_res))
        if resample is not None:
            setattr(self, "downsample" if isinstance(resample, Downsample) else "upsample", resample)

    def forward(self, x: Tensor) -> Tensor:
        for i, block in enumerate(self.res):
            x = block(x)
            if hasattr(self, "attn"):
                x = self.attn[i](x)
        if hasattr(self, "downsample"):
            x = self.downsample(x)
        if hasattr(self, "upsample"):
            x = self.upsample(x)
        return x


class Encoder(nn.Module):
    def __init__(self, ch: int, ch_mult: tuple[int, ...], num_res_blocks: int, z_channels: int, dropout: float):
        super().__init__()
        self.conv_in = nn.Conv2d(3, ch, 3, padding=1)
        in_mult = (1, *ch_mult)
        n = len(ch_mult)
        self.conv_blocks = nn.ModuleList()
        for level in range(n):
            block_in, block_out = ch * in_mult[level], ch * ch_mult[level]
            last = level == n - 1
            down = None if last else Downsample(block_out)
            self.conv_blocks.append(ConvLevel(block_in, block_out, num_res_blocks, last, down, dropout))
        block_in = ch * ch_mult[-1]
        self.mid = nn.Sequential(
            ResnetBlock(block_in, block_in, dropout), AttnBlock(block_in), ResnetBlock(block_in, block_in, dropout)
        )
        self.norm_out = group_norm(block_in)
        self.conv_out = nn.Conv2d(block_in, z_channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv_in(x)
        for level in self.conv_blocks:
            h = level(h)
        h = self.mid(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(nn.Module):
    """Note the key order: `conv_blocks.0` is the LOWEST resolution level (VAR/MAR are reversed)."""

    def __init__(self, ch: int, ch_mult: tuple[int, ...], num_res_blocks: int, z_channels: int, dropout: float):
        super().__init__()
        n = len(ch_mult)
        block_in = ch * ch_mult[-1]
        self.conv_in = nn.Conv2d(z_channels, block_in, 3, padding=1)
        self.mid = nn.Sequential(
            ResnetBlock(block_in, block_in, dropout), AttnBlock(block_in), ResnetBlock(block_in, block_in, dropout)
        )
        self.conv_blocks = nn.ModuleList()
        for level in range(n):
            block_out = ch * ch_mult[n - level - 1]
            up = None if level == n - 1 else Upsample(block_out)
            self.conv_blocks.append(ConvLevel(block_in, block_out, num_res_blocks + 1, level == 0, up, dropout))
            block_in = block_out
        self.norm_out = group_norm(block_in)
        self.conv_out = nn.Conv2d(block_in, 3, 3, padding=1)

    def forward(self, z: Tensor) -> Tensor:
        h = self.mid(self.conv_in(z))
        for level in self.conv_blocks:
            h = level(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class VectorQuantizer(nn.Module):
    def __init__(self, config: VQConfig):
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.codebook_size, config.codebook_embed_dim)
        self.embedding.weight.data.uniform_(-1.0 / config.codebook_size, 1.0 / config.codebook_size)
        if config.codebook_l2_norm:
            self.embedding.weight.data = F.normalize(self.embedding.weight.data, p=2, dim=-1)
        if config.codebook_show_usage:
            # Official training bookkeeping (a ring of recent code ids); kept for strict loading.
            self.register_buffer("codebook_used", torch.zeros(65536))

    def codebook(self) -> Tensor:
        """The code vectors actually used for lookup [V, C] (L2-normalised when configured)."""
        weight = self.embedding.weight
        return F.normalize(weight, p=2, dim=-1) if self.config.codebook_l2_norm else weight

    def nearest_codes(self, z: Tensor) -> Tensor:
        """z [B, C, h, w] -> code ids [B, h, w]: arg-min squared distance to the codebook."""
        z = z.permute(0, 2, 3, 1)
        if self.config.codebook_l2_norm:
            z = F.normalize(z, p=2, dim=-1)
        flat = z.reshape(-1, z.shape[-1])
        book = self.codebook()
        dist = flat.pow(2).sum(1, keepdim=True) + book.pow(2).sum(1) - 2 * flat @ book.t()
        return dist.argmin(dim=1).view(z.shape[:-1])

    def lookup(self, codes: Tensor) -> Tensor:
        """codes [B, h, w] -> code vectors [B, C, h, w]."""
        return self.codebook()[codes].permute(0, 3, 1, 2)

    def forward(self, z: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """Quantise with the straight-through estimator; returns (z_q, codes, losses)."""
        codes = self.nearest_codes(z)
        z_q = self.lookup(codes)
        z_n = F.normalize(z, p=2, dim=1) if self.config.codebook_l2_norm else z
        losses = {
            "codebook": F.mse_loss(z_q, z_n.detach()),
            "commit": self.config.commit_loss_beta * F.mse_loss(z_q.detach(), z_n),
        }
        return z_n + (z_q - z_n).detach(), codes, losses


class VQModel(nn.Module):
    """LlamaGen's VQ tokenizer; implements `visar.tokenizers.base.TokenGridTokenizer`."""

    def __init__(self, config: VQConfig):
        super().__init__()
        self.config = config
        self.encoder = Encoder(
            config.ch, config.encoder_ch_mult, config.num_res_blocks, config.z_channels, config.dropout_p
        )
        self.decoder = Decoder(
            config.ch, config.decoder_ch_mult, config.num_res_blocks, config.z_channels, config.dropout_p
        )
        self.quantize = VectorQuantizer(config)
        self.quant_conv = nn.Conv2d(config.z_channels, config.codebook_embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(config.codebook_embed_dim, config.z_channels, 1)

    @property
    def vocab_size(self) -> int:
        return self.config.codebook_size

    @property
    def downsample(self) -> int:
        return self.config.downsample

    def codebook(self) -> Tensor:
        """The code vectors [V, C] that token ids decode through."""
        return self.quantize.codebook()

    def pre_quant(self, images: Tensor) -> Tensor:
        return self.quant_conv(self.encoder(images))

    def encode(self, images: Tensor) -> Tensor:
        """images [B, 3, H, W] in [-1, 1] -> codes [B, H/ds, W/ds] (int64)."""
        return self.quantize.nearest_codes(self.pre_quant(images))

    def decode_latents(self, z_q: Tensor) -> Tensor:
        return self.decoder(self.post_quant_conv(z_q))

    def decode(self, codes: Tensor) -> Tensor:
        """codes [B, h, w] -> images [B, 3, h*ds, w*ds] in about [-1, 1] (not clamped)."""
        return self.decode_latents(self.quantize.lookup(codes))

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """Training pass: (reconstruction, codes, quantiser losses)."""
        z_q, codes, losses = self.quantize(self.pre_quant(images))
        return self.decode_latents(z_q), codes, losses
