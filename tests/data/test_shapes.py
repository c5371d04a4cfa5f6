"""The shapes world: constants, labels, GenEval-format metadata, seeded renders that satisfy it."""

import itertools
import json
from collections import Counter

import numpy as np
import pytest

from visar.data import shapes
from visar.data.shapes import (
    COLORS,
    IMAGE_SIZE,
    NUM_CLASSES,
    OBJECT_GAP,
    PALETTE,
    POSITION_MARGIN,
    SHAPES,
    TASKS,
    class_name,
    label_of,
    make_geneval_metadata,
    position_offset,
    relations_between,
    render_caption_sample,
    render_class,
    render_from_metadata,
    shape_and_color,
)

GENEVAL_COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")


def assert_satisfies_metadata(sample: shapes.ShapesSample) -> None:
    """Objects drawn match the entry exactly: counts, colours, relations with margin, exclusions."""
    metadata = sample.metadata
    drawn = Counter(obj.shape for obj in sample.objects)
    include = metadata["include"]
    assert drawn == Counter({item["class"]: item["count"] for item in include})
    groups = [[obj for obj in sample.objects if obj.shape == item["class"]] for item in include]
    for item, group in zip(include, groups, strict=True):
        if "color" in item:
            assert all(obj.color == item["color"] for obj in group)
        if "position" in item:
            relation, target = item["position"]
            for obj, target_obj in itertools.product(group, groups[target]):
                dx, dy = position_offset(obj.box, target_obj.box)
                component = {"left of": -dx, "right of": dx, "above": -dy, "below": dy}[relation]
                assert component >= 0.5 + POSITION_MARGIN
                assert relation in relations_between(obj.box, target_obj.box)
    for item in metadata.get("exclude", []):
        assert drawn[item["class"]] < item["count"]
    for first, second in itertools.combinations(sample.objects, 2):
        assert shapes._boxes_apart(first.box, second.box, OBJECT_GAP)
    for obj in sample.objects:
        x0, y0, x1, y1 = obj.box
        assert 0 <= x0 < x1 <= IMAGE_SIZE and 0 <= y0 < y1 <= IMAGE_SIZE
        assert x1 - x0 == y1 - y0 >= shapes.MIN_OBJECT_SIZE
        # Every shape covers its box centre: the pixel there has the object's exact colour.
        centre = sample.image[(y0 + y1) // 2, (x0 + x1) // 2]
        assert tuple(int(value) for value in centre) == PALETTE[obj.color]


def test_constants():
    assert COLORS == GENEVAL_COLORS
    assert len(SHAPES) >= 4 and len(set(SHAPES)) == len(SHAPES)
    assert NUM_CLASSES == len(SHAPES) * len(COLORS)
    assert TASKS == ("single_object", "two_object", "counting", "colors", "position", "color_attr")
    palette = np.array([PALETTE[color] for color in COLORS], dtype=float)
    pairwise = np.linalg.norm(palette[:, None] - palette[None], axis=-1)
    assert pairwise[~np.eye(len(COLORS), dtype=bool)].min() >= 90  # separable after blur or a VQ decode


def test_labels_round_trip():
    for label in range(NUM_CLASSES):
        shape, color = shape_and_color(label)
        assert label_of(shape, color) == label
        assert class_name(label) == f"{color} {shape}"
    assert label_of(SHAPES[1], COLORS[3]) == 1 * len(COLORS) + 3
    assert class_name(0) == f"{COLORS[0]} {SHAPES[0]}"


@pytest.mark.parametrize("bad", [-1, NUM_CLASSES, 2.0, True, "3", None])
def test_bad_labels_raise(bad):
    with pytest.raises(ValueError, match="class label"):
        class_name(bad)
    with pytest.raises(ValueError, match="class label"):
        render_class(bad, 0)


def test_unknown_names_raise():
    with pytest.raises(ValueError, match="unknown shape 'hexagon'"):
        label_of("hexagon", "red")
    with pytest.raises(ValueError, match="unknown color 'teal'"):
        label_of("circle", "teal")
    with pytest.raises(ValueError, match="unknown task 'poses'"):
        render_caption_sample(0, "poses")
    with pytest.raises(ValueError, match="unknown shape 'bench'"):
        render_from_metadata({"tag": "single_object", "include": [{"class": "bench", "count": 1}]}, 0)
    with pytest.raises(ValueError, match="unknown color 'teal'"):
        render_from_metadata({"include": [{"class": "circle", "count": 1, "color": "teal"}]}, 0)
    with pytest.raises(ValueError, match="unknown relation 'behind'"):
        render_from_metadata(
            {
                "include": [
                    {"class": "circle", "count": 1},
                    {"class": "cross", "count": 1, "position": ["behind", 0]},
                ]
            },
            0,
        )
    with pytest.raises(ValueError, match="earlier include entry"):
        render_from_metadata({"include": [{"class": "circle", "count": 1, "position": ["above", 0]}]}, 0)
    with pytest.raises(ValueError, match="at most"):
        render_from_metadata({"include": [{"class": "circle", "count": 9}]}, 0)
    with pytest.raises(ValueError, match="contradicts"):
        render_from_metadata(
            {"include": [{"class": "cross", "count": 2}], "exclude": [{"class": "cross", "count": 2}]}, 0
        )


def test_renders_are_deterministic():
    first, again, other = render_class(7, 123), render_class(7, 123), render_class(7, 124)
    assert first.image.shape == (IMAGE_SIZE, IMAGE_SIZE, 3) and first.image.dtype == np.uint8
    np.testing.assert_array_equal(first.image, again.image)
    assert first.objects == again.objects
    assert not np.array_equal(first.image, other.image)
    for task in (*TASKS, None):
        sample, repeat = render_caption_sample(5, task), render_caption_sample(5, task)
        np.testing.assert_array_equal(sample.image, repeat.image)
        assert sample.metadata == repeat.metadata and sample.objects == repeat.objects


def test_class_renders_hold_one_object_of_the_label():
    for label in range(NUM_CLASSES):
        sample = render_class(label, seed=label)
        shape, color = shape_and_color(label)
        assert sample.class_label == label
        assert [(obj.shape, obj.color) for obj in sample.objects] == [(shape, color)]
        assert sample.caption == sample.metadata["prompt"]
        assert_satisfies_metadata(sample)


def background_swing(sample) -> float:
    """Luminance range of a one-object render outside the object's box (plus its blur margin)."""
    (obj,) = sample.objects
    x0, y0, x1, y1 = obj.box
    background = np.ones((IMAGE_SIZE, IMAGE_SIZE), dtype=bool)
    background[max(0, y0 - 2) : y1 + 2, max(0, x0 - 2) : x1 + 2] = False
    return float(np.ptp(sample.image.mean(-1)[background]))


def test_easy_class_renders_keep_their_size_and_calm_background():
    options = shapes.class_render_options(json.loads(json.dumps({"render": shapes.CLASS_RENDER_EASY})))
    assert options == shapes.CLASS_RENDER_EASY  # survives a config.json round trip (lists back to tuples)
    easy, default = [], []
    for label in range(NUM_CLASSES):
        sample = render_class(label, seed=label, **options)
        (obj,) = sample.objects
        assert (obj.shape, obj.color) == shape_and_color(label)
        assert min(obj.box[2] - obj.box[0], obj.box[3] - obj.box[1]) >= options["min_size"]
        easy.append(background_swing(sample))
        default.append(background_swing(render_class(label, seed=label)))
    assert np.median(easy) < 0.75 * np.median(default)
    with pytest.raises(ValueError, match="min_size"):
        render_class(0, 0, min_size=40)
    with pytest.raises(ValueError, match="background_amplitude"):
        render_class(0, 0, background_amplitude=(10.0, 5.0))


def test_easy_caption_renders_take_the_largest_size_their_count_allows():
    """The visar-tiny-t2i recipe's renders: the class renders' size floor, capped per object count,
    the same prompt stream as the default renders (only sizes and the background change)."""
    options = dict(shapes.CLASS_RENDER_EASY)
    for task in TASKS:
        for seed in range(30):
            easy, default = render_caption_sample(seed, task, **options), render_caption_sample(seed, task)
            assert easy.caption == default.caption
            cap = shapes._MAX_SIZE_FOR_COUNT[len(easy.objects)]
            assert all(obj.box[2] - obj.box[0] == cap for obj in easy.objects)
    with pytest.raises(ValueError, match="min_size"):
        render_caption_sample(0, min_size=8)


@pytest.mark.parametrize("task", TASKS)
def test_caption_renders_satisfy_their_metadata(task):
    for seed in range(120):
        sample = render_caption_sample(seed, task)
        assert sample.metadata["tag"] == task and sample.class_label is None
        assert sample.caption == sample.metadata["prompt"]
        assert_satisfies_metadata(sample)


def test_geneval_phrasing_and_format():
    entries = {task: shapes._task_entries(task) for task in TASKS}
    prompts = {entry["prompt"] for task_entries in entries.values() for entry in task_entries}
    assert "a photo of a circle" in prompts
    assert "a photo of a circle and a square" in prompts
    assert "a photo of three crosses" in prompts
    assert "a photo of an orange triangle" in prompts
    assert "a photo of a square right of a circle" in prompts
    assert "a photo of a purple square and a black cross" in prompts
    position = next(e for e in entries["position"] if e["prompt"] == "a photo of a square right of a circle")
    assert position == {
        "tag": "position",
        "include": [
            {"class": "circle", "count": 1},
            {"class": "square", "count": 1, "position": ["right of", 0]},
        ],
        "prompt": "a photo of a square right of a circle",
    }
    counting = next(e for e in entries["counting"] if e["prompt"] == "a photo of three crosses")
    assert counting == {
        "tag": "counting",
        "include": [{"class": "cross", "count": 3}],
        "exclude": [{"class": "cross", "count": 4}],
        "prompt": "a photo of three crosses",
    }
    for task_entries in entries.values():
        for entry in task_entries:
            assert list(entry)[0] == "tag" and list(entry)[-1] == "prompt"
    # two_object, position and color_attr pair distinct shapes, color_attr distinct colours.
    for task in ("two_object", "position", "color_attr"):
        assert all(e["include"][0]["class"] != e["include"][1]["class"] for e in entries[task])
    assert all(e["include"][0]["color"] != e["include"][1]["color"] for e in entries["color_attr"])


def test_make_geneval_metadata():
    metadata = make_geneval_metadata(n_per_task=20, seed=3)
    assert len(metadata) == 20 * len(TASKS)
    assert [entry["tag"] for entry in metadata] == [task for task in TASKS for _ in range(20)]
    assert metadata == make_geneval_metadata(n_per_task=20, seed=3)
    assert metadata != make_geneval_metadata(n_per_task=20, seed=4)
    json.dumps(metadata)  # plain JSON, writable as GenEval's metadata.jsonl lines
    # No repeats until a task's distinct prompts run out (single_object has len(SHAPES)).
    single = [entry["prompt"] for entry in metadata if entry["tag"] == "single_object"]
    assert len(set(single[: len(SHAPES)])) == len(SHAPES)
    colors = [entry["prompt"] for entry in metadata if entry["tag"] == "colors"]
    assert len(set(colors)) == 20
    metadata[0]["include"][0]["count"] = 99  # callers own their copies
    assert make_geneval_metadata(n_per_task=20, seed=3)[0]["include"][0]["count"] == 1
    for index, entry in enumerate(metadata[1:]):
        assert_satisfies_metadata(render_from_metadata(entry, seed=index))
    with pytest.raises(ValueError, match="n_per_task"):
        make_geneval_metadata(-1, 0)


def test_backgrounds_are_grey_mid_range_and_bundled():
    names = shapes.background_names()
    assert len(names) >= 10 and "astronaut" in names
    for seed in range(50):
        image = render_from_metadata({"include": []}, seed).image.astype(float)  # background only
        grey = image.mean(axis=-1)
        low, high = shapes.BACKGROUND_LUMA_RANGE
        assert grey.min() >= low - 1 and grey.max() <= high + 1
        assert np.abs(image - grey[..., None]).max() <= 4 / 3 * shapes._BACKGROUND_TINT + 1  # zero-mean tint
