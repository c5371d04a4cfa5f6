"""`visar eval geneval`: GenEval's image layout from its prompt metadata, and shapes-world scoring.

Metadata: GenEval's `evaluation_metadata.jsonl` format, one JSON object per line with `tag`,
`prompt`, `include` (a list of {"class", "count", optional "color", optional "position":
[relation, earlier include index]}) and optional `exclude` ({"class", "count"}).
`load_metadata` checks every line and names the first bad one.

Layout (what GenEval's `evaluation/evaluate_images.py` reads; its folders must be all digits and
its images match `\\d+\\.png`):

    OUT/00000/metadata.jsonl     # the prompt's ONE JSON object, written with json.dump
    OUT/00000/samples/00000.png  # N_SAMPLES images per prompt (GenEval's default 4)
    OUT/00000/samples/00001.png ...
    OUT/config.json              # what decides the pixels; a resumed run must match it

Image j of prompt i draws from seed SEED + i * N_SAMPLES + j: its global index, as in
`visar eval fid`, so reruns and resumption reproduce it whatever the batch size.

Scoring (shapes-world models): every image goes through the shapes detector and GenEval's rules
(`visar.eval.detector.score_geneval`); OUT/results.jsonl has GenEval's rows (filename, tag,
prompt, correct, reason, metadata, details) and `summary` mirrors GenEval's
`evaluation/summary_scores.py`: images, prompts, % correct images, % correct prompts (any of a
prompt's images correct), per-task accuracy and the overall score, the unweighted mean of the
six task accuracies. Real models are scored by GenEval's own evaluator on the same folder
(docs/EVALUATION.md).
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from numbers import Integral
from pathlib import Path

from ..errors import VisarError
from .samples import (
    SampleJob,
    check_run_config,
    generate_missing,
    recorded_choice,
    settled_method,
    write_atomic,
    write_json_atomic,
    writing,
)

SHIPPED_METADATA = Path(__file__).resolve().parents[1] / "data" / "geneval_shapes_metadata.jsonl"
GENEVAL_RELATIONS = ("left of", "right of", "above", "below")


def metadata_problem(entry) -> str | None:
    """What makes one parsed line not GenEval metadata, or None when it is."""
    if not isinstance(entry, dict):
        return f"a JSON object is expected, got {type(entry).__name__}"
    for key in ("tag", "prompt"):
        if not isinstance(entry.get(key), str) or not entry[key].strip():
            return f"{key!r} must be a non-empty string"
    include = entry.get("include")
    if not isinstance(include, list) or not include:
        return "'include' must be a non-empty list"
    for kind in ("include", "exclude"):
        clauses = entry.get(kind, [])
        if not isinstance(clauses, list):
            return f"{kind!r} must be a list"
        for index, clause in enumerate(clauses):
            where = f"{kind}[{index}]"
            if not isinstance(clause, dict):
                return f"{where} must be an object"
            if not isinstance(clause.get("class"), str):
                return f"{where} needs a 'class' string"
            count = clause.get("count")
            if isinstance(count, bool) or not isinstance(count, Integral) or count < 1:
                return f"{where} 'count' must be an integer >= 1, got {count!r}"
            if "color" in clause and not isinstance(clause["color"], str):
                return f"{where} 'color' must be a string"
            if "position" in clause:
                position = clause["position"]
                if kind == "exclude":
                    return f"{where}: only include clauses take a position"
                if not (isinstance(position, list) and len(position) == 2 and position[0] in GENEVAL_RELATIONS):
                    return f"{where} 'position' must be [relation, group] with relation one of {GENEVAL_RELATIONS}"
                group = position[1]
                if isinstance(group, bool) or not isinstance(group, Integral) or not 0 <= group < index:
                    return f"{where} 'position' must point at an earlier include entry, got {group!r}"
    return None


def load_metadata(path: str | Path | None = None) -> list[dict]:
    """Entries of a GenEval metadata file (default: the shipped shapes-world set); VisarError on a bad line."""
    path = Path(path) if path is not None else SHIPPED_METADATA
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise VisarError(f"cannot read metadata file {path}: {err}") from err
    entries = []
    for number, line in enumerate(lines, start=1):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as err:
            raise VisarError(f"{path} line {number} is not valid GenEval metadata: not JSON ({err.msg})") from None
        problem = metadata_problem(entry)
        if problem:
            raise VisarError(f"{path} line {number} is not valid GenEval metadata: {problem}")
        entries.append(entry)
    if not entries:
        raise VisarError(f"metadata file {path} has no prompts")
    return entries


def check_shapes_world(entries: list[dict], path, hint: str = "") -> None:
    """VisarError naming the first entry outside the shapes world (a class that is no shape, an unknown colour)."""
    from ..data.shapes import COLORS, SHAPES

    for number, entry in enumerate(entries, start=1):
        for kind in ("include", "exclude"):
            for clause in entry.get(kind, []):
                if clause["class"] not in SHAPES or clause.get("color", COLORS[0]) not in COLORS:
                    named = " ".join(filter(None, (clause.get("color"), repr(clause["class"]))))
                    raise VisarError(
                        f"{path} line {number} names {named}, not an object "
                        f"of the shapes world ({', '.join(SHAPES)} in {', '.join(COLORS)}){hint}"
                    )


def make_shapes_metadata(per_task: int = 20, seed: int = 0) -> list[dict]:
    """The shipped prompt set: `make_geneval_metadata(per_task, seed)` without repeats.

    A task with fewer distinct prompts than `per_task` keeps all of them once (single_object 4,
    two_object 12, counting 12); the others keep `per_task` (colors, position, color_attr).
    `visar/data/geneval_shapes_metadata.jsonl` is `make_shapes_metadata(20, 0)`, one entry a line.
    """
    from ..data.shapes import make_geneval_metadata

    entries, seen = [], set()
    for entry in make_geneval_metadata(per_task, seed=seed):
        key = json.dumps(entry, sort_keys=True)
        if key not in seen:
            seen.add(key)
            entries.append(entry)
    return entries


def prompt_folder(out: Path, index: int) -> Path:
    return Path(out) / f"{index:05d}"


def geneval_jobs(out: Path, entries: list[dict], n_samples: int, seed: int = 0) -> list[SampleJob]:
    """Image j of prompt i -> OUT/{i:05d}/samples/{j:05d}.png, seed SEED + i * n_samples + j."""
    if n_samples < 1:
        raise VisarError("--n-samples must be >= 1")
    return [
        SampleJob(prompt_folder(out, i) / "samples" / f"{j:05d}.png", entry["prompt"], seed + i * n_samples + j)
        for i, entry in enumerate(entries)
        for j in range(n_samples)
    ]


def write_prompt_metadata(out: Path, entries: list[dict]) -> None:
    """OUT/{i:05d}/metadata.jsonl = entry i (one object, json.dump); an existing one must be the same entry."""
    for i, entry in enumerate(entries):
        path = prompt_folder(out, i) / "metadata.jsonl"
        if path.is_file():
            try:
                existing = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                existing = None  # unreadable: rewrite it
            if existing is not None and existing != entry:
                raise VisarError(
                    f"{path} holds {existing.get('prompt')!r}, not line {i + 1} of the metadata "
                    f"({entry['prompt']!r}): use another output folder for another prompt file"
                )
            if existing == entry:
                continue
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda file, entry=entry: file.write(json.dumps(entry).encode()))


def score_layout(out: Path, entries: list[dict], n_samples: int) -> list[dict]:
    """Score every image of the layout with the shapes detector -> GenEval's results rows."""
    from PIL import Image

    from .detector import detect, score_geneval

    rows = []
    for i, entry in enumerate(entries):
        for j in range(n_samples):
            path = prompt_folder(out, i) / "samples" / f"{j:05d}.png"
            with Image.open(path) as image:
                detections = detect(image)
            correct, reason = score_geneval(detections, entry)
            details = defaultdict(list)
            for d in detections:
                details[d.shape].append([*d.box, d.score])
            rows.append(
                {
                    "filename": str(path),
                    "tag": entry["tag"],
                    "prompt": entry["prompt"],
                    "correct": correct,
                    "reason": reason,
                    "metadata": json.dumps(entry),
                    "details": json.dumps(details),
                }
            )
    return rows


