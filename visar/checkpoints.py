"""Safe, strict checkpoint loading shared by every model family.

Files are read with safetensors or `torch.load(weights_only=True)` (no pickled code runs). A
state_dict that does not fit its model raises one `CheckpointMismatchError` naming the first
mismatching keys with expected and found shapes, and the preset that would fit; nothing is ever
loaded partially.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from .errors import CheckpointMismatchError, VisarError

# Wrapper keys used by the official training scripts, in the order their samplers look for them.
WRAPPER_KEYS = ("model", "module", "state_dict", "ema")


def read_state_dict(path: str | os.PathLike, wrapper_keys: Iterable[str] = WRAPPER_KEYS) -> dict[str, torch.Tensor]:
    """Read a checkpoint file and unwrap `{'model': sd, ...}`-style containers."""
    path = Path(path)
    if not path.exists():
        raise VisarError(f"checkpoint not found: {path}")
    if path.is_dir():
        raise VisarError(f"expected a checkpoint file, got a folder: {path}")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            obj = load_file(str(path))
        else:
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # corrupt, truncated, or not a checkpoint at all
        raise VisarError(f"cannot read checkpoint {path} (corrupt, truncated or not a checkpoint): {err}") from err
    if isinstance(obj, dict):
        for key in wrapper_keys:
            if key in obj and isinstance(obj[key], dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise VisarError(f"{path} holds no state_dict of tensors (looked under keys {list(wrapper_keys)})")
    return obj


def shape_mismatches(expected: dict[str, torch.Size], found: dict[str, torch.Tensor]) -> list[str]:
    """Human-readable lines for missing, unexpected and wrongly shaped keys (in that order)."""
    lines = []
    for key, shape in expected.items():
        if key not in found:
            lines.append(f"missing {key} (expected {list(shape)})")
        elif tuple(found[key].shape) != tuple(shape):
            lines.append(f"{key}: expected {list(shape)}, found {list(found[key].shape)}")
    lines += [f"unexpected {key} {list(found[key].shape)}" for key in found if key not in expected]
    return lines


def expected_shapes(model: nn.Module) -> dict[str, torch.Size]:
    return {k: v.shape for k, v in model.state_dict().items()}


def load_strict(
    model: nn.Module,
    state_dict: dict[str, torch.Tensor],
    *,
    source: str = "checkpoint",
    presets: dict[str, Callable[[], nn.Module]] | None = None,
    assign: bool = False,
) -> nn.Module:
    """Load every key, or raise CheckpointMismatchError naming what differs and what would fit.

    presets: name -> builder of a model (built on the meta device here, so it costs nothing)
    used to say which preset matches the checkpoint when the requested one does not.
    """
    mismatches = shape_mismatches(expected_shapes(model), state_dict)
    if mismatches:
        fitting = []
        for name, build in (presets or {}).items():
            with torch.device("meta"):
                candidate = build()
            if not shape_mismatches(expected_shapes(candidate), state_dict):
                fitting.append(name)
        hint = f"; the preset that fits is {fitting[0]!r}" if fitting else "; no known preset fits it"
        shown = "; ".join(mismatches[:5]) + (f"; ... ({len(mismatches)} in all)" if len(mismatches) > 5 else "")
        raise CheckpointMismatchError(f"{source} does not fit the model: {shown}{hint}")
    model.load_state_dict(state_dict, strict=True, assign=assign)
    return model


def seeded_init(module: nn.Module, seed: int, std: float = 0.02):
    """Deterministic random weights (visar-tiny-random, a proxy's cost model): N(0, std) for every weight
    of two or more dimensions (linear, embedding); norms keep their ones."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
