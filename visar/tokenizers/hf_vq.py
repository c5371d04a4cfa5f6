"""transformers VQ-VAEs (Janus's `JanusVQVAE`, Emu3's `Emu3VQVAE`) behind visar's `TokenGridTokenizer` interface.

Codes decode as each model's own image decoding does, and images come out in about [-1, 1], as
visar's tokenizers give them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class HFVQTokenizer(nn.Module):
    """Janus: the codebook entry (L2-normalised by `get_codebook_entry`), `post_quant_conv`, the conv
    decoder (transformers' `decode_image_tokens`); its images are already in [-1, 1]."""

    def __init__(self, vq: nn.Module):
        super().__init__()
        self.vq = vq

    @property
    def vocab_size(self) -> int:
        return self.vq.quantize.num_embeddings

    def codebook(self) -> Tensor:
        """The code vectors [V, C] the decoder reads: the L2-normalised embeddings (`get_codebook_entry`)."""
        return F.normalize(self.vq.quantize.embedding.weight, p=2, dim=-1)

    def decode(self, codes: Tensor) -> Tensor:
        """codes [B, h, w] -> images [B, 3, H, W] in about [-1, 1]."""
        weight = self.vq.quantize.embedding.weight
        return self.vq.decode(codes.reshape(codes.shape[0], -1).to(weight.device)).float()


class Emu3VQTokenizer(nn.Module):
    """Emu3: the raw codebook entries, `post_quant_conv` and the spatially normalised decoder
    (`Emu3VQVAE.decode`, a one-frame video); its images are normalised by the image processor's
    mean and std, which `decode` undoes (as `Emu3ImageProcessor.postprocess`) before mapping to [-1, 1]."""

    def __init__(self, vq: nn.Module, image_mean, image_std):
        super().__init__()
        self.vq = vq
        self.register_buffer("image_mean", torch.tensor(image_mean, dtype=torch.float32).reshape(1, 3, 1, 1))
        self.register_buffer("image_std", torch.tensor(image_std, dtype=torch.float32).reshape(1, 3, 1, 1))

    @property
    def vocab_size(self) -> int:
        return self.vq.quantize.embedding.num_embeddings

    def codebook(self) -> Tensor:
        return self.vq.quantize.embedding.weight

    def decode(self, codes: Tensor) -> Tensor:
        """codes [B, h, w] -> images [B, 3, H, W] in about [-1, 1]."""
        images = self.vq.decode(codes.to(self.image_mean.device)).float()
        return (images * self.image_std + self.image_mean) * 2 - 1
