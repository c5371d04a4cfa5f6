"""The written interfaces between models and decoding methods: one `Protocol` per kind of model.

A decoding method in `visar/accel` sees a model only through the interface of its kind, never a
concrete model class, so a new family (a Hugging Face decoder, another LlamaGen-like GPT) joins
every method of its kind by implementing the interface in its own file. Two kinds exist:

- `RasterModel` ("raster"): next-token prediction over an H x W grid of image tokens in raster
  order, after a condition (a class id or caption embeddings), with a KV cache that methods set
  up, write at explicit positions, truncate per sample and clear.
- `MaskedModel` ("masked"): a bidirectional pass over the whole grid with unknown positions set
  to a mask id, logits for every position (MaskGIT, aMUSEd); no cache.

The interfaces of next-scale (VAR) and continuous-token (MAR) models join here with their
families. A model declares its kind in `model_kind`; a method declares the kind it decodes
(`visar.accel.Method.model_kind`) and refuses any other with one clear error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor


@dataclass(frozen=True)
class ConditionLayout:
    """What a model is conditioned on and how many sequence positions the condition takes.

    kind "class": cond is a LongTensor [B] of ids 0 .. num_classes - 1. kind "text": cond is
    caption embeddings [B, num_tokens, embed_dim] (with an optional validity mask [B, num_tokens]
    for padded captions), or, with embed_dim 0 (Hugging Face models, which embed their prompt
    themselves), the prompt's token ids [B, num_tokens] of the model's own tokenizer, left-padded.
    Two models can share drafts or images only with equal layouts.
    """

    kind: Literal["class", "text"]
    num_tokens: int  # condition positions before image token 0
    num_classes: int = 0  # kind "class"
    embed_dim: int = 0  # kind "text": width of one caption embedding


@runtime_checkable
class RasterModel(Protocol):
    """A next-token image model over an H x W token grid in raster order, with a KV cache.

    Sequence layout: [T condition positions | N = H * W image tokens]; image token i sits at
    position T + i, and the output at position T + i - 1 predicts it (the last condition
    position predicts token 0).

    Calls (`model(tokens, cond, input_pos=..., mask=..., cache_pos=...)`) return float32
    logits [B, L, V] for the L inputs fed, [condition (if cond) ; tokens (if tokens)]:
    - input_pos ([L] shared, or [B, L] per sample): the absolute position of each input; with a
      cache it is also the slot the input's keys and values are written to, unless cache_pos
      ([L] or [B, L]) names other slots (inputs that share a position, such as draft-tree nodes).
    - mask ([B, L, S] bool, True = visible; S = the cache length): which cached slots each input
      attends to. The model hides the condition positions that `setup_cache`'s cond_mask marks
      invalid (padded captions) from every query, whatever the mask says. mask None: causal by
      position over the cache.
    A method never reads the cache or any attribute outside this interface; the cache holds what
    was written at a slot until `truncate_cache` forgets it.
    """

    model_kind: ClassVar[str]  # "raster"

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def grid_size(self) -> tuple[int, int]:
        """(H, W) of the image-token grid."""
        ...

    @property
    def num_image_tokens(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def num_condition_tokens(self) -> int:
        """T, the condition positions before image token 0."""
        ...

    @property
    def condition_layout(self) -> ConditionLayout: ...

    def null_condition(self, cond: Tensor) -> Tensor:
        """The unconditional counterpart of `cond` (same shape), for classifier-free guidance."""
        ...

    def null_condition_mask(self, cond_mask: Tensor | None) -> Tensor | None:
        """The valid positions [B, T] of `null_condition(cond)`, given cond's: cond_mask itself when
        the null condition keeps the layout of cond (a class, Janus's padded prompt), the negative
        prompt's own padding when it has its own tokens (Emu3)."""
        ...

    def setup_cache(self, batch_size: int, max_seq_len: int, cond_mask: Tensor | None = None) -> None:
        """Allocate an empty cache of max_seq_len slots for batch_size rows; cond_mask [B, T] bool
        marks the valid condition positions of each row (None: all valid)."""
        ...

    def truncate_cache(self, lengths: Tensor) -> None:
        """Forget every slot at or beyond lengths[b] in row b ([B] long)."""
        ...

    def clear_cache(self) -> None: ...

    def __call__(
        self,
        tokens: Tensor | None = None,
        cond: Tensor | None = None,
        *,
        input_pos: Tensor | None = None,
        mask: Tensor | None = None,
        cache_pos: Tensor | None = None,
    ) -> Tensor: ...


@runtime_checkable
class MaskedModel(Protocol):
    """A masked (bidirectional) image-token model over an H x W grid: MaskGIT, aMUSEd's UVit2DModel.

    `model(tokens, cond, cond_mask=None)`: tokens [B, N] (N = H * W, raster order) hold a code id
    0 .. V - 1 at known positions and `mask_token_id` at unknown ones; cond is a class id [B] or a
    prompt (`condition_layout`), cond_mask its valid positions [B, T] or None. Returns float32
    logits [B, N, V] over the V codes for every position, known ones included (methods ignore
    those). Every call is a full pass: nothing is cached between calls, so a method may change any
    position between calls.
    """

    model_kind: ClassVar[str]  # "masked"

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def grid_size(self) -> tuple[int, int]:
        """(H, W) of the image-token grid."""
        ...

    @property
    def num_image_tokens(self) -> int: ...

    @property
    def vocab_size(self) -> int:
        """V, the codes the logits cover (the mask id is not one of them)."""
        ...

    @property
    def mask_token_id(self) -> int:
        """The input id of an unknown position (>= V)."""
        ...

    @property
    def condition_layout(self) -> ConditionLayout: ...

    def null_condition(self, cond: Tensor) -> Tensor:
        """The unconditional counterpart of `cond`, for classifier-free guidance."""
        ...

    def null_condition_mask(self, cond_mask: Tensor | None) -> Tensor | None:
        """The valid positions of `null_condition(cond)`, given cond's."""
        ...

    def __call__(self, tokens: Tensor, cond: Tensor, cond_mask: Tensor | None = None) -> Tensor: ...


def condition_validity(cond_mask: Tensor | None, batch_size: int, length: int, device) -> Tensor:
    """[B, length] bool over a sequence [condition | ...]: False at the condition positions that
    cond_mask [B, T] marks invalid (padded captions or prompts), True everywhere else."""
    valid = torch.ones(batch_size, length, dtype=torch.bool, device=device)
    if cond_mask is not None:
        valid[:, : cond_mask.shape[1]] = cond_mask.bool()
    return valid


class CacheKeys:
    """Which slots of a raster model's KV cache a query may see: valid condition positions that
    were written and not forgotten since. Truncation only marks slots unwritten, so it costs a
    [B, S] update instead of a pass over every layer's keys and values, and a slot written again
    is visible again."""

    def __init__(self, batch_size: int, num_slots: int, cond_mask: Tensor | None, device):
        self.valid = condition_validity(cond_mask, batch_size, num_slots, device)  # [B, S]
        self.written = torch.zeros(batch_size, num_slots, dtype=torch.bool, device=device)

    def write(self, slots: Tensor) -> Tensor:
        """Record this call's writes (slots [B, L]) -> the slots its queries may see [B, S]."""
        self.written.scatter_(1, slots, True)
        return self.valid & self.written

    def truncate(self, lengths: Tensor):
        """Forget every slot at or beyond lengths[b] in row b."""
        slots = torch.arange(self.written.shape[1], device=lengths.device)
        self.written &= slots[None, :] < lengths[:, None]


def causal_visibility(input_pos: Tensor, key_pos: Tensor, key_valid: Tensor | None) -> Tensor:
    """The default mask of a raster model: a query at position p sees the valid keys at positions
    <= p, and itself. input_pos [B, L], key_pos [B, S], key_valid [B, S] bool -> [B, L, S]."""
    visible = key_pos[:, None, :] <= input_pos[:, :, None]
    if key_valid is not None:
        visible = visible & key_valid[:, None, :]
    return visible | (key_pos[:, None, :] == input_pos[:, :, None])


def model_kind(model) -> str | None:
    """The interface a model declares (`model_kind`), or None for an object that declares none."""
    return getattr(model, "model_kind", None)
