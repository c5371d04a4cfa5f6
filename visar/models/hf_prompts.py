"""Prompts -> a Hugging Face model's condition: token ids [B, T] of its own tokenizer, left-padded.

The pipeline's text encoder for Hugging Face raster models (`Pipeline.text_encoder`): the model's
own processor formats each prompt as its image-generation code does (for Janus the chat template
with the generation prompt, then `processor(text, generation_mode="image")`, which appends
`<begin_of_image>`; for Emu3 the bare prompt through `processor(text, return_for_image_generation=True)`,
which appends `<|image start|>H*W<|image token|>`), and the ids are
left-padded to the model's T condition positions with a validity mask (False on padding).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import VisarError


class HFPromptEncoder:
    """processor: a transformers processor or tokenizer; call_kwargs: what its image-generation call takes;
    chat: format prompts with the processor's chat template (Janus) or pass them as they are (Emu3-Gen);
    negative_call_kwargs: what the processor's call takes for a negative prompt (None: a prompt's own,
    template included; Emu3 as transformers' docs format `negative_prompt_ids`: {}, BOS and the text)."""

    def __init__(
        self,
        processor,
        max_tokens: int,
        pad_token_id: int,
        call_kwargs: dict | None = None,
        chat: bool = True,
        negative_call_kwargs: dict | None = None,
    ):
        self.processor = processor
        self.chat = chat
        self.max_tokens = max_tokens
        self.pad_token_id = pad_token_id
        self.call_kwargs = dict(call_kwargs or {})
        self.negative_call_kwargs = None if negative_call_kwargs is None else dict(negative_call_kwargs)

    def format(self, prompt: str) -> str:
        if not self.chat or getattr(self.processor, "chat_template", None) is None:
            return prompt
        messages = [{"role": "user", "content": [{"type": "text", "text": prompt}]}]
        return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """prompts -> (token ids [B, T], validity mask [B, T]), left-padded to T = max_tokens."""
        if any(not p.strip() for p in prompts):
            raise VisarError("empty prompt")
        return self.tokenize([self.format(p) for p in prompts], self.call_kwargs, "a prompt")

    def encode_negative(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """Negative prompts -> (token ids [B, T], validity mask [B, T]), formatted as the model's
        unconditional branch (see negative_call_kwargs), left-padded like prompts. An empty one is
        what its format leaves: BOS alone (Emu3), the chat template around nothing (Janus)."""
        if self.negative_call_kwargs is None:
            return self.tokenize([self.format(p) for p in prompts], self.call_kwargs, "a negative prompt")
        return self.tokenize(list(prompts), self.negative_call_kwargs, "a negative prompt")

    def tokenize(self, texts: list[str], call_kwargs: dict, what: str) -> tuple[Tensor, Tensor]:
        """Formatted texts -> ids and mask [B, T], left-padded to T = max_tokens, through the processor."""
        batch = self.processor(text=texts, padding="longest", padding_side="left", return_tensors="pt", **call_kwargs)
        return self.fit(batch["input_ids"], batch["attention_mask"].bool(), what)

    def fit(self, ids: Tensor, mask: Tensor, what: str) -> tuple[Tensor, Tensor]:
        """Left-padded ids and validity mask [B, L] -> [B, T], T = max_tokens (one sentence if a prompt is longer)."""
        lengths = mask.sum(1)
        if int(lengths.max()) > self.max_tokens:
            raise VisarError(
                f"{what} takes {int(lengths.max())} tokens (formatted for image generation), more than this model's "
                f"{self.max_tokens} condition positions: shorten it, or load with model_args={{'max_prompt_tokens': N}}"
            )
        ids, mask = ids[:, -self.max_tokens :], mask[:, -self.max_tokens :]  # drops padding only
        pad = self.max_tokens - ids.shape[1]
        ids = torch.nn.functional.pad(ids, (pad, 0), value=self.pad_token_id)
        mask = torch.nn.functional.pad(mask, (pad, 0), value=False)
        return ids.masked_fill(~mask, self.pad_token_id), mask

    def to(self, *args, **kwargs) -> HFPromptEncoder:
        """Nothing to move (ids are made on the CPU; the pipeline moves them); for Pipeline's loading."""
        return self

    def float(self) -> HFPromptEncoder:
        return self

    def eval(self) -> HFPromptEncoder:
        return self
