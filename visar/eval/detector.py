"""A classical detector for the shapes world (`visar.data.shapes`) and GenEval's scoring rules on it.

GenEval (Ghosh et al. 2023, github.com/djghosh13/geneval) scores a text-to-image model by
detecting objects (Mask2Former), naming their colours (CLIP) and checking each prompt's
metadata with `evaluation/evaluate_images.py`. Here the world is known, so a few lines of
classical vision replace both networks, and `score_geneval` mirrors GenEval's `evaluate()`:
include clauses are ANDed, colour and position are judged on the `count` most confident
objects of the class, exclude clauses fail when `len(found) >= count`.

How `detect` works, on a 64x64 image:
1. foreground = pixels farther than `FOREGROUND_DISTANCE` from the background model, the
   grey axis between luminance 74 and 181 (the renderer's [82, 173] plus a margin);
2. a 4-neighbour opening removes specks and 1-px JPEG/VQ fringes, then 4-connected components;
3. a component whose core holds two palette colours in force is split by colour (objects of
   different colours that touch); parts under `MIN_AREA` px are dropped;
4. each part is re-segmented at half contrast between its colour and its local background, so
   blur does not fatten shapes;
5. colour = nearest palette entry to the median colour of the part's eroded core;
6. shape = the `SHAPES` template, stretched to the part's box, with the highest IoU against its
   mask; a part with IoU < `MIN_SHAPE_IOU` or an aspect beyond `MAX_ASPECT` is tried once more
   split by erosion (same-coloured objects that touch), else dropped as no object of this world.
Score = shape IoU x colour margin (d2 - d1) / (d2 + d1), in [0, 1], used to order detections
the way GenEval orders Mask2Former's by confidence.
Limitation: same-coloured objects that merge into a shape-less blob erosion cannot split (two
squares side by side make a rectangle) are missed; renders keep objects 3 px apart.

`python3 -m visar.eval.detector` measures its accuracy on clean and degraded renders (the
figures: docs/EVALUATION.md). "degraded" = `degrade(image, seed)`: per-image colour shift
(uniform +-12 per channel), Gaussian blur sigma 0.7, noise std 8/255, JPEG quality 75 (4:4:4),
standing in for a VQ tokenizer's decode. "heavy": blur 1.0, noise 12/255, JPEG quality 50.
"jpeg420": "degraded" with JPEG's 4:2:0 chroma subsampling, which halves colour resolution. The
test suite asserts >= 98% clean and >= 95% "degraded" on other seeds.
"""

from __future__ import annotations

import io
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Any

import numpy as np
from PIL import Image

from visar.data.shapes import (
    BACKGROUND_LUMA_RANGE,
    COLORS,
    IMAGE_SIZE,
    PALETTE,
    RELATIONS,
    SHAPES,
    TASKS,
    relations_between,
    shape_and_color,
    shape_coverage,
)
from visar.errors import require

ndimage = require("scipy.ndimage", "eval")

FOREGROUND_DISTANCE = 40.0  # RGB distance from the background model above which a pixel is an object
_BACKGROUND_LUMA_MARGIN = 8.0  # renders stay inside BACKGROUND_LUMA_RANGE; degradations may not
MIN_AREA = 30  # px; the smallest render (a 12 px triangle) covers ~70
MIN_SHAPE_IOU = 0.55  # below this a blob matches no template: a circle scores ~0.79 on the square one
MAX_ASPECT = 1.6  # renders have square boxes; a blob much longer than wide is no object of this world
_SPLIT_MIN_SHARE = 0.2  # a second colour splits a component when it holds this share of its core
_SPLIT_MIN_PIXELS = 15  # ... and at least this many core pixels

_PALETTE_RGB = np.array([PALETTE[color] for color in COLORS], dtype=np.float32)  # [10, 3]
_CROSS_3X3 = ndimage.generate_binary_structure(2, 1)  # 4-neighbourhood


@dataclass(frozen=True)
class Detection:
    """One detected object; box is (x0, y0, x1, y1) in the input image's pixels, ends exclusive."""

    shape: str
    color: str
    box: tuple[float, float, float, float]
    score: float


