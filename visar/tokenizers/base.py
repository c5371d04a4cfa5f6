"""The written interface of a discrete image tokenizer, as the pipeline and the decoding methods use it.

Methods that compare tokens by what they look like (GSD's groups, LANTERN's neighbours) read the
code vectors through `codebook()`; the pipeline decodes token grids to images through `decode`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor


@runtime_checkable
class TokenGridTokenizer(Protocol):
    """Token ids on a grid <-> images, through a codebook of V code vectors."""

    @property
    def vocab_size(self) -> int: ...

    def codebook(self) -> Tensor:
        """The code vectors [V, C] that token ids decode through."""
        ...

    def decode(self, codes: Tensor) -> Tensor:
        """codes [B, h, w] -> images [B, 3, H, W] in about [-1, 1]."""
        ...
