"""An open running batch (`core.source.ImageSource`, `Request.source`): images join while it decodes.

Every raster engine (chain, draft trees, static tree, row fronts) decodes a source that grows between
passes, each image as its decode alone whenever it joined (tests/accel/raster/test_engine_conformance.py).
Here: a source that starts with fewer images than slots decodes spares in the empty slots, which are
never handed over (each image still its decode alone, one torch thread: tests/conftest.py); one that
has nothing to decode waits for an image or its close; the methods that cut their images into
batches refuse an open source; and the pipeline's open batch gives each image its generate alone.
"""

import threading

import pytest
import torch
from laws import JoinsBetweenPasses, perturbed, tiny_llamagen, unit_codebook

from visar.accel import Request, get_method
from visar.accel.core.sampling import SamplingParams
from visar.accel.core.source import ImageSource
from visar.errors import VisarError

PARAMS = SamplingParams(guidance_scale=2.0, top_k=20)
LABELS = [0, 2, 1, 1, 0, 2, 1]
SEED = 70

pytestmark = pytest.mark.usefixtures("private_neighbour_cache")


@pytest.fixture(scope="module")
def model():
    return tiny_llamagen(vocab=32, block_size=36, seed=6, std=0.3)  # a 6 x 6 grid


def engine_cases(model) -> list:
    draft = perturbed(model, seed=1, scale=0.3)
    return [
        ("sjd", dict(window=4)),  # chain
        ("mc-sjd", dict(window=8)),
        ("spec", dict(window=3, draft=draft)),
        ("lantern", dict(window=4, delta=0.2, coupling="maximal")),
        ("sjd-pac", dict(window=8, branch=2, depth=3)),  # draft trees
        ("tree-mc-sjd", dict(window=8, branch=3, depth=2)),
        ("lantern++", dict(draft=draft, tree=[[0], [1], [0, 0], [0, 1], [0, 0, 0]])),  # static tree
        ("zipar", dict(s=2)),  # row fronts
        ("zipar-mc-sjd", dict(s=2, window=4)),
        ("zipar-tree", dict(s=2, window=4, branch=4)),
    ]


def conditions(images: range):
    cond = torch.tensor([LABELS[i % len(LABELS)] for i in images])
    return cond, [torch.Generator().manual_seed(SEED + i) for i in images]


def decode_source(model, name, options, source, slots):
    handed = []
    cond, _, generators = source.snapshot()
    request = Request(
        model, cond, PARAMS, generators, slots=slots, source=source,
        tokenizer=unit_codebook(model.vocab_size, 8, seed=0),
        on_image=lambda image, tokens, info: handed.append((image, tokens, *info.values())),
    )  # fmt: skip
    tokens, stats = get_method(name).fn(request, **options)
    return tokens, stats, handed


def assert_each_as_alone(model, name, options, stats, handed):
    assert sorted(image for image, *_ in handed) == list(range(len(LABELS)))
    for image, image_tokens, passes, commit_pass in handed:
        cond, generators = conditions(range(image, image + 1))
        request = Request(model, cond, PARAMS, generators, tokenizer=unit_codebook(model.vocab_size, 8, seed=0))
        alone, alone_stats = get_method(name).fn(request, **options)
        assert torch.equal(image_tokens, alone[0]), (name, image)
        assert passes == alone_stats["forward_passes_per_image"][0]
        assert torch.equal(commit_pass, alone_stats["commit_pass"][0]), (name, image)


@pytest.mark.one_thread
def test_a_source_with_fewer_images_than_slots_decodes_spares_and_hands_over_only_images(model):
    """One image at 3 slots (two spares), one more before the first pass (a service's image that came as
    the decode started), two before pass 3, three before pass 9."""
    for name, options in engine_cases(model)[1::3]:  # mc-sjd, sjd-pac, zipar, ...: one of each engine
        source = JoinsBetweenPasses(conditions, 1, {1: 1, 3: 2, 9: 3})
        tokens, stats, handed = decode_source(model, name, options, source, slots=3)
        assert len(handed) == 7
        assert_each_as_alone(model, name, options, stats, handed)


class Remembers(JoinsBetweenPasses):
    """A source that notes, each time the loop asks its count, how many adds it still holds."""

    def count(self) -> int:
        self.held = [*getattr(self, "held", []), len(self.added)]
        return super().count()


