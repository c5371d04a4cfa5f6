"""Draft models given by name, loaded once per process, and whether a draft's tokenizer is the target's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import VisarError
from ..tokenizers.base import TokenGridTokenizer


def same_tokenizer(a: TokenGridTokenizer, b: TokenGridTokenizer) -> bool:
    """Do token ids mean the same images under both? Same object, or equal weights (codebook and decoder).

    Every tensor pair is compared where it lies and the answers are read back once: a check per
    tensor (a VQ has about 180) would make a GPU wait that many times before the first pass."""
    if a is b:
        return True
    if hasattr(a, "codebook") != hasattr(b, "codebook"):
        return False
    state_a, state_b = a.state_dict(), b.state_dict()
    if state_a.keys() != state_b.keys() or (hasattr(a, "codebook") and a.vocab_size != b.vocab_size):
        return False
    pairs = [(state_a[k], state_b[k]) for k in state_a]
    if hasattr(a, "codebook"):
        pairs.append((a.codebook(), b.codebook()))
    if any(x.shape != y.shape for x, y in pairs):
        return False
    equal = [(x.detach() == y.detach().to(x.device)).all() for x, y in pairs]
    return bool(torch.stack(equal).all()) if equal else True


LOADED_DRAFTS: dict[tuple, Any] = {}  # (name, device, dtype) -> a loaded draft Pipeline
# Loads a draft given by name or folder: visar.load, which visar.loading sets here (the loader builds
# Pipelines, so the pipeline cannot import it back; importing this module runs visar/__init__.py,
# which imports the loader first).
DRAFT_LOADER: Callable[..., Any] | None = None  # -> a Pipeline


def loaded_draft(name, device: torch.device, dtype: torch.dtype):
    """The Pipeline of a draft given by registered name or folder, loaded once per (name, device, dtype)
    in this process, so that a batch loop does not reload it."""
    key = (str(name), str(device), dtype)
    if key not in LOADED_DRAFTS:
        LOADED_DRAFTS[key] = DRAFT_LOADER(name, device=device, dtype=dtype)
    return LOADED_DRAFTS[key]


def check_draft_tokenizer(draft_tokenizer: TokenGridTokenizer | None, tokenizer: TokenGridTokenizer | None):
    """A draft with a tokenizer must share the target's: its token ids mean images."""
    if draft_tokenizer is not None and tokenizer is not None and not same_tokenizer(draft_tokenizer, tokenizer):
        raise VisarError(
            "the draft model's tokenizer differs from the target's (codebook or decoder): its token ids "
            "mean other images, so it cannot draft for this model"
        )
