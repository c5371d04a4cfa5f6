"""A seeded, offline 64x64 world of flat-coloured shapes on photographic backgrounds.

Why a toy world: it gives exact ground truth for every image, so tokenizers, AR models, the
acceleration methods and a GenEval-style evaluation can all be trained and scored offline, on
small budgets, without COCO, Mask2Former or CLIP. `visar.eval.detector` is its detector.

The world:
- `SHAPES` x `COLORS` objects. The colours are GenEval's ten; their RGB values are fixed and at
  least 95 apart (Euclidean, 0..255), so a detector can name them after blur, noise or a VQ
  round trip.
- Backgrounds are random crops of the photographs bundled inside scikit-image (no download),
  turned grey, mid-bright and low-contrast: luminance within [82, 173] and a tint of a few
  levels. Every palette colour, black and white included, is more than 70 away from that set.
- Objects are axis-aligned, anti-aliased (4x4 supersampling), 12..28 px, fully inside the
  image and at least `OBJECT_GAP` px apart, so counting is well defined.

Two ways to draw:
- class-conditional: `render_class(label, seed)`, one object, `label = shape_index *
  len(COLORS) + color_index`, `NUM_CLASSES = len(SHAPES) * len(COLORS)`;
- text-conditional: `render_caption_sample(seed, task)` draws one of GenEval's six tasks with
  GenEval's prompt phrasing and its exact metadata entry (`tag`, `include`, `exclude`, `prompt`);
  `render_from_metadata(metadata, seed)` renders any such entry, and
  `make_geneval_metadata(n_per_task, seed)` builds a prompt set in GenEval's format.

Everything random comes from `numpy.random.default_rng(seed)`: the same seed gives the same
pixels (given the same set of bundled photographs, see `background_names()`).

Speed: about 1,400 class and 1,200 caption renders per second on one CPU core (coverage
masks are cached per shape and size; the photographs load once, at first use).
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Integral
from typing import Any

import numpy as np
from PIL import Image

IMAGE_SIZE = 64

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "cross")
# GenEval's ten colour words, in GenEval's order.
COLORS: tuple[str, ...] = (
    "red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white",
)  # fmt: skip
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "orange": (255, 140, 0),
    "yellow": (250, 230, 30),
    "green": (30, 170, 50),
    "blue": (30, 70, 230),
    "purple": (140, 40, 190),
    "pink": (255, 120, 200),
    "brown": (120, 70, 20),
    "black": (10, 10, 10),
    "white": (245, 245, 245),
}
NUM_CLASSES = len(SHAPES) * len(COLORS)

# GenEval's task tags, in the order of its prompt file and summary.
TASKS: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
COUNT_WORDS: dict[int, str] = {2: "two", 3: "three", 4: "four"}
PLURALS: dict[str, str] = {
    "circle": "circles",
    "square": "squares",
    "triangle": "triangles",
    "cross": "crosses",
}

MIN_OBJECT_SIZE = 12
MAX_OBJECT_SIZE = 28
# Largest object side for n objects in one image, so that up to 6 fit without overlap.
_MAX_SIZE_FOR_COUNT = {1: 28, 2: 24, 3: 20, 4: 18, 5: 16, 6: 14}
OBJECT_GAP = 3  # px of background between any two boxes: blur cannot merge neighbours
# GenEval's position rule (`relative_position` in evaluation/evaluate_images.py): centre offset
# minus a dead zone of 0.1 x (sum of the two boxes' dims), normalised by the raw offset; a
# relation holds when its component exceeds 0.5. Renders require POSITION_MARGIN beyond 0.5.
POSITION_DEAD_ZONE = 0.1
POSITION_MARGIN = 0.2

_SUPERSAMPLE = 4  # sub-pixels per side for anti-aliased coverage
_MAX_LAYOUT_ATTEMPTS = 200
_MAX_PLACEMENT_TRIES = 60

# Background luminance: mid brightness, low contrast, so both black (10) and white (245)
# objects stand out; the detector's background model uses the same numbers plus a margin.
BACKGROUND_LUMA_RANGE = (82.0, 173.0)
_BACKGROUND_MID_RANGE = (110.0, 145.0)
_BACKGROUND_AMPLITUDE_RANGE = (8.0, 28.0)
_BACKGROUND_TINT = 6.0  # max per-channel tint before removing its mean: stays grey-ish
_CROP_SIDE_RANGE = (48, 256)  # crop side in photo pixels: close-up texture .. wide view
# The class-conditional default model's world: one object of 28 px (7x7 tokens) on a calm
# photo-texture background (swing 2-6 grey levels), still at a free position. A raster model
# that trains in under an hour on 2 CPU cores learned to draw the class's shape far sooner on it
# than on the full world (objects from 12 px, swing up to 28), whose background texture holds
# most of the tokens' entropy (the sweep: tools/recipe_sweep.py, docs/MODELS.md).
# Keyword arguments of `render_class`.
CLASS_RENDER_EASY = {"min_size": 28, "background_amplitude": (2.0, 6.0)}

# (skimage.data loader, file it reads from the installed package). Only photographs that
# ship inside the wheel are used; a loader whose file is absent would download, so it is
# skipped instead.
_BACKGROUND_PHOTOS: tuple[tuple[str, str], ...] = (
    ("astronaut", "astronaut.png"),
    ("camera", "camera.png"),
    ("coffee", "coffee.png"),
    ("chelsea", "chelsea.png"),
    ("rocket", "rocket.jpg"),
    ("coins", "coins.png"),
    ("moon", "moon.png"),
    ("page", "page.png"),
    ("text", "text.png"),
    ("grass", "grass.png"),
    ("gravel", "gravel.png"),
    ("brick", "brick.png"),
    ("clock", "clock_motion.png"),
    ("hubble_deep_field", "hubble_deep_field.jpg"),
    ("immunohistochemistry", "ihc.png"),
    ("cell", "cell.png"),
)
_LUMA_WEIGHTS = np.array([0.299, 0.587, 0.114], dtype=np.float32)

Box = tuple[int, int, int, int]  # x0, y0, x1, y1 in pixels; x1 and y1 exclusive


@dataclass(frozen=True)
class ShapeObject:
    """One drawn object: its shape, colour name and tight pixel box (x0, y0, x1, y1), ends exclusive."""

    shape: str
    color: str
    box: Box


@dataclass
class ShapesSample:
    """One render: pixels, ground-truth objects, and the conditioning that produced them."""

    image: np.ndarray  # [64, 64, 3] uint8
    objects: list[ShapeObject]
    class_label: int | None  # set by render_class, None for caption samples
    caption: str
    metadata: dict[str, Any]  # the GenEval entry the image satisfies: tag, include, [exclude], prompt


# ---------------------------------------------------------------------------- names and labels


def _check_shape(shape: str) -> int:
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known shapes: {', '.join(SHAPES)}")
    return SHAPES.index(shape)


def _check_color(color: str) -> int:
    if color not in COLORS:
        raise ValueError(f"unknown color {color!r}; known colors: {', '.join(COLORS)}")
    return COLORS.index(color)


def _check_label(label: int) -> int:
    if isinstance(label, bool) or not isinstance(label, Integral) or not 0 <= label < NUM_CLASSES:
        raise ValueError(f"class label must be an int in [0, {NUM_CLASSES}), got {label!r}")
    return int(label)


def label_of(shape: str, color: str) -> int:
    """Class label of a (shape, colour) pair: shape_index * len(COLORS) + color_index."""
    return _check_shape(shape) * len(COLORS) + _check_color(color)


def shape_and_color(label: int) -> tuple[str, str]:
    """Inverse of `label_of`: (shape, colour) of a class label."""
    shape_index, color_index = divmod(_check_label(label), len(COLORS))
    return SHAPES[shape_index], COLORS[color_index]


def class_name(label: int) -> str:
    """Readable class name, colour first: 0 -> "red circle"."""
    shape, color = shape_and_color(label)
    return f"{color} {shape}"


# ------------------------------------------------------------------------------- geometry


@functools.cache
def _coverage_cached(shape: str, width: int, height: int) -> np.ndarray:
    rows = height * _SUPERSAMPLE
    cols = width * _SUPERSAMPLE
    u = ((np.arange(cols) + 0.5) / cols)[None, :]  # [1, cols] sub-pixel centres, box units 0..1
    v = ((np.arange(rows) + 0.5) / rows)[:, None]  # [rows, 1]
    if shape == "circle":
        inside = (u - 0.5) ** 2 + (v - 0.5) ** 2 <= 0.25
    elif shape == "square":
        inside = np.ones((rows, cols), dtype=bool)
    elif shape == "triangle":
        inside = np.abs(u - 0.5) <= 0.5 * v  # apex at the top centre, base along the bottom edge
    else:  # cross: two bars a third of the box thick
        inside = (np.abs(u - 0.5) <= 1 / 6) | (np.abs(v - 0.5) <= 1 / 6)
    coverage = inside.reshape(height, _SUPERSAMPLE, width, _SUPERSAMPLE).mean(axis=(1, 3), dtype=np.float32)
    coverage.flags.writeable = False  # shared by the cache
    return coverage


def shape_coverage(shape: str, width: int, height: int) -> np.ndarray:
    """Anti-aliased coverage of `shape` filling a width x height box: [height, width] float32 in [0, 1].

    The shape touches all four sides of its box, so a render's box is tight. Read-only (cached).
    """
    _check_shape(shape)
    if width < 1 or height < 1:
        raise ValueError(f"box must be at least 1x1 px, got {width}x{height}")
    return _coverage_cached(shape, int(width), int(height))


def position_offset(box_a: tuple[float, ...], box_b: tuple[float, ...]) -> tuple[float, float]:
    """GenEval's dead-zoned direction of box A relative to box B, as (dx, dy).

    With centres c, sizes d = (w, h) and offset o = c_a - c_b:
        r = sign(o) * max(|o| - 0.1 * (d_a + d_b), 0),   (dx, dy) = r / |o|
    "left of" holds when dx < -0.5, "right of" when dx > 0.5, "above" when dy < -0.5 and
    "below" when dy > 0.5 (image y grows downwards). Coincident centres give (0, 0).
    """
    # Plain floats: this runs inside the layout's rejection loop, where numpy's overhead dominates.
    offset_x = (box_a[0] + box_a[2] - box_b[0] - box_b[2]) / 2
    offset_y = (box_a[1] + box_a[3] - box_b[1] - box_b[3]) / 2
    norm = math.hypot(offset_x, offset_y)
    if norm == 0.0:
        return 0.0, 0.0
    dims_x = abs(box_a[2] - box_a[0]) + abs(box_b[2] - box_b[0])
    dims_y = abs(box_a[3] - box_a[1]) + abs(box_b[3] - box_b[1])
    revised_x = math.copysign(max(abs(offset_x) - POSITION_DEAD_ZONE * dims_x, 0.0), offset_x)
    revised_y = math.copysign(max(abs(offset_y) - POSITION_DEAD_ZONE * dims_y, 0.0), offset_y)
    return float(revised_x / norm), float(revised_y / norm)


def relations_between(box_a: tuple[float, ...], box_b: tuple[float, ...], threshold: float = 0.5) -> set[str]:
    """Relations of A to B ("left of", "right of", "above", "below") by GenEval's rule."""
    dx, dy = position_offset(box_a, box_b)
    relations = set()
    if dx < -threshold:
        relations.add("left of")
    if dx > threshold:
        relations.add("right of")
    if dy < -threshold:
        relations.add("above")
    if dy > threshold:
        relations.add("below")
    return relations


