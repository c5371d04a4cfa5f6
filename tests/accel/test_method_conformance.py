"""Conformance, driven by the registries: every registered method x every registered family's tiny model.

A new method (visar.accel.register_method) or family (visar.families.register_family) is covered
here without a new test. For each pair whose kinds fit: token shapes and range, determinism for a
seed, batch invariance (an image's tokens do not depend on its batch; `auto`, which chooses for
the batch size and tunes from call to call, excepted from both), the common statistics, and
the lossless flag for the options; where the kinds do not fit, or the model lacks what the method
needs, one clear VisarError. Then every "exact at these settings" claim of a lossy method is
checked against the enumerated law of a tiny model (slow tier), with a negative control.
"""

import re
from types import SimpleNamespace

import pytest
import torch
from conftest import ON_ACCELERATOR, TEST_DEVICE, TEST_DTYPES, law_samples
from laws import (
    SAMPLES,
    VOCAB,
    compare_laws,
    exact_law,
    perturbed,
    sequence_index,
    tiny_llamagen,
    tiny_pipeline,
    unit_codebook,
)

from visar.accel import METHODS, Request, methods_for, reference_method
from visar.accel.core.sampling import SamplingParams, make_generators
from visar.accel.core.stats import COMMON_STATS
from visar.errors import VisarError
from visar.families import FAMILIES

# Options that keep a test-size run small, applied where a method has the option.
SMALL = {"tree": [[0], [1], [0, 0]], "num_iter": 4}


@pytest.fixture(scope="module", params=[(f, d) for d in TEST_DTYPES for f in sorted(FAMILIES)], ids=str)
def family_pair(request):
    """(target, draft) tiny pipelines of one family on the test device, in one of the test dtypes: the
    draft a second, differently seeded instance."""
    family, dtype = request.param
    return tiny_pipeline(family, 0, TEST_DEVICE, dtype), tiny_pipeline(family, 1, TEST_DEVICE, dtype)


def options_for(method, draft_pipe) -> dict:
    options = {k: v for k, v in SMALL.items() if k in method.options}
    if method.needs_draft:
        options[method.draft_option] = draft_pipe.model
    return options


def conditions(pipe, n):
    return {"class_labels": list(range(n))} if pipe.is_class_conditional else {"prompts": ["a red circle"] * n}


