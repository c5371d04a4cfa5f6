"""Lumina-mGPT 1.0 and 2.0 (Alpha-VLLM) as visar raster models, over transformers' Chameleon classes.

Papers: Liu et al. 2024, "Lumina-mGPT: Illuminate Flexible Photorealistic Text-to-Image Generation with
Multimodal Generative Pretraining" (Alpha-VLLM/Lumina-mGPT); Lumina-mGPT 2.0 (Alpha-VLLM/Lumina-mGPT-2.0,
trained from scratch). Both language models are the official code's copy of transformers-4.4x Chameleon;
transformers' `ChameleonForConditionalGeneration` holds them (visar/families/hf_lumina.py loads them).
Checked against the official vanilla `generate` on tiny random weights by tests/models/test_hf_lumina.py.

What differs from a plain raster model, and where it is handled:
- Image tokens are text-vocabulary ids: in 1.0 Chameleon's `IMGIMG...Z` tokens, whose VQ code is read
  from the token's name (transformers' `ChameleonImageVocabularyMapping`), in 2.0 155000 + code. Logits
  are `lm_head` over those rows, which is what the official constraint (only image ids inside a row)
  leaves of the vocabulary; the official CFG mixes raw logits before that constraint, the same thing.
- An end-of-line token follows every image row (the constraint forces it): `visar.models.row_ends`.
- The prompt ends with the image header `<racm3:break>`, the height and the width in 32-pixel grid
  units (`<reserved{8800 + n}>`), written by the prompt encoder (see the family module for why).
- The unconditional branch is the header alone, at positions from 0 (the official CFG processor runs
  `[<racm3:break>, H, W, generated...]` through its own cache).
- 2.0 schedules the guidance scale (`guidance_schedule`): its CFG processor sets
  g <- max(4, g * (1 - n / A)) at every step, n the tokens after `<racm3:break>` (header and row ends
  included) and A = (2 h) * (2 w) for a header of h x w grid units (2 tokens per unit per side, 1.0's
  count, where 2.0's tokenizer has 4: A is a quarter of the tokens), compounding from the user's
  scale; a scale of 1 turns guidance off as elsewhere.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .row_ends import RowEndAdapter

SCHEDULE_FLOOR = 4.0  # Lumina-mGPT 2.0's CFG processor never goes below this scale


def lumina2_guidance(scale: float, height: int, width: int, area: int) -> tuple[float, ...]:
    """The guidance scale 2.0's CFG processor uses for each image token (raster order) of an H x W grid,
    computed step by step in Python floats as the processor does (so the float32 scale is the same);
    area: the processor's A (see the module docstring)."""
    scales, g = [], scale
    for n in range(2, 2 + height * (width + 1)):  # steps from the first image token to the last row end
        g = max(SCHEDULE_FLOOR, g * (1 - n / area))
        if (n - 2) % (width + 1) != width:  # an image token (the other steps predict a row end)
            scales.append(g)
    return tuple(scales)


class HFLumina(RowEndAdapter):
    """`ChameleonForConditionalGeneration` (no VQ module) as Lumina-mGPT runs it.

    version: 1 or 2; grid_size: (H, W) tokens; grid_units: (h, w) of the header; visual_ids [V]: the id of
    code k; header_ids [3]: `<racm3:break>`, height, width (the unconditional prompt, left-padded to
    max_prompt_tokens).
    """

    def __init__(
        self,
        hf_model: nn.Module,
        *,
        version: int,
        max_prompt_tokens: int,
        grid_size: tuple[int, int],
        grid_units: tuple[int, int],
        visual_ids: Tensor,
        eol_token_id: int,
        header_ids: list[int],
    ):
        null_ids = torch.zeros(max_prompt_tokens, dtype=torch.long)
        null_ids[-len(header_ids) :] = torch.tensor(header_ids)
        null_mask = torch.zeros(max_prompt_tokens, dtype=torch.bool)
        null_mask[-len(header_ids) :] = True
        super().__init__(
            hf_model.lm_head,
            max_prompt_tokens=max_prompt_tokens,
            grid_size=grid_size,
            visual_ids=visual_ids,
            eol_token_id=eol_token_id,
            null_ids=null_ids,
            null_mask=null_mask,
        )
        self.hf = hf_model
        self.version = version
        self.header_ids = list(header_ids)
        self.grid_units = tuple(grid_units)
        self.schedule_tables: dict[tuple[float, str], Tensor] = {}  # (scale, device) -> 2.0's scales

    @property
    def decoder(self) -> nn.Module:
        return self.hf.model

    @property
    def guidance_schedule(self):
        """2.0's scale per image token (see the module docstring); None for 1.0 (a constant scale)."""
        return self.scheduled_guidance if self.version == 2 else None

    def scheduled_guidance(self, scale: float, image_index: Tensor) -> Tensor:
        """The user's scale -> 2.0's scale at each image index (any shape), float32 on its device."""
        key = (float(scale), str(image_index.device))
        if key not in self.schedule_tables:  # made once per scale and device, not uploaded every pass
            area = (2 * self.grid_units[0]) * (2 * self.grid_units[1])
            scales = lumina2_guidance(float(scale), *self.grid_size, area)
            self.schedule_tables[key] = torch.tensor(scales, dtype=torch.float32, device=image_index.device)
        table = self.schedule_tables[key]
        return table[image_index.clamp(max=len(table) - 1)]
