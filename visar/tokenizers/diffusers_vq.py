"""diffusers' `VQModel` (aMUSEd's VQ-GAN) behind visar's `TokenGridTokenizer` interface.

Codes decode as `AmusedPipeline` decodes them (`decode(codes, force_not_quantize=True, shape=...)`,
clipped to [0, 1]), and images come out in [-1, 1], as visar's tokenizers give them.
"""

from __future__ import annotations

from torch import Tensor, nn


class DiffusersVQTokenizer(nn.Module):
    def __init__(self, vq: nn.Module):
        super().__init__()
        self.vq = vq

    @property
    def vocab_size(self) -> int:
        return int(self.vq.config.num_vq_embeddings)

    def codebook(self) -> Tensor:
        return self.vq.quantize.embedding.weight

    def decode(self, codes: Tensor) -> Tensor:
        """codes [B, h, w] -> images [B, 3, H, W] in [-1, 1]."""
        batch, height, width = codes.shape
        codes = codes.to(self.codebook().device)
        shape = (batch, height, width, self.vq.config.latent_channels)
        images = self.vq.decode(codes, force_not_quantize=True, shape=shape).sample.clip(0, 1)
        return images.float() * 2 - 1
