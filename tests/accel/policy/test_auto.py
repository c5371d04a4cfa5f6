"""`auto` as an autotuner (visar.accel.policy.auto): the ladder walk on timed rounds of the call's own images,
the tuning kept on disk and read by a later process, re-timed when an AR step drifts, bad candidates
and bad files, an interrupted tuning, and the exact law while tuning in a refilling queue, with a
negative control whose choice reads each image's own draws."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from laws import (
    CFG_TOPK,
    SAMPLES,
    TOPP_TEMP,
    VOCAB,
    compare_laws,
    exact_law,
    sequence_index,
    tiny_llamagen,
    tiny_pipeline,
)

from visar.accel import get_method
from visar.accel.core import method_registry
from visar.accel.core.method_registry import Request
from visar.accel.core.sampling import make_generators
from visar.accel.policy import auto
from visar.errors import VisarError

# seconds per image of each candidate: where rows are dear (a CPU at a large batch) and where they are not
ROWS_DEAR = {"ar": 1.0, "mc-sjd:8": 1.1, "mc-sjd": 1.3, "mc-sjd:32": 1.6, "tree-mc-sjd": 2.0}
ROWS_CHEAP = {"ar": 3.0, "mc-sjd:8": 1.2, "mc-sjd": 1.0, "mc-sjd:32": 0.9, "tree-mc-sjd": 0.8}
# 8 slots within 5% of 16: a tie, so the walk goes past both (and finds AR faster than either)
TIED = {"ar": 0.9, "mc-sjd:8": 1.02, "mc-sjd": 1.0, "mc-sjd:32": 1.5, "tree-mc-sjd": 2.0}


@pytest.fixture(scope="module")
def model():
    return tiny_llamagen()


def test_the_entropy_temperature_is_part_of_the_key_and_leaves_the_other_keys_as_they_were(model):
    request = Request(model, torch.tensor([1]), CFG_TOPK, make_generators(1, 0))
    key = auto.tuning_key(request, ["ar", "mc-sjd"])
    assert key[-6:] == (2.0, 1.0, 4, 1.0, "ar", "mc-sjd")  # the sampling part as kept before the setting existed
    hot = replace(request, params=replace(CFG_TOPK, entropy_temperature=1.4))
    assert auto.tuning_key(hot, ["ar", "mc-sjd"]) == (*key[:-2], "entropy_temperature", 1.4, "ar", "mc-sjd")


def spec_of(name: str, options: dict) -> str:
    return name + (f":{options['budget']}" if "budget" in options else "")


class Timed:
    """auto's clock made to read `costs[candidate] * images` over each part it runs, and the parts run."""

    def __init__(self, costs: dict):
        self.costs, self.now, self.parts = costs, 0.0, []

    def clock(self, device) -> float:
        return self.now


@pytest.fixture
def timed(monkeypatch, tmp_path):
    monkeypatch.setenv("VISAR_CACHE", str(tmp_path))  # nothing kept by another test
    auto.forget_tunings()
    monkeypatch.setattr(auto, "ar_step_seconds", lambda request: 1e-3)
    state = Timed(dict(ROWS_DEAR))
    monkeypatch.setattr(auto, "synchronized_clock", state.clock)
    real = auto.run_images

    def run(request, name, options, start, stop):
        spec = spec_of(name, options)
        state.parts.append((spec, start, stop))
        state.now += state.costs[spec] * (stop - start)
        return real(request, name, options, start, stop)

    monkeypatch.setattr(auto, "run_images", run)
    yield state
    auto.forget_tunings()


def queue(model, n: int, slots: int | None, seed: int = 0, params=TOPP_TEMP, **kw) -> Request:
    return Request(model, torch.full((n,), 1), params, make_generators(n, seed), slots=slots, **kw)


