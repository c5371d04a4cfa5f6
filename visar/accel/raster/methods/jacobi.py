"""The chain engine's registered methods: sjd, mc-sjd and spec (`raster/chain.py` is their engine)."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from ....errors import VisarError
from ....models.base import RasterModel
from ...core.checks import check_budget
from ...core.method_registry import Request, register_method
from ..chain import speculative_decode
from ..draft_model import DraftModelProposer
from ..drafts import resolve_initialiser
from ..proposers import Carry, JacobiProposer, carry_updater, independent_carry


@register_method(
    "sjd",
    lossless=True,
    description="speculative Jacobi decoding (Teng et al. 2024), per-image commits, exact at any batch size",
    refills=True,
)
def sjd(
    request: Request,
    *,
    window: int = 16,
    warmup: int = 0,
    tail: int = 0,
    init: str | Callable = "above",
    budget: int | None = None,
) -> tuple[Tensor, dict]:
    """Speculative Jacobi decoding (Teng et al. 2024), exact at every batch size.

    window: slots per target pass (the last committed token + window - 1 drafts), so 1..window
    tokens per pass; warmup / tail: the first / last tokens decoded one per pass (plain AR);
    init: the draft initialiser for new slots: "above" (the token one row up; the default, as it
    takes the fewest passes, docs/DEFAULTS.md), "random" (the paper's), "left", "above-left";
    budget: rows per pass, the window's other name (`auto`'s candidates set it), None keeps `window`.
    """
    window = check_budget(budget, "sjd") or window
    proposer = JacobiProposer(resolve_initialiser(init), Carry(independent_carry))
    tokens, stats = speculative_decode(request, proposer, window=window, warmup=warmup, tail=tail)
    return tokens, {**stats, "budget": budget or "fixed"}


@register_method(
    "mc-sjd",
    lossless=True,
    description="coupled speculative Jacobi decoding (So et al. 2025): maximal or Gumbel coupling of drafts",
    refills=True,
)
def mc_sjd(
    request: Request,
    *,
    window: int = 16,
    warmup: int = 0,
    tail: int = 0,
    coupling: str = "maximal",
    init: str | Callable = "above",
    budget: int | None = None,
) -> tuple[Tensor, dict]:
    """Coupled speculative Jacobi decoding (So et al. 2025): SJD whose carried drafts are coupled to the old ones.

    coupling: "maximal" (the speculative test at every slot, pi_MC) or "gumbel" (Gumbel-max with
    noise keyed to image and absolute position, pi_GS). Other options as `sjd` (init "above" by
    default: the fewest passes, docs/DEFAULTS.md), budget as `sjd`'s.
    """
    window = check_budget(budget, "mc-sjd") or window
    proposer = JacobiProposer(resolve_initialiser(init), carry_updater(coupling, "mc-sjd"))
    tokens, stats = speculative_decode(request, proposer, window=window, warmup=warmup, tail=tail)
    return tokens, {**stats, "budget": budget or "fixed", "coupling": coupling}


def check_draft(model: RasterModel, draft, method: str = "spec") -> RasterModel:
    """The draft model, or one clear VisarError if it cannot draft for `model` (same vocabulary, grid,
    condition; a separate instance on the same device). Names and folders are resolved before the
    method runs (`Pipeline.generate`, which also checks that both share a tokenizer)."""
    if draft is None:
        raise VisarError(
            f"method {method!r} needs a draft model: draft=<a model of the same family, or (through "
            "Pipeline.generate) a registered model name or folder>"
        )
    if not isinstance(draft, RasterModel):
        raise VisarError(
            f"draft= must be a raster model (resolve a name or folder with Pipeline.generate or visar.load), "
            f"got {type(draft).__name__}"
        )
    if draft is model:
        raise VisarError("the draft model must be a separate model instance from the target (each keeps a KV cache)")
    if draft.device != model.device:
        raise VisarError(f"draft model is on {draft.device}, the target on {model.device}: put both on the same device")
    if draft.vocab_size != model.vocab_size:
        raise VisarError(
            f"draft model vocabulary ({draft.vocab_size} tokens) differs from the target's ({model.vocab_size}): "
            "a draft must use the target's tokenizer"
        )
    if tuple(draft.grid_size) != tuple(model.grid_size):
        raise VisarError(
            f"draft model grid {tuple(draft.grid_size)} differs from the target's {tuple(model.grid_size)}"
        )
    if draft.condition_layout != model.condition_layout:
        raise VisarError(
            f"the draft model's condition {draft.condition_layout} differs from the target's "
            f"{model.condition_layout}: they must share the condition (kind, classes, caption layout)"
        )
    return draft


@register_method(
    "spec",
    lossless=True,
    description="speculative sampling with a draft model of the same family (draft=name, folder or model)",
    needs_draft=True,
    refills=True,
)
def spec(
    request: Request,
    *,
    draft: RasterModel | None = None,
    window: int = 5,
    warmup: int = 0,
    tail: int = 0,
) -> tuple[Tensor, dict]:
    """Speculative sampling with a draft model of the same family (Leviathan et al. 2023).

    draft: a model sharing the target's vocabulary, tokenizer, grid and condition (through
    Pipeline.generate also a Pipeline or a registered name / folder). window: target slots per
    pass (the draft proposes window - 1 tokens autoregressively, sampled with the same CFG /
    temperature / top-k / top-p).
    """
    draft = check_draft(request.model, draft)
    proposer = DraftModelProposer(draft, request)
    return speculative_decode(request, proposer, window=window, warmup=warmup, tail=tail)
