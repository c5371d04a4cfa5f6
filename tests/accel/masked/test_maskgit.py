"""Masked-model schedules (visar/accel/masked/loop.py, maskgit.py, halton.py, lpd.py) on visar's tiny MaskGIT.

The checks of the parallel-family brief (section 5): per-step reveal counts follow the schedule and
sum to N; revealed tokens never change; with Gumbel scale 0 the lowest-confidence tokens go back
to the mask; the Halton selector covers the grid. Then bad options. LPD's order (proximity picks
that keep the repulsion distance, disjoint groups, fixed by the seed): tests/accel/masked/test_lpd.py.
Shapes, determinism and batch invariance of every method: tests/accel/test_method_conformance.py.
"""

import math

import pytest
import torch
from laws import tiny_pipeline

import visar
from visar.accel.masked.halton import halton_order, radical_inverse
from visar.accel.masked.loop import reveal_counts, sample_positions
from visar.accel.masked.maskgit import noise_temperatures
from visar.errors import VisarError
from visar.families import FAMILIES
from visar.loading import seeded_init
from visar.models.maskgit import MaskGIT, MaskGITConfig

MASKED_METHODS = ["maskgit", "halton", "lpd-order", "lpd-confidence"]


class Recording(MaskGIT):
    """The tiny MaskGIT, keeping every input grid it was called with (and the logits it gave)."""

    def __init__(self, config):
        super().__init__(config)
        self.calls = []

    def forward(self, tokens, cond, cond_mask=None):
        logits = super().forward(tokens, cond, cond_mask)
        self.calls.append((tokens.clone(), logits.clone()))
        return logits


def recording_pipeline(grid: int = 6, seed: int = 0) -> visar.Pipeline:
    args = {**FAMILIES["maskgit"].tiny_model_args, "grid_size": grid}
    model = Recording(MaskGITConfig(**args))
    seeded_init(model, seed, std=0.3)
    return visar.Pipeline(model, None, name="recording", defaults={"guidance_scale": 1.0})


@pytest.mark.parametrize("method", MASKED_METHODS)
@pytest.mark.parametrize("steps", [1, 5, 12, 36])
def test_reveal_counts_follow_the_schedule_and_revealed_tokens_stay(method, steps):
    pipe = recording_pipeline()
    out = pipe.generate(class_labels=[0, 3], method=method, steps=steps, seed=1, output_type="tokens")
    schedule = "arccos" if method == "halton" else "cosine"
    counts = reveal_counts(steps, 36, schedule)
    assert sum(counts) == 36 and all(c >= 1 for c in counts)
    commit_pass = out.stats["commit_pass"].flatten(1)
    for image in range(2):
        assert torch.bincount(commit_pass[image], minlength=steps + 1)[1:].tolist() == counts
    calls = [tokens for tokens, _ in pipe.model.calls]
    assert len(calls) == steps == out.stats["forward_passes"]
    final = out.tokens.flatten(1)
    mask_id = pipe.model.mask_token_id
    for tokens in calls:  # a token, once revealed, is the final token at every later pass
        known = tokens != mask_id
        assert torch.equal(tokens[known], final[known])
    assert (calls[0] == mask_id).all()


def test_cosine_counts_are_amuseds():
    # mask_len = floor(N cos(pi/2 (t+1)/T)), clamped to [1, unknown - 1]; 0 after the last step. In float32,
    # as AmusedScheduler computes it: 256 cos(pi/3) is 127.99999 there, so 127 stay masked after step 7, not 128.
    counts, unknown = [], 256
    for step in range(12):
        ratio = torch.tensor((step + 1) / 12, dtype=torch.float32)
        left = max(1, min(unknown - 1, int((256 * torch.cos(ratio * math.pi / 2)).floor()))) if step < 11 else 0
        counts.append(unknown - left)
        unknown = left
    assert reveal_counts(12, 256, "cosine") == counts and counts[7] == 28
    # aMUSEd's clamp can leave a step with nothing to reveal: linear, N = T = 3 masks floor(1.9999999) = 1
    # after step 0, then max(1, min(unknown - 1, 1)) = 1 again after step 1
    assert reveal_counts(3, 3, "linear") == [2, 0, 1]