@pytest.mark.one_thread  # tokens of a batch against each image alone (fp32, CPU)
@pytest.mark.parametrize("method_name", sorted(METHODS))
def test_method_on_every_family(family_pair, method_name):
    pipe, draft = family_pair
    method = METHODS[method_name]
    options = options_for(method, draft)
    if method_name == "auto" and pipe.model.model_kind != "raster":  # the pipeline runs the kind's reference
        out = pipe.generate(**conditions(pipe, 1), method="auto", output_type="tokens")
        assert out.stats["method"] == reference_method(pipe.model)
        return
    if not method.fits(pipe.model):
        with pytest.raises(VisarError) as err:
            pipe.generate(**conditions(pipe, 1), method=method_name, output_type="tokens", **options)
        assert method_name in str(err.value) or any(c in str(err.value) for c in method.requires)
        return
    if pipe.model.model_kind == "next-scale":
        return check_next_scale_method(pipe, method, options)
    height, width = pipe.model.grid_size
    continuous = pipe.model.model_kind == "continuous"
    run = dict(method=method_name, output_type="tokens", seed=5, **options)
    out = pipe.generate(**conditions(pipe, 3), **run)
    tokens, stats = out.tokens, out.stats
    if continuous:  # the float latent the VAE decodes
        assert tokens.shape == pipe.model.unpatchify(torch.zeros(3, height * width, pipe.model.token_dim)).shape
        assert tokens.is_floating_point() and bool(torch.isfinite(tokens).all())
    else:
        assert tokens.shape == (3, height, width) and tokens.dtype == torch.long
        assert 0 <= int(tokens.min()) and int(tokens.max()) < pipe.model.vocab_size

    # the common statistics, with values that make sense
    assert set(COMMON_STATS) | {"method", "lossless", "batch_size"} <= set(stats)
    assert stats["method"] == method_name and stats["batch_size"] == 3
    assert len(stats["forward_passes_per_image"]) == 3 and stats["forward_passes"] >= max(
        stats["forward_passes_per_image"]
    )
    assert stats["tokens_per_forward"] >= 1.0 and stats["latency_s"] > 0
    assert len(stats["draft_tokens_by_row"]) == len(stats["accepted_tokens_by_row"]) == height
    assert stats["draft_tokens"] == sum(stats["draft_tokens_by_row"]) >= stats["accepted_tokens"] >= 0
    assert stats["acceptance_rate"] is None if stats["draft_tokens"] == 0 else 0 <= stats["acceptance_rate"] <= 1
    assert stats["lossless"] == method.is_lossless(options, pipe.model)
    assert (stats["draft_forward_passes"] > 0) == method.needs_draft or method_name == "lantern"
    # the pass that committed each token: every token has one, within the image's passes
    commit_pass = stats["commit_pass"]
    assert commit_pass.shape == (3, height, width) and int(commit_pass.min()) >= 1
    last_pass = commit_pass.flatten(1).max(1).values.tolist()
    assert all(last <= passes for last, passes in zip(last_pass, stats["forward_passes_per_image"], strict=True))
    if method_name == "ar":
        assert torch.equal(commit_pass[0].flatten(), torch.arange(1, height * width + 1))

    # determinism for a seed, and batch invariance: image i of the batch alone, with seed 5 + i. auto
    # chooses for the batch size and goes on tuning from call to call (the same law, other random
    # numbers); tests/accel/policy/test_auto.py checks each of its images against the candidate that made it
    if not method.batch_invariant:
        return
    again = pipe.generate(**conditions(pipe, 3), **run)
    assert torch.equal(again.tokens, tokens)
    if pipe.dtype != torch.float32 or ON_ACCELERATOR:  # bits across batch shapes: a CPU at one thread only
        return check_low_precision_batch_invariance(pipe, run, tokens, continuous)
    for i in range(3):
        labels = {k: v[i : i + 1] for k, v in conditions(pipe, 3).items()}
        alone = pipe.generate(**labels, **{**run, "seed": 5 + i})
        if continuous:  # float chains: equal up to kernel rounding, relative to the image's scale
            # (this random head's chains pass t = 999, where sqrt(1 / abar) = 2e4 amplifies the
            # rounding of batch-shaped matmuls; cspd's residual chains run on other row counts
            # alone than in the batch: 1.2e-5 of the scale was seen)
            scale = float(tokens[i].abs().max())
            torch.testing.assert_close(alone.tokens[0], tokens[i], rtol=0, atol=5e-5 * scale)
        else:
            assert torch.equal(alone.tokens[0], tokens[i]), f"image {i} depends on its batch"


def check_low_precision_batch_invariance(pipe, run, tokens, continuous):
    """Batch invariance in bf16 / fp16, or on a GPU, with a tolerance. The randomness is batch-invariant
    in any dtype (per-image CPU generators, position-keyed noise), but a half-precision matmul, or any
    GPU matmul, rounds by the shape of its batch (a BLAS picks its kernel and split by the row count),
    so an image's logits alone and in a batch differ (~1e-2 relative in half precision); where a draw's
    uniform lies that close to a CDF boundary the token flips, and every later token of the image
    follows the flip. So: at most one of the three images may differ (in fp32 on a CPU at one thread
    none may), and a continuous model's float chains, which
    amplify rounding up to 2e4-fold at t = 999 (see the fp32 branch above), are checked for being
    finite only."""
    differing = 0
    for i in range(3):
        labels = {k: v[i : i + 1] for k, v in conditions(pipe, 3).items()}
        alone = pipe.generate(**labels, **{**run, "seed": 5 + i})
        if continuous:
            assert bool(torch.isfinite(alone.tokens).all())
        else:
            differing += int(not torch.equal(alone.tokens[0], tokens[i]))
    assert differing <= 1, f"{differing} of 3 images depend on their batch in {pipe.dtype}"


