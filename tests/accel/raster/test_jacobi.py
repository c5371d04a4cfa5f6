"""The speculative Jacobi engine: exact joint law, greedy equality with AR, batch invariance, KV cache, bad input.

The exactness test enumerates the joint law of a tiny LlamaGen (vocabulary 6, 2x2 = 4 image
tokens: 1296 sequences) by scoring every sequence with the model through `logits_to_probs`,
then draws 20,000 images from each lossless method in one batch and compares (chi-square and
total variation). Every method meets every window length (2, 4, 8: 8 is clipped to the 4
tokens), and each meets CFG, top-k and top-p in some combination; a 3x3-token model with
vocabulary 2 runs the couplings with a window of 8 that is not clipped. Plain AR, sjd and both
mc-sjd couplings also sample the entropy temperature's target exactly, and draws that ignore it fail.
"""

import copy
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import TEST_DEVICE, law_samples
from laws import (
    CFG_TOPK,
    CFG_TOPK_TOPP,
    CFG_TOPK_TOPP_ENTROPY,
    SAMPLES,
    TOPP_TEMP,
    VOCAB,
    compare_laws,
    draw,
    exact_law,
    perturbed,
    sequence_index,
    tiny_llamagen,
)

import visar
from visar.accel import METHODS, get_method
from visar.accel.core.acceptance import AcceptanceRule, lossless, speculative_accept
from visar.accel.core.method_registry import Request
from visar.accel.core.sampling import SamplingParams, make_generators
from visar.accel.core.stats import COMMON_STATS
from visar.accel.raster import chain, drafts, proposers
from visar.accel.raster.methods import ar, jacobi
from visar.errors import VisarError


@pytest.fixture(scope="module")
def model():
    return tiny_llamagen(device=TEST_DEVICE)  # the law tests' model: on VISAR_TEST_DEVICE


@pytest.fixture(scope="module")
def draft(model):
    return perturbed(model, seed=1, scale=0.3)


SETTINGS = [CFG_TOPK, TOPP_TEMP, CFG_TOPK_TOPP]
LOSSLESS = [
    ("sjd", {}),
    ("mc-sjd", {"coupling": "maximal"}),
    ("mc-sjd", {"coupling": "gumbel"}),
    ("spec", {}),
]
# Every (method, window) pair once; the sampling settings rotate so each method meets all three.
CASES = [
    pytest.param(name, options, window, SETTINGS[(i + j) % 3], id=f"{name}-{options.get('coupling', '')}-w{window}")
    for i, (name, options) in enumerate(LOSSLESS)
    for j, window in enumerate([2, 4, 8])
]
# and the entropy temperature's target (issue 70), which the verifiers read from the same logits_to_probs
CASES += [
    pytest.param(name, options, 4, CFG_TOPK_TOPP_ENTROPY, id=f"{name}-{options.get('coupling', '')}-w4-entropy")
    for name, options in LOSSLESS[:3]
]
SPANS = {("sjd", 8): dict(warmup=1), ("mc-sjd", 2): dict(tail=1), ("spec", 4): dict(warmup=1, tail=1)}


@pytest.mark.slow
@pytest.mark.parametrize("name, options, window, params", CASES)
def test_joint_law_is_exact(model, draft, name, options, window, params):
    options = dict(options, window=window, **SPANS.get((name, window), {}))
    if name == "spec":
        options["draft"] = draft
    label, seed = 1, 1000 * window
    tokens, stats = draw(name, model, label, params, law_samples(SAMPLES), seed, **options)
    pvalue, tv, tolerance = compare_laws(sequence_index(tokens, VOCAB), exact_law(model, label, params))
    print(f"{name} {options.get('coupling', '')} w={window} p={pvalue:.3g} tv={tv:.4f} tol={tolerance:.4f}")
    assert pvalue > 1e-3 and tv < tolerance, (pvalue, tv, tolerance)
    assert stats["tokens_per_forward"] > 1.0  # the windows were used, not only plain AR steps

    # Batch composition does not matter: images 0..2 decoded in batches of 3 (with another
    # class and seed in the middle) and 1 give the same tokens and forward counts as in the big batch.
    cond = torch.tensor([label, 2, label], device=model.device)
    gens = [
        torch.Generator().manual_seed(seed),
        torch.Generator().manual_seed(77),
        torch.Generator().manual_seed(seed + 2),
    ]
    small, small_stats = get_method(name).fn(Request(model, cond, params, gens), **options)
    assert torch.equal(small[[0, 2]], tokens[[0, 2]])
    assert [small_stats["forward_passes_per_image"][i] for i in (0, 2)] == [
        stats["forward_passes_per_image"][i] for i in (0, 2)
    ]
    alone, alone_stats = draw(name, model, label, params, 1, seed + 1, **options)
    assert torch.equal(alone[0], tokens[1])
    assert alone_stats["forward_passes_per_image"][0] == stats["forward_passes_per_image"][1]


