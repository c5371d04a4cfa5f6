"""VAR's multi-scale VQVAE: conv encoder, one codebook shared by every scale, residual Phi convs, conv decoder.

Checked against FoundationVision/VAR @ 78b9539 (`models/vqvae.py`, `models/quant.py`,
`models/basic_vae.py`) through tests/fixtures/var/tiny_vqvae.*: identical keys, codes, f_hat
and decoded images.

An image is the sum over scales k of Phi_k(upsample(codebook[tokens_k])), accumulated at the last
scale's size in `f_hat`; scale k + 1 of a next-scale model reads `f_hat` area-downsampled to its
size. Token maps go up with bicubic interpolation and down with 'area', as upstream. The official
VQVAE hard-codes the encoder/decoder base width and channel multipliers; here they are `ch` and
`ch_mult` in the config, so the fixtures (ch 32, ch_mult (2, 1)) load into the same class.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..configs import config_from_dict
from ..errors import VisarError

SCALES_256 = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)  # the 256 px releases: 680 tokens
SCALES_512 = (1, 2, 3, 4, 6, 9, 13, 18, 24, 32)  # VAR-d36 at 512 px: 2240 tokens


@dataclass(frozen=True)
class MSVQConfig:
    """The official `VQVAE` constructor arguments plus what it hard-codes (ch_mult, num_res_blocks)."""

    vocab_size: int = 4096
    z_channels: int = 32
    ch: int = 160
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    num_res_blocks: int = 2
    dropout: float = 0.0
    beta: float = 0.25  # training only
    using_znorm: bool = False
    quant_conv_ks: int = 3
    quant_resi: float = 0.5  # Phi(h) = (1 - quant_resi) h + quant_resi conv(h)
    share_quant_resi: int = 4  # 0: one Phi per scale, 1: one for all, n: n shared along the schedule
    default_qresi_counts: int = 0
    v_patch_nums: tuple[int, ...] = SCALES_256
    using_sa: bool = True
    using_mid_sa: bool = True
    test_mode: bool = True  # upstream's flag (eval mode, frozen); accepted and ignored

    @classmethod
    def from_dict(cls, args: dict) -> MSVQConfig:
        return config_from_dict(
            cls,
            args,
            "VAR VQVAE vq_args",
            renamed={"encoder_decoder_ch_mult": "ch_mult"},  # the fixtures' name for ch_mult
            convert={"ch_mult": tuple, "v_patch_nums": tuple},
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)


MSVQ_PRESETS = {
    "vae_ch160v4096z32": MSVQConfig(),
    "vae_ch160v4096z32-512": MSVQConfig(v_patch_nums=SCALES_512),
}


# -- the conv autoencoder (VAR's basic_vae: taming / latent-diffusion layout) -------------------------


def group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, dropout: float):
        super().__init__()
        self.norm1 = group_norm(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.norm2 = group_norm(out_channels)
        self.dropout = nn.Dropout(dropout) if dropout > 1e-6 else nn.Identity()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        # A 1x1 shortcut only where the width changes (no key otherwise, as upstream).
        self.nin_shortcut = nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        return self.nin_shortcut(x) + h


class AttnBlock(nn.Module):
    """Single-head self-attention over pixels; one 1x1 conv makes q, k and v."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = group_norm(channels)
        self.qkv = nn.Conv2d(channels, 3 * channels, 1)
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        batch, channels, height, width = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(batch, 3, channels, height * width).unbind(1)  # [B, C, HW]
        weights = torch.bmm(q.transpose(1, 2), k).mul_(channels**-0.5).softmax(dim=2)  # [B, HW(q), HW(k)]
        h = torch.bmm(v, weights.transpose(1, 2)).reshape(batch, channels, height, width)
        return x + self.proj_out(h)


def attention_or_identity(channels: int, enabled: bool) -> nn.Module:
    return AttnBlock(channels) if enabled else nn.Identity()


class Downsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=0)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))  # pad right and bottom only


class Upsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.interpolate(x, scale_factor=2, mode="nearest"))


