"""Janus / Janus-Pro image generation (transformers' `JanusForConditionalGeneration`) as a visar raster model.

Paper: Chen et al. 2025, "Janus-Pro: Unified Multimodal Understanding and Generation with Data and
Model Scaling" (deepseek-ai/Janus). Checked against transformers 5.24
`models/janus/modeling_janus.py::JanusForConditionalGeneration.generate(generation_mode="image")`
by tests/models/test_hf_janus.py: same greedy image tokens, same teacher-forced logits.

The pieces image generation uses, as transformers' `generate` does:
- the prompt (chat template + `<begin_of_image>`, left-padded) is embedded with the language
  model's text embeddings; image tokens with `generation_embeddings` then `generation_aligner`;
- the Llama decoder (`model.language_model`) runs over both; `generation_head` (not `lm_head`)
  turns a hidden state into logits over the VQ codebook;
- CFG: the unconditional prompt is the prompt with every token but BOS and `<begin_of_image>`
  replaced by the pad token, with the same attention mask; guidance mixes
  uncond + scale * (cond - uncond) (transformers' ClassifierFreeGuidanceLogitsProcessor), which is
  visar's `cfg_mix`;
- the VQ (`model.vqmodel`) decodes token grids; it lives in the tokenizer
  (`visar.tokenizers.hf_vq.HFVQTokenizer`), not in this module, so it stays in float32.
The vision encoder (SigLIP) and `lm_head` are for understanding and are never called here.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .hf_raster import HFRasterAdapter


def split_vq(hf_model: nn.Module) -> nn.Module:
    """Take the VQ out of a `JanusForConditionalGeneration` (for the tokenizer) and return it."""
    vq = hf_model.model.vqmodel
    hf_model.model.vqmodel = None
    return vq


class HFJanus(HFRasterAdapter):
    """`JanusForConditionalGeneration` (its VQ removed) behind the `RasterModel` interface.

    bos_token_id, pad_token_id and boi_token_id are the generation config's (what transformers'
    image generation reads to build the unconditional prompt).
    """

    def __init__(
        self, hf_model: nn.Module, *, max_prompt_tokens: int, bos_token_id: int, pad_token_id: int, boi_token_id: int
    ):
        super().__init__(max_prompt_tokens)
        self.hf = hf_model
        self.bos_token_id, self.pad_token_id, self.boi_token_id = bos_token_id, pad_token_id, boi_token_id
        config = hf_model.config
        self._num_image_tokens = config.vision_config.num_image_tokens
        self._vocab_size = config.vq_config.num_embeddings
        side = math.isqrt(self._num_image_tokens)
        self._grid_size = (side, side)

    @property
    def decoder(self) -> nn.Module:
        return self.hf.model.language_model

    @property
    def grid_size(self) -> tuple[int, int]:
        return self._grid_size

    @property
    def num_image_tokens(self) -> int:
        return self._num_image_tokens

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def default_null_condition(self, cond: Tensor) -> Tensor:
        """Janus's unconditional prompt: every token but BOS and <begin_of_image> becomes the pad token."""
        keep = (cond == self.bos_token_id) | (cond == self.boi_token_id)
        return torch.where(keep, cond, torch.full_like(cond, self.pad_token_id))

    def embed_condition(self, cond: Tensor) -> Tensor:
        return self.decoder.get_input_embeddings()(cond)

    def embed_image_tokens(self, tokens: Tensor) -> Tensor:
        return self.hf.prepare_embeddings_for_image_generation(tokens)

    def image_logits(self, hidden: Tensor) -> Tensor:
        return self.hf.model.generation_head(hidden)