@pytest.mark.slow
@pytest.mark.parametrize("coupling", ["maximal", "gumbel"])
def test_joint_law_with_a_full_window_of_8(coupling):
    """Windows of 8 that are not clipped: a vocabulary-2 model with 3x3 tokens (512 sequences), so
    carried drafts travel across several passes and the Gumbel noise ring (8 rows) wraps around."""
    model = tiny_llamagen(vocab=2, block_size=9, seed=2, device=TEST_DEVICE)
    params, label = SamplingParams(temperature=1.2), 1
    tokens, stats = draw("mc-sjd", model, label, params, law_samples(SAMPLES), 6000, window=8, coupling=coupling)
    pvalue, tv, tolerance = compare_laws(sequence_index(tokens, 2), exact_law(model, label, params))
    print(f"mc-sjd {coupling} 3x3 w=8: p={pvalue:.3g} tv={tv:.4f} tol={tolerance:.4f}")
    assert pvalue > 1e-3 and tv < tolerance
    assert stats["draft_tokens_by_slot"][6] > 0  # the last draft slot of the window was verified


def repeat_left_init(request: drafts.FillRequest):
    """A 2-D style initialiser through the canvas hook: copy the token to the left (q one-hot: the
    copy is determined by what the verifier has already seen), else a uniform token (q uniform)."""
    vocab = request.state.vocab_size
    left = request.canvas.gather(1, (request.draft_index - 1).clamp(min=0))
    known = (left >= 0) & (request.draft_index % request.state.grid_size[1] > 0)
    random_tokens, uniform = drafts.random_init(request)
    tokens = torch.where(known, left, random_tokens)
    one_hot = torch.nn.functional.one_hot(tokens, vocab).float()
    return tokens, torch.where(known[..., None], one_hot, uniform)


@pytest.mark.slow
def test_pluggable_initialiser_keeps_the_law(model):
    params, label = CFG_TOPK, 1
    tokens, stats = draw("mc-sjd", model, label, params, law_samples(SAMPLES), 5000, window=4, init=repeat_left_init)
    pvalue, tv, tolerance = compare_laws(sequence_index(tokens, VOCAB), exact_law(model, label, params))
    print(f"mc-sjd repeat-left init: p={pvalue:.3g} tv={tv:.4f} tol={tolerance:.4f}")
    assert pvalue > 1e-3 and tv < tolerance


@pytest.mark.slow
@pytest.mark.parametrize(
    "params",
    [CFG_TOPK, TOPP_TEMP, CFG_TOPK_TOPP, CFG_TOPK_TOPP_ENTROPY],
    ids=["cfg-topk", "topp-temp", "cfg-topk-topp", "cfg-topk-topp-entropy"],
)
def test_plain_ar_samples_the_enumerated_law(model, params):
    """The reference itself: each token drawn from logits_to_probs of its prefix is the teacher-forced law."""
    tokens, _ = draw("ar", model, 1, params, law_samples(SAMPLES), 8000)
    pvalue, tv, tolerance = compare_laws(sequence_index(tokens, VOCAB), exact_law(model, 1, params))
    print(f"ar {params}: p={pvalue:.3g} tv={tv:.4f} tol={tolerance:.4f}")
    assert pvalue > 1e-3 and tv < tolerance


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ar", "mc-sjd"])
def test_ignoring_the_entropy_temperature_is_detected(model, name):
    """Negative control: draws at the same settings without the entropy temperature (a method that dropped
    it) fail the joint-law test against its target."""
    plain = replace(CFG_TOPK_TOPP_ENTROPY, entropy_temperature=None)
    tokens, _ = draw(name, model, 1, plain, law_samples(SAMPLES), 8100, **({"window": 4} if name != "ar" else {}))
    pvalue, tv, tolerance = compare_laws(sequence_index(tokens, VOCAB), exact_law(model, 1, CFG_TOPK_TOPP_ENTROPY))
    print(f"{name} without the entropy temperature: p={pvalue:.3g} tv={tv:.4f} tol={tolerance:.4f}")
    assert pvalue < 1e-3 and tv > tolerance