class Level(nn.Module):
    """One resolution level: res blocks, attention after each at the lowest resolution, a resampler."""

    def __init__(self, blocks: list[nn.Module], attn: list[nn.Module], resample: nn.Module | None, name: str):
        super().__init__()
        self.block = nn.ModuleList(blocks)
        self.attn = nn.ModuleList(attn)
        self.resample_name = name if resample is not None else None  # upstream's key: downsample / upsample
        if resample is not None:
            self.add_module(name, resample)

    @property
    def resample(self) -> nn.Module | None:
        return getattr(self, self.resample_name) if self.resample_name else None

    def run_blocks(self, h: Tensor) -> Tensor:
        for i, block in enumerate(self.block):
            h = block(h)
            if len(self.attn):
                h = self.attn[i](h)
        return h


class Middle(nn.Module):
    def __init__(self, channels: int, dropout: float, attention: bool):
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels, dropout)
        self.attn_1 = attention_or_identity(channels, attention)
        self.block_2 = ResnetBlock(channels, channels, dropout)

    def forward(self, h: Tensor) -> Tensor:
        return self.block_2(self.attn_1(self.block_1(h)))


class Encoder(nn.Module):
    def __init__(self, config: MSVQConfig):
        super().__init__()
        ch, mult, levels = config.ch, config.ch_mult, len(config.ch_mult)
        self.conv_in = nn.Conv2d(3, ch, 3, padding=1)
        self.down = nn.ModuleList()
        width = ch
        for level in range(levels):
            out, lowest = ch * mult[level], level == levels - 1
            blocks, attn = [], []
            for _ in range(config.num_res_blocks):
                blocks.append(ResnetBlock(width, out, config.dropout))
                width = out
                if lowest and config.using_sa:
                    attn.append(AttnBlock(width))
            self.down.append(Level(blocks, attn, None if lowest else Downsample(width), "downsample"))
        self.mid = Middle(width, config.dropout, config.using_mid_sa)
        self.norm_out = group_norm(width)
        self.conv_out = nn.Conv2d(width, config.z_channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv_in(x)
        for level in self.down:
            h = level.run_blocks(h)
            if level.resample is not None:
                h = level.resample(h)
        return self.conv_out(F.silu(self.norm_out(self.mid(h))))


class Decoder(nn.Module):
    def __init__(self, config: MSVQConfig):
        super().__init__()
        ch, mult, levels = config.ch, config.ch_mult, len(config.ch_mult)
        width = ch * mult[-1]
        self.conv_in = nn.Conv2d(config.z_channels, width, 3, padding=1)
        self.mid = Middle(width, config.dropout, config.using_mid_sa)
        up = []
        for level in reversed(range(levels)):  # lowest resolution first; stored highest first (up.0)
            out, lowest = ch * mult[level], level == levels - 1
            blocks, attn = [], []
            for _ in range(config.num_res_blocks + 1):
                blocks.append(ResnetBlock(width, out, config.dropout))
                width = out
                if lowest and config.using_sa:
                    attn.append(AttnBlock(width))
            up.insert(0, Level(blocks, attn, Upsample(width) if level != 0 else None, "upsample"))
        self.up = nn.ModuleList(up)
        self.norm_out = group_norm(width)
        self.conv_out = nn.Conv2d(width, 3, 3, padding=1)

    def forward(self, z: Tensor) -> Tensor:
        h = self.mid(self.conv_in(z))
        for level in reversed(self.up):
            h = level.run_blocks(h)
            if level.resample is not None:
                h = level.resample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


# -- the multi-scale residual quantiser ---------------------------------------------------------------


class Phi(nn.Conv2d):
    """The residual conv after upsampling a scale's code map: (1 - r) h + r conv3x3(h)."""

    def __init__(self, channels: int, ratio: float):
        super().__init__(channels, channels, 3, padding=1)
        self.ratio = abs(ratio)

    def forward(self, h: Tensor) -> Tensor:
        return h * (1 - self.ratio) + super().forward(h) * self.ratio


def phi_ticks(count: int) -> np.ndarray:
    """Where along the schedule (0 = first scale, 1 = last) each of `count` Phi convs sits (upstream's
    numpy linspace, float64: exact ties between two ticks occur and must resolve as upstream's)."""
    if count == 4:
        return np.linspace(1 / 3 / count, 1 - 1 / 3 / count, count)
    return np.linspace(1 / 2 / count, 1 - 1 / 2 / count, count)


def phi_index_per_scale(num_phis: int, num_scales: int) -> list[int]:
    """The Phi each scale uses: the nearest tick to k / (S - 1), first index on a tie."""
    ticks = phi_ticks(num_phis)
    return [int(np.argmin(np.abs(ticks - k / (num_scales - 1)))) for k in range(num_scales)]


class PhiList(nn.Module):
    """The Phi convs under the key layout of upstream's sharing mode (1: `qresi`, n > 1: `qresi_ls.i`,
    0: `i`), and which one each scale uses."""

    def __init__(self, config: MSVQConfig):
        super().__init__()
        num_scales, share = len(config.v_patch_nums), config.share_quant_resi

        def make():
            return Phi(config.z_channels, config.quant_resi) if abs(config.quant_resi) > 1e-6 else nn.Identity()

        if share == 1:
            self.qresi = make()
            self.phis, self.index = [self.qresi], [0] * num_scales
            return
        count = share if share > 1 else (config.default_qresi_counts or num_scales)
        phis = nn.ModuleList([make() for _ in range(count)])
        if share > 1:
            self.qresi_ls = phis
        else:
            for i, phi in enumerate(phis):
                self.add_module(str(i), phi)
        self.phis, self.index = list(phis), phi_index_per_scale(count, num_scales)

    def at_scale(self, k: int) -> nn.Module:
        return self.phis[self.index[k]]


class MultiScaleQuantizer(nn.Module):
    """Upstream's `VectorQuantizer2` at inference: the shared codebook, the Phi convs, the scale schedule."""

    def __init__(self, config: MSVQConfig):
        super().__init__()
        self.scale_sizes = tuple(config.v_patch_nums)
        self.quant_resi = PhiList(config)
        # Training statistics, kept so official files load strictly; never read here.
        self.register_buffer("ema_vocab_hit_SV", torch.zeros(len(self.scale_sizes), config.vocab_size))
        self.embedding = nn.Embedding(config.vocab_size, config.z_channels)

    def code_map(self, tokens: Tensor) -> Tensor:
        """tokens [B, h, w] -> raw code vectors [B, C, h, w] (no normalisation)."""
        return self.embedding(tokens).permute(0, 3, 1, 2)

    def residual(self, tokens: Tensor, k: int) -> Tensor:
        """What scale k's tokens [B, pn, pn] add to f_hat: Phi_k(bicubic upsample to the last size)."""
        side = self.scale_sizes[-1]
        h = self.code_map(tokens).float()
        if k < len(self.scale_sizes) - 1:
            h = F.interpolate(h, size=(side, side), mode="bicubic")
        return self.quant_resi.at_scale(k)(h)

    def scale_input(self, f_hat: Tensor, k: int) -> Tensor:
        """f_hat [B, C, H, W] area-downsampled to scale k -> a next-scale model's input latents [B, pn^2, C]."""
        side = self.scale_sizes[k]
        return F.interpolate(f_hat, size=(side, side), mode="area").flatten(2).transpose(1, 2)

    def nearest_codes(self, latents: Tensor) -> Tensor:
        """[N, C] -> the codebook rows nearest in squared L2 distance [N]."""
        codebook = self.embedding.weight
        distances = latents.square().sum(1, keepdim=True) + codebook.square().sum(1)
        distances = distances.addmm(latents, codebook.T, alpha=-2, beta=1)
        return distances.argmin(dim=1)


class MultiScaleVQVAE(nn.Module):
    """VAR's tokenizer: image <-> a list of token maps [B, pn, pn], one per scale (`MultiScaleTokenizer`)."""

    def __init__(self, config: MSVQConfig):
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        self.quantize = MultiScaleQuantizer(config)
        pad = config.quant_conv_ks // 2
        self.quant_conv = nn.Conv2d(config.z_channels, config.z_channels, config.quant_conv_ks, padding=pad)
        self.post_quant_conv = nn.Conv2d(config.z_channels, config.z_channels, config.quant_conv_ks, padding=pad)

    # -- the interface ------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def scale_sizes(self) -> tuple[int, ...]:
        return self.quantize.scale_sizes

    @property
    def latent_dim(self) -> int:
        return self.config.z_channels

    def codebook(self) -> Tensor:
        return self.quantize.embedding.weight

    def empty_latent(self, batch_size: int, device) -> Tensor:
        """f_hat before any scale: zeros [B, C, H, W] at the last scale's size."""
        side = self.scale_sizes[-1]
        return torch.zeros(batch_size, self.latent_dim, side, side, device=device)

    def next_scale_input(self, f_hat: Tensor, tokens: Tensor, k: int) -> tuple[Tensor, Tensor | None]:
        """Add scale k's tokens [B, pn, pn] to f_hat -> (f_hat, the latents of scale k + 1 [B, pn'^2, C],
        None after the last scale)."""
        f_hat = f_hat + self.quantize.residual(tokens, k)
        last = k == len(self.scale_sizes) - 1
        return f_hat, None if last else self.quantize.scale_input(f_hat, k + 1)

    def decode(self, scale_tokens: list[Tensor]) -> Tensor:
        """One token map per scale ([B, pn, pn] each) -> images [B, 3, H, W] in [-1, 1]."""
        return self.decode_latent(self.accumulate(scale_tokens)[-1])

    # -- the rest of upstream's VQVAE ---------------------------------------------------------------
    def accumulate(self, scale_tokens: list[Tensor]) -> list[Tensor]:
        """f_hat after each scale [B, C, H, W] (upstream's embed_to_fhat, all to the max scale)."""
        self.check_scales(scale_tokens)
        f_hat = self.empty_latent(scale_tokens[0].shape[0], scale_tokens[0].device)
        out = []
        for k, tokens in enumerate(scale_tokens):
            f_hat = f_hat + self.quantize.residual(tokens, k)
            out.append(f_hat)
        return out

    def decode_latent(self, f_hat: Tensor) -> Tensor:
        """f_hat [B, C, H, W] -> images in [-1, 1] (clamped, as upstream's fhat_to_img)."""
        return self.decoder(self.post_quant_conv(f_hat)).clamp(-1, 1)

    def pre_quant(self, images: Tensor) -> Tensor:
        """images [B, 3, H, W] in [-1, 1] -> the continuous latents before quantisation [B, C, h, w]
        (what `encode` quantises; visar.eval.bench pools them into its Frechet features)."""
        return self.quant_conv(self.encoder(images))

    def encode(self, images: Tensor) -> list[Tensor]:
        """images [B, 3, H, W] in [-1, 1] -> token maps [B, pn, pn] per scale (residual quantisation:
        each scale codes what the earlier ones left, area-downsampled)."""
        f_rest = self.pre_quant(images).float()
        batch, side = f_rest.shape[0], self.scale_sizes[-1]
        if f_rest.shape[-1] != side:
            raise VisarError(
                f"images of {images.shape[-1]} px give {f_rest.shape[-1]}-token maps; this VQVAE's "
                f"last scale is {side} (images of {side * self.config.downsample} px)"
            )
        scale_tokens = []
        for k, pn in enumerate(self.scale_sizes):
            last = k == len(self.scale_sizes) - 1
            latents = f_rest.flatten(2).transpose(1, 2) if last else self.quantize.scale_input(f_rest, k)
            tokens = self.quantize.nearest_codes(latents.reshape(-1, self.latent_dim)).reshape(batch, pn, pn)
            f_rest = f_rest - self.quantize.residual(tokens, k)
            scale_tokens.append(tokens)
        return scale_tokens

    def teacher_forcing_inputs(self, scale_tokens: list[Tensor]) -> Tensor:
        """The inputs of scales 1 .. S - 1 given every scale's tokens: [B, L - 1, C] (upstream's
        idxBl_to_var_input); scale 0's input is the model's start token."""
        self.check_scales(scale_tokens)
        f_hat = self.empty_latent(scale_tokens[0].shape[0], scale_tokens[0].device)
        inputs = []
        for k, tokens in enumerate(scale_tokens[:-1]):
            f_hat, latents = self.next_scale_input(f_hat, tokens, k)
            inputs.append(latents)
        return torch.cat(inputs, dim=1)

    def check_scales(self, scale_tokens: list[Tensor]):
        sides = tuple(t.shape[-1] for t in scale_tokens)
        if sides != self.scale_sizes[: len(sides)] or not sides:
            raise VisarError(
                f"token maps of sides {list(sides)} do not follow this VQVAE's scales {list(self.scale_sizes)}"
            )


def fit_training_statistics(state: dict[str, Tensor], tokenizer: MultiScaleVQVAE) -> dict[str, Tensor]:
    """Upstream's loader replaces the VQVAE's training statistics (`quantize.ema_vocab_hit_SV`, one row
    per scale) when a file was trained with another number of scales; so do we. Never read here."""
    key = "quantize.ema_vocab_hit_SV"
    expected = tokenizer.quantize.ema_vocab_hit_SV
    if key in state and state[key].shape != expected.shape and state[key].shape[1:] == expected.shape[1:]:
        state = {**state, key: torch.zeros(expected.shape)}
    return state
