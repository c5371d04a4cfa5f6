"""Lumina-mGPT's sampling law on visar's tiny random Lumina-mGPTs (nothing downloaded, no official code).

(a) 2.0's guidance schedule: the scale of each image token, recomputed here step by step over the whole
sequence the official CFG processor sees (header, image tokens and row ends), equals the adapter's table,
and the scorer mixes with it (a cond/uncond pair of logits through `GuidedScorer`);
(b) every lossless raster method samples the enumerated joint law of each of two left-padded prompts in
one batch (image vocabulary 6, 2 x 2 tokens, so every token sits next to a row end), the law computed
here by teacher forcing with the schedule above; negative controls: the law with a constant scale, and
the law with the row ends dropped, are both far from it.
Greedy equality with the official code on its own fixtures: tests/models/test_hf_lumina.py.
"""

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from conftest import law_samples  # noqa: E402
from laws import all_sequences, compare_laws, sequence_index  # noqa: E402

from visar.accel import Request, get_method  # noqa: E402
from visar.accel.core.sampling import SamplingParams, logits_to_probs, make_generators  # noqa: E402
from visar.families import hf_lumina  # noqa: E402
from visar.loading import seeded_init  # noqa: E402

VOCAB = 6
PROMPTS = ["a red circle", "the blue dog on a green square"]


def official_schedule(scale: float, height: int, width: int, units: tuple[int, int]) -> list[float]:
    """2.0's CFG processor, step by step: after the header every step is n = 2, 3, ... (tokens after
    <racm3:break>), g <- max(4, g * (1 - n / (2 h * 2 w))); the steps that predict a row end are skipped
    here but still update g."""
    area = (units[0] * 2) * (units[1] * 2)
    scales, g, n = [], scale, 2
    for _row in range(height):
        for column in range(width + 1):
            g = max(4.0, g * (1 - n / area))
            if column < width:
                scales.append(g)
            n += 1
    return scales


def tiny_lumina(version: int, size: int, downsampling: int, seed: int = 0):
    args = hf_lumina.tiny_model_args(version, size, size) | {"image_vocab": VOCAB, "downsampling": downsampling}
    model = hf_lumina.build_model(args)
    seeded_init(model, seed, std=0.3)
    return model.eval(), hf_lumina.build_text_encoder(args)


@pytest.mark.parametrize("scale", [1.5, 5.0, 40.0])
def test_the_schedule_is_the_official_processors(scale):
    model, _ = tiny_lumina(2, 64, 8)  # an 8 x 8 grid, 2 x 2 header units
    index = torch.arange(model.num_image_tokens)
    expected = torch.tensor(official_schedule(scale, 8, 8, (2, 2)), dtype=torch.float32)
    assert torch.equal(model.guidance_schedule(scale, index), expected)
    assert expected.min() == 4.0 and (scale < 4 or expected.max() > 4)  # the floor, and a decay to it


def test_1_0_has_no_schedule():
    model, _ = tiny_lumina(1, 64, 16)
    assert model.guidance_schedule is None