def check_next_scale_method(pipe, method, options):
    """A next-scale method: one token map [B, pn, pn] per scale, the common statistics with scales as
    rows, determinism and batch invariance."""
    sizes = pipe.model.scale_sizes
    run = dict(method=method.name, output_type="tokens", seed=5, **options)
    out = pipe.generate(**conditions(pipe, 3), **run)
    tokens, stats = out.tokens, out.stats
    assert [tuple(t.shape) for t in tokens] == [(3, side, side) for side in sizes]
    assert all(t.dtype == torch.long and 0 <= int(t.min()) and int(t.max()) < pipe.model.vocab_size for t in tokens)
    assert set(COMMON_STATS) | {"method", "lossless", "batch_size"} <= set(stats)
    assert stats["method"] == method.name and stats["batch_size"] == 3
    assert stats["forward_passes_per_image"] == [len(sizes)] * 3 and stats["forward_passes"] == len(sizes)
    assert stats["tokens_per_forward"] >= 1.0 and stats["latency_s"] > 0
    assert len(stats["draft_tokens_by_row"]) == len(sizes) and stats["acceptance_rate"] is None
    assert stats["lossless"] == method.is_lossless(options, pipe.model)
    assert (stats["draft_forward_passes"] > 0) == method.needs_draft
    assert [tuple(c.shape) for c in stats["commit_pass"]] == [(3, side, side) for side in sizes]
    assert [int(c.min()) for c in stats["commit_pass"]] == list(range(1, len(sizes) + 1))
    again = pipe.generate(**conditions(pipe, 3), **run)
    assert all(torch.equal(a, b) for a, b in zip(again.tokens, tokens, strict=True))
    differing = 0  # none in fp32; at most one of three in half precision (check_low_precision_batch_invariance)
    for i in range(3):
        labels = {k: v[i : i + 1] for k, v in conditions(pipe, 3).items()}
        alone = pipe.generate(**labels, **{**run, "seed": 5 + i})
        differing += not all(torch.equal(a[0], b[i]) for a, b in zip(alone.tokens, tokens, strict=True))
    exact = pipe.dtype == torch.float32 and not ON_ACCELERATOR  # at one CPU thread (the one_thread mark)
    assert differing <= (0 if exact else 1), f"{differing} of 3 images depend on their batch"


# A tiny model of another kind, for the refusals: a method meets a family that is not of its kind.
OTHER_KIND = {"raster": "maskgit", "masked": "llamagen", "next-scale": "mar", "continuous": "var"}


@pytest.mark.parametrize("method_name", sorted(METHODS))
def test_every_method_refuses_a_model_of_another_kind(method_name):
    method = METHODS[method_name]
    pipe = tiny_pipeline(OTHER_KIND[method.model_kind])
    other = pipe.model.model_kind
    message = (
        f"method '{method_name}' decodes {method.model_kind} models; {type(pipe.model).__name__} is a {other} model"
    )
    with pytest.raises(VisarError, match=re.escape(message)):
        method.check_model(pipe.model)
    if method_name == "auto":  # through the pipeline, "auto" is the other kind's reference decoding
        out = pipe.generate(class_labels=[0], method=method_name, output_type="tokens")
        assert out.stats["method"] == reference_method(pipe.model)
        return
    # through the pipeline the model is named as the user named it, not by its class
    named = message.replace(type(pipe.model).__name__, pipe.name)
    with pytest.raises(VisarError, match=re.escape(named)):
        pipe.generate(class_labels=[0], method=method_name, output_type="tokens")


def test_methods_for_a_model_are_those_of_its_kind_that_it_has_what_they_need_for():
    """A masked model gets masked methods only, a raster model raster ones, each in registration order
    with its kind's reference first; a method that requires an attribute the model lacks is left out."""
    masked, raster = tiny_pipeline("maskgit").model, tiny_pipeline("llamagen").model
    assert methods_for(masked)[0] == "maskgit" and {METHODS[m].model_kind for m in methods_for(masked)} == {"masked"}
    raster_methods = methods_for(raster)
    assert raster_methods[:2] == ["ar", "sjd"] and "maskgit" not in raster_methods
    assert raster_methods == [m for m in METHODS if m in raster_methods]  # registration order
    # the methods that require more than the kind's interface (zipar-tree: dependency_reach) come and go with it
    needy = [m for m in METHODS if METHODS[m].model_kind == "raster" and METHODS[m].requires]
    declared = SimpleNamespace(model_kind="raster", **{need: 1 for m in needy for need in METHODS[m].requires})
    assert needy and not set(needy) & set(raster_methods) and set(needy) <= set(methods_for(declared))
    assert [m for m in methods_for(declared) if m not in needy] == raster_methods
    for model in (masked, raster):
        assert methods_for(model)[0] == reference_method(model)
        for name, method in METHODS.items():  # exactly the methods whose check_model passes
            try:
                method.check_model(model)
            except VisarError:
                assert name not in methods_for(model)
            else:
                assert name in methods_for(model)