@pytest.mark.slow
def test_wrong_residual_is_detected(model):
    """Negative control: SJD resampling rejections from p (Lumina-mGPT 2.0) fails the same joint-law test."""

    @lossless(False)
    def from_target(target_probs, draft_probs):
        return target_probs

    params, label = TOPP_TEMP, 1
    proposer = proposers.JacobiProposer(drafts.random_init, proposers.Carry(proposers.independent_carry))
    rule = AcceptanceRule(speculative_accept, from_target)
    cond = torch.full((law_samples(SAMPLES),), label, device=model.device)
    request = Request(model, cond, params, make_generators(len(cond), 4000))
    tokens, _ = chain.speculative_decode(request, proposer, window=4, rule=rule)
    pvalue, tv, tolerance = compare_laws(sequence_index(tokens, VOCAB), exact_law(model, label, params))
    print(f"wrong residual: p={pvalue:.3g} tv={tv:.4f} tol={tolerance:.4f}")
    assert pvalue < 1e-3 and tv > tolerance


@pytest.mark.parametrize("params", [SamplingParams(top_k=1), SamplingParams(top_k=1, guidance_scale=3.0)])
@pytest.mark.parametrize("window", [3, 16])
def test_greedy_equals_plain_ar(model16, params, window):
    cond = torch.tensor([0, 2, 1])
    reference, _ = ar.autoregressive(Request(model16, cond, params, make_generators(3, 0)))
    draft = perturbed(model16, seed=5, scale=0.1)
    for name, options in LOSSLESS:
        options = dict(options, window=window, **({"draft": draft} if name == "spec" else {}))
        tokens, _ = get_method(name).fn(Request(model16, cond, params, make_generators(3, 9)), **options)
        assert torch.equal(tokens, reference), (name, options)


def test_greedy_equals_plain_ar_text_conditional():
    """Caption conditions with padding (t2i): the condition prefill and the cache's key mask carry over."""
    model = tiny_llamagen(vocab=32, block_size=9, seed=4, std=0.3, model_type="t2i", cls_token_num=3, caption_dim=8)
    captions = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[False, True, True], [True, True, True]])
    params = SamplingParams(top_k=1, guidance_scale=2.0)
    reference, _ = ar.autoregressive(Request(model, captions, params, make_generators(2, 0), cond_mask=mask))
    draft = perturbed(model, seed=5, scale=0.1)
    for name, options in LOSSLESS:
        options = dict(options, window=4, **({"draft": draft} if name == "spec" else {}))
        tokens, _ = get_method(name).fn(
            Request(model, captions, params, make_generators(2, 1), cond_mask=mask), **options
        )
        assert torch.equal(tokens, reference), (name, options)


def test_identical_draft_is_always_accepted(model16):
    """The draft model's ragged cache stays in step with the target's: a copy of the target as draft
    has every draft accepted, so each pass commits a full window."""
    window, cond = 5, torch.tensor([0, 1])
    tokens, stats = jacobi.spec(
        Request(model16, cond, SamplingParams(top_k=1), make_generators(2, 0)),
        draft=copy.deepcopy(model16),
        window=window,
    )
    passes = math.ceil(model16.num_image_tokens / window)
    assert stats["forward_passes_per_image"] == [passes, passes]
    assert stats["acceptance_rate"] == 1.0
    # the draft runs window - 1 steps per pass (the first includes its prefill); the catch-up of the
    # bonus token of a full acceptance costs one more step
    assert stats["draft_forward_passes"] <= passes * window


