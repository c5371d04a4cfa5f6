"""aMUSEd's components behind visar's `MaskedModel` interface: diffusers' `UVit2DModel` with its CLIP text encoder.

aMUSEd (Patil et al. 2024, diffusers `AmusedPipeline`, deprecated in diffusers 0.42) conditions
its U-ViT on a CLIP text encoder's penultimate hidden states (cross-attention) and its pooled,
projected embedding plus micro-conditions (image size, crop, aesthetic score) through adaptive
norms. Here the condition is the prompt's CLIP token ids [B, T] (T = the tokenizer's
model_max_length, padded to it as aMUSEd pads; `ConditionLayout` kind "text", embed_dim 0) and
the null condition the load-time negative prompt's ids (AmusedPipeline's default: the empty
prompt), or those of a negative prompt given for one call (`negative_prompt`,
`visar.models.negative_prompt`); the model runs the text encoder itself, once per distinct batch of
ids (every step of a decode reuses it).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from .base import ConditionLayout
from .negative_prompt import NegativePrompt, holding


class ClipPromptIds:
    """Prompts -> CLIP token ids [B, T], padded and truncated to T as `AmusedPipeline` tokenizes, and an
    all-True mask (aMUSEd's text encoder sees every position). The pipeline's text encoder for aMUSEd."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.max_tokens = int(tokenizer.model_max_length)

    def ids(self, prompts: list[str]) -> Tensor:
        return self.tokenizer(
            prompts, return_tensors="pt", padding="max_length", truncation=True, max_length=self.max_tokens
        ).input_ids

    def encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        ids = self.ids(prompts)
        return ids, torch.ones_like(ids, dtype=torch.bool)

    def encode_negative(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """Negative prompts, tokenized as AmusedPipeline tokenizes `negative_prompt` (the empty one, its
        default, included)."""
        return self.encode(prompts)

    def to(self, *args, **kwargs) -> ClipPromptIds:
        return self

    def float(self) -> ClipPromptIds:
        return self

    def eval(self) -> ClipPromptIds:
        return self


class AmusedTransformer(nn.Module):
    """UVit2DModel + CLIPTextModelWithProjection: tokens [B, N] (mask id where unknown), prompt ids [B, T]
    -> logits [B, N, V] over the codebook (float32)."""

    model_kind: ClassVar[str] = "masked"

    def __init__(
        self,
        transformer: nn.Module,
        text_encoder: nn.Module,
        *,
        negative_ids: Tensor,
        mask_token_id: int,
        micro_conds: tuple[float, ...],
    ):
        super().__init__()
        self.transformer = transformer
        self.text_encoder = text_encoder
        self.register_buffer("negative_ids", negative_ids.reshape(-1).long(), persistent=False)
        self.mask_id = int(mask_token_id)
        # (width px, height px, crop top, crop left, aesthetic score): aMUSEd's micro-conditioning, in its order
        self.micro_conds = tuple(float(v) for v in micro_conds)
        self._encoded: tuple[Tensor, Tensor, Tensor] | None = None  # (ids, pooled, hidden) of the last call
        self.negative: NegativePrompt | None = None  # the negative prompt of the call under way, if it has one

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.transformer.parameters()).dtype

    @property
    def grid_size(self) -> tuple[int, int]:
        size = int(self.transformer.config.sample_size)
        return (size, size)

    @property
    def num_image_tokens(self) -> int:
        height, width = self.grid_size
        return height * width

    @property
    def vocab_size(self) -> int:
        return int(self.transformer.config.codebook_size)

    @property
    def mask_token_id(self) -> int:
        return self.mask_id

    @property
    def condition_layout(self) -> ConditionLayout:
        return ConditionLayout("text", len(self.negative_ids))

    def null_condition(self, cond: Tensor) -> Tensor:
        """The negative prompt's ids [B, T]: the call's (`negative_prompt`), else the load-time one."""
        if self.negative is not None:
            return self.negative.condition(cond)
        return self.negative_ids.to(cond.device).expand(cond.shape[0], -1)

    def null_condition_mask(self, cond_mask: Tensor | None) -> Tensor | None:
        return cond_mask  # CLIP sees every position, padding included, as aMUSEd runs it

    def negative_prompt(self, cond: Tensor, mask: Tensor):
        """A block in which the unconditional branch is this negative prompt: CLIP ids [B, T] padded as
        prompts are (mask [B, T], all True: the text encoder sees every position)."""
        return holding(self, cond, mask)

    def encode_prompts(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """ids [B, T] -> (pooled projected embedding [B, P], penultimate hidden states [B, T, D]), as
        AmusedPipeline encodes; the last batch's result is kept, so a decode encodes its prompts once."""
        cached, ids = self._encoded, ids.to(self.device)
        if cached is None or cached[0].device != ids.device or cached[0].shape != ids.shape:
            cached = None
        if cached is None or cached[1].dtype != self.dtype or not torch.equal(cached[0], ids):
            out = self.text_encoder(ids, return_dict=True, output_hidden_states=True)
            cached = self._encoded = (ids.clone(), out.text_embeds, out.hidden_states[-2])
        return cached[1], cached[2]

    def forward(self, tokens: Tensor, cond: Tensor, cond_mask: Tensor | None = None) -> Tensor:
        pooled, hidden = self.encode_prompts(cond)
        height, width = self.grid_size
        micro_conds = torch.tensor(self.micro_conds, device=hidden.device, dtype=hidden.dtype)
        logits = self.transformer(
            tokens.reshape(-1, height, width),
            micro_conds=micro_conds.expand(tokens.shape[0], -1),
            pooled_text_emb=pooled,
            encoder_hidden_states=hidden,
        )  # [B, V, H, W]
        return logits.flatten(2).transpose(1, 2).float()  # [B, N, V]