def _boxes_apart(box_a: Box, box_b: Box, gap: int = OBJECT_GAP) -> bool:
    return (
        box_a[2] + gap <= box_b[0]
        or box_b[2] + gap <= box_a[0]
        or box_a[3] + gap <= box_b[1]
        or box_b[3] + gap <= box_a[1]
    )


# ---------------------------------------------------------------------------- backgrounds


@functools.cache
def _background_photos() -> tuple[tuple[str, Image.Image], ...]:
    """The bundled photographs as greyscale PIL images, loaded on first use and kept."""
    try:
        import skimage.data
    except ImportError as err:
        raise ImportError(
            "visar.data.shapes draws its backgrounds from scikit-image's bundled photographs; "
            "install it with `pip install scikit-image`."
        ) from err
    data_dir = os.path.dirname(skimage.data.__file__)
    photos = []
    skipped = []
    for name, filename in _BACKGROUND_PHOTOS:
        loader = getattr(skimage.data, name, None)
        if loader is None or not os.path.isfile(os.path.join(data_dir, filename)):
            skipped.append(name)  # not bundled here: its loader would try to download it
            continue
        pixels = np.asarray(loader())
        if pixels.ndim == 3:
            grey = pixels[..., :3].astype(np.float32) @ _LUMA_WEIGHTS  # [H, W]
        else:
            grey = pixels.astype(np.float32)
        photos.append((name, Image.fromarray(np.clip(grey, 0, 255).astype(np.uint8), mode="L")))
    if not photos:
        raise RuntimeError("none of scikit-image's bundled photographs could be found for backgrounds")
    if skipped:
        warnings.warn(
            f"scikit-image lacks bundled photographs {skipped}; shape-world backgrounds (and so "
            "seeded pixels) differ from a full install",
            stacklevel=3,
        )
    return tuple(photos)


