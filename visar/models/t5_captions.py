"""Prompts -> text-to-image LlamaGen's caption embeddings, through transformers' `T5EncoderModel` (flan-t5-xl).

As FoundationVision/LlamaGen computes them (`language/t5.py::T5Embedder.get_text_embeddings` and
`autoregressive/sample/sample_t2i.py`): the T5 tokenizer pads on the right to `max_length` (120) with
truncation and the end-of-sequence token; the encoder runs with that attention mask; then each row is
rotated so that its valid tokens end the sequence (LlamaGen's left padding), the padding rows are
zeroed, and the mask is flipped to match. Difference: LlamaGen's caption cleaning (ftfy, BeautifulSoup
and a list of regular expressions written for web captions) is not applied; prompts are lower-cased with
their white space collapsed, which is what that cleaning leaves of a plain sentence.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..errors import VisarError


def clean(prompt: str) -> str:
    return " ".join(str(prompt).lower().split())


class T5CaptionEncoder:
    """tokenizer: a transformers T5 tokenizer; encoder: a `T5EncoderModel` (kept in float32, eval mode)."""

    def __init__(self, tokenizer, encoder, max_length: int = 120):
        self.tokenizer, self.encoder, self.max_length = tokenizer, encoder.eval(), max_length
        self.tokenizer.padding_side = "right"  # the rotation below assumes T5's own right padding

    @property
    def embed_dim(self) -> int:
        return self.encoder.config.d_model

    def to(self, device) -> T5CaptionEncoder:
        self.encoder.to(device)
        return self

    def tokenize(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """prompts -> (ids [B, max_length], attention mask [B, max_length]), right-padded as T5 pads."""
        batch = self.tokenizer(
            [clean(p) for p in prompts],
            max_length=self.max_length,
            padding="max_length",
            truncation=True,
            return_attention_mask=True,
            add_special_tokens=True,
            return_tensors="pt",
        )
        return batch["input_ids"], batch["attention_mask"]

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """prompts -> (caption embeddings [B, max_length, d_model], mask [B, max_length] bool), left-padded."""
        ids, mask = self.tokenize(prompts)
        device = next(self.encoder.parameters()).device
        hidden = self.encoder(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state.float()
        return left_pad(hidden, mask.to(device))

    def encode_negative(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """Negative prompts, encoded as prompts are (an empty one is T5's end-of-sequence token alone)."""
        return self.encode(prompts)


def left_pad(hidden: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Right-padded encoder states and mask -> LlamaGen's left-padded, zero-padded embeddings and mask."""
    rows = [torch.cat([h[int(n) :], h[: int(n)]]) for h, n in zip(hidden, mask.sum(dim=1), strict=True)]
    flipped = torch.flip(mask, dims=[-1])
    return torch.stack(rows) * flipped[..., None].to(hidden.dtype), flipped.bool()


class LazyTextEncoder:
    """A text encoder loaded on first use (a preset's default flan-t5-xl is fetched only when prompts
    need it: caption_embeds= never does)."""

    def __init__(self, load: Callable[[], object], name: str):
        self.load, self.name, self.device, self.loaded = load, name, None, None

    def to(self, device) -> LazyTextEncoder:
        self.device = device
        if self.loaded is not None:
            self.loaded.to(device)
        return self

    def encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        return self.encoder().encode(prompts)

    def encode_negative(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        return self.encoder().encode_negative(prompts)

    def encoder(self):
        """The encoder, loaded (and moved to the asked device) on the first call."""
        if self.loaded is None:
            self.loaded = self.load()
            if self.device is not None:
                self.loaded.to(self.device)
        return self.loaded


def check_caption_width(encoder: T5CaptionEncoder, embed_dim: int, name: str):
    if encoder.embed_dim != embed_dim:
        raise VisarError(
            f"text encoder {name} gives {encoder.embed_dim}-wide states but the model reads {embed_dim}-wide "
            "captions (official LlamaGen t2i: flan-t5-xl, 2048)"
        )