# ---------------------------------------------------------------------------------- detection


def _as_rgb64(image: np.ndarray | Image.Image) -> tuple[np.ndarray, float, float]:
    """Pixels as [64, 64, 3] float32 in 0..255, and the (x, y) scale back to the input's pixels.

    Accepts a PIL image or an [H, W, 3|4] array, uint8 or float in [0, 1]. Other sizes are
    resized to 64x64 (area averaging when shrinking), so thresholds keep their meaning; boxes
    are scaled back.
    """
    if isinstance(image, Image.Image):
        pil = image.convert("RGB")
    else:
        array = np.asarray(image)
        if array.ndim != 3 or array.shape[2] not in (3, 4):
            raise ValueError(f"image must be [H, W, 3] (or RGBA), got shape {array.shape}")
        if np.issubdtype(array.dtype, np.floating):
            array = np.clip(np.rint(array * 255.0), 0, 255).astype(np.uint8)  # float input is read as [0, 1]
        elif array.dtype != np.uint8:
            raise ValueError(f"image must be uint8 or float in [0, 1], got dtype {array.dtype}")
        array = np.ascontiguousarray(array[..., :3])
        if array.shape[:2] == (IMAGE_SIZE, IMAGE_SIZE):
            return array.astype(np.float32), 1.0, 1.0
        pil = Image.fromarray(array, mode="RGB")
    width, height = pil.size
    if (width, height) != (IMAGE_SIZE, IMAGE_SIZE):
        shrinking = width > IMAGE_SIZE or height > IMAGE_SIZE
        resample = Image.Resampling.BOX if shrinking else Image.Resampling.BILINEAR
        pil = pil.resize((IMAGE_SIZE, IMAGE_SIZE), resample)
    return np.asarray(pil, dtype=np.float32), width / IMAGE_SIZE, height / IMAGE_SIZE


def background_distance(pixels: np.ndarray) -> np.ndarray:
    """RGB distance of each pixel to the background model: [..., 3] -> [...].

    The model is the segment of the grey axis with luminance in the renderer's range plus a
    margin; a pixel's distance is its chroma (distance to the grey axis) combined with how far
    its grey level lies outside the range.
    """
    grey = pixels.mean(axis=-1)  # [...] nearest grey level (m, m, m)
    chroma_sq = ((pixels - grey[..., None]) ** 2).sum(axis=-1)
    low = BACKGROUND_LUMA_RANGE[0] - _BACKGROUND_LUMA_MARGIN
    high = BACKGROUND_LUMA_RANGE[1] + _BACKGROUND_LUMA_MARGIN
    outside = np.maximum(np.maximum(low - grey, grey - high), 0.0) * np.sqrt(3.0)  # along the grey axis
    return np.sqrt(chroma_sq + outside**2)


def _palette_distances(colors: np.ndarray) -> np.ndarray:
    """[N, 3] RGB -> [N, 10] Euclidean distance to each palette colour."""
    return np.linalg.norm(colors[:, None, :] - _PALETTE_RGB[None, :, :], axis=-1)


def _core(mask: np.ndarray) -> np.ndarray:
    """Mask minus its 1-px rim, where colour is not mixed with the background (the mask if too small)."""
    core = ndimage.binary_erosion(mask, structure=_CROSS_3X3)
    return core if core.sum() >= 5 else mask


def _split_by_color(mask: np.ndarray, pixels: np.ndarray) -> list[np.ndarray]:
    """Split a component into single-colour parts when its core holds two or more palette colours in force.

    mask: [h, w] bool, pixels: [h, w, 3]. Returns a list of [h, w] bool masks.
    """
    core = _core(mask)
    nearest = _palette_distances(pixels[core]).argmin(axis=1)  # [N] palette index per core pixel
    counts = np.bincount(nearest, minlength=len(COLORS))
    strong = np.flatnonzero((counts >= _SPLIT_MIN_PIXELS) & (counts >= _SPLIT_MIN_SHARE * core.sum()))
    if len(strong) < 2:
        return [mask]
    # Each pixel of the component goes to the nearest of the strong colours only, so blended
    # seams between two objects do not create a third colour.
    distances = np.linalg.norm(pixels[:, :, None, :] - _PALETTE_RGB[strong][None, None], axis=-1)  # [h, w, S]
    owner = distances.argmin(axis=-1)  # [h, w]
    parts = []
    for index in range(len(strong)):
        part = ndimage.binary_opening(mask & (owner == index), structure=_CROSS_3X3)
        labels, count = ndimage.label(part, structure=_CROSS_3X3)
        parts.extend(labels == label for label in range(1, count + 1))
    return parts