def background_names() -> tuple[str, ...]:
    """Names of the scikit-image photographs used as backgrounds on this install (loads them)."""
    return tuple(name for name, _ in _background_photos())


def _render_background(
    rng: np.random.Generator, amplitude_range: tuple[float, float] = _BACKGROUND_AMPLITUDE_RANGE
) -> np.ndarray:
    """A grey, mid-bright, low-contrast crop of a bundled photograph: [64, 64, 3] float32."""
    photos = _background_photos()
    _, photo = photos[int(rng.integers(len(photos)))]
    width, height = photo.size
    side = int(rng.integers(_CROP_SIDE_RANGE[0], min(width, height, _CROP_SIDE_RANGE[1]) + 1))
    x0 = int(rng.integers(0, width - side + 1))
    y0 = int(rng.integers(0, height - side + 1))
    crop_box = (x0, y0, x0 + side, y0 + side)
    crop = photo.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BILINEAR, box=crop_box)
    luma = np.asarray(crop, dtype=np.float32)  # [64, 64]
    if rng.random() < 0.5:
        luma = luma[:, ::-1]
    # Standardise, clip to +-2 std, then map into [mid - amplitude, mid + amplitude].
    normalised = np.clip((luma - luma.mean()) / (luma.std() + 1.0), -2.0, 2.0) * 0.5
    mid = rng.uniform(*_BACKGROUND_MID_RANGE)
    amplitude = rng.uniform(*amplitude_range)
    tint = rng.uniform(-_BACKGROUND_TINT, _BACKGROUND_TINT, size=3).astype(np.float32)
    tint -= tint.mean()  # zero-mean tint: colours the grey without moving its luminance
    return (mid + amplitude * normalised)[..., None] + tint  # [64, 64, 3]