def test_the_scorer_mixes_with_the_scheduled_scale():
    from visar.accel.core.scoring import GuidedScorer

    model, encoder = tiny_lumina(2, 64, 8)
    ids, mask = encoder.encode(PROMPTS)
    params = SamplingParams(guidance_scale=40.0)
    scorer = GuidedScorer(model, ids, mask, params)
    tokens = torch.randint(0, VOCAB, (2, model.num_image_tokens))
    with scorer.cache(model.max_seq_len):
        scorer.prefill()
        positions = torch.arange(model.num_image_tokens - 1) + model.num_condition_tokens
        guided = scorer.logits(tokens[:, :-1], positions)
    cond = model(tokens[:, :-1], ids, cond_mask=mask)[:, model.num_condition_tokens :]
    null = model(tokens[:, :-1], model.null_condition(ids), cond_mask=model.null_condition_mask(mask))
    null = null[:, model.num_condition_tokens :]
    scales = torch.tensor(official_schedule(40.0, 8, 8, (2, 2))[1:])[None, :, None]
    torch.testing.assert_close(guided, null + (cond - null) * scales, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(guided, null + (cond - null) * 40.0, atol=1e-2)


# -- (b) the enumerated law -----------------------------------------------------------------------------


@torch.no_grad()
def lumina_law(model, ids, mask, params, scales, drop_row_ends=False) -> np.ndarray:
    """P(sequence) of one prompt for every 2 x 2 sequence, teacher-forced, mixed with these scales [N]."""
    seqs = all_sequences(model.vocab_size, model.num_image_tokens)
    cond, cond_mask = ids.expand(len(seqs), -1), mask.expand(len(seqs), -1)
    grid = model._grid_size
    if drop_row_ends:  # one row of H * W + 1 tokens: no row end is ever fed
        model._grid_size = (1, model.num_image_tokens + 1)
    try:
        logits = model(seqs[:, :-1], cond, cond_mask=cond_mask)[:, model.num_condition_tokens - 1 :]
        null = model(seqs[:, :-1], model.null_condition(cond), cond_mask=model.null_condition_mask(cond_mask))
    finally:
        model._grid_size = grid
    null = null[:, model.num_condition_tokens - 1 :]
    if params.uses_cfg:
        logits = null + (logits - null) * torch.tensor(scales)[None, :, None]
    probs = logits_to_probs(logits, params)
    return probs.gather(-1, seqs[..., None]).squeeze(-1).double().prod(-1).numpy()


LAW_CASES = [
    ("ar", {}, 40.0, None),
    ("sjd", {"window": 4}, 40.0, 4),
    ("mc-sjd", {"window": 4}, 40.0, None),
    ("sjd-pac", {"window": 4, "branch": 2, "depth": 2}, 40.0, None),
    ("tree-mc-sjd", {"window": 4, "branch": 2, "depth": 2}, 1.0, None),
]


@pytest.mark.slow
@pytest.mark.parametrize("method, options, scale, top_k", LAW_CASES, ids=[c[0] for c in LAW_CASES])
def test_every_lossless_method_samples_2_0s_law(method, options, scale, top_k):
    model, encoder = tiny_lumina(2, 32, 16, seed=3)  # 2 x 2 tokens, one grid unit: scales 20, 5, 4, 4
    ids, mask = encoder.encode(PROMPTS)
    params = SamplingParams(guidance_scale=scale, top_k=top_k)
    scales = official_schedule(scale, 2, 2, (1, 1))
    samples = law_samples(12_000)
    which = torch.arange(samples) % 2
    request = Request(model, ids[which], params, make_generators(samples, 100), cond_mask=mask[which])
    tokens, stats = get_method(method).fn(request, **options)
    for prompt in (0, 1):
        law = lumina_law(model, ids[prompt], mask[prompt], params, scales)
        pvalue, tv, tolerance = compare_laws(sequence_index(tokens[which == prompt], VOCAB), law)
        print(f"{method} prompt {prompt}: p={pvalue:.3g} tv={tv:.4f} tol={tolerance:.4f}")
        assert pvalue > 1e-3 and tv < tolerance, (prompt, pvalue, tv, tolerance)
    if method != "ar":
        assert stats["tokens_per_forward"] > 1.0
    if params.uses_cfg:  # negative controls: a constant scale, and no row ends, are other laws
        law = lumina_law(model, ids[0], mask[0], params, scales)
        constant = lumina_law(model, ids[0], mask[0], params, [scale] * 4)
        no_row_ends = lumina_law(model, ids[0], mask[0], params, scales, drop_row_ends=True)
        assert 0.5 * np.abs(law - constant).sum() > 0.05
        assert 0.5 * np.abs(law - no_row_ends).sum() > 0.05