def _classify_shape(mask: np.ndarray) -> tuple[str, float] | None:
    """Best template (shape, IoU) for a mask cropped to its box, or None if it matches none."""
    height, width = mask.shape
    if max(width, height) > MAX_ASPECT * min(width, height):
        return None
    area = mask.sum()
    best_shape, best_iou = "", 0.0
    for shape in SHAPES:
        template = shape_coverage(shape, width, height) >= 0.5  # [h, w]
        intersection = np.count_nonzero(mask & template)
        iou = intersection / (area + np.count_nonzero(template) - intersection)
        if iou > best_iou:
            best_shape, best_iou = shape, float(iou)
    if best_iou < MIN_SHAPE_IOU:
        return None
    return best_shape, best_iou


def _refine(part: np.ndarray, others: np.ndarray, foreground: np.ndarray, pixels: np.ndarray) -> np.ndarray:
    """Re-segment one object at half contrast between its own colour and its local background.

    part, others, foreground: [64, 64] bool; pixels: [64, 64, 3]. The fixed foreground threshold
    sits well below half contrast for saturated colours, so blur, JPEG chroma bleed or a VQ
    decode would fatten shapes (crosses turn into blobs); thresholding the coverage estimate
    t = (p - bg) . (obj - bg) / |obj - bg|^2 at 0.5 puts the edge where the renderer put it.
    """
    near = ndimage.binary_dilation(part, structure=_CROSS_3X3, iterations=2)
    ring = ndimage.binary_dilation(part, iterations=4) & ~near & ~foreground
    if ring.sum() < 8:
        ring = ~foreground
    if not ring.any():
        return part
    background_color = np.median(pixels[ring], axis=0)  # [3]
    object_color = np.median(pixels[_core(part)], axis=0)  # [3]
    direction = object_color - background_color
    contrast_sq = float(direction @ direction)
    if contrast_sq < FOREGROUND_DISTANCE**2:
        return part  # too little contrast to locate an edge better than the foreground mask does
    coverage = (pixels - background_color) @ direction / contrast_sq  # [64, 64]
    refined = ndimage.binary_fill_holes(near & ~others & (coverage >= 0.5))
    # Keep only what is connected to the object's core, not bits of a neighbour's halo.
    labels, _ = ndimage.label(refined, structure=_CROSS_3X3)
    kept = np.unique(labels[_core(part) & refined])
    kept = kept[kept > 0]
    if len(kept) == 0:
        return part
    return np.isin(labels, kept)


def _split_by_erosion(mask: np.ndarray) -> list[np.ndarray]:
    """Split a blob of touching same-coloured objects: erode until it falls apart, then give each
    pixel to its nearest seed. mask: [64, 64] bool; returns [] when erosion never splits it.

    Only tried on blobs that match no template: erosion never splits this world's shapes
    (convex, or a plus whose arms stay joined at the centre), so a true object is never cut.
    """
    for iterations in range(1, 5):
        eroded = ndimage.binary_erosion(mask, structure=_CROSS_3X3, iterations=iterations)
        seeds, count = ndimage.label(eroded, structure=_CROSS_3X3)
        if count == 0:
            return []
        if count >= 2:
            # For every pixel, the index of its nearest seed pixel, then that seed's label.
            _, (nearest_rows, nearest_cols) = ndimage.distance_transform_edt(seeds == 0, return_indices=True)
            owner = seeds[nearest_rows, nearest_cols]  # [64, 64]
            return [mask & (owner == label) for label in range(1, count + 1)]
    return []