# ---------------------------------------------------------------------------------- prompts


def _with_article(phrase: str) -> str:
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


def _validate_metadata(metadata: Mapping[str, Any]) -> None:
    """Check an entry names only this world's shapes, colours, relations and valid groups."""
    if not isinstance(metadata, Mapping) or "include" not in metadata:
        raise ValueError("GenEval metadata must be a mapping with an 'include' list")
    include = metadata["include"]
    for index, item in enumerate(include):
        _check_shape(item["class"])
        count = item["count"]
        if isinstance(count, bool) or not isinstance(count, Integral) or count < 1:
            raise ValueError(f"include[{index}] count must be a positive int, got {count!r}")
        if "color" in item:
            _check_color(item["color"])
        if "position" in item:
            relation, group = item["position"]
            if relation not in RELATIONS:
                raise ValueError(f"unknown relation {relation!r}; known relations: {', '.join(RELATIONS)}")
            if not (isinstance(group, Integral) and 0 <= group < index):
                raise ValueError(
                    f"include[{index}] position must point at an earlier include entry, got {group!r}",
                )
    for item in metadata.get("exclude", []):
        _check_shape(item["class"])


@functools.cache
def _task_entries(task: str) -> tuple[dict[str, Any], ...]:
    """Every distinct GenEval entry of one task in this world (callers deep-copy before returning)."""
    entries: list[dict[str, Any]] = []
    if task == "single_object":
        for shape in SHAPES:
            entries.append(
                {
                    "tag": task,
                    "include": [{"class": shape, "count": 1}],
                    "prompt": f"a photo of {_with_article(shape)}",
                }
            )
    elif task == "two_object":
        for first, second in itertools.permutations(SHAPES, 2):
            entries.append(
                {
                    "tag": task,
                    "include": [{"class": first, "count": 1}, {"class": second, "count": 1}],
                    "prompt": f"a photo of {_with_article(first)} and {_with_article(second)}",
                }
            )
    elif task == "counting":
        for shape, count in itertools.product(SHAPES, COUNT_WORDS):
            entries.append(
                {
                    "tag": task,
                    "include": [{"class": shape, "count": count}],
                    "exclude": [{"class": shape, "count": count + 1}],
                    "prompt": f"a photo of {COUNT_WORDS[count]} {PLURALS[shape]}",
                }
            )
    elif task == "colors":
        for shape, color in itertools.product(SHAPES, COLORS):
            entries.append(
                {
                    "tag": task,
                    "include": [{"class": shape, "count": 1, "color": color}],
                    "prompt": f"a photo of {_with_article(f'{color} {shape}')}",
                }
            )
    elif task == "position":
        # GenEval's order: the reference object first, then the positioned one pointing at group 0.
        for (target, subject), relation in itertools.product(itertools.permutations(SHAPES, 2), RELATIONS):
            entries.append(
                {
                    "tag": task,
                    "include": [
                        {"class": target, "count": 1},
                        {"class": subject, "count": 1, "position": [relation, 0]},
                    ],
                    "prompt": f"a photo of {_with_article(subject)} {relation} {_with_article(target)}",
                }
            )
    elif task == "color_attr":
        for (first, second), (first_color, second_color) in itertools.product(
            itertools.permutations(SHAPES, 2), itertools.permutations(COLORS, 2)
        ):
            entries.append(
                {
                    "tag": task,
                    "include": [
                        {"class": first, "count": 1, "color": first_color},
                        {"class": second, "count": 1, "color": second_color},
                    ],
                    "prompt": (
                        f"a photo of {_with_article(f'{first_color} {first}')} and "
                        f"{_with_article(f'{second_color} {second}')}"
                    ),
                }
            )
    else:
        raise ValueError(f"unknown task {task!r}; known tasks: {', '.join(TASKS)}")
    return tuple(entries)


