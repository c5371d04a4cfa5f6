"""One raster pass loop: every raster method that drafts runs its passes through `pass_loop.run_pass`
(`decode_passes`' body), so a method with a loop of its own fails here."""

import pytest
import torch
from laws import LocalLlamaGen, tiny_llamagen

from visar.accel import METHODS, Request
from visar.accel.core.sampling import SamplingParams, make_generators
from visar.accel.core.stats import DRAFT_PASSES_AT_ONCE, DecodeLog
from visar.accel.raster import pass_loop

DRAFTING = sorted(
    name for name, method in METHODS.items() if method.model_kind == "raster" and name not in ("ar", "auto")
)


@pytest.fixture(scope="module")
def models():
    target = tiny_llamagen(vocab=32, block_size=64, seed=3, std=0.3)  # an 8 x 8 grid
    local = tiny_llamagen(vocab=32, block_size=36, seed=7, std=0.5, cls=LocalLlamaGen)  # what wavefront decodes
    return target, tiny_llamagen(vocab=32, block_size=64, seed=4, std=0.3), local


@pytest.mark.parametrize("name", DRAFTING)
def test_every_drafting_raster_method_runs_on_the_pass_loop(name, models, monkeypatch):
    target, draft, local = models
    method = METHODS[name]
    target = local if name == "wavefront" else target  # a model that declares local dependence
    calls = []
    run_pass = pass_loop.run_pass
    counted = lambda engine, plan: calls.append(type(engine).__name__) or run_pass(engine, plan)  # noqa: E731
    monkeypatch.setattr(pass_loop, "run_pass", counted)
    options = {method.draft_option: draft} if method.needs_draft else {}
    codebook = torch.randn(32, 4)  # what gsd and lantern compare tokens by
    request = Request(
        target, torch.tensor([0, 3]), SamplingParams(guidance_scale=2.0), make_generators(2, 0), tokenizer=codebook
    )
    _, stats = method.fn(request, **options)
    prefill = 1 if name == "lantern++" else 0  # its first token is sampled from the prefill, before the first tree
    assert calls and len(calls) == stats["forward_passes"] - prefill, (name, set(calls))


def test_the_draft_tallies_count_every_pass_handed_over():
    # DecodeLog keeps each pass's drafts and counts them many passes at a time (and at `stats`):
    # the same tallies as counting each pass at once, across the batching boundary, shapes varying
    log, gen = DecodeLog(2, (4, 4), 6, torch.device("cpu")), torch.Generator().manual_seed(0)
    by_row, by_slot = torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 6, dtype=torch.long)
    for step in range(DRAFT_PASSES_AT_ONCE * 2 + 5):
        width = 1 + step % 5
        index, slot = torch.randint(0, 16, (2, width), generator=gen), torch.randint(0, 6, (2, width), generator=gen)
        tested, accepted = torch.rand(2, width, generator=gen) < 0.7, torch.rand(2, width, generator=gen) < 0.5
        log.drafts(index, slot, tested, accepted)
        by_row[0].scatter_add_(0, (index // 4).flatten(), tested.flatten().long())
        by_row[1].scatter_add_(0, (index // 4).flatten(), (tested & accepted).flatten().long())
        by_slot[0].scatter_add_(0, slot.flatten(), tested.flatten().long())
        by_slot[1].scatter_add_(0, slot.flatten(), (tested & accepted).flatten().long())
    stats = log.stats(forward_passes=1)
    for kind, counts in (("row", by_row), ("slot", by_slot)):
        assert stats[f"draft_tokens_by_{kind}"] == counts[0].tolist()
        assert stats[f"accepted_tokens_by_{kind}"] == counts[1].tolist()
    assert stats["draft_tokens"] == int(by_row[0].sum()) > 0
