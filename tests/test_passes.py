"""One raster pass loop: every raster method that drafts runs its passes through `passes.run_pass`
(`decode_passes`' body), so a method with a loop of its own fails here."""

import pytest
import torch
from laws import LocalLlamaGen, tiny_llamagen

from visar.accel import METHODS, Request, passes
from visar.accel.sampling import SamplingParams, make_generators

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
    run_pass = passes.run_pass
    counted = lambda engine, plan: calls.append(type(engine).__name__) or run_pass(engine, plan)  # noqa: E731
    monkeypatch.setattr(passes, "run_pass", counted)
    options = {method.draft_option: draft} if method.needs_draft else {}
    codebook = torch.randn(32, 4)  # what gsd and lantern compare tokens by
    request = Request(
        target, torch.tensor([0, 3]), SamplingParams(guidance_scale=2.0), make_generators(2, 0), tokenizer=codebook
    )
    _, stats = method.fn(request, **options)
    prefill = 1 if name == "lantern++" else 0  # its first token is sampled from the prefill, before the first tree
    assert calls and len(calls) == stats["forward_passes"] - prefill, (name, set(calls))