def make_geneval_metadata(n_per_task: int, seed: int) -> list[dict[str, Any]]:
    """A GenEval-format prompt set for this world: n_per_task entries of each task, in GenEval's task order.

    Within a task, entries are a seeded permutation of all distinct prompts, so there are no
    repeats until a task's prompts run out (single_object has 4, two_object 12, counting 12,
    colors 40, position 48, color_attr 1080); then the next permutation starts.
    """
    if isinstance(n_per_task, bool) or not isinstance(n_per_task, Integral) or n_per_task < 0:
        raise ValueError(f"n_per_task must be a non-negative int, got {n_per_task!r}")
    rng = np.random.default_rng(seed)
    metadata: list[dict[str, Any]] = []
    for task in TASKS:
        entries = _task_entries(task)
        chosen: list[int] = []
        while len(chosen) < n_per_task:
            chosen.extend(rng.permutation(len(entries)).tolist())
        metadata.extend(copy.deepcopy(entries[index]) for index in chosen[:n_per_task])
    return metadata


# -------------------------------------------------------------------------------- rendering


def _layout(
    plan: list[tuple[str, str, int]],
    include: list[Mapping[str, Any]],
    rng: np.random.Generator,
    min_size: int = MIN_OBJECT_SIZE,
) -> list[Box]:
    """Boxes for `plan` (shape, colour, include group) that are apart and satisfy every position clause."""
    max_size = _MAX_SIZE_FOR_COUNT[len(plan)]
    min_size = min(min_size, max_size)  # an easy render's size floor gives way where many objects must fit
    for _ in range(_MAX_LAYOUT_ATTEMPTS):
        boxes: list[Box] = []
        group_boxes: dict[int, list[Box]] = {}
        for _, _, group in plan:
            position = include[group].get("position")
            size = int(rng.integers(min_size, max_size + 1))
            # One draw of candidate corners per object; the first that fits is taken.
            corners = rng.integers(0, IMAGE_SIZE - size + 1, size=(_MAX_PLACEMENT_TRIES, 2))  # [T, 2]
            for x0, y0 in corners.tolist():
                box = (x0, y0, x0 + size, y0 + size)
                if not all(_boxes_apart(box, other) for other in boxes):
                    continue
                if position is not None:
                    relation, target_group = position
                    targets = group_boxes[target_group]
                    if not all(_relation_holds_clearly(box, target, relation) for target in targets):
                        continue
                break
            else:
                break  # this object did not fit: start the layout again
            boxes.append(box)
            group_boxes.setdefault(group, []).append(box)
        if len(boxes) == len(plan):
            return boxes
    raise RuntimeError(f"could not lay out {len(plan)} objects in {_MAX_LAYOUT_ATTEMPTS} attempts")


