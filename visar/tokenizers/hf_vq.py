"""A transformers VQ-VAE (Janus's `JanusVQVAE`) behind visar's `TokenGridTokenizer` interface.

Codes decode as transformers' `decode_image_tokens` does: the codebook entry (L2-normalised by
Janus's `get_codebook_entry`), `post_quant_conv`, the conv decoder; images come out in about
[-1, 1], as visar's tokenizers give them.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class HFVQTokenizer(nn.Module):
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
