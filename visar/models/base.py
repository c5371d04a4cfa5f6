"""The written interfaces between models and decoding methods: one `Protocol` per kind of model.

A decoding method in `visar/accel` sees a model only through the interface of its kind, never a
concrete model class, so a new family (a Hugging Face decoder, another LlamaGen-like GPT) joins
every method of its kind by implementing the interface in its own file. Two kinds exist:

- `RasterModel` ("raster"): next-token prediction over an H x W grid of image tokens in raster
  order, after a condition (a class id or caption embeddings), with a KV cache that methods set
  up, write at explicit positions, truncate per sample and clear.
- `NextScaleModel` ("next-scale"): VAR-style prediction of a pyramid of token maps, one whole
  scale per pass, each scale's input made by the multi-scale tokenizer from the scales before it.

The interfaces of masked (MaskGIT) and continuous-token (MAR) models join here with their
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
class NextScaleModel(Protocol):
    """A next-scale image model (VAR): scale k predicts a whole pn_k x pn_k token map at once.

    Sequence layout: the inputs of scales 0 .. S - 1 in order, pn_k^2 each (L = sum pn_k^2). Scale
    0's input is the start token, made from the class condition; scale k > 0's inputs are latents
    [pn_k^2, latent_dim] that the multi-scale tokenizer (`visar.tokenizers.base.MultiScaleTokenizer`)
    makes from the tokens of scales 0 .. k - 1. The output at an input of scale k is the logits of
    scale k's token at that place. The condition also modulates every layer (AdaLN).

    Calls (`model(cond, latents, first_scale=k, keep_fraction=1.0)`) return float32 logits
    [B, l, V] for the inputs fed: scale `first_scale` and the scales after it that `latents`
    [B, l', latent_dim] cover (scale 0 adds its start token to them). Attention is block-causal: an
    input sees the inputs of its own and earlier scales, in this call and in the cache.
    - Without a cache the call must start at scale 0 (teacher forcing).
    - With a cache (`setup_cache`), the call's keys and values are appended to it; a method feeds
      the scales in order, one call per scale or several at once (a prefill).
    - keep_fraction < 1 (FastVAR's cached token pruning; a one-scale call right after another, on a
      cache set up with pruning=True): only that fraction of the scale's inputs go through each
      layer, those that changed most against the previous scale; the others take the previous
      scale's layer outputs, upsampled. 1 is exact.
    A method never reads the cache or any attribute outside this interface.
    """

    model_kind: ClassVar[str]  # "next-scale"

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def scale_sizes(self) -> tuple[int, ...]:
        """pn_k, the side of each scale's square token map, small to large."""
        ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def latent_dim(self) -> int:
        """The width of the tokenizer latents a scale's inputs are made of."""
        ...

    @property
    def condition_layout(self) -> ConditionLayout: ...

    def null_condition(self, cond: Tensor) -> Tensor:
        """The unconditional counterpart of `cond` (same shape), for classifier-free guidance."""
        ...

    def setup_cache(self, batch_size: int, pruning: bool = False) -> None:
        """An empty KV cache for every scale, for batch_size rows; pruning: keep what later calls with
        keep_fraction < 1 reuse (each one-scale call's layer outputs)."""
        ...

    def clear_cache(self) -> None: ...

    def __call__(
        self, cond: Tensor, latents: Tensor | None = None, *, first_scale: int = 0, keep_fraction: float = 1.0
    ) -> Tensor: ...


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
