"""`visar eval shapes`: generate images with a shapes-world model and score them with the detector.

Class-conditional models: image i has class i mod num_classes (classes spread evenly) and is
correct when the detector's largest object has the class's shape and colour (`score_class`).
Text-conditional models: image i has GenEval task i mod 6 and the (i div 6)-th prompt of that
task in a fixed prompt set (`make_geneval_metadata(ceil(n / 6), seed=0)`), scored with GenEval's
rules (`score_geneval`); "overall" is the unweighted mean of the six task accuracies.
Image i is generated with seed `seed + i`, whatever the batch size.
"""

from __future__ import annotations

import math

from ..errors import VisarError
from ..progress import progress_bar
from .samples import settled_method


def caption_metadata(n: int) -> list[dict]:
    """GenEval metadata for n images, tasks interleaved: image i gets task i mod 6."""
    from ..data.shapes import TASKS, make_geneval_metadata

    per_task = math.ceil(n / len(TASKS))
    metadata = make_geneval_metadata(per_task, seed=0)  # grouped by task, per_task each
    return [metadata[(i % len(TASKS)) * per_task + i // len(TASKS)] for i in range(n)]


def shapes_conditions(pipe, n: int) -> list:
    """The condition of each of n images: class ids, or GenEval metadata entries."""
    return [i % pipe.num_classes for i in range(n)] if pipe.is_class_conditional else caption_metadata(n)


def evaluate_shapes(
    pipe,
    *,
    n: int,
    method: str | None = None,
    seed: int = 0,
    batch_size: int = 16,
    progress: bool = True,
    **generate_kwargs,
) -> dict:
    """Generate n images and score them; returns the JSON record of `visar eval shapes`. method None:
    the reference decoding of the model's kind (ar, var, maskgit, mar)."""
    from ..accel import reference_method
    from .detector import detect, score_class, score_geneval, summarize

    method = method or reference_method(pipe.model)
    if n < 1:
        raise VisarError("--n must be >= 1")
    conditions = shapes_conditions(pipe, n)
    opening = [c if pipe.is_class_conditional else c["prompt"] for c in conditions[:batch_size]]
    # auto settled before the first image: every image decoded by one candidate, named in the record
    decoding, generate_kwargs, choice, _ = settled_method(pipe, method, opening, batch_size, generate_kwargs)
    rows = []
    for first in progress_bar(
        range(0, n, batch_size), enabled=progress, desc=f"eval shapes {method}", unit="batch", leave=True
    ):
        chunk = conditions[first : first + batch_size]
        if pipe.is_class_conditional:
            out = pipe.generate(
                class_labels=chunk, method=decoding, seed=seed + first, output_type="np", **generate_kwargs
            )
            rows += [{"correct": score_class(detect(img), label)} for img, label in zip(out.images, chunk, strict=True)]
        else:
            out = pipe.generate(
                prompts=[m["prompt"] for m in chunk],
                method=decoding,
                seed=seed + first,
                output_type="np",
                **generate_kwargs,
            )
            for img, meta in zip(out.images, chunk, strict=True):
                correct, _ = score_geneval(detect(img), meta)
                rows.append({"tag": meta["tag"], "correct": correct})
    record = {"model": pipe.name, "method": method, "n": n, **choice}
    if pipe.is_class_conditional:
        record["accuracy"] = sum(r["correct"] for r in rows) / n
    else:
        summary = summarize(rows)
        record["overall"] = summary.pop("overall")
        record["tasks"] = summary
    return record


def ground_truth_scores(n: int, class_conditional: bool, class_render: dict | None = None) -> dict:
    """The detector's score on n ground-truth renders laid out as `evaluate_shapes` lays out images.

    class_render: `render_class` options of the model's training data (`class_render_options(pipe.recipe)`).
    """
    from ..data.shapes import NUM_CLASSES, render_class, render_from_metadata
    from .detector import detect, score_class, score_geneval, summarize

    if class_conditional:
        renders = (render_class(i % NUM_CLASSES, i, **(class_render or {})) for i in range(n))
        correct = [score_class(detect(r.image), r.class_label) for r in renders]
        return {"accuracy": sum(correct) / n, "n": n}
    rows = []
    for i, meta in enumerate(caption_metadata(n)):
        correct, _ = score_geneval(detect(render_from_metadata(meta, i).image), meta)
        rows.append({"tag": meta["tag"], "correct": correct})
    summary = summarize(rows)
    return {"overall": summary.pop("overall"), "tasks": summary, "n": n}
