"""A small MaskGIT-style masked image-token transformer (bidirectional, class-conditional).

Sequence layout: [class token | N = H * W image tokens in raster order], learned absolute
position embeddings, pre-norm blocks with full (bidirectional) attention, one output head over
the V codes. Input ids 0 .. V - 1 are codes and V is the mask id; class ids 0 .. C - 1 are the
classes and C is the null class of classifier-free guidance (trained by class dropout). This is
MaskGIT's bidirectional transformer (google-research/maskgit `libml/transformer` style) at the
size of visar's tiny raster models; it implements `visar.models.base.MaskedModel`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..configs import config_from_dict
from .base import ConditionLayout


@dataclass(frozen=True)
class MaskGITConfig:
    dim: int = 128
    n_layer: int = 3
    n_head: int = 4
    mlp_ratio: float = 4.0
    vocab_size: int = 512  # codes; the mask id is vocab_size
    num_classes: int = 40  # the null class is num_classes
    grid_size: int = 16  # H = W
    class_dropout_prob: float = 0.1  # training only: the null class instead of the label
    dropout_p: float = 0.0

    @classmethod
    def from_dict(cls, args: dict) -> MaskGITConfig:
        return config_from_dict(cls, args, "MaskGIT model_args")

    def to_dict(self) -> dict:
        return asdict(self)


class Block(nn.Module):
    def __init__(self, config: MaskGITConfig):
        super().__init__()
        self.n_head = config.n_head
        self.attention_norm = nn.LayerNorm(config.dim)
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.proj = nn.Linear(config.dim, config.dim)
        self.ffn_norm = nn.LayerNorm(config.dim)
        hidden = int(config.dim * config.mlp_ratio)
        self.ffn = nn.Sequential(nn.Linear(config.dim, hidden), nn.GELU(), nn.Linear(hidden, config.dim))
        self.dropout = nn.Dropout(config.dropout_p)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).split(dim, dim=-1)
        q, k, v = (t.view(batch, length, self.n_head, dim // self.n_head).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v)  # no mask: every position sees every position
        x = x + self.dropout(self.proj(attended.transpose(1, 2).reshape(batch, length, dim)))
        return x + self.dropout(self.ffn(self.ffn_norm(x)))


class MaskGIT(nn.Module):
    """tokens [B, N] (mask id V where unknown), class ids [B] -> logits [B, N, V] (float32)."""

    model_kind: ClassVar[str] = "masked"

    def __init__(self, config: MaskGITConfig):
        super().__init__()
        self.config = config
        num_tokens = config.grid_size**2
        self.tok_embeddings = nn.Embedding(config.vocab_size + 1, config.dim)
        self.class_embeddings = nn.Embedding(config.num_classes + 1, config.dim)
        self.pos_embeddings = nn.Parameter(torch.zeros(1, num_tokens + 1, config.dim))
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = nn.LayerNorm(config.dim)
        self.output = nn.Linear(config.dim, config.vocab_size)

    # -- the MaskedModel interface ----------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.output.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.output.weight.dtype

    @property
    def grid_size(self) -> tuple[int, int]:
        return (self.config.grid_size, self.config.grid_size)

    @property
    def num_image_tokens(self) -> int:
        return self.config.grid_size**2

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def mask_token_id(self) -> int:
        return self.config.vocab_size

    @property
    def condition_layout(self) -> ConditionLayout:
        return ConditionLayout("class", 1, num_classes=self.config.num_classes)

    def null_condition(self, cond: Tensor) -> Tensor:
        return torch.full_like(cond, self.config.num_classes)

    def null_condition_mask(self, cond_mask: Tensor | None) -> Tensor | None:
        return cond_mask

    def forward(self, tokens: Tensor, cond: Tensor, cond_mask: Tensor | None = None) -> Tensor:
        if self.training and self.config.class_dropout_prob > 0:
            drop = torch.rand(cond.shape, device=cond.device) < self.config.class_dropout_prob
            cond = torch.where(drop, self.config.num_classes, cond)
        x = torch.cat([self.class_embeddings(cond)[:, None], self.tok_embeddings(tokens)], 1)  # [B, 1 + N, D]
        x = x + self.pos_embeddings
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x[:, 1:])).float()  # [B, N, V]


def init_maskgit(model: MaskGIT, std: float = 0.02):
    """BERT-style init: N(0, std) for linear, embedding and position weights,
    zero biases, a zero output head (every code equally likely at the start)."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
    nn.init.normal_(model.pos_embeddings, std=std)
    nn.init.zeros_(model.output.weight)
    nn.init.zeros_(model.output.bias)


def masking_ratio(uniform: Tensor) -> Tensor:
    """MaskGIT's training mask ratio: cos(pi / 2 * u) for u ~ U[0, 1), the same cosine as its schedule."""
    return torch.cos(math.pi / 2 * uniform)