def _relation_holds_clearly(box: Box, target_box: Box, relation: str) -> bool:
    dx, dy = position_offset(box, target_box)
    needed = 0.5 + POSITION_MARGIN
    return {"left of": -dx, "right of": dx, "above": -dy, "below": dy}[relation] >= needed


def _draw(background: np.ndarray, objects: list[ShapeObject]) -> np.ndarray:
    """Composite flat-coloured objects over a float background: [64, 64, 3] uint8."""
    canvas = background.copy()  # [64, 64, 3] float32
    for obj in objects:
        x0, y0, x1, y1 = obj.box
        coverage = _coverage_cached(obj.shape, x1 - x0, y1 - y0)[..., None]  # [h, w, 1]
        color = np.asarray(PALETTE[obj.color], dtype=np.float32)
        region = canvas[y0:y1, x0:x1]
        canvas[y0:y1, x0:x1] = region + coverage * (color - region)
    return np.clip(np.rint(canvas), 0, 255).astype(np.uint8)


def _render_entry(
    metadata: Mapping[str, Any],
    rng: np.random.Generator,
    min_size: int = MIN_OBJECT_SIZE,
    background_amplitude: tuple[float, float] = _BACKGROUND_AMPLITUDE_RANGE,
) -> tuple[np.ndarray, list[ShapeObject]]:
    include = list(metadata["include"])
    classes = [item["class"] for item in include]
    if len(set(classes)) != len(classes):
        raise ValueError(f"include entries must name distinct shapes to be renderable, got {classes}")
    # Colour-free clauses get a random colour per object: GenEval does not constrain them.
    plan = [
        (item["class"], item.get("color") or COLORS[int(rng.integers(len(COLORS)))], group)
        for group, item in enumerate(include)
        for _ in range(item["count"])
    ]
    if len(plan) > max(_MAX_SIZE_FOR_COUNT):
        raise ValueError(
            f"at most {max(_MAX_SIZE_FOR_COUNT)} objects fit in a render, metadata asks for {len(plan)}",
        )
    for group, item in enumerate(include):
        if "position" in item and (item["count"] != 1 or include[item["position"][1]]["count"] != 1):
            raise ValueError(f"include[{group}]: position clauses are rendered only between single objects")
    for item in metadata.get("exclude", []):
        drawn = sum(1 for shape, _, _ in plan if shape == item["class"])
        if drawn >= item["count"]:
            raise ValueError(f"exclude {item} contradicts include: {drawn} {item['class']} must be drawn")
    background = _render_background(rng, background_amplitude)
    if not plan:
        return _draw(background, []), []
    boxes = _layout(plan, include, rng, min_size)
    objects = [ShapeObject(shape, color, box) for (shape, color, _), box in zip(plan, boxes, strict=True)]
    return _draw(background, objects), objects