@pytest.mark.parametrize("name, options", [("sjd", {}), ("mc-sjd", {"coupling": "gumbel"})])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(guidance_scale=2.0)])
def test_cached_window_logits_equal_fresh_forward(model16, name, options, params):
    """Every cached window pass (ragged positions, after per-image truncation) gives the logits of a
    fresh, cache-free forward over the committed prefix plus that window."""
    calls = []
    original = model16.forward

    def recording_forward(tokens=None, cond=None, **kw):
        logits = original(tokens, cond, **kw)
        if cond is None:
            calls.append((tokens.clone(), kw["input_pos"].clone(), logits.clone()))
        return logits

    cond = torch.tensor([0, 2, 1])
    model16.forward = recording_forward
    try:
        tokens, stats = get_method(name).fn(Request(model16, cond, params, make_generators(3, 1)), window=6, **options)
    finally:
        del model16.forward
    assert len(calls) == stats["forward_passes"] - 1 and len(calls) > 3
    full_cond = torch.cat([cond, model16.null_condition(cond)]) if params.uses_cfg else cond
    num_cond, checked = model16.num_condition_tokens, 0
    for window_tokens, input_pos, logits in calls:
        for row in range(len(window_tokens)):
            image = row % len(cond)
            committed = int(input_pos[row, 0]) - num_cond + 1
            if committed >= model16.num_image_tokens:
                continue  # a finished image riding along
            # Padding slots sit after the window, clamped to the last position (which never holds a
            # real input: the last image token is never fed), where several may collide.
            real = int((input_pos[row] < num_cond + model16.num_image_tokens - 1).sum())
            assert window_tokens[row, 0] == tokens[image, committed - 1]
            seq = torch.cat([tokens[image, : committed - 1], window_tokens[row, :real]])
            fresh = model16(seq[None], full_cond[row : row + 1])[0, num_cond - 1 + committed :]
            torch.testing.assert_close(logits[row, :real], fresh, atol=1e-5, rtol=0)
            checked += 1
    assert checked > 10


def test_stats_and_window_clipping(model16):
    cond = torch.tensor([0, 1])
    tokens, stats = jacobi.mc_sjd(Request(model16, cond, SamplingParams(), make_generators(2, 0)), window=100)
    assert tokens.shape == (2, 16)
    assert set(COMMON_STATS) <= set(stats) and stats["window"] == 16
    per_image = stats["forward_passes_per_image"]
    assert stats["forward_passes"] == max(per_image)
    # every pass commits its accepted drafts plus one token: accepted drafts = tokens - passes,
    # counted by the image row they sit in (a 4x4 grid here) and by window slot
    assert len(stats["accepted_tokens_by_row"]) == 4
    assert stats["accepted_tokens"] == sum(stats["accepted_tokens_by_row"]) == 2 * 16 - sum(per_image)
    assert sum(stats["accepted_tokens_by_slot"]) == stats["accepted_tokens"]
    assert stats["draft_tokens"] == sum(stats["draft_tokens_by_row"]) == sum(stats["draft_tokens_by_slot"])
    assert all(a <= t for a, t in zip(stats["accepted_tokens_by_row"], stats["draft_tokens_by_row"], strict=True))
    assert stats["acceptance_rate"] == stats["accepted_tokens"] / stats["draft_tokens"]
    assert stats["tokens_per_forward"] == pytest.approx(np.mean([16 / p for p in per_image]))
    # plain-AR spans: window 1 everywhere is exactly AR, one token per pass
    _, ar_stats = jacobi.sjd(Request(model16, cond, SamplingParams(), make_generators(2, 0)), warmup=16)
    assert ar_stats["forward_passes"] == 16 and ar_stats["tokens_per_forward"] == 1.0
    _, tail_stats = jacobi.sjd(Request(model16, cond, SamplingParams(), make_generators(2, 0)), window=4, tail=16)
    assert tail_stats["forward_passes"] == 16


def test_coupling_needs_fewer_passes_than_sjd(model16):
    """The point of MC-SJD: carried drafts survive more often, so fewer target passes (on this
    model and seed: sjd 2.02, maximal 2.33, gumbel 2.13 tokens per pass)."""
    cond = torch.zeros(64, dtype=torch.long)
    params = SamplingParams()
    sjd_rate = jacobi.sjd(Request(model16, cond, params, make_generators(64, 0)), window=8)[1]["tokens_per_forward"]
    for coupling in ("maximal", "gumbel"):
        _, stats = jacobi.mc_sjd(Request(model16, cond, params, make_generators(64, 0)), window=8, coupling=coupling)
        print(f"tokens per forward: sjd {sjd_rate:.3f}, mc-sjd {coupling} {stats['tokens_per_forward']:.3f}")
        assert stats["tokens_per_forward"] > sjd_rate + 0.05


