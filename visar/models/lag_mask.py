"""ZipAR's lag-s visibility as a static training mask, shared by training and by the zipar decode's tests.

ZipAR (He et al. 2025) decodes row r + 1 once row r has s tokens; a model trained with some
sequences under this mask (ZipAR-aware training, `visar train`) meets at generation the contexts
it was trained on. It lives with the models, not with the decoding method, so that training code
imports no decoding method; tests/accel/raster/test_zipar.py checks it against the masks a real zipar decode
feeds.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import VisarError


def check_lag(s) -> int:
    if isinstance(s, bool) or not isinstance(s, int) or s < 1:
        raise VisarError(
            f"s (the ZipAR window: tokens of a row before the next starts) must be an integer >= 1, got {s!r}"
        )
    return s


def lag_training_mask(grid: tuple[int, int], s: int, num_condition_tokens: int = 1) -> Tensor:
    """zipar's visibility at lag s as one static [L, L] bool mask over a training sequence.

    The sequence is the teacher-forced one (L = T + N - 1: T condition positions, then image
    tokens 0 .. N - 2; position T - 1 + t predicts token t). Under zipar's schedule token
    (r, c) is drawn in pass c + r * s (plus the prefill), and the input that predicts it, fed
    in that pass, sees exactly the earlier tokens drawn in earlier passes: (r', c') with
    c' < c + (r - r') * s above it, all of its own row to the left, and the condition. Its KV
    is cached with that context, so a model trained under this mask meets at generation the
    contexts it was trained on (ZipAR-aware training; the one difference: a row's last token
    is fed again for its KV once its row is complete, seeing its whole row).
    With s >= W the mask is plain causal.
    """
    height, width = grid
    s = check_lag(s)
    num_tokens = height * width
    length = num_condition_tokens + num_tokens - 1
    token = torch.arange(num_tokens)
    drawn_in = token % width + (token // width) * min(s, width)  # the pass that draws each token
    position = torch.arange(length)
    predicted = (position - num_condition_tokens + 1).clamp(min=0)  # token each position predicts
    held = (position - num_condition_tokens).clamp(min=0)  # token each position holds
    earlier = drawn_in[held][None, :] < drawn_in[predicted][:, None]
    earlier |= (position < num_condition_tokens)[None, :]  # the condition is always there
    earlier |= (position < num_condition_tokens - 1)[:, None]  # condition queries predict nothing
    causal = position[None, :] <= position[:, None]
    return causal & (earlier | (position[None, :] == position[:, None]))