def render_from_metadata(metadata: Mapping[str, Any], seed: int) -> ShapesSample:
    """Render an image satisfying a GenEval entry of this world (classes are shape names).

    Exactly `count` objects are drawn per include clause (so `exclude` with count + 1 holds);
    clauses without a colour get random colours; position clauses hold with a margin of
    `POSITION_MARGIN` beyond GenEval's 0.5. An empty include list gives a bare background.
    """
    _validate_metadata(metadata)
    image, objects = _render_entry(metadata, np.random.default_rng(seed))
    entry = copy.deepcopy(dict(metadata))
    caption = entry.get("prompt", "")
    return ShapesSample(image=image, objects=objects, class_label=None, caption=caption, metadata=entry)


def render_caption_sample(
    seed: int,
    task: str | None = None,
    *,
    min_size: int = MIN_OBJECT_SIZE,
    background_amplitude: tuple[float, float] = _BACKGROUND_AMPLITUDE_RANGE,
) -> ShapesSample:
    """A text-conditional sample: a GenEval task (uniform over `TASKS` if None), its prompt and image.

    `min_size` and `background_amplitude` select an easier variant as in `render_class`; the
    size floor is capped at the largest size that `count` objects may take (20 px for three)."""
    _check_render_options(min_size, background_amplitude)
    rng = np.random.default_rng(seed)
    if task is None:
        task = TASKS[int(rng.integers(len(TASKS)))]
    entries = _task_entries(task)  # raises ValueError for an unknown task
    entry = copy.deepcopy(entries[int(rng.integers(len(entries)))])
    image, objects = _render_entry(entry, rng, min_size, background_amplitude)
    caption = entry["prompt"]
    return ShapesSample(image=image, objects=objects, class_label=None, caption=caption, metadata=entry)


def _check_render_options(min_size: int, background_amplitude: tuple[float, float]) -> None:
    if not MIN_OBJECT_SIZE <= min_size <= MAX_OBJECT_SIZE:
        raise ValueError(f"min_size must be in [{MIN_OBJECT_SIZE}, {MAX_OBJECT_SIZE}], got {min_size}")
    low, high = background_amplitude
    if not 0 <= low <= high <= _BACKGROUND_AMPLITUDE_RANGE[1]:
        raise ValueError(f"background_amplitude must satisfy 0 <= low <= high <= 28, got {background_amplitude}")


def class_render_options(recipe: Mapping[str, Any] | None) -> dict:
    """The `render_class` keyword arguments of a training recipe (also as read back from config.json)."""
    render = dict((recipe or {}).get("render") or {})
    if "background_amplitude" in render:
        render["background_amplitude"] = tuple(render["background_amplitude"])
    return render


def render_class(
    label: int,
    seed: int,
    *,
    min_size: int = MIN_OBJECT_SIZE,
    background_amplitude: tuple[float, float] = _BACKGROUND_AMPLITUDE_RANGE,
) -> ShapesSample:
    """A class-conditional sample: exactly one object of the label's shape and colour.

    Its metadata is the GenEval "colors" entry for that object, e.g. "a photo of a red circle".
    `min_size` (px, up to `MAX_OBJECT_SIZE`) and `background_amplitude` (the background's
    luminance swing) select an easier variant of the world; the visar-tiny-c2i recipe uses one
    (see `CLASS_RENDER_EASY`). The defaults draw the same world as the caption renders.
    """
    _check_render_options(min_size, background_amplitude)
    shape, color = shape_and_color(label)
    entry = {
        "tag": "colors",
        "include": [{"class": shape, "count": 1, "color": color}],
        "prompt": f"a photo of {_with_article(f'{color} {shape}')}",
    }
    image, objects = _render_entry(entry, np.random.default_rng(seed), min_size, background_amplitude)
    caption = entry["prompt"]
    return ShapesSample(image=image, objects=objects, class_label=int(label), caption=caption, metadata=entry)
