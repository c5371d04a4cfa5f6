"""A running batch (`Request.slots`, `Pipeline.generate(batch_size=)`): B slots over a queue of images,
a finished image's slot taken by the next one (`visar.accel.raster.pass_loop.RunningBatch`).

At a fixed budget every image's tokens, passes and commit_pass are those of its decode alone, whatever
slot it took and whoever shared the batch; the joint law holds with refills happening (and a refill
that kept the slot's old condition fails the same test: the negative control); the pipeline runs the
methods that do not refill as consecutive batches, and saves each image of a refilling run as soon as
it is done, so an interrupted run keeps every finished image.
"""

import json
from dataclasses import replace

import pytest
import torch
from conftest import law_samples
from laws import (
    CFG_TOPK,
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

import visar
from visar.accel import get_method
from visar.accel.core.method_registry import Request
from visar.accel.core.sampling import SamplingParams, make_generators
from visar.accel.policy import auto
from visar.errors import VisarError
from visar.eval.samples import SampleJob, generate_missing

GUIDED = SamplingParams(guidance_scale=2.0, temperature=1.1)


@pytest.fixture(scope="module")
def model16():
    """4x4 tokens, vocabulary 32: several windows per image, images that finish at different passes."""
    return tiny_llamagen(vocab=32, block_size=16, seed=3, std=0.3)


def chain_cases(model):
    draft = perturbed(model, seed=1, scale=0.3)
    book = unit_codebook(model.vocab_size, 8, seed=0)
    return [
        ("sjd", {"window": 4}),
        ("mc-sjd", {"window": 8}),
        ("mc-sjd", {"window": 5, "coupling": "gumbel", "init": "random"}),
        ("spec", {"window": 3, "draft": draft}),
        ("gsd", {"window": 6, "group_size": 2}),
        ("lantern", {"window": 4, "delta": 0.2, "coupling": "maximal"}),
    ], book


def decode(model, labels, seeds, name, options, slots=None, tokenizer=None):
    cond = torch.tensor(labels, device=model.device)
    generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    request = Request(model, cond, GUIDED, generators, tokenizer=tokenizer, slots=slots)
    return get_method(name).fn(request, **options)


@pytest.mark.one_thread  # a running batch's images against their decodes alone, bit for bit
def test_every_image_of_a_running_batch_is_its_decode_alone(model16):
    """Seven images through 2 slots (five refills): each image's tokens, passes and commit passes equal
    those of its decode alone, for every chain method."""
    cases, book = chain_cases(model16)
    labels, seeds = [0, 1, 2, 1, 0, 2, 1], [11, 12, 13, 14, 15, 16, 17]
    for name, options in cases:
        assert get_method(name).refills
        tokens, stats = decode(model16, labels, seeds, name, options, slots=2, tokenizer=book)
        assert tokens.shape == (7, 16) and stats["slots"] == 2 and stats["refills"] == 5
        for i, (label, seed) in enumerate(zip(labels, seeds, strict=True)):
            alone, alone_stats = decode(model16, [label], [seed], name, options, tokenizer=book)
            assert torch.equal(tokens[i], alone[0]), (name, options, i)
            assert stats["forward_passes_per_image"][i] == alone_stats["forward_passes_per_image"][0], (name, i)
            assert torch.equal(stats["commit_pass"][i], alone_stats["commit_pass"][0]), (name, i)
        # the batch ran fewer passes than its images took one after another
        assert stats["forward_passes"] < sum(stats["forward_passes_per_image"])


@pytest.mark.one_thread  # a running batch's images against their decodes alone, bit for bit
def test_each_image_is_handed_over_once_as_it_finishes(model16):
    """on_image sees every image once, with its final tokens and passes (the interrupted run below
    shows they come while others still decode)."""
    seen = []
    cond = torch.tensor([0, 1, 2, 0, 1], device=model16.device)
    on_image = lambda index, tokens, info: seen.append((index, tokens.clone(), info["forward_passes"]))  # noqa: E731
    request = Request(model16, cond, GUIDED, make_generators(5, 40), slots=2, on_image=on_image)
    tokens, stats = get_method("mc-sjd").fn(request, window=8)
    assert sorted(index for index, _, _ in seen) == [0, 1, 2, 3, 4]
    for index, image_tokens, passes in seen:
        assert torch.equal(image_tokens, tokens[index])
        assert passes == stats["forward_passes_per_image"][index]


@pytest.mark.slow
@pytest.mark.parametrize("name, options", [("mc-sjd", {"window": 4, "coupling": "gumbel"})])
def test_the_joint_law_holds_with_refills(name, options, monkeypatch):
    """Images of class 2 queued between images of class 1, 64 slots: the class-2 images follow class 2's
    exact law. Negative control: a refill that keeps the slot's old condition (its cache reset, its
    tokens restarted) fails the same test."""
    model = tiny_llamagen(device="cpu")
    n = law_samples(SAMPLES)
    labels = torch.tensor([1 + (i % 3 == 0) for i in range(2 * n)])  # a third of them class 2
    picked = (labels == 2).nonzero()[:, 0]

    def class_two_law(seed):
        request = Request(model, labels, CFG_TOPK, make_generators(len(labels), seed), slots=64)
        tokens, stats = get_method(name).fn(request, **options)
        assert stats["refills"] == len(labels) - 64
        return compare_laws(sequence_index(tokens[picked], VOCAB), exact_law(model, 2, CFG_TOPK))

    pvalue, tv, tolerance = class_two_law(9000)
    print(f"{name} with refills: p={pvalue:.3g} tv={tv:.4f} tol={tolerance:.4f}")
    assert pvalue > 1e-3 and tv < tolerance

    from visar.accel.core.scoring import GuidedScorer

    def stale_admit(self, rows, images):  # resets the rows' cache, keeps their old conditions
        self.model.reset_cache_rows(torch.cat([rows, rows + self.batch]) if self.guided else rows)

    monkeypatch.setattr(GuidedScorer, "admit", stale_admit)
    try:
        pvalue, tv, tolerance = class_two_law(9001)
    except AssertionError as err:  # top-k 4: class 1's law draws sequences class 2's cannot
        assert "zero-probability" in str(err)
        print(f"{name} refilled with stale conditions: drew a sequence of probability 0")
        return
    print(f"{name} refilled with stale conditions: p={pvalue:.3g} tv={tv:.4f} tol={tolerance:.4f}")
    assert pvalue < 1e-3 and tv > tolerance


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline("llamagen")


@pytest.mark.one_thread  # a running batch's images against their decodes alone, bit for bit
def test_pipeline_batch_size_refills_or_runs_consecutive_batches(pipe):
    """A drafting method refills; ar's slots all free at once (consecutive batches); other kinds'
    methods decode consecutive batches in the pipeline. The same images either way."""
    labels = [0, 1, 2, 3, 1, 0]
    whole = pipe.generate(class_labels=labels, method="mc-sjd", seed=3, output_type="tokens")
    running = pipe.generate(class_labels=labels, method="mc-sjd", seed=3, output_type="tokens", batch_size=2)
    assert torch.equal(whole.tokens, running.tokens)
    assert running.stats["forward_passes_per_image"] == whole.stats["forward_passes_per_image"]
    assert running.stats["refills"] == 4 and running.tokens.shape == whole.tokens.shape
    # ar does not refill (every image takes N passes): the pipeline decodes three consecutive batches of two
    assert not get_method("ar").refills
    batches = pipe.generate(class_labels=labels, method="ar", seed=3, output_type="tokens", batch_size=2)
    alone = pipe.generate(class_labels=labels, method="ar", seed=3, output_type="tokens")
    assert torch.equal(batches.tokens, alone.tokens)
    assert batches.stats["forward_passes"] == 3 * pipe.model.num_image_tokens
    assert batches.stats["commit_pass"].shape == alone.stats["commit_pass"].shape
    assert batches.stats["refills"] == 4 and batches.stats["batch_passes"] == 3 * pipe.model.num_image_tokens
    handed = {}
    pipe.generate(
        class_labels=labels, method="ar", seed=3, output_type="tokens", batch_size=4,
        on_image=lambda index, tokens, info: handed.setdefault(index, (tokens, info["forward_passes"])),
    )  # fmt: skip
    assert sorted(handed) == list(range(6))
    assert all(torch.equal(handed[i][0], alone.tokens[i]) for i in range(6))
    assert all(handed[i][1] == pipe.model.num_image_tokens for i in range(6))
    # methods of other kinds decode consecutive batches through the pipeline
    maskgit = tiny_pipeline("maskgit")
    assert not get_method("maskgit").refills
    whole = maskgit.generate(class_labels=labels, method="maskgit", seed=3, output_type="tokens")
    batches = maskgit.generate(class_labels=labels, method="maskgit", seed=3, output_type="tokens", batch_size=4)
    assert torch.equal(whole.tokens, batches.tokens)
    assert batches.stats["forward_passes_per_image"] == whole.stats["forward_passes_per_image"]
    assert batches.stats["slots"] == 4 and batches.stats["refills"] == 2
    assert batches.stats["batch_passes"] == 2 * whole.stats["forward_passes"]


@pytest.mark.parametrize(
    "batch_size, message",
    [(0, "batch_size must be a whole number >= 1"), (2.5, "whole number"), (7, "larger than the 6 images")],
)
def test_bad_batch_sizes_are_one_sentence(pipe, batch_size, message):
    with pytest.raises(VisarError, match=message):
        pipe.generate(class_labels=[0, 1, 2, 3, 1, 0], method="mc-sjd", batch_size=batch_size, output_type="tokens")


@pytest.mark.one_thread  # a running batch's images against their decodes alone, bit for bit
def test_an_interrupted_refilling_run_keeps_its_finished_images_and_resumes_to_the_same_files(pipe, tmp_path):
    def jobs(folder):
        return [SampleJob(folder / f"{i:05d}.png", i % 4, 100 + i) for i in range(7)]

    reference = tmp_path / "reference"
    generate_missing(pipe, jobs(reference), method="mc-sjd", batch_size=3, progress=False)
    interrupted = tmp_path / "interrupted"
    saved = []

    def stop_after_three(job, record):
        saved.append(job)
        if len(saved) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate_missing(
            pipe, jobs(interrupted), method="mc-sjd", batch_size=3, progress=False, on_image=stop_after_three
        )
    assert len(list(interrupted.glob("*.png"))) == 3
    stats = generate_missing(pipe, jobs(interrupted), method="mc-sjd", batch_size=2, progress=False)
    assert stats["generated"] == 4 and stats["reused"] == 3
    for job in jobs(reference):
        assert (interrupted / job.path.name).read_bytes() == job.path.read_bytes()


@pytest.mark.slow  # about 16 s: every row runs warm-up, timed and memory-counted decodes
def test_bench_throughput_rows_and_command(pipe, tmp_path, capsys):
    from visar.apps import cli
    from visar.eval.throughput import throughput, throughput_table

    report = throughput(pipe, ["mc-sjd"], batch_sizes=(1, 3), images_per_slot=3, progress=False)
    rows = {(r["method"], r["batch_size"], r["refill"]): r for r in report["rows"]}
    assert set(rows) == {
        ("ar", 1, False),
        ("ar", 3, False),
        ("mc-sjd", 1, False),
        ("mc-sjd", 3, False),
        ("mc-sjd", 3, True),
    }
    assert rows[("ar", 3, False)]["passes_fed_per_image"] == pipe.model.num_image_tokens
    assert rows[("mc-sjd", 1, False)]["passes_vs_alone"] == 1.0
    # a fixed batch feeds its finished images' rows until its slowest is done; a running batch refills them
    fixed, running = rows[("mc-sjd", 3, False)], rows[("mc-sjd", 3, True)]
    assert fixed["passes_alone_per_image"] == running["passes_alone_per_image"]
    assert 1.0 <= running["passes_fed_per_image"] <= fixed["passes_fed_per_image"]
    assert all(r["peak_mem_mb"] > 0 and r["images_per_s"] > 0 for r in report["rows"])
    assert "| mc-sjd | 3 | yes | 1 |" in throughput_table(report)

    out = tmp_path / "throughput.json"
    args = ["bench", "--model", "visar-tiny-random", "--methods", "sjd", "--throughput", "--batch-sizes", "2"]
    assert cli.main([*args, "--images-per-slot", "1", "--json", str(out), "--deterministic"]) == 0
    printed = capsys.readouterr().out
    assert "| sjd | 2 | yes |" in printed and "| sjd | 2 | alone (deterministic) |" in printed
    alone = [r for r in json.loads(out.read_text())["rows"] if r["alone"]]
    assert [(r["method"], r["batch_size"]) for r in alone] == [("ar", 2), ("sjd", 2)]
    assert all(r["passes_vs_alone"] == 1.0 and r["speed_vs_fixed"] > 0 for r in alone)  # it feeds no padding
    assert cli.main([*args, "--batch-sizes", "two"]) == 2


@pytest.mark.one_thread  # a running batch's images against their decodes alone, bit for bit
def test_a_running_batch_with_a_compressed_kv_cache_starts_each_image_afresh(model16):
    """kv_keep < 1 (lossy): a refilled slot's compressed cache (slot table, attention scores) starts
    empty for its new image: with one-slot windows (no padding, whose inputs would take cache room
    in a batch and not alone) each image is its decode alone, evictions included. Wider windows
    refill too."""
    labels, seeds = [0, 1, 2, 1, 0], [21, 22, 23, 24, 25]
    cond = torch.tensor(labels)
    request = Request(model16, cond, GUIDED, [torch.Generator().manual_seed(s) for s in seeds], kv_keep=0.8)
    tokens, stats = get_method("sjd").fn(replace(request, slots=2), window=1)
    assert stats["refills"] == 3
    for i in range(5):
        alone = Request(model16, cond[i : i + 1], GUIDED, [torch.Generator().manual_seed(seeds[i])], kv_keep=0.8)
        assert torch.equal(tokens[i], get_method("sjd").fn(alone, window=1)[0][0]), i
    request = replace(request, generators=[torch.Generator().manual_seed(s) for s in seeds], slots=2)
    tokens, stats = get_method("mc-sjd").fn(request, window=4)
    assert stats["refills"] == 3 and tokens.shape == (5, 16) and int(tokens.max()) < model16.vocab_size


@pytest.mark.one_thread  # a running batch's images against their decodes alone, bit for bit
@pytest.mark.slow  # whole decodes of the 256-token text model, seven of them
def test_auto_and_ar_run_a_running_batch_with_a_negative_prompt(tmp_path, monkeypatch):
    """auto (timing its candidates on parts of the queue) and ar take a running batch, on a text model
    with a negative prompt held for the whole call: every batch's null condition is its images'
    negative prompts."""
    t2i = visar.load("visar-tiny-t2i", device="cpu")
    prompts = ["a red circle", "two blue squares", "a green star", "a small yellow triangle", "an orange square"]
    negative = ["blurry", "dark", "noisy", "blurry", "cropped"]
    for method in ("ar", "mc-sjd"):
        whole = t2i.generate(prompts=prompts, negative_prompt=negative, method=method, seed=4, output_type="tokens")
        running = t2i.generate(
            prompts=prompts, negative_prompt=negative, method=method, seed=4, output_type="tokens", batch_size=2
        )
        assert torch.equal(whole.tokens, running.tokens), method
    # auto times its candidates on the queue's first images, each part with its own images' negative
    # prompts: every image is the candidate that decoded it, as that candidate decodes it alone
    monkeypatch.setenv("VISAR_CACHE", str(tmp_path))  # no tuning kept by another test
    auto.forget_tunings()
    # eight images: mc-sjd's two rounds of two (a candidate is timed on four), then mc-sjd:8's
    prompts, negative = prompts + ["a blue circle", "two red stars", "a big green square"], negative + ["dark"] * 3
    ran = {}
    out = t2i.generate(
        prompts=prompts,
        negative_prompt=negative,
        method="auto",
        seed=4,
        output_type="tokens",
        batch_size=2,
        on_image=lambda index, tokens, info: ran.setdefault(index, info["auto"]),
    )
    assert out.tokens.shape[0] == 8 and sorted(ran) == list(range(8)) and len(set(ran.values())) >= 2
    for spec in set(ran.values()):
        name, _, size = spec.partition(":")
        alone = t2i.generate(
            prompts=prompts,
            negative_prompt=negative,
            method=name,
            seed=4,
            output_type="tokens",
            **({"budget": int(size)} if size else {}),
        )
        for image in (i for i, s in ran.items() if s == spec):
            assert torch.equal(out.tokens[image], alone.tokens[image]), (spec, image)