def _detect_part(
    part: np.ndarray,
    others: np.ndarray,
    foreground: np.ndarray,
    pixels: np.ndarray,
    scale: tuple[float, float],
) -> Detection | None:
    """Detection for one single-colour candidate mask ([64, 64] bool), or None if it is no object."""
    mask = _refine(part, others, foreground, pixels)
    if mask.sum() < MIN_AREA:
        return None
    rows = np.flatnonzero(mask.any(axis=1))
    cols = np.flatnonzero(mask.any(axis=0))
    y0, y1, x0, x1 = int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1
    shape_fit = _classify_shape(mask[y0:y1, x0:x1])
    if shape_fit is None:
        return None
    median_color = np.median(pixels[_core(part)], axis=0)  # [3]
    distances = _palette_distances(median_color[None])[0]  # [10]
    nearest, second = np.sort(distances)[:2]
    color = COLORS[int(distances.argmin())]
    color_margin = float((second - nearest) / (second + nearest))
    box = (x0 * scale[0], y0 * scale[1], x1 * scale[0], y1 * scale[1])
    return Detection(shape_fit[0], color, box, shape_fit[1] * color_margin)


def detect(image: np.ndarray | Image.Image) -> list[Detection]:
    """Objects of the shapes world in an image, most confident first.

    image: [H, W, 3] uint8 (or float in [0, 1]) array, or a PIL image; 64x64 is native, other
    sizes are resized to 64x64 first and boxes are mapped back to the input's pixels.
    """
    pixels, scale_x, scale_y = _as_rgb64(image)  # [64, 64, 3]
    foreground = background_distance(pixels) > FOREGROUND_DISTANCE  # [64, 64]
    foreground = ndimage.binary_opening(foreground, structure=_CROSS_3X3)
    labels, _ = ndimage.label(foreground, structure=_CROSS_3X3)
    parts = []  # [64, 64] bool masks, one per single-colour object candidate
    for index, region in enumerate(ndimage.find_objects(labels), start=1):
        component = labels[region] == index  # [h, w] mask in the region's frame
        if component.sum() < MIN_AREA:
            continue
        for part in _split_by_color(component, pixels[region]):
            if part.sum() >= MIN_AREA:
                full = np.zeros(foreground.shape, dtype=bool)
                full[region] = part
                parts.append(full)
    all_parts = np.any(parts, axis=0) if parts else np.zeros(foreground.shape, dtype=bool)
    detections = []
    for part in parts:
        others = all_parts & ~part
        detection = _detect_part(part, others, foreground, pixels, (scale_x, scale_y))
        if detection is not None:
            detections.append(detection)
            continue
        pieces = _split_by_erosion(part)
        for piece in pieces:
            if piece.sum() >= MIN_AREA:
                piece_others = others | (part & ~piece)
                detection = _detect_part(piece, piece_others, foreground, pixels, (scale_x, scale_y))
                if detection is not None:
                    detections.append(detection)
    detections.sort(key=lambda detection: -detection.score)
    return detections


# ------------------------------------------------------------------------------------ scoring


def _check_metadata(metadata: Mapping[str, Any]) -> None:
    for clause_kind in ("include", "exclude"):
        for index, clause in enumerate(metadata.get(clause_kind, [])):
            if clause.get("class") not in SHAPES:
                raise ValueError(
                    f"{clause_kind}[{index}] class {clause.get('class')!r} is not a shape of this world "
                    f"({', '.join(SHAPES)})"
                )
            if "color" in clause and clause["color"] not in COLORS:
                raise ValueError(
                    f"{clause_kind}[{index}] color {clause['color']!r} is not one of {', '.join(COLORS)}",
                )
            if "position" in clause:
                relation, group = clause["position"]
                if relation not in RELATIONS:
                    raise ValueError(
                        f"{clause_kind}[{index}] relation {relation!r} is not one of {', '.join(RELATIONS)}"
                    )
                if not (isinstance(group, Integral) and 0 <= group < index):
                    raise ValueError(
                        f"{clause_kind}[{index}] position must point at an earlier include entry",
                    )


