"""taming-transformers VQGAN checkpoints (Chameleon's VQGAN, SBER-MoVQGAN) in diffusers' `VQModel`.

Lumina-mGPT 1.0 decodes with Meta's Chameleon VQGAN (taming's `VQModel`: group norms, 16x), 2.0 with
MoVQGAN 270M (the same encoder, a decoder whose norms are modulated by the quantized latent: diffusers'
`norm_type="spatial"`, 8x). Both are diffusers' `VQModel` once the checkpoint's keys are renamed
(`diffusers_state_dict`): visar keeps no decoder of its own. Codes decode as the official
`decode_code` does (codebook entry -> post_quant_conv -> decoder, the decoder also reading the entry
under spatial norms), images in about [-1, 1] as visar's tokenizers give them.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from .diffusers_vq import DiffusersVQTokenizer


def vq_model_config(ddconfig: dict, n_embed: int, embed_dim: int, spatial: bool) -> dict:
    """A taming `ddconfig` (ch, ch_mult, num_res_blocks, attn_resolutions, resolution, z_channels, ...)
    and the quantizer's size -> diffusers `VQModel` arguments."""
    levels = len(ddconfig["ch_mult"])
    attention = [ddconfig["resolution"] // 2**i in ddconfig["attn_resolutions"] for i in range(levels)]
    return dict(
        in_channels=ddconfig.get("in_channels", 3),
        out_channels=ddconfig.get("out_ch", 3),
        down_block_types=tuple("AttnDownEncoderBlock2D" if a else "DownEncoderBlock2D" for a in attention),
        up_block_types=tuple("AttnUpDecoderBlock2D" if a else "UpDecoderBlock2D" for a in reversed(attention)),
        block_out_channels=tuple(ddconfig["ch"] * m for m in ddconfig["ch_mult"]),
        layers_per_block=ddconfig["num_res_blocks"],
        latent_channels=ddconfig["z_channels"],
        sample_size=ddconfig["resolution"],
        num_vq_embeddings=n_embed,
        vq_embed_dim=embed_dim,
        norm_num_groups=32,  # taming's Normalize
        norm_type="spatial" if spatial else "group",
        mid_block_add_attention=True,
        lookup_from_codebook=True,
    )


ATTENTION_PARTS = {"q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}


UP_PARTS = {"block": "resnets", "attn": "attentions", "upsample": "upsamplers.0"}


def up_block(match: re.Match, levels: int) -> str:
    return f"up_blocks.{levels - 1 - int(match[1])}.{UP_PARTS[match[2]]}."


def rename(key: str, levels: int, spatial: bool) -> str:
    """One taming key -> diffusers' (see `diffusers_state_dict`)."""
    side, rest = key.split(".", 1) if key.startswith(("encoder.", "decoder.")) else ("", key)
    if not side:
        return key  # quant_conv, post_quant_conv, quantize.embedding
    norm = "spatial_norm" if spatial and side == "decoder" else "group_norm"
    rest = re.sub(r"^norm_out\.", "conv_norm_out.", rest)
    rest = re.sub(r"^mid\.block_(\d)\.", lambda m: f"mid_block.resnets.{int(m[1]) - 1}.", rest)
    rest = re.sub(r"^mid\.attn_1\.", "mid_block.attentions.0.", rest)
    rest = re.sub(r"^down\.(\d+)\.block\.", r"down_blocks.\1.resnets.", rest)
    rest = re.sub(r"^down\.(\d+)\.attn\.", r"down_blocks.\1.attentions.", rest)
    rest = re.sub(r"^down\.(\d+)\.downsample\.", r"down_blocks.\1.downsamplers.0.", rest)
    # taming numbers decoder levels from the lowest resolution's end, diffusers in the order they run
    rest = re.sub(r"^up\.(\d+)\.(block|attn|upsample)\.", lambda m: up_block(m, levels), rest)
    if ".attentions." in rest:
        rest = re.sub(r"\.norm\.", f".{norm}.", rest)
        rest = re.sub(r"\.(q|k|v|proj_out)\.", lambda m: f".{ATTENTION_PARTS[m[1]]}.", rest)
    rest = re.sub(r"\.nin_shortcut\.", ".conv_shortcut.", rest)
    return f"{side}.{rest}"


def diffusers_state_dict(state: dict[str, Tensor], levels: int, spatial: bool) -> dict[str, Tensor]:
    """A taming VQGAN state dict -> diffusers `VQModel`'s: keys renamed, attention's 1x1 convolutions
    as linear weights; the training loss's keys (discriminator, perceptual net) are left out."""
    out = {}
    for key, value in state.items():
        if key.startswith("loss."):
            continue
        new = rename(key, levels, spatial)
        if re.search(r"\.attentions\.\d+\.to_(q|k|v|out\.0)\.weight$", new) and value.dim() == 4:
            value = value[:, :, 0, 0]
        out[new] = value
    return out


class TamingVQTokenizer(DiffusersVQTokenizer):
    """A diffusers `VQModel` holding a taming VQGAN, behind visar's `TokenGridTokenizer` interface: decoded
    as the official code decodes (no clipping; aMUSEd's `DiffusersVQTokenizer` clips to its [0, 1] output).
    pixel_rounding: how the model's own code makes 8-bit pixels ("round", or "floor": Lumina-mGPT 1.0's
    `astype(uint8)` after scaling, which truncates)."""

    def __init__(self, vq, pixel_rounding: str = "round"):
        super().__init__(vq)
        self.pixel_rounding = pixel_rounding

    @property
    def downsampling(self) -> int:
        """Pixels per token side."""
        return 2 ** (len(self.vq.config.block_out_channels) - 1)

    def decode(self, codes: Tensor) -> Tensor:
        """codes [B, h, w] -> images [B, 3, H, W] in about [-1, 1]."""
        batch, height, width = codes.shape
        codes = codes.to(self.codebook().device)
        shape = (batch, height, width, self.codebook().shape[1])
        return self.vq.decode(codes.reshape(batch, -1), force_not_quantize=True, shape=shape).sample.float()

    @torch.no_grad()
    def encode(self, images: Tensor) -> Tensor:
        """images [B, 3, H, W] in [-1, 1] -> codes [B, h, w] (the nearest codebook entry)."""
        latents = self.vq.encode(images.to(self.codebook())).latents
        _, _, (_, _, indices) = self.vq.quantize(latents)
        return indices.reshape(latents.shape[0], latents.shape[2], latents.shape[3])