def test_methods_are_registered_with_their_options():
    assert {"sjd", "mc-sjd", "spec"} <= set(METHODS)
    assert all(METHODS[m].lossless for m in ("sjd", "mc-sjd", "spec"))
    assert METHODS["sjd"].options == ["window", "warmup", "tail", "init", "budget"]
    assert METHODS["mc-sjd"].options == ["window", "warmup", "tail", "coupling", "init", "budget"]
    assert METHODS["spec"].options == ["draft", "window", "warmup", "tail"]


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(window=0), "window must be an integer >= 1"),
        (dict(window=-3), "window must be an integer >= 1"),
        (dict(window=2.5), "window must be an integer >= 1"),
        (dict(warmup=-1), "warmup must be an integer >= 0"),
        (dict(tail=True), "tail must be an integer >= 0"),
        (dict(init="zeros"), "unknown draft initialiser"),
    ],
)
def test_bad_options(model16, options, message):
    with pytest.raises(VisarError, match=message):
        jacobi.sjd(Request(model16, torch.tensor([0]), SamplingParams(), make_generators(1, 0)), **options)


def test_bad_coupling_and_draft(model16):
    request = Request(model16, torch.tensor([0]), SamplingParams(), make_generators(1, 0))
    with pytest.raises(VisarError, match="unknown coupling"):
        jacobi.mc_sjd(request, coupling="independent")
    with pytest.raises(VisarError, match="needs a draft model"):
        jacobi.spec(request)
    with pytest.raises(VisarError, match="vocabulary"):
        jacobi.spec(request, draft=tiny_llamagen(vocab=48, block_size=16))
    with pytest.raises(VisarError, match="separate model instance"):
        jacobi.spec(request, draft=model16)
    with pytest.raises(VisarError, match="grid"):
        jacobi.spec(request, draft=tiny_llamagen(vocab=32, block_size=4))
    with pytest.raises(VisarError, match="must be a raster model"):  # names are resolved by the pipeline
        jacobi.spec(request, draft="visar-tiny-random")
    with pytest.raises(VisarError, match="condition"):
        jacobi.spec(request, draft=tiny_llamagen(vocab=32, block_size=16, num_classes=5))


def test_draft_with_another_tokenizer_is_rejected():
    pipe = visar.load("visar-tiny-random", device="cpu")
    other = visar.load("visar-tiny-random", device="cpu")
    with torch.no_grad():
        other.tokenizer.quantize.embedding.weight.add_(1.0)
    options = dict(method="spec", output_type="tokens", top_k=1)
    with pytest.raises(VisarError, match="tokenizer differs"):
        pipe.generate(class_labels=[0], draft=other, **options)
    with pytest.raises(VisarError, match="unknown model"):
        pipe.generate(class_labels=[0], draft="no-such-model", **options)
    # by name: the registered model's tokenizer is the same one, so it drafts (it is the same network here)
    out = pipe.generate(class_labels=[0], draft="visar-tiny-random", window=8, **options)
    assert out.stats["acceptance_rate"] == 1.0


def test_the_draft_tokenizer_check_reads_the_device_back_once():
    # a VQ has dozens of tensors: one read-back for all, not one each before the first pass
    from visar.eval.readbacks import ReadBackCounter
    from visar.pipeline import same_tokenizer

    pipe = visar.load("visar-tiny-random", device="cpu")
    other = visar.load("visar-tiny-random", device="cpu")
    assert len(pipe.tokenizer.state_dict()) > 10
    with ReadBackCounter() as counter:
        assert same_tokenizer(pipe.tokenizer, other.tokenizer)
    assert counter.total == 1
    with torch.no_grad():
        next(iter(other.tokenizer.parameters()))[..., -1:].add_(1.0)  # one value of one tensor
    assert not same_tokenizer(pipe.tokenizer, other.tokenizer)


def test_pipeline_and_unknown_option():
    pipe = visar.load("visar-tiny-random", device="cpu")
    out = pipe.generate(class_labels=[1, 2], method="mc-sjd", window=8, output_type="tokens", seed=3)
    assert out.tokens.shape == (2, 16, 16) and out.stats["lossless"] and out.stats["method"] == "mc-sjd"
    with pytest.raises(VisarError, match="unknown option"):
        pipe.generate(class_labels=[1], method="sjd", windw=8, output_type="tokens")