def test_an_open_source_forgets_the_images_its_batch_is_past(model):
    """A service's batch may run for days: its source holds the adds still waiting or being read, not
    every image it was given. One image, then one more every 16 passes at 2 slots (faster than they are
    decoded, about 12 passes each): at most the one image not yet in a slot is held at any pass (and
    the one added then), none at the end, and a cancellation is dropped once its image has left."""
    source = Remembers(conditions, 1, dict.fromkeys(range(2, 2 + 16 * 24, 16), 1))
    source.cancel([0])  # in its slot: it leaves unfinished
    tokens, stats, handed = decode_source(model, "mc-sjd", dict(window=8), source, slots=2)
    assert source.count() == 25 and sorted(image for image, *_ in handed) == list(range(1, 25))
    assert max(source.held) <= 2  # the images waiting, not the 25 given
    assert source.added == [] and source.cancelled == set()
    assert stats["images"] == 24 and stats["forward_passes_per_image"] == []  # handed over, not kept
    with pytest.raises(IndexError, match="forgotten"):
        source.rows(torch.tensor([3]))


def test_an_add_of_another_layout_is_refused_before_it_joins():
    """Conditions of another shape or dtype, or a mask where the source has none, never reach a pass."""
    source = ImageSource(torch.zeros(1, 4, 8), None, [torch.Generator()], closed=False)
    for cond, mask, why in [
        (torch.zeros(1, 5, 8), None, "cannot join"),
        (torch.zeros(1, 4, 8, dtype=torch.float64), None, "cannot join"),
        (torch.zeros(1, 4, 8), torch.ones(1, 4, dtype=torch.bool), "exactly when"),
    ]:
        with pytest.raises(ValueError, match=why):
            source.add(cond, mask, [torch.Generator()])
    assert source.count() == 1 and list(source.add(torch.ones(2, 4, 8), None, [torch.Generator()] * 2)) == [1, 2]
    assert torch.equal(source.rows(torch.tensor([2, 0]))[0], torch.stack([torch.ones(4, 8), torch.zeros(4, 8)]))


def test_an_idle_batch_waits_for_an_image_and_ends_at_the_close(model):
    """The decode runs in a thread; its first image is handed over before the second is added, the
    decode waits (no pass) until then, and ends once the source is closed."""
    cond, generators = conditions(range(1))
    source = ImageSource(cond, None, generators, closed=False)
    first_done = threading.Event()
    handed = []
    request = Request(
        model, cond, PARAMS, list(generators), slots=2, source=source,
        on_image=lambda image, tokens, info: (handed.append(image), first_done.set()),
    )  # fmt: skip
    result = {}
    thread = threading.Thread(target=lambda: result.update(out=get_method("mc-sjd").fn(request, window=8)))
    thread.start()
    assert first_done.wait(60)
    assert handed == [0] and thread.is_alive()  # handed over at once; the decode waits for more
    cond, generators = conditions(range(1, 3))
    assert list(source.add(cond, None, generators)) == [1, 2]
    source.close()
    thread.join(60)
    assert not thread.is_alive()
    tokens, stats = result["out"]
    # handed over, not kept: an open batch's stats count its images
    assert sorted(handed) == [0, 1, 2] and stats["images"] == 3 and stats["forward_passes_per_image"] == []
    with pytest.raises(ValueError, match="closed"):
        source.add(cond, None, generators)


@pytest.mark.parametrize("name", ["ar", "auto"])
def test_a_method_that_cuts_its_images_into_batches_refuses_an_open_source(model, name):
    from visar.accel.core.method_registry import run_images
    from visar.errors import VisarError

    cond, generators = conditions(range(2))
    source = ImageSource(cond, None, generators, closed=False)
    request = Request(model, cond, PARAMS, list(generators), slots=2, source=source)
    with pytest.raises(VisarError, match="open running batch"):
        run_images(request, name, {}, 0, 2)


@pytest.fixture(scope="module")
def text_pipe():
    import visar

    return visar.load("visar-tiny-t2i", device="cpu")