def score_geneval(detections: Sequence[Detection], metadata: Mapping[str, Any]) -> tuple[bool, str]:
    """GenEval's verdict for one image: (correct, reason), reason empty when correct.

    Mirrors `evaluate()` in GenEval's evaluation/evaluate_images.py, with shapes as classes:
    - include clauses (ANDed): the `count` most confident detections of the class must exist
      (`len(found) >= count`); with a `color`, all of those must have it; with
      `position: [relation, group]`, each must stand in that relation (`relations_between`,
      0.1 x summed dims dead zone) to every object matched by the earlier clause `group`, which
      itself must have matched;
    - exclude clauses (ORed): fail when `len(found) >= count` (counting's exact-count check).
    """
    _check_metadata(metadata)
    by_class: dict[str, list[Detection]] = defaultdict(list)
    for detection in sorted(detections, key=lambda detection: -detection.score):
        by_class[detection.shape].append(detection)
    correct = True
    reasons: list[str] = []
    matched_groups: list[list[Detection] | None] = []
    for clause in metadata.get("include", []):
        classname, count = clause["class"], clause["count"]
        matched = True
        found = by_class[classname][:count]
        if len(found) < count:
            correct = matched = False
            reasons.append(f"expected {classname}>={count}, found {len(found)}")
        else:
            if "color" in clause:
                colors = [detection.color for detection in found]
                if colors.count(clause["color"]) < count:
                    correct = matched = False
                    seen = ", ".join(f"{colors.count(color)} {color}" for color in COLORS if color in colors)
                    reasons.append(
                        f"expected {clause['color']} {classname}>={count}, found "
                        f"{colors.count(clause['color'])} {clause['color']}; and {seen}"
                    )
            if "position" in clause and matched:
                expected_relation, target_group = clause["position"]
                targets = matched_groups[target_group]
                if targets is None:
                    correct = matched = False
                    reasons.append(f"no target for {classname} to be {expected_relation}")
                else:
                    for detection in found:
                        for target in targets:
                            relations = relations_between(detection.box, target.box)
                            if expected_relation not in relations:
                                correct = matched = False
                                reasons.append(
                                    f"expected {classname} {expected_relation} target, found "
                                    f"{' and '.join(sorted(relations))} target"
                                )
                                break
                        if not matched:
                            break
        matched_groups.append(found if matched else None)
    for clause in metadata.get("exclude", []):
        classname = clause["class"]
        if len(by_class[classname]) >= clause["count"]:
            correct = False
            reasons.append(f"expected {classname}<{clause['count']}, found {len(by_class[classname])}")
    return correct, "\n".join(reasons)


def score_class(detections: Sequence[Detection], label: int) -> bool:
    """Class-conditional correctness: the largest detection (box area, ties to the higher score)
    has the label's shape and colour. No detection is incorrect; smaller extra detections are
    tolerated, as GenEval tolerates extra objects outside its clauses.
    """
    shape, color = shape_and_color(label)  # raises ValueError for a label out of range
    main = largest(detections)
    return main is not None and main.shape == shape and main.color == color


def largest(detections: Sequence[Detection]) -> Detection | None:
    """The detection with the largest box (ties to the higher score), None when there is none."""
    if not detections:
        return None
    return max(
        detections,
        key=lambda detection: (
            (detection.box[2] - detection.box[0]) * (detection.box[3] - detection.box[1]),
            detection.score,
        ),
    )