@pytest.mark.parametrize(
    "costs, walk, winner",
    [
        (ROWS_DEAR, ["mc-sjd", "mc-sjd:8", "ar"], "ar"),  # down to AR; neither 32 slots nor a tree timed
        (ROWS_CHEAP, ["mc-sjd", "mc-sjd:8", "mc-sjd:32", "tree-mc-sjd"], "tree-mc-sjd"),  # down, then up to the tree
        (TIED, ["mc-sjd", "mc-sjd:8", "mc-sjd:32", "ar"], "ar"),
    ],
    ids=["rows-dear", "rows-cheap", "tied"],
)
def test_the_walk_times_neighbours_of_the_fastest_on_the_call_s_own_images(model, timed, costs, walk, winner):
    timed.costs = costs
    tokens, stats = auto.auto(queue(model, 24, slots=4))  # a round of 4 slots: a candidate's 4 images
    rounds = [(spec, 4 * i, 4 * i + 4) for i, spec in enumerate(walk)]
    assert timed.parts == [*rounds, (winner, 4 * len(walk), 24)]
    assert stats["auto_winner"] == winner and stats["auto_images"] == {
        spec: 28 - 4 * len(walk) if spec == winner else 4 for spec in walk
    }
    assert stats["auto_tuning"] == {spec: pytest.approx(1 / costs[spec], rel=1e-3) for spec in walk}
    assert f"tuned on this call's first {4 * len(walk)} images" in stats["auto_reason"]
    assert stats["refills"] == 20 and len(stats["forward_passes_per_image"]) == 24
    # every image is an output: its tokens are those its candidate gives it decoded alone
    for spec, start, stop in timed.parts:
        name, _, size = spec.partition(":")
        options = {"budget": int(size)} if size else {}
        alone, _ = get_method(name).fn(queue(model, 24, slots=None).images(start, stop), **options)
        assert torch.equal(tokens[start:stop], alone), spec


def test_a_later_process_reads_the_tuning_and_times_nothing_unless_an_ar_step_drifted(model, timed, monkeypatch):
    auto.auto(queue(model, 12, slots=2))
    kept = json.loads((auto.cost_store.cache_root() / auto.TUNING_FILE).read_text())
    assert [entry["timed"].keys() for entry in kept.values()] == [{"mc-sjd", "mc-sjd:8", "ar"}]
    auto.forget_tunings()  # a new process
    timed.parts.clear()
    _, stats = auto.auto(queue(model, 12, slots=2, seed=100))
    assert timed.parts == [("ar", 0, 12)] and stats["auto"] == "ar" and "kept on disk" in stats["auto_reason"]
    auto.forget_tunings()  # a new process on a machine now 1.5x slower
    monkeypatch.setattr(auto, "ar_step_seconds", lambda request: 1.5e-3)
    timed.parts.clear()
    _, stats = auto.auto(queue(model, 12, slots=2, seed=200))
    assert (
        timed.parts[0] == ("mc-sjd", 0, 2)
        and "timed again: an AR step took 1.50 ms against 1.00 ms" in (stats["auto_reason"])
    )


def test_tuning_goes_on_over_calls_of_one_image_and_keys_differ_by_batch_and_sampling(model, timed):
    """A call of one image (the demo's click) is one round, and a candidate is timed on four; another
    batch size or sampling setting tunes apart."""
    ran = [auto.auto(queue(model, 1, slots=None, seed=i))[1]["auto"] for i in range(14)]
    assert ran == ["mc-sjd"] * 4 + ["mc-sjd:8"] * 4 + ["ar"] * 6
    _, stats = auto.auto(queue(model, 1, slots=None, seed=7, params=CFG_TOPK))
    assert stats["auto"] == "mc-sjd" and stats["auto_winner"] is None
    _, stats = auto.auto(queue(model, 2, slots=None, seed=8))
    assert stats["auto"] == "mc-sjd" and "tuning: 1 of 5 candidates timed" in stats["auto_reason"]


