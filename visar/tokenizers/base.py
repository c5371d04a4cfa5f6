"""The written interface of a discrete image tokenizer, as the pipeline and the decoding methods use it.

Methods that compare tokens by what they look like (GSD's groups, LANTERN's neighbours) read the
code vectors through `codebook()`; the pipeline decodes token grids to images through `decode`.
Next-scale methods build each scale's input through a `MultiScaleTokenizer` (VAR's VQVAE).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class TokenGridTokenizer(Protocol):
    """Token ids on a grid <-> images, through a codebook of V code vectors."""

    @property
    def vocab_size(self) -> int: ...

    def codebook(self) -> Tensor:
        """The code vectors [V, C] that token ids decode through."""
        ...

    def decode(self, codes: Tensor) -> Tensor:
        """codes [B, h, w] -> images [B, 3, H, W] in about [-1, 1]."""
        ...

    # Optional: `pixel_rounding`, "floor" where the model's own code truncates to 8-bit pixels (the
    # pipeline rounds otherwise).


@runtime_checkable
class MultiScaleTokenizer(Protocol):
    """A residual multi-scale tokenizer (VAR's VQVAE): an image is a sum of upsampled code maps, one
    token map [B, pn_k, pn_k] per scale, accumulated in a latent `f_hat` [B, C, H, W]; a next-scale
    model's input for scale k + 1 is `f_hat` after scales 0 .. k, resized to that scale."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def scale_sizes(self) -> tuple[int, ...]: ...

    @property
    def latent_dim(self) -> int: ...

    def codebook(self) -> Tensor: ...

    def empty_latent(self, batch_size: int, device: torch.device) -> Tensor:
        """f_hat before any scale."""
        ...

    def next_scale_input(self, f_hat: Tensor, tokens: Tensor, k: int) -> tuple[Tensor, Tensor | None]:
        """Add scale k's tokens [B, pn, pn] -> (f_hat, scale k + 1's latents [B, pn'^2, C], None after the last)."""
        ...

    def decode(self, scale_tokens: list[Tensor]) -> Tensor:
        """One token map per scale -> images [B, 3, H, W] in about [-1, 1]."""
        ...