def summary(rows: list[dict]) -> dict:
    """GenEval's summary_scores.py on results rows: prompts are grouped by their metadata string."""
    from .detector import summarize

    by_prompt = defaultdict(list)
    for row in rows:
        by_prompt[row["metadata"]].append(bool(row["correct"]))
    tasks = summarize(rows)
    overall = tasks.pop("overall")
    return {
        "images": len(rows),
        "prompts": len(by_prompt),
        "correct_images": sum(bool(r["correct"]) for r in rows) / len(rows),
        "correct_prompts": sum(any(v) for v in by_prompt.values()) / len(by_prompt),
        "tasks": tasks,
        "overall": overall,
        "task_counts": {  # tag -> [correct images, images]
            tag: [sum(bool(r["correct"]) for r in rows if r["tag"] == tag), sum(r["tag"] == tag for r in rows)]
            for tag in tasks
        },
    }


def format_summary(s: dict) -> str:
    """The summary as GenEval's summary_scores.py prints it."""
    lines = [
        f"Total images: {s['images']}",
        f"Total prompts: {s['prompts']}",
        f"% correct images: {s['correct_images']:.2%}",
        f"% correct prompts: {s['correct_prompts']:.2%}",
        "",
        "Task breakdown",
    ]
    for tag, accuracy in s["tasks"].items():
        correct, total = s["task_counts"][tag]
        lines.append(f"{tag:<16} = {accuracy:.2%} ({correct} / {total})")
    lines += ["", f"Overall score (avg. over tasks): {s['overall']:.5f}"]
    return "\n".join(lines)