def summarize(results: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """GenEval's summary: accuracy per task tag and "overall", the unweighted mean over the tags present.

    results: rows with "tag" and "correct" (e.g. GenEval's results.jsonl rows). Tags follow
    `TASKS` order, unknown tags after them; with all six tasks present, "overall" is GenEval's
    "Overall score (avg. over tasks)".
    """
    per_task: dict[str, list[bool]] = defaultdict(list)
    for row in results:
        per_task[row["tag"]].append(bool(row["correct"]))
    if not per_task:
        raise ValueError("summarize needs at least one result row")
    order = [tag for tag in TASKS if tag in per_task] + sorted(tag for tag in per_task if tag not in TASKS)
    summary = {tag: float(np.mean(per_task[tag])) for tag in order}
    summary["overall"] = float(np.mean([summary[tag] for tag in order]))
    return summary


# ------------------------------------------------------------------------------- degradation


def degrade(
    image: np.ndarray,
    seed: int,
    blur_sigma: float = 0.7,
    noise_std: float = 8.0,
    jpeg_quality: int = 75,
    chroma_subsampling: bool = False,
) -> np.ndarray:
    """A render as a VQ tokenizer might return it: [64, 64, 3] uint8 -> same.

    Per-image colour shift (uniform +-12 per channel), Gaussian blur, Gaussian noise (std in
    0..255 units, 8 = 8/255), then a JPEG round trip. Used to test the detector's robustness.
    """
    rng = np.random.default_rng(seed)
    pixels = image.astype(np.float32) + rng.uniform(-12.0, 12.0, size=3).astype(np.float32)
    pixels = ndimage.gaussian_filter(pixels, sigma=(blur_sigma, blur_sigma, 0.0))
    pixels = pixels + rng.normal(0.0, noise_std, size=pixels.shape)
    degraded = Image.fromarray(np.clip(np.rint(pixels), 0, 255).astype(np.uint8), mode="RGB")
    buffer = io.BytesIO()
    # 4:4:4 by default: a VQ decoder blurs colour no more than brightness; chroma_subsampling
    # gives JPEG's 4:2:0, a harsher stress case.
    degraded.save(buffer, format="JPEG", quality=jpeg_quality, subsampling=2 if chroma_subsampling else 0)
    buffer.seek(0)
    return np.asarray(Image.open(buffer).convert("RGB"))


# Degradations of the accuracy table: name -> degrade() keyword arguments.
_DEGRADATIONS: dict[str, dict[str, Any]] = {
    "degraded": {},
    "heavy": {"blur_sigma": 1.0, "noise_std": 12.0, "jpeg_quality": 50},
    "jpeg420": {"chroma_subsampling": True},
}


def _accuracy_table(renders_per_task: int, class_renders: int) -> None:
    """Print the accuracy table in this module's docstring (run `python3 -m visar.eval.detector`)."""
    import time

    from visar.data.shapes import NUM_CLASSES, render_caption_sample, render_class

    start = time.perf_counter()
    variants = ["clean", *_DEGRADATIONS]
    rows: dict[str, list[dict[str, Any]]] = {variant: [] for variant in variants}
    class_correct = dict.fromkeys(variants, 0)

    def variant_images(image: np.ndarray, seed: int) -> dict[str, np.ndarray]:
        images = {"clean": image}
        images.update({name: degrade(image, seed, **kwargs) for name, kwargs in _DEGRADATIONS.items()})
        return images

    for task_index, task in enumerate(TASKS):
        for seed in range(renders_per_task):
            sample = render_caption_sample(seed, task)
            for variant, pixels in variant_images(sample.image, seed + 7919 * task_index).items():
                correct, reason = score_geneval(detect(pixels), sample.metadata)
                rows[variant].append({"tag": task, "correct": correct})
                if not correct and variant in ("clean", "degraded"):
                    print(f"[{variant}] {task} seed {seed}: {sample.caption!r}: {reason!r}")
    for seed in range(class_renders):
        label = seed % NUM_CLASSES
        sample = render_class(label, seed)
        for variant, pixels in variant_images(sample.image, seed).items():
            class_correct[variant] += score_class(detect(pixels), label)
    summaries = {variant: summarize(rows[variant]) for variant in variants}
    print(f"{'task':15}" + "".join(f"{variant:>10}" for variant in variants))
    for tag in [*TASKS, "overall"]:
        print(f"{tag:15}" + "".join(f"{summaries[variant][tag]:10.1%}" for variant in variants))
    print(f"{'class labels':15}" + "".join(f"{class_correct[v] / class_renders:10.1%}" for v in variants))
    print(f"({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    _accuracy_table(renders_per_task=400, class_renders=2000)