@pytest.mark.one_thread  # images against their decodes alone, bit for bit
def test_an_open_batch_gives_each_image_its_generate_alone_with_its_own_negative_prompt(text_pipe):
    """Pipeline.open_batch: three adds (one with a negative prompt, one without, one with another), the
    later two after the first image was handed over; each image is generate's for its prompt, seed and
    negative prompt alone, and a negative prompt changes the image (the negative control)."""
    batch = text_pipe.open_batch("mc-sjd", slots=2, output_type="tokens", window=8)
    handed, first = {}, threading.Event()

    def on_image(index, tokens, info):
        handed[index] = tokens
        first.set()

    worker = threading.Thread(target=lambda: handed.update(stats=batch.run(on_image=on_image)))
    worker.start()
    adds = [
        dict(prompts=["a red circle"], negative_prompt="a blue cross", seed=3),
        dict(prompts=["two blue squares", "a green triangle"], seed=7),
        dict(prompts=["a red circle"], negative_prompt="a green square", num_images_per_prompt=2, seed=9),
    ]
    ids = [batch.add(**adds[0])]
    assert first.wait(120)
    ids += [batch.add(**adds[1]), batch.add(**adds[2])]
    batch.close()
    worker.join(120)
    assert ids == [[0], [1, 2], [3, 4]] and sorted(k for k in handed if k != "stats") == [0, 1, 2, 3, 4]
    stats = handed["stats"]
    assert stats["method"] == "mc-sjd" and stats["lossless"] and stats["images"] == 5
    for add, images in zip(adds, ids, strict=True):
        alone = text_pipe.generate(**add, method="mc-sjd", window=8, output_type="tokens").tokens
        for k, index in enumerate(images):
            assert torch.equal(handed[index], alone[k]), index
    without = text_pipe.generate(prompts=["a red circle"], seed=3, method="mc-sjd", window=8, output_type="tokens")
    assert not torch.equal(handed[0], without.tokens[0])


def test_an_open_batch_refuses_what_it_cannot_decode(text_pipe):
    from visar.errors import VisarError

    for method in ("auto", "ar"):
        with pytest.raises(VisarError, match="refills its slots"):
            text_pipe.open_batch(method, slots=2)
    with pytest.raises(VisarError, match="slots must be"):
        text_pipe.open_batch("sjd", slots=0)
    batch = text_pipe.open_batch("sjd", slots=2)
    batch.close()
    assert batch.run() == {"forward_passes": 0, "forward_passes_per_image": [], "images": 0}  # closed before any image
    with pytest.raises(VisarError, match="closed"):
        batch.add(prompts=["a red circle"])


@pytest.mark.one_thread  # images against their decodes alone, bit for bit
def test_a_paced_batch_runs_a_pass_a_step_and_a_cancelled_image_leaves_the_others_unchanged(text_pipe):
    """A paced open batch (a serving loop's) decodes nothing until `step` lets it, one pass a step; of
    four images at two slots, one cancelled in its slot and one cancelled while it waits are never
    handed over, and the other two are each generate's alone."""
    batch = text_pipe.open_batch("mc-sjd", slots=2, output_type="tokens", paced=True, window=8)
    handed = {}
    worker = threading.Thread(
        target=lambda: handed.update(stats=batch.run(on_image=lambda i, tokens, info: handed.update({i: tokens})))
    )
    worker.start()
    prompts = ["a red circle", "two blue squares", "a green triangle", "a red cross"]
    assert batch.add(prompts=prompts, seed=4) == [0, 1, 2, 3]
    threading.Event().wait(0.5)
    assert handed == {}  # unpaced, these images take a few milliseconds a pass
    steps = 0
    for _ in range(2):
        steps += batch.step(timeout=30)
    batch.cancel([1, 3])  # 1 holds a slot; 3 waits
    while not {0, 2} <= handed.keys():
        assert batch.step(timeout=30)
        steps += 1
    batch.close()
    worker.join(120)
    stats = handed.pop("stats")
    assert sorted(handed) == [0, 2]
    assert stats["batch_passes"] == steps  # a pass a step, none unpaced
    alone = text_pipe.generate(prompts=prompts, seed=4, method="mc-sjd", window=8, output_type="tokens").tokens
    for index in (0, 2):
        assert torch.equal(handed[index], alone[index]), index
    with pytest.raises(VisarError, match="paced"):
        text_pipe.open_batch("sjd", slots=2).step()