@pytest.mark.parametrize(
    "candidates, says",
    [
        ("ar,mc-sjdx", "'mc-sjdx' is not one"),
        ("ar:8", "'ar:8' is not one"),
        ("mc-sjd:0", "'mc-sjd:0' is not one"),
        ("mc-sjd:auto", "'mc-sjd:auto' is not one"),
        ("", "got ''"),
        ("gsd", "'gsd' is not one"),  # lossy
        ("spec", "'spec' is not one"),  # needs a draft model
        ("auto", "'auto' is not one"),
        ("ar,mc-sjd,ar", "'ar' is named twice"),
    ],
)
def test_a_bad_candidate_is_one_sentence(model, candidates, says):
    with pytest.raises(VisarError, match="auto's candidates are comma-separated lossless raster methods") as err:
        auto.auto(queue(model, 1, slots=None), candidates=candidates)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_corrupt_foreign_or_other_version_tuning_is_timed_again(model, timed, monkeypatch):
    path = auto.cost_store.cache_root() / auto.TUNING_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"cut short')
    _, stats = auto.auto(queue(model, 12, slots=2))
    assert stats["auto_winner"] == "ar"
    kept = json.loads(path.read_text())
    name = next(iter(kept))
    for bad in ({"ar_step_s": "fast", "timed": {}}, {"ar_step_s": 1e-3, "timed": {"zipar": [2, 1.0]}}, [1, 2]):
        path.write_text(json.dumps({name: bad}))
        auto.forget_tunings()
        timed.parts.clear()
        auto.auto(queue(model, 4, slots=2))
        assert timed.parts[0] == ("mc-sjd", 0, 2), bad  # tuning from the start
    auto.forget_tunings()
    monkeypatch.setattr(auto, "__version__", "0.0.0-other")
    timed.parts.clear()
    auto.auto(queue(model, 4, slots=2))
    assert timed.parts[0] == ("mc-sjd", 0, 2) and len(json.loads(path.read_text())) == 2


def test_an_interrupted_tuning_keeps_its_images_and_its_timed_rounds(model, timed):
    handed = {}

    def save(index, tokens, info):
        if index >= 2:  # the second round's first image to finish
            raise KeyboardInterrupt
        handed[index] = info["auto"]

    with pytest.raises(KeyboardInterrupt):
        auto.auto(queue(model, 12, slots=2, on_image=save))
    assert handed == {0: "mc-sjd", 1: "mc-sjd"}  # saved as each was done
    auto.forget_tunings()  # the rerun, a new process: the first round counts, one more times mc-sjd
    timed.parts.clear()
    auto.auto(queue(model, 12, slots=2))
    assert timed.parts[:2] == [("mc-sjd", 0, 2), ("mc-sjd:8", 2, 4)]


def test_under_a_compiled_pipeline_a_candidate_s_first_round_is_not_timed(model, timed, monkeypatch):
    """Its first round compiles the candidate's passes: decoded (an output), untimed; its next one timed."""
    ran = []

    def run(request, name, options, start, stop):  # AR's tokens stand in; what counts is what is timed
        spec = spec_of(name, options)
        ran.append((spec, start, stop))
        timed.now += (100.0 if spec not in {s for s, *_ in ran[:-1]} else timed.costs[spec]) * (stop - start)
        return get_method("ar").fn(request.images(start, stop))

    monkeypatch.setattr(auto, "run_images", run)
    _, stats = auto.auto(queue(model, 28, slots=4, compile_passes={"mode": "default"}))
    assert ran == [
        ("mc-sjd", 0, 4),
        ("mc-sjd", 4, 8),
        ("mc-sjd:8", 8, 12),
        ("mc-sjd:8", 12, 16),
        ("ar", 16, 20),
        ("ar", 20, 24),
        ("ar", 24, 28),
    ]
    assert stats["auto_tuning"] == {
        spec: pytest.approx(1 / ROWS_DEAR[spec], rel=1e-3) for spec in ("mc-sjd", "mc-sjd:8", "ar")
    }


