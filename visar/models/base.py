"""The written interfaces between models and decoding methods: one `Protocol` per kind of model.

A decoding method in `visar/accel` sees a model only through the interface of its kind, never a
concrete model class, so a new family (a Hugging Face decoder, another LlamaGen-like GPT) joins
every method of its kind by implementing the interface in its own file. Four kinds exist:

- `RasterModel` ("raster"): next-token prediction over an H x W grid of image tokens in raster
  order, after a condition (a class id or caption embeddings), with a KV cache that methods set
  up, write at explicit positions, truncate per sample and clear.
- `NextScaleModel` ("next-scale"): VAR-style prediction of a pyramid of token maps, one whole
  scale per pass, each scale's input made by the multi-scale tokenizer from the scales before it.
- `MaskedModel` ("masked"): a bidirectional pass over the whole grid with unknown positions set
  to a mask id, logits for every position (MaskGIT, aMUSEd); no cache.
- `ContinuousTokenModel` ("continuous"): masked autoregression over continuous tokens (MAR): a
  bidirectional transformer gives each position a condition vector, and a small diffusion head
  samples the token from it. The diffusion schedule it shares with its methods is in
  `visar.models.diffusion` (`DiffusionSchedule`, `diffusion_step`), so plain sampling and
  verification use one formula.

A model declares its kind in `model_kind`; a method declares the kind it decodes
(`visar.accel.Method.model_kind`) and refuses any other with one clear error.

The models' own helpers live beside this file: `kv_cache` (which cache slots a raster model's
queries see) and `outputs` (what `Pipeline.generate` makes of a method's tokens, per kind).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor

from ..errors import VisarError
from .diffusion import DiffusionSchedule


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
    - rows ([R] long, distinct cache rows; None = all): the call is for those rows of the cache
      only. tokens, cond, per-sample input_pos and cache_pos ([R, L]) and mask ([R, L, S]) then
      have R rows, the logits are [R, L, V], keys and values are written into and read from those
      rows only, and the other rows' cache is untouched. Without a cache rows must be None. With
      `reset_cache_rows`, a batch can refill: a finished image's rows take the next condition
      while the other rows keep decoding.
    A method never reads the cache or any attribute outside this interface; the cache holds what
    was written at a slot until `truncate_cache` or `reset_cache_rows` forgets it.

    Optional: `guidance_schedule` (None, or a callable (scale, image_index [...]) -> the guidance
    scale [...] of those image tokens) when the model's own sampler varies the scale along the
    image (Lumina-mGPT 2.0); the guided scorer mixes each output with its token's scale.
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

    def setup_cache(
        self,
        batch_size: int,
        max_seq_len: int,
        cond_mask: Tensor | None = None,
        kv_keep: float = 1.0,
        kv_evict: str = "h2o",
    ) -> None:
        """Allocate an empty cache of max_seq_len slots for batch_size rows; cond_mask [B, T] bool
        marks the valid condition positions of each row (None: all valid).

        kv_keep in (0, 1]: the fraction of slots whose keys and values are kept. 1 (the default, the
        only value a model need take): the whole cache, exact. Below 1 the model keeps C =
        ceil(kv_keep * max_seq_len) slots per row (memory falls with it) and evicts what it chooses
        (LlamaGen and the Hugging Face adapters: `models/kv_cache.CompressedCache`), while methods keep
        addressing the logical slots 0 .. max_seq_len - 1 (positions, cache_pos, masks [B, L, S],
        truncate_cache's lengths); an evicted slot is hidden from every query as a forgotten one is.
        kv_evict (one of EVICTION_RULES, read only below 1) names the rule that chooses what to evict.
        A budget too small for the condition, the last two grid rows and a call's inputs raises one
        VisarError; a model that does not compress refuses kv_keep < 1 the same way."""
        ...

    def truncate_cache(self, lengths: Tensor) -> None:
        """Forget every slot at or beyond lengths[b] in row b ([B] long)."""
        ...

    def reset_cache_rows(self, rows: Tensor, cond_mask: Tensor | None = None) -> None:
        """Forget every slot of cache rows `rows` ([R] long, distinct), as `truncate_cache` to length 0
        would, and take cond_mask ([R, T] bool, None = all valid) as their valid condition positions
        from now on: the rows are free for a new condition. The other rows are unchanged."""
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
        rows: Tensor | None = None,
    ) -> Tensor:
        """Logits [B, L, V] (float32), or [R, L, V] for the cache rows `rows` (see the class docstring)."""
        ...


@runtime_checkable
class NextScaleModel(Protocol):
    """A next-scale image model (VAR): scale k predicts a whole pn_k x pn_k token map at once.

    Sequence layout: the inputs of scales 0 .. S - 1 in order, pn_k^2 each (L = sum pn_k^2). Scale
    0's input is the start token, made from the class condition; scale k > 0's inputs are latents
    [pn_k^2, latent_dim] that the multi-scale tokenizer (`visar.tokenizers.base.MultiScaleTokenizer`)
    makes from the tokens of scales 0 .. k - 1. The output at an input of scale k is the logits of
    scale k's token at that place. The condition also modulates every layer (AdaLN).

    Calls (`model(cond, latents, first_scale=k, keep_fraction=1.0, last_scale_only=False)`) return float32 logits
    [B, l, V] for the inputs fed: scale `first_scale` and the scales after it that `latents`
    [B, l', latent_dim] cover (scale 0 adds its start token to them). Attention is block-causal: an
    input sees the inputs of its own and earlier scales, in this call and in the cache.
    - Without a cache the call must start at scale 0 (teacher forcing).
    - With a cache (`setup_cache`), the call's keys and values are appended to it; a method feeds
      the scales in order, one call per scale or several at once (a prefill).
    - keep_fraction < 1 (FastVAR's cached token pruning; a one-scale call right after another call,
      on a cache set up with pruning=True): only that fraction of the scale's inputs go through each
      layer, those that changed most against the previous scale; the others take the previous
      scale's layer outputs, upsampled. 1 is exact.
    - last_scale_only: return the logits of the call's last scale only [B, pn^2, V]; the model may
      skip work that only the other inputs' outputs need (their keys and values still enter the
      cache), as a prefill that reads one scale's law wants.
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
        keep_fraction < 1 reuse (the layer outputs of each call's last scale)."""
        ...

    def clear_cache(self) -> None: ...

    def __call__(
        self,
        cond: Tensor,
        latents: Tensor | None = None,
        *,
        first_scale: int = 0,
        keep_fraction: float = 1.0,
        last_scale_only: bool = False,
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


def model_kind(model) -> str | None:
    """The interface a model declares (`model_kind`), or None for an object that declares none."""
    return getattr(model, "model_kind", None)


# How a raster model's compressed KV cache (setup_cache's kv_evict) chooses what to evict
# (`kv_cache.CompressedCache`): "h2o", on each write that needs room, by the attention each slot drew
# so far, decayed; "line" (LineAR's rule), at grid-row boundaries, by the attention of the last row's queries.
EVICTION_RULES = ("h2o", "line")


def check_kv_evict(kv_evict) -> str:
    """kv_evict as one of EVICTION_RULES, or one VisarError."""
    if not isinstance(kv_evict, str) or kv_evict not in EVICTION_RULES:
        raise VisarError(
            "kv_evict must be 'h2o' (evict on each write, by decayed accumulated attention) or 'line' (LineAR: "
            f"evict at grid-row boundaries, by the attention of the last row's queries), not {kv_evict!r}"
        )
    return kv_evict


@runtime_checkable
class ContinuousTokenModel(Protocol):
    """Masked autoregression over L = h * w continuous tokens of width C (MAR).

    A step runs `condition_features` on the tokens fixed so far (`visible`) and gives every
    position a condition vector z; the diffusion head then denoises each token to predict, from
    Gaussian noise, through `diffusion_schedule(steps)`: at respaced step i the head's output
    [eps | v] at (x, z) fixes a Gaussian transition (`diffusion_step`). Classifier-free guidance
    mixes eps of the class and null conditions; the variance stays the class's.
    """

    model_kind: ClassVar[str]  # "continuous"

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def grid_size(self) -> tuple[int, int]:
        """(h, w) of the token grid."""
        ...

    @property
    def num_image_tokens(self) -> int: ...

    @property
    def token_dim(self) -> int:
        """C, the width of one token (VAE channels x patch area)."""
        ...

    @property
    def condition_layout(self) -> ConditionLayout: ...

    @property
    def num_sampling_steps(self) -> int:
        """The diffusion head's default number of respaced steps."""
        ...

    def embed_condition(self, cond: Tensor) -> Tensor:
        """Class ids [B] -> condition embeddings [B, D]."""
        ...

    def null_embedding(self, batch_size: int) -> Tensor:
        """The unconditional embedding [B, D] for classifier-free guidance."""
        ...

    def condition_features(
        self, tokens: Tensor, visible: Tensor, cond_embedding: Tensor, reuse: BlockReuse | None = None
    ) -> Tensor:
        """tokens [B, L, C], visible [B, L] bool (the tokens fixed so far), cond_embedding [B, D] ->
        the diffusion condition z [B, L, Dz] of every position. `reuse` may skip work for tokens whose
        block inputs barely changed since its last call (approximate; None: exact)."""
        ...

    def diffusion_head(self, x: Tensor, timesteps: Tensor, z: Tensor) -> Tensor:
        """x [N, C] noisy tokens, timesteps [N] on the original 0..999 scale, z [N, Dz] -> [N, 2C]:
        eps, then the variance interpolation values v in [-1, 1]."""
        ...

    def diffusion_chain(self, z: Tensor, timesteps: Tensor) -> Callable[[Tensor, int], Tensor]:
        """The head along reverse chains that share z [N, Dz]: the returned head(x [N, C], i) is
        diffusion_head(x, timesteps[i] for every row, z); what depends only on z or the timestep
        (computed once here, not at every step) is the model's to choose."""
        ...

    def diffusion_schedule(self, num_steps: int | None = None) -> DiffusionSchedule: ...

    def unpatchify(self, tokens: Tensor) -> Tensor:
        """tokens [B, L, C] -> latent [B, C / p^2, h * p, w * p] (what the VAE decodes, scaled)."""
        ...


class BlockReuse(Protocol):
    """A policy that lets a transformer skip tokens whose block inputs barely changed (see mar-cache):
    `recompute(key, h, positions)` -> [B, S] bool, which tokens to run the block for; `store(key,
    positions, h_in, h_out)` records this call's inputs and outputs, by token position."""

    def recompute(self, key: str, h: Tensor, positions: Tensor) -> Tensor: ...

    def reused_output(self, key: str, h: Tensor, positions: Tensor) -> Tensor: ...

    def store(self, key: str, positions: Tensor, h_in: Tensor, h_out: Tensor) -> None: ...
