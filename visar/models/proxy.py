"""A raster model with one model's next-token law at another model's cost: speed figures that carry over.

A method's gain is its passes (set by the model's law: how often drafts are accepted) times what a
pass costs (set by the model's size on the device). The embedded models have a trained law at a toy
cost (0.78 M parameters); a full-size model with random weights has a real cost and a near-uniform
law, under which drafts pass far more often than under any trained model. `LawCostProxy` runs both
on every call, on the same tokens, positions, masks and cache rows:
- `law`, a trained model (visar-tiny-c2i), gives the logits, bit for bit;
- `cost`, a full-size LlamaGen (random weights, the official dimensions and 16,384-code head), runs
  in full, its own KV cache written and read as the law's is.
The cost model's logits reach the output through a value check (a NaN anywhere in a position's
logits makes that position's output NaN), so no compiler can prove them unused and drop the large
model, while for finite logits the output is the law's, bit for bit. A method sees one raster model
(`visar.models.base.RasterModel`) whose tokens, passes and acceptance are the law's and whose pass
costs what the large model's does; what the method does per vocabulary entry (its laws, residuals,
sampling) stays the law's width (512 codes for visar-tiny-c2i, not 16,384).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from ..errors import VisarError
from .base import ConditionLayout


class LawCostProxy(nn.Module):
    """`law`'s logits at `cost`'s price: both LlamaGen-like raster models over the same sequence layout."""

    model_kind: ClassVar[str] = "raster"

    def __init__(self, law: nn.Module, cost: nn.Module):
        super().__init__()
        if (law.num_condition_tokens, law.num_image_tokens) != (cost.num_condition_tokens, cost.num_image_tokens):
            raise VisarError(
                f"a proxy's cost model must read the law's sequence: {cost.num_condition_tokens} condition and "
                f"{cost.num_image_tokens} image positions, against the law's {law.num_condition_tokens} and "
                f"{law.num_image_tokens}"
            )
        self.law, self.cost = law, cost

    # -- the RasterModel interface: the law's layout and vocabulary --------------------------
    @property
    def device(self) -> torch.device:
        return self.law.device

    @property
    def dtype(self) -> torch.dtype:
        return self.law.dtype

    @property
    def grid_size(self) -> tuple[int, int]:
        return self.law.grid_size

    @property
    def num_image_tokens(self) -> int:
        return self.law.num_image_tokens

    @property
    def vocab_size(self) -> int:
        return self.law.vocab_size

    @property
    def num_condition_tokens(self) -> int:
        return self.law.num_condition_tokens

    @property
    def condition_layout(self) -> ConditionLayout:
        return self.law.condition_layout

    def null_condition(self, cond: Tensor) -> Tensor:
        return self.law.null_condition(cond)

    def null_condition_mask(self, cond_mask: Tensor | None) -> Tensor | None:
        return self.law.null_condition_mask(cond_mask)

    # -- both caches, kept in step --------------------------------------------------------------
    def setup_cache(self, batch_size, max_seq_len=None, cond_mask=None, kv_keep=1.0, kv_evict="h2o"):
        for model in (self.law, self.cost):
            model.setup_cache(batch_size, max_seq_len, cond_mask, kv_keep, kv_evict)

    def truncate_cache(self, lengths: Tensor):
        self.law.truncate_cache(lengths)
        self.cost.truncate_cache(lengths)

    def reset_cache_rows(self, rows: Tensor, cond_mask: Tensor | None = None):
        self.law.reset_cache_rows(rows, cond_mask)
        self.cost.reset_cache_rows(rows, cond_mask)

    def clear_cache(self):
        self.law.clear_cache()
        self.cost.clear_cache()

    def forward(self, tokens=None, cond=None, *, input_pos=None, mask=None, cache_pos=None, rows=None) -> Tensor:
        """The law's logits [B, L, V] (float32), after the cost model ran the same call in full."""
        call = dict(input_pos=input_pos, mask=mask, cache_pos=cache_pos, rows=rows)
        logits = self.law(tokens, cond, **call)
        # The class ids and null class are the law's; any id below the cost model's class count costs the same.
        cost_logits = self.cost(tokens, cond, **call)
        broken = torch.isnan(cost_logits).any(dim=-1, keepdim=True)  # never for finite weights; unprovable
        return logits.masked_fill(broken, float("nan"))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
