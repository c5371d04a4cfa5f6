"""What `Pipeline.generate` returns, per kind of model: a method's tokens and stats["commit_pass"] in
the shape of the model's kind.

Models implement their interface (`visar.models.base`) structurally, with no base class to inherit
a default from, so this is a function per kind rather than a model member: a new family of a kind
needs nothing, a new kind adds its entry to `OUTPUT_MAPS`.
"""

from __future__ import annotations

from torch import Tensor

from .base import ContinuousTokenModel, MaskedModel, NextScaleModel, RasterModel, model_kind


def grid_maps(model: RasterModel | MaskedModel, tokens: Tensor, commit_pass: Tensor) -> tuple[Tensor, Tensor]:
    """Token ids and commit passes [B, N] -> both as [B, h, w] grids."""
    return tokens.reshape(len(tokens), *model.grid_size), commit_pass.reshape(len(commit_pass), *model.grid_size)


def latent_maps(model: ContinuousTokenModel, tokens: Tensor, commit_pass: Tensor) -> tuple[Tensor, Tensor]:
    """Float tokens [B, L, C] -> the latent the VAE decodes; commit passes [B, L] -> a [B, h, w] grid."""
    return model.unpatchify(tokens), commit_pass.reshape(len(commit_pass), *model.grid_size)


def scale_maps(
    model: NextScaleModel, tokens: list[Tensor], commit_pass: list[Tensor]
) -> tuple[list[Tensor], list[Tensor]]:
    """Token ids and commit passes as they come: already one [B, pn, pn] map per scale."""
    return tokens, commit_pass


OUTPUT_MAPS = {"raster": grid_maps, "masked": grid_maps, "continuous": latent_maps, "next-scale": scale_maps}


def output_maps(model, tokens, commit_pass):
    """A decoding method's tokens and stats["commit_pass"] -> (`GenerationOutput.tokens`, the
    commit_pass it reports): per image, in the shape of the model's kind."""
    return OUTPUT_MAPS[model_kind(model)](model, tokens, commit_pass)