def evaluate_geneval(
    pipe,
    out: str | Path,
    *,
    metadata: str | Path | None = None,
    n_samples: int = 4,
    method: str = "ar",
    seed: int = 0,
    batch_size: int = 16,
    score: bool = True,
    identity: dict | None = None,
    generate_kwargs: dict | None = None,
    progress: bool = True,
) -> dict:
    """Write (resuming) the GenEval layout for `metadata`, then score it when `score`.

    Returns {"model", "method", "n_prompts", "n_samples", "generated", "reused", ... [, "summary"]};
    with scoring, also writes OUT/results.jsonl and OUT/summary.json.
    """
    if pipe.is_class_conditional:
        raise VisarError(f"{pipe.name} is class-conditional: GenEval needs a text-conditional model")
    out = Path(out)
    metadata_path = Path(metadata) if metadata is not None else SHIPPED_METADATA
    entries = load_metadata(metadata_path)
    if score:
        hint = ": score it with GenEval's evaluator (docs/EVALUATION.md) and pass --no-score"
        check_shapes_world(entries, metadata_path, hint)
    digest = hashlib.sha256("\n".join(json.dumps(e, sort_keys=True) for e in entries).encode()).hexdigest()[:12]
    run = {
        "command": "eval geneval",
        "model": pipe.name,
        "method": method,
        "seed": seed,
        "n_samples": n_samples,
        "metadata_sha256": digest,
        "dtype": str(pipe.dtype).removeprefix("torch."),
        **(identity or {}),
    }
    jobs = geneval_jobs(out, entries, n_samples, seed)
    with writing(out):
        config = out / "config.json"
        first = [job.condition for job in jobs[:batch_size]]
        decoding, kwargs, choice, _ = settled_method(
            pipe, method, first, batch_size, generate_kwargs or {}, recorded_choice(config)
        )
        check_run_config(config, {**run, **choice})
        write_prompt_metadata(out, entries)
        stats = generate_missing(
            pipe,
            jobs,
            method=decoding,
            batch_size=batch_size,
            progress=progress,
            desc=f"eval geneval {method}",
            **kwargs,
        )
    record = {
        "model": pipe.name,
        "method": method,
        **choice,
        "metadata": str(metadata_path),
        "n_prompts": len(entries),
        "n_samples": n_samples,
        "out": str(out),
        **stats,
    }
    if score:
        rows = score_layout(out, entries, n_samples)
        record["summary"] = summary(rows)
        with writing(out):
            lines = "".join(json.dumps(r) + "\n" for r in rows).encode()
            write_atomic(out / "results.jsonl", lambda file: file.write(lines))
            write_json_atomic(out / "summary.json", record)
    return record
