"""A negative prompt given for one generation: the unconditional branch of classifier-free guidance.

A text-conditional model has its own unconditional branch (`null_condition`: LlamaGen's null
caption, Janus's padded prompt, Emu3's and aMUSEd's load-time negative prompt). A caller that
gives a negative prompt for one call (`Pipeline.generate(negative_prompt=...)`) encodes it as the
model's prompts are encoded and holds it on the model for that call (`holding`): inside the block
the model's `null_condition` / `null_condition_mask` return it instead. The decoding methods only
ever ask the model for its null condition, so none of them knows that a negative prompt exists.
This is per-call state, like the KV cache a method sets up and clears around one generation.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class NegativePrompt:
    """An encoded negative prompt per sample: cond [B, T, ...] (token ids or caption embeddings, as the
    model's condition) and its valid positions mask [B, T] (its own padding, not the prompt's)."""

    cond: Tensor
    mask: Tensor

    def condition(self, cond: Tensor) -> Tensor:
        """The unconditional counterpart of cond [B, ...]: sample b's negative prompt."""
        if cond.shape[0] != self.cond.shape[0]:
            # a caller error, not a user's: guidance always pairs the whole batch with its null half
            raise ValueError(
                f"a negative prompt was given for {self.cond.shape[0]} samples, the condition has {cond.shape[0]}"
            )
        return self.cond.to(cond.device)


@contextmanager
def holding(model, cond: Tensor, mask: Tensor) -> Iterator[None]:
    """Within the block, `model.negative` is this negative prompt (the model's null_condition reads it);
    afterwards what it was before (None: the model's own unconditional branch)."""
    before = model.negative
    model.negative = NegativePrompt(cond, mask)
    try:
        yield
    finally:
        model.negative = before
