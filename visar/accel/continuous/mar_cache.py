"""mar-cache: training-free reuse across MAR steps (after LazyMAR, Yan et al. 2025).

Written from the paper's two observations, not from its code:
- token redundancy: between adjacent steps most tokens' inputs to a decoder block barely change;
  such a token takes its block output as its input plus the block's residual from the last step
  it was computed (`TokenReuse`, relative change below `token_threshold`);
- condition redundancy: the gap between the class and null diffusion conditions is stable, so the
  null branch of guidance runs every `null_interval` steps and is z - (cached gap) in between.
Both are approximations (lossy). token_threshold=0 and null_interval=1 reuse nothing and are
plain MAR exactly (the same calls in the same order).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.checks import check_number
from ..core.method_registry import Request, register_method
from .mar import check_loop, check_params, decode_mar


class TokenReuse:
    """A BlockReuse policy: recompute a token in a block when its input moved by more than
    `threshold` (relative L2) since the block last ran; otherwise reuse that run's residual."""

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.records: dict[str, tuple[Tensor, Tensor]] = {}
        self.reused = self.seen = 0

    def recompute(self, key: str, h: Tensor, positions: Tensor) -> Tensor:
        record = self.records.get(self.slot(key, h))
        if record is None:  # the first call of this block at this batch shape
            return torch.ones(h.shape[:2], dtype=torch.bool, device=h.device)
        previous = record[0]
        change = (h - previous).norm(dim=-1) / previous.norm(dim=-1).clamp(min=1e-12)
        fresh = change > self.threshold
        self.reused += int((~fresh).sum())
        self.seen += fresh.numel()
        return fresh

    @staticmethod
    def slot(key: str, h: Tensor) -> str:
        """Records are kept per batch shape: steps that skip the null branch run half the rows."""
        return f"{key}@{h.shape[0]}"

    def reused_output(self, key: str, h: Tensor, positions: Tensor) -> Tensor:
        h_in, h_out = self.records[self.slot(key, h)]
        return h + (h_out - h_in)

    def store(self, key: str, positions: Tensor, h_in: Tensor, h_out: Tensor) -> None:
        self.records[self.slot(key, h_in)] = (h_in, h_out)


@torch.no_grad()
def is_exact(options: dict, model) -> bool:
    return options.get("token_threshold") == 0 and options.get("null_interval") == 1


@register_method(
    "mar-cache",
    lossless=False,
    description="MAR with LazyMAR-style reuse across steps: decoder-block features of tokens whose inputs barely "
    "change (token_threshold) and the null condition of guidance (null_interval)",
    model_kind="continuous",
    exact_when=is_exact,
    exact_when_text="token_threshold=0 and null_interval=1",
    exact_example={"token_threshold": 0.0, "null_interval": 1},
)
def mar_cache(
    request: Request,
    *,
    num_iter: int | None = None,
    num_diffusion_steps: int | None = None,
    cfg_schedule: str = "linear",
    token_threshold: float = 0.05,
    null_interval: int = 2,
):
    """MAR with reuse of decoder-block features and of the null condition across steps."""
    check_params(request.params)
    num_iter = check_loop(request.model, num_iter, num_diffusion_steps, cfg_schedule)
    check_number("token_threshold", token_threshold, 0)
    check_number("null_interval", null_interval, 1, integer=True)
    reuse = TokenReuse(token_threshold) if token_threshold > 0 else None
    tokens, stats = decode_mar(
        request,
        num_iter=num_iter,
        num_diffusion_steps=num_diffusion_steps,
        cfg_schedule=cfg_schedule,
        reuse=reuse,
        null_interval=null_interval,
    )
    reused = reuse.reused / reuse.seen if reuse is not None and reuse.seen else 0.0
    return tokens, {**stats, "reused_token_fraction": reused}