def test_without_gumbel_noise_the_least_confident_go_back():
    pipe = recording_pipeline()
    out = pipe.generate(
        class_labels=[2], method="maskgit", steps=4, choice_temperature=[0.0, 0.0], seed=3, output_type="tokens"
    )
    (_, logits0), (tokens1, _) = pipe.model.calls[0], pipe.model.calls[1]
    revealed = tokens1[0] != pipe.model.mask_token_id
    probs = logits0.softmax(-1)
    drawn = sample_positions(probs, [torch.Generator().manual_seed(3)])[0]  # step 0's draws: the seed's first
    assert torch.equal(drawn[revealed], out.tokens.flatten()[revealed])
    confidence = probs[0].gather(-1, drawn[:, None])[:, 0]
    assert revealed.sum() == reveal_counts(4, 36, "cosine")[0]
    assert confidence[revealed].min() >= confidence[~revealed].max()


def test_noise_annealing_conventions():
    # aMUSEd: a pair is linspace(start, end); MaskGIT: c * (1 - (t + 1) / T)
    assert torch.allclose(noise_temperatures([2.0, 0.0], 5), torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0]))
    assert torch.allclose(noise_temperatures(4.5, 3), torch.tensor([3.0, 1.5, 0.0]))


def test_halton_order_covers_the_grid_and_spreads():
    assert [radical_inverse(i, 2) for i in (1, 2, 3)] == [0.5, 0.25, 0.75]
    assert radical_inverse(1, 3) == pytest.approx(1 / 3)
    for height, width in [(16, 16), (4, 6), (1, 5)]:
        assert sorted(halton_order(height, width)) == list(range(height * width))
    first = [(cell // 16, cell % 16) for cell in halton_order(16, 16)[:16]]
    assert len({row for row, _ in first}) == 16  # base 2 stratifies the rows
    assert min(max(abs(a[0] - b[0]), abs(a[1] - b[1])) for i, a in enumerate(first) for b in first[:i]) >= 2


@pytest.mark.parametrize("method", MASKED_METHODS)
@pytest.mark.parametrize("steps", [0, 37, 2.5, True])
def test_steps_out_of_range(method, steps):
    pipe = recording_pipeline()
    with pytest.raises(VisarError, match=r"steps must be an integer from 1 to the number of image tokens \(36"):
        pipe.generate(class_labels=[0], method=method, steps=steps)


@pytest.mark.parametrize(
    "method, options, message",
    [
        ("maskgit", {"choice_temperature": "hot"}, "choice_temperature must be a number"),
        ("maskgit", {"mask_schedule": "square"}, "mask_schedule must be one of cosine, linear, arccos"),
        ("lpd-order", {"repulsion_threshold": -1}, "repulsion_threshold must be an integer >= 0"),
        ("lpd-confidence", {"proximity_threshold": "near"}, "proximity_threshold must be a number >= 0"),
    ],
)
def test_bad_options(method, options, message):
    with pytest.raises(VisarError, match=message):
        recording_pipeline().generate(class_labels=[0], method=method, **options)


def test_masked_methods_refuse_a_raster_model():
    pipe = visar.load("visar-tiny-random", device="cpu")
    with pytest.raises(VisarError, match="method 'halton' decodes masked models; visar-tiny-random is a raster model"):
        pipe.generate(class_labels=[0], method="halton")


def test_teacher_forced_logits_are_for_raster_models():
    with pytest.raises(VisarError, match="Pipeline.logits is for raster models; recording is a masked model"):
        recording_pipeline().logits(torch.zeros(1, 36, dtype=torch.long), class_labels=[0])


def test_bench_on_a_masked_model_measures_against_one_token_per_step():
    from visar.eval.bench import bench

    pipe = tiny_pipeline("maskgit")
    report = bench(pipe, ["halton"], n=2, quality_n=2, method_options={"halton": {"steps": 4}}, progress=False)
    reference, halton = report["rows"]
    assert reference["method"] == "maskgit" and reference["forward_passes"] == pipe.model.num_image_tokens
    assert halton["forward_passes"] == 4 and halton["frechet_vs_ar"] is not None