def test_every_family_kind_has_methods():
    kinds = {method.model_kind for method in METHODS.values()}
    assert {family.model_kind for family in FAMILIES.values()} <= kinds


def test_lossless_labels_say_when_a_lossy_method_is_exact():
    assert METHODS["sjd"].lossless_label == "lossless"
    assert METHODS["gsd"].lossless_label == "lossy (exact when group_size=1)"
    assert METHODS["zipar"].lossless_label == "lossy (exact when s >= the grid width)"
    model = tiny_llamagen(vocab=8, block_size=16)  # a 4 x 4 grid
    assert METHODS["zipar"].is_lossless({"s": 4}, model) and not METHODS["zipar"].is_lossless({"s": 3}, model)
    assert not METHODS["gsd"].is_lossless({}, model) and METHODS["gsd"].is_lossless({"group_size": 1}, model)
    assert METHODS["lantern++"].is_lossless({"delta": 0.0}, model)


# -- every exactness claim, against the enumerated law ------------------------------------------------

PARAMS = SamplingParams(guidance_scale=2.0, top_k=4)
# The enumerated law is a raster model's. Continuous claims are tested in tests/accel/continuous/test_cspd.py (per-token
# marginals) and tests/accel/continuous/test_mar.py (mar-cache's equality with plain MAR); next-scale ones (var-prune at
# keep_fraction 1, code with every scale drafted) are equalities with plain `var`, tested in tests/models/test_var.py.
EXACT_CLAIMS = sorted(
    name for name, method in METHODS.items() if method.exact_when is not None and method.model_kind == "raster"
)


def law_options(method, model, **overrides) -> dict:
    options = {k: v for k, v in SMALL.items() if k in method.options}
    if method.needs_draft:
        options[method.draft_option] = perturbed(model, seed=1, scale=0.3)
    return {**options, **overrides}


def law_request(model, cond) -> Request:
    """Images of `cond`, with a unit-norm codebook as the tokenizer for the methods that compare code vectors."""
    return Request(model, cond, PARAMS, make_generators(len(cond), 9), tokenizer=unit_codebook(VOCAB, 3, 0))


@pytest.fixture(scope="module")
def law_model():
    return tiny_llamagen(vocab=VOCAB, block_size=4, device=TEST_DEVICE)  # 2 x 2 tokens: 1,296 sequences


@pytest.mark.slow
@pytest.mark.parametrize("method_name", EXACT_CLAIMS)
def test_exact_settings_sample_the_exact_law(law_model, method_name):
    method = METHODS[method_name]
    assert method.is_lossless(method.exact_example, law_model)
    options = law_options(method, law_model, **method.exact_example)
    label, cond = 1, torch.full((law_samples(SAMPLES),), 1, device=law_model.device)
    tokens, _ = method.fn(law_request(law_model, cond), **options)
    pvalue, tv, tolerance = compare_laws(sequence_index(tokens, VOCAB), exact_law(law_model, label, PARAMS))
    print(f"{method_name} {method.exact_example}: p={pvalue:.3g} tv={tv:.4f} tol={tolerance:.4f}")
    assert pvalue > 1e-3 and tv < tolerance


@pytest.mark.slow
def test_the_law_test_catches_a_lossy_setting(law_model):
    """Negative control: lantern moving up to half the mass is caught by the same comparison."""
    method = METHODS["lantern"]
    options = law_options(method, law_model, delta=0.5, k=4)
    cond = torch.full((law_samples(SAMPLES),), 1, device=law_model.device)
    tokens, _ = method.fn(law_request(law_model, cond), **options)
    pvalue, tv, tolerance = compare_laws(sequence_index(tokens, VOCAB), exact_law(law_model, 1, PARAMS))
    assert pvalue < 1e-3 and tv > tolerance