def draw_tuning(model, params, n, calls, seed, timed) -> torch.Tensor:
    """n images in `calls` calls of a refilling queue (2 slots), each call tuning from nothing under
    costs drawn at random per call (so that the walks and winners differ)."""
    rng, tokens = np.random.default_rng(seed), []
    per_call = n // calls
    for call in range(calls):
        auto.forget_tunings()
        (auto.cost_store.cache_root() / auto.TUNING_FILE).unlink(missing_ok=True)
        timed.costs = dict(zip(ROWS_DEAR, rng.uniform(0.5, 2.0, len(ROWS_DEAR)), strict=True))
        out, _ = auto.auto(queue(model, per_call, slots=2, seed=seed + call * per_call, params=params))
        tokens.append(out)
    return torch.cat(tokens)


@pytest.mark.slow
def test_joint_law_is_exact_while_tuning_in_a_refilling_queue(model, timed):
    tokens = draw_tuning(model, CFG_TOPK, SAMPLES, SAMPLES // 20, 7000, timed)
    ran = {spec for spec, *_ in timed.parts}
    assert len(ran) == 5, ran  # every candidate decoded images, in tuning rounds and as winner
    pvalue, tv, tolerance = compare_laws(sequence_index(tokens, VOCAB), exact_law(model, 1, CFG_TOPK))
    print(f"auto while tuning: p={pvalue:.3g} tv={tv:.4f} tol={tolerance:.4f}, candidates run {sorted(ran)}")
    assert pvalue > 1e-3 and tv < tolerance, (pvalue, tv, tolerance)


@pytest.mark.slow
def test_a_choice_that_reads_the_image_s_own_draws_is_detected(model, timed, monkeypatch):
    """Negative control: each image decoded by AR unless AR, peeked at on a copy of its generator,
    would give its last token 0; then by mc-sjd:8 from the same generator (whose drafts spend the
    draws otherwise). No real tuner can see an
    image's outcome before choosing; this one biases the law, and the test above would see it."""

    def peeking(request, name, options, start, stop):
        timed.now += stop - start
        parts = []
        for image in range(start, stop):
            one = request.images(image, image + 1)
            copy = torch.Generator().set_state(one.generators[0].get_state())
            peek, _ = get_method("ar").fn(Request(one.model, one.cond, one.params, [copy]))
            choice = ("mc-sjd", {"budget": 8}) if int(peek[0, -1]) == 0 else ("ar", {})
            parts.append(method_registry.run_images(request, *choice, image, image + 1))
        return torch.cat([t for t, _ in parts]), auto.merged_stats([stats for _, stats in parts], request)

    monkeypatch.setattr(auto, "run_images", peeking)
    tokens = []
    for start in range(0, 3000, 50):
        auto.forget_tunings()
        out, _ = auto.auto(queue(model, 50, slots=2, seed=5000 + start, params=CFG_TOPK))
        tokens.append(out)
    pvalue, tv, _ = compare_laws(sequence_index(torch.cat(tokens), VOCAB), exact_law(model, 1, CFG_TOPK))
    print(f"peeking choice: p={pvalue:.3g} tv={tv:.4f}")
    assert pvalue < 1e-6


@pytest.mark.slow  # every row runs warm-up, timed and memory-counted decodes
def test_bench_throughput_shows_auto_s_first_and_second_call_and_what_it_timed(monkeypatch, tmp_path):
    from visar.eval.throughput import throughput, throughput_table

    monkeypatch.setenv("VISAR_CACHE", str(tmp_path))
    auto.forget_tunings()
    pipe = tiny_pipeline("llamagen")
    report = throughput(pipe, ["mc-sjd:8", "mc-sjd", "auto"], batch_sizes=(2,), images_per_slot=12, progress=False)
    rows = {(r["method"], r["refill"]): r for r in report["rows"]}
    assert set(rows) == {
        ("ar", False),
        *((label, refill) for label in ("mc-sjd:8", "mc-sjd", "auto", "auto, second call") for refill in (False, True)),
    }
    assert rows[("mc-sjd:8", False)]["options"] == {"budget": 8}
    first, second = rows[("auto", True)]["auto"], rows[("auto, second call", True)]["auto"]
    assert first["ran"]["mc-sjd"] >= 4 and sum(first["ran"].values()) == 24  # its first rounds: the ladder's middle
    assert set(first["timed"]) <= set(second["timed"]) and len(second["ran"]) == 1 and second["winner"] is not None
    table = throughput_table(report)
    assert "| auto, second call | 2 | yes | " in table and "x fastest candidate" in table
    with pytest.raises(VisarError, match="METHOD or METHOD:N"):
        throughput(pipe, ["mc-sjd:auto"], batch_sizes=(1,), progress=False)
    auto.forget_tunings()


def test_bench_pools_auto_calls_whose_candidates_differ_in_slots(monkeypatch, tmp_path):
    """From an empty cache, auto's tuning calls run candidates of different window sizes, so their
    per-slot draft counts differ in length: bench pools them by slot index (it crashed on them)."""
    from visar.eval.bench import bench

    monkeypatch.setenv("VISAR_CACHE", str(tmp_path))
    pipe = tiny_pipeline("llamagen")
    for batch_size in (1, 4):
        auto.forget_tunings()
        report = bench(pipe, ["auto"], n=8, batch_size=batch_size, progress=False)
        row = next(r for r in report["rows"] if r["method"] == "auto")
        assert len(row["auto"]) >= 2, row["auto"]  # tuning ran candidates of several sizes, the case at hand
        by_slot = row["acceptance_by_slot"]
        assert by_slot[0] is not None and all(r is None or 0 <= r <= 1 for r in by_slot)
    auto.forget_tunings()


def test_acceptance_is_pooled_by_slot_index_over_lists_of_different_lengths():
    from visar.eval.bench import acceptance_columns

    def stats(tested, accepted):
        return {
            "draft_tokens": sum(tested),
            "accepted_tokens": sum(accepted),
            "draft_tokens_by_row": [sum(tested)],
            "accepted_tokens_by_row": [sum(accepted)],
            "draft_tokens_by_slot": tested,
            "accepted_tokens_by_slot": accepted,
        }

    pooled = acceptance_columns([stats([10, 8], [6, 4]), stats([10, 8, 6, 4], [9, 6, 3, 0]), stats([], [])])
    assert pooled["acceptance_by_slot"] == [15 / 20, 10 / 16, 3 / 6, 0.0]
    assert pooled["acceptance_rate"] == 28 / 46


@pytest.mark.one_thread  # the same tokens on a repeated call: bits
def test_deterministic_auto_settles_its_choice_before_any_image_and_repeats_it(monkeypatch, tmp_path):
    """generate(method="auto", deterministic=True) from an empty cache chooses one candidate before any
    image counts (its tuning on throwaway images), decodes every image with it, says which, and a
    repeated call (the choice now kept) gives the same tokens: those of the candidate named."""
    monkeypatch.setenv("VISAR_CACHE", str(tmp_path))
    auto.forget_tunings()
    pipe = tiny_pipeline("llamagen")
    kwargs = dict(class_labels=[1, 2, 3], seed=4, output_type="tokens", deterministic=True)
    handed = {}
    first = pipe.generate(method="auto", on_image=lambda i, tokens, info: handed.update({i: info["auto"]}), **kwargs)
    spec = first.stats["auto"]
    assert " + " not in spec and "throwaway" in first.stats["auto_reason"] and handed == {0: spec, 1: spec, 2: spec}
    auto.forget_tunings()  # a new process: the choice read from disk
    again = pipe.generate(method="auto", **kwargs)
    assert again.stats["auto"] == spec and "throwaway" not in again.stats["auto_reason"]
    name, _, size = spec.partition(":")
    named = pipe.generate(method=name, **({"budget": int(size)} if size else {}), **kwargs)
    assert torch.equal(first.tokens, again.tokens) and torch.equal(first.tokens, named.tokens)
    auto.forget_tunings()
