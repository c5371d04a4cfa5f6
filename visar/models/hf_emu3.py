"""Emu3 image generation (transformers' `Emu3ForConditionalGeneration`, Emu3-Gen) as a visar raster model.

Paper: Wang et al. 2024, "Emu3: Next-Token Prediction is All You Need" (baaivision/Emu3). Checked
against transformers 5.24 `generate` with Emu3's prefix constraint and negative-prompt guidance
(baaivision/Emu3 `image_generation.py`; transformers' Emu3 docs) by tests/models/test_hf_emu3.py: same
greedy image tokens, same teacher-forced logits.

What differs from a plain raster model, and where it is handled:
- Visual tokens are a slice of the text vocabulary (`<|visual token000000|>`...): image tokens are
  embedded through `visual_ids` with the text embeddings, and logits are `lm_head` restricted to
  those rows, which is what Emu3's prefix constraint leaves of the vocabulary.
- Each image row ends with an end-of-line token (`<|extra_200|>`), which the constraint forces:
  `visar.models.row_ends` feeds it after each row's last token, as for Lumina-mGPT.
- Positions start at 0 at each prompt's first real token (transformers counts positions from the
  attention mask), and the unconditional half is the negative prompt with its own padding
  (`null_condition` / `null_condition_mask`), as Emu3's guidance runs it: the load-time one, or the
  one given for the call (`negative_prompt`, `HFRasterAdapter`).
- The VQ (`model.vqmodel`) lives in the tokenizer (`visar.tokenizers.hf_vq.Emu3VQTokenizer`).
"""

from __future__ import annotations

from torch import Tensor, nn

from .row_ends import RowEndAdapter


def split_vq(hf_model: nn.Module) -> nn.Module:
    """Take the VQ out of an `Emu3ForConditionalGeneration` (for the tokenizer) and return it."""
    vq = hf_model.model.vqmodel
    hf_model.model.vqmodel = None
    return vq


class HFEmu3(RowEndAdapter):
    """`Emu3ForConditionalGeneration` (its VQ removed) behind the `RasterModel` interface.

    grid_size: (H, W) of the generated image, as Emu3's processor computes it from the ratio and
    image area; negative_ids / negative_mask [1, T]: the negative prompt (formatted for image
    generation and left-padded like every prompt), the unconditional half of guidance.
    """

    def __init__(
        self,
        hf_model: nn.Module,
        *,
        max_prompt_tokens: int,
        grid_size: tuple[int, int],
        negative_ids: Tensor,
        negative_mask: Tensor,
    ):
        mapping = hf_model.model.vocabulary_mapping
        super().__init__(
            hf_model.lm_head,
            max_prompt_tokens=max_prompt_tokens,
            grid_size=grid_size,
            visual_ids=mapping.img2bpe_mapping_tensor,  # visual code k -> its text-vocabulary id
            eol_token_id=mapping.eol_token_id,
            null_ids=negative_ids,
            null_mask=negative_mask,
        )
        self.hf = hf_model

    @property
    def decoder(self) -> nn.Module:
        return self.hf.model.text_model
