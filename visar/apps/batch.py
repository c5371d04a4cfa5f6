"""Batch generation behind `visar generate`: a list of items, N images each, resumable, on K processes.

Layout. Items (class ids / names or prompts) come from the command line or a file; image g (the
global index, 0 <= g < total) has item g mod P and seed SEED + g, and draws from its own
`torch.Generator` seeded so. Its file is OUT/[folder/]{g:05d}.png (`folder`: an optional
per-item subfolder of a jsonl items file). An image therefore does not depend on the batch it
is sampled in, nor on how many processes share the work, nor on earlier interruptions: in law
always, in bits on a CPU at one torch thread or with deterministic=True (`--deterministic`: each
image decoded alone), since a multi-threaded BLAS or a GPU rounds by the batch's shape.

Files. Every PNG is written through a temporary file renamed into place (`eval.samples`);
`settings.json` records what decides the pixels, and a rerun with other settings is refused (unless
the run it records finished no image); each process appends one JSON line per finished image to its
own `.records-*.jsonl` as it goes, and when all images are done the first process writes
`images.jsonl` (one record per image, in index order: index, file, condition (and negative prompt),
seed, method, forward passes) and `stats.json` (this run's counts and timings, the only file that
differs between runs), then removes the partial records.
An image is finished when its PNG is complete and its record is written: a rerun of the same
command generates only the others, and ends with the same files as an uninterrupted run.

Processes. Under `torchrun --nproc_per_node K -m visar generate ...` (WORLD_SIZE > 1 in the
environment) process r takes the images g with g mod K = r, on `cuda:LOCAL_RANK` with NCCL when
CUDA is there, on the CPU with gloo otherwise.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import VisarError
from ..eval.samples import (
    SampleJob,
    auto_choice,
    check_run_config,
    generate_missing,
    is_complete_png,
    recorded_choice,
    settled_method,
    write_atomic,
    write_error,
    write_json_atomic,
)

SETTINGS_FILE = "settings.json"
RECORDS_FILE = "images.jsonl"
STATS_FILE = "stats.json"
RESERVED = {SETTINGS_FILE, RECORDS_FILE, STATS_FILE}
PARTIAL_RECORDS = ".records-*.jsonl"  # one per process and run, merged into images.jsonl at the end
ITEM_KEYS = {"class": ("class", "class_label", "class_id"), "prompt": ("prompt", "text")}
# what an item object may hold besides its condition (a prompt's own negative prompt: prompts only)
ITEM_EXTRAS = {"class": ("folder",), "prompt": ("folder", "negative_prompt")}


# -- items -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Item:
    """What one item of the list asks for: a class id (with its name, if the model has names) or a prompt."""

    condition: int | str
    class_name: str | None = None
    folder: str | None = None  # subfolder of OUT for this item's images (jsonl "folder")
    negative_prompt: str | None = None  # a prompt's own (jsonl "negative_prompt"), before --negative-prompt


def resolve_class(pipe, value, where: str = "") -> Item:
    """A class id (int or digits) or one of the model's class names -> Item; `where` prefixes errors."""
    names = pipe.class_names or []
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise VisarError(f"{where}expected a class id or class name, got {value!r}")
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value.strip())
    if isinstance(value, int):
        if not 0 <= value < pipe.num_classes:
            raise VisarError(f"{where}class id {value} out of range: {pipe.name} has classes 0..{pipe.num_classes - 1}")
        return Item(value, names[value] if value < len(names) else None)
    folded = {name.casefold(): i for i, name in enumerate(names)}
    if value.strip().casefold() not in folded:
        hint = f"; its names: {', '.join(names[:8])}{', ...' if len(names) > 8 else ''}" if names else ""
        raise VisarError(f"{where}{value!r} is not a class of {pipe.name} (ids 0..{pipe.num_classes - 1}{hint})")
    index = folded[value.strip().casefold()]
    return Item(index, names[index])


def check_negative_prompts(pipe, items: list[Item]):
    """The items' own negative prompts refused (on a class model, too long, an empty one the model's encoder
    cannot encode) before a run writes anything: each distinct one is encoded once, as generate would."""
    distinct = sorted({item.negative_prompt for item in items if item.negative_prompt is not None})
    for first in range(0, len(distinct), 64):
        check_negatives(pipe, distinct[first : first + 64], 'leave out the line\'s "negative_prompt"')


def check_negatives(pipe, negatives: list[str], leave_out: str):
    """Negative prompts encoded as generate encodes them, so that what it would refuse is refused now. An empty
    one that the model's encoder refuses for being empty (visar's caption encoder: no words to attend to, while
    one word passes) is said in the command line's words: `leave_out`, what the user drops for the model's own
    unconditional branch (the Python API's sentence says negative_prompt=None)."""
    try:
        pipe.negative_condition(negatives, len(negatives))
    except VisarError as err:
        worded = [text if text.split() else "a" for text in negatives]
        if worded == negatives:
            raise
        try:
            pipe.negative_condition(worded, len(worded))
        except VisarError:
            raise err from err.__cause__  # refused for another reason than the empty one
        raise VisarError(
            "an empty negative prompt cannot be encoded by this model's caption encoder (it has no words): give it "
            f"some words, or {leave_out} for the model's own null caption"
        ) from err


def check_folder(folder, where: str) -> str:
    """A per-item subfolder must stay inside the output folder: relative, no '..', no hidden parts."""
    if not isinstance(folder, str) or not folder.strip():
        raise VisarError(f'{where}"folder" must be a non-empty relative path, got {folder!r}')
    path = Path(folder)
    parts = path.parts
    if path.is_absolute() or path.anchor or "\\" in folder or "\x00" in folder:
        raise VisarError(f"{where}folder {folder!r} is not a relative path inside the output folder")
    if any(part in ("..", ".") or part.startswith(".") for part in parts):
        raise VisarError(f"{where}folder {folder!r} would write outside the output folder (or into a hidden one)")
    if parts[0] in RESERVED:
        raise VisarError(f"{where}folder {folder!r} is the name of a file visar writes in the output folder")
    return path.as_posix()


def read_items(path: str | os.PathLike, kind: str, pipe) -> list[Item]:
    """A file of items, kind "class" or "prompt": .jsonl (one JSON value per line: an id, a name, a
    prompt, or {"class": ..., "folder": ...} / {"prompt": ..., "folder": ..., "negative_prompt": ...})
    or text (one item per line). Blank lines are skipped; errors name the line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise VisarError(f"{path} is not UTF-8 text: {err}") from err
    except OSError as err:
        raise VisarError(f"cannot read items file {path}: {err.strerror or err}") from err
    jsonl = path.suffix.lower() in (".jsonl", ".ndjson")
    items = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path} line {number}: "
        value, extras = line.strip(), {}
        if jsonl:
            try:
                value = json.loads(line)
            except json.JSONDecodeError as err:
                raise VisarError(f"{where}not valid JSON ({err.msg})") from None
            if isinstance(value, dict):
                value, extras = item_from_object(value, kind, where)
        if kind == "class":
            item = resolve_class(pipe, value, where)
        else:
            if not isinstance(value, str) or not value.strip():
                raise VisarError(f"{where}expected a non-empty prompt, got {value!r}")
            item = Item(value.strip())
        folder, negative = extras.get("folder"), extras.get("negative_prompt")
        if negative is not None and not isinstance(negative, str):
            raise VisarError(f'{where}"negative_prompt" must be a string, got {negative!r}')
        if folder is not None or negative is not None:
            folder = None if folder is None else check_folder(folder, where)
            item = Item(item.condition, item.class_name, folder, negative)
        items.append(item)
    if not items:
        raise VisarError(f"{path} holds no items (one {'class id or name' if kind == 'class' else 'prompt'} a line)")
    return items


def item_from_object(entry: dict, kind: str, where: str) -> tuple[Any, dict]:
    """A jsonl item object -> (its condition, its extras: folder, and a prompt's negative_prompt)."""
    keys = [key for key in ITEM_KEYS[kind] if key in entry]
    unknown = sorted(set(entry) - set(ITEM_KEYS[kind]) - set(ITEM_EXTRAS[kind]))
    if len(keys) != 1 or unknown:
        optional = ", ".join(f'"{extra}": optional' for extra in ITEM_EXTRAS[kind])
        expected = f'{{"{ITEM_KEYS[kind][0]}": ..., {optional}}}'
        raise VisarError(f"{where}expected {expected}, got keys {sorted(entry)}")
    return entry[keys[0]], {extra: entry[extra] for extra in ITEM_EXTRAS[kind] if extra in entry}


# -- processes ---------------------------------------------------------------------------------------


@dataclass
class Processes:
    """This process's place among the torchrun processes (rank 0 of 1 without torchrun)."""

    rank: int = 0
    world: int = 1
    distributed: bool = False

    def barrier(self):
        if self.distributed:
            torch.distributed.barrier()

    def gather(self, value) -> list:
        """Every process's value, in rank order (on every process)."""
        if not self.distributed:
            return [value]
        values = [None] * self.world
        torch.distributed.all_gather_object(values, value)
        return values

    def close(self):
        if self.distributed and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def start_processes(device: str | None) -> tuple[Processes, str | None]:
    """Join torchrun's process group when WORLD_SIZE > 1: NCCL on CUDA, gloo on CPU. Returns the
    processes and the device to load on (`cuda:LOCAL_RANK` for `cuda` or the default on a GPU machine)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Processes(), device
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = (device in (None, "cuda") and torch.cuda.is_available()) or str(device).startswith("cuda")
    if use_cuda:
        device = f"cuda:{local_rank}" if device in (None, "cuda") else device
        torch.cuda.set_device(torch.device(device))
    torch.distributed.init_process_group(backend="nccl" if use_cuda else "gloo")
    return Processes(rank, world, True), device


# -- the run -----------------------------------------------------------------------------------------


def image_jobs(
    out: Path, items: list[Item], total: int, seed: int, negative_prompt: str | None = None
) -> tuple[list[SampleJob], list[dict]]:
    """Image g: item g mod P, seed SEED + g, file OUT/[folder/]{g:05d}.png, negative prompt the item's own,
    else the run's (None: the model's); with its record's fixed part (naming the negative prompt, if any)."""
    jobs, records = [], []
    for g in range(total):
        item = items[g % len(items)]
        file = f"{item.folder}/{g:05d}.png" if item.folder else f"{g:05d}.png"
        own = item.negative_prompt if item.negative_prompt is not None else negative_prompt
        negative = {} if own is None else {"negative_prompt": own}
        jobs.append(SampleJob(out / file, item.condition, seed + g, own))
        if isinstance(item.condition, str):
            condition = {"prompt": item.condition}
        else:
            condition = {"class_label": item.condition, **({"class_name": item.class_name} if item.class_name else {})}
        records.append({"index": g, "file": file, **condition, **negative, "seed": seed + g})
    return jobs, records


def check_inside(out: Path, jobs: list[SampleJob]):
    """No file may land outside OUT, even through a symbolic link inside it."""
    root = out.resolve()
    for folder in sorted({job.path.parent for job in jobs}):
        if not folder.resolve().is_relative_to(root):
            raise VisarError(f"{folder} resolves to {folder.resolve()}, outside the output folder {root}")


def read_records(out: Path) -> dict[int, dict]:
    """Records of finished images: images.jsonl of an earlier run and every process's partial file.
    A line cut short by a kill (the last of a partial file) is skipped: its image is done again."""
    records = {}
    for path in [out / RECORDS_FILE, *sorted(out.glob(PARTIAL_RECORDS))]:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            continue
        except OSError as err:
            raise VisarError(f"cannot read {path}: {err.strerror or err}") from err
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("index"), int):
                records[record["index"]] = record
    return records


def remove_stale_temporaries(out: Path, jobs: list[SampleJob]):
    """Temporary files left by a killed process: `.NAME.PID.tmp` (`write_atomic`) for our NAMEs only."""
    ours = {(job.path.parent, job.path.name) for job in jobs} | {(out, name) for name in RESERVED}
    for folder in sorted({folder for folder, _ in ours}):
        if not folder.is_dir():
            continue
        for path in folder.glob(".*.tmp"):
            match = re.fullmatch(r"\.(.+)\.\d+\.tmp", path.name)
            if match and (folder, match.group(1)) in ours:
                path.unlink(missing_ok=True)


def refuse_foreign_folder(out: Path, jobs: list[SampleJob]):
    """A folder with our file names but no settings.json (an older visar, another tool): never mix."""
    if (out / SETTINGS_FILE).exists():
        return
    taken = [p for p in (out / STATS_FILE, out / RECORDS_FILE, *(job.path for job in jobs)) if p.exists()]
    if taken:
        raise VisarError(
            f"{out} already holds {taken[0].name} but no {SETTINGS_FILE} (written by another tool or an older "
            "visar), so its images cannot be checked against these settings: use another --out folder"
        )


def forget_settings_without_images(out: Path):
    """settings.json protects an earlier run's images from being mixed with other settings; a run that
    finished no image (it failed before its first: an unknown method, a bad option value) left nothing
    to protect, so its settings go and the corrected command is not refused. An image counts once its
    PNG exists, record or not (a kill between the two)."""
    settings = out / SETTINGS_FILE
    if settings.is_file() and not read_records(out) and next(out.rglob("*.png"), None) is None:
        settings.unlink()


def topmost_missing(path: Path) -> Path | None:
    """The outermost folder of `path` (itself included) that does not exist yet; None when it exists."""
    missing = None
    for folder in [path, *path.parents]:
        if folder.exists():
            break
        missing = folder
    return missing


def undo_imageless_run(out: Path, made: Path | None):
    """What a run that finished no image wrote goes: its settings.json (`forget_settings_without_images`),
    then, where this run made OUT (with its parents up to `made`), every folder left empty."""
    if out.is_dir():
        forget_settings_without_images(out)
    if made is None:
        return
    folders = sorted((p for p in out.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
    for folder in [*folders, out, *out.parents]:
        try:
            folder.rmdir()
        except OSError:  # not empty: an image or a file of someone else's stays, and so do the folders above
            return
        if folder == made:
            return


def run_batch(
    pipe,
    items: list[Item],
    *,
    total: int,
    out: str | os.PathLike,
    method: str,
    seed: int,
    batch_size: int,
    identity: dict,
    generate_kwargs: dict,
    processes: Processes | None = None,
    progress: bool = True,
) -> dict | None:
    """Generate the images of `items` (total images, image g: item g mod P) that OUT lacks.

    identity: what besides items, method and seed decides the pixels (recorded in settings.json).
    Returns the run's stats (on process 0; None on the others).
    """
    processes = processes or Processes()
    if total < 1:
        raise VisarError("--n must be >= 1")
    if batch_size < 1:
        raise VisarError("--batch-size must be >= 1")
    out = Path(out)
    # the run's negative prompt goes with each job (an item's own comes first), not to every call
    generate_kwargs = dict(generate_kwargs)
    jobs, fixed = image_jobs(out, items, total, seed, generate_kwargs.pop("negative_prompt", None))
    settings = batch_settings(pipe, items, method, seed, identity)
    made = topmost_missing(out)  # the folder this run makes (None: OUT was there)
    try:
        decoding, generate_kwargs, choice, auto_stats = settled_choice(
            pipe, out, jobs, method, batch_size, generate_kwargs, processes
        )
        settings |= choice
        prepare_output(out, jobs, settings, processes)
        per_image = {"method": method} | ({"auto": choice["auto_choice"]} if choice else {})
        counts = generate_share(
            pipe, out, jobs, fixed, decoding, batch_size, generate_kwargs, processes, progress and processes.rank == 0,
            per_image,
        )  # fmt: skip
    except BaseException:
        # A run refused before its first image (a method option's value is checked by the method itself, at
        # its first call) leaves nothing behind. One process only: under torchrun the others may still write.
        if processes.world == 1:
            undo_imageless_run(out, made)
        raise
    processes.barrier()  # every process's images and records are written
    all_counts = processes.gather(counts)
    if processes.rank != 0:
        return None
    return write_records_and_stats(pipe, out, settings, total, all_counts, batch_size, processes.world) | auto_stats


def settled_choice(pipe, out: Path, jobs: list[SampleJob], method: str, batch_size: int, kwargs: dict, processes):
    """`auto` made one candidate for the whole run before its first image (`settled_method`): the one a
    resumed run's settings.json records, else process 0's choice, which every process takes -> (the
    method to decode with, generate_kwargs for it, {"auto_choice": ...} for settings.json or {}, and
    {"auto", "auto_reason"} for stats.json or {})."""
    first = [job.condition for job in jobs[:batch_size]]
    recorded, why = recorded_choice(out / SETTINGS_FILE), ""
    if processes.rank == 0:
        _, _, choice, why = settled_method(pipe, method, first, batch_size, kwargs, recorded)
        recorded = choice.get("auto_choice")
    recorded, why = processes.gather((recorded, why))[0]
    decoding, kwargs, choice, _ = settled_method(pipe, method, first, batch_size, kwargs, recorded)
    return decoding, kwargs, choice, {"auto": recorded, "auto_reason": why} if choice else {}


def batch_settings(pipe, items: list[Item], method: str, seed: int, identity: dict) -> dict:
    """settings.json: everything that decides the pixels, which a resumed run must repeat."""
    return {
        "command": "generate",
        "layout": "image g: item g mod P, seed SEED + g, file [folder/]{g:05d}.png",
        "model": pipe.name,
        "method": method,
        "seed": seed,
        "dtype": str(pipe.dtype).removeprefix("torch."),
        **identity,
        "items": [item_settings(item) for item in items],
    }


def item_settings(item: Item) -> dict:
    """An item as settings.json records it: its condition, and its folder and own negative prompt if it has them."""
    settings = {"condition": item.condition}
    if item.folder:
        settings["folder"] = item.folder
    if item.negative_prompt is not None:
        settings["negative_prompt"] = item.negative_prompt
    return settings


def prepare_output(out: Path, jobs: list[SampleJob], settings: dict, processes: Processes):
    """Process 0 makes OUT and checks it may write there under these settings (no link out of it, no
    other tool's folder, the settings of an earlier run) and clears killed runs' temporaries; the
    others wait for it, then check the settings too."""
    try:
        if processes.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            check_inside(out, jobs)
            refuse_foreign_folder(out, jobs)
            forget_settings_without_images(out)
            check_run_config(out / SETTINGS_FILE, settings)
            remove_stale_temporaries(out, jobs)  # no other process writes yet: they wait below
        processes.barrier()
        if processes.rank != 0:
            check_run_config(out / SETTINGS_FILE, settings)
    except OSError as err:
        raise write_error(err, out) from err


def generate_share(
    pipe,
    out: Path,
    jobs: list[SampleJob],
    fixed: list[dict],
    method: str,
    batch_size: int,
    generate_kwargs: dict,
    processes: Processes,
    progress: bool,
    per_image: dict,
) -> dict:
    """This process's share of the images (every world-th from its rank) that OUT lacks, decoded with
    `method`, each recorded (with `per_image`: the run's method, and auto's choice) in the process's own
    partial records file once its PNG is written -> the counts, with wall_s."""
    total = len(jobs)
    mine = jobs[processes.rank :: processes.world]
    done = read_records(out)
    by_path = {job.path: g for g, job in zip(range(processes.rank, total, processes.world), mine, strict=True)}

    def finished(job: SampleJob) -> bool:
        g = by_path[job.path]
        return done.get(g, {}).get("file") == fixed[g]["file"] and is_complete_png(job.path)

    kept = {job.path for job in mine if finished(job)}  # each PNG checked once, for the line and the run

    def is_done(job: SampleJob) -> bool:
        return job.path in kept

    if processes.rank == 0:  # this process's share; one line, --quiet or not
        say_resuming(out, len(kept), len(mine), generate_kwargs.get("deterministic", False), per_image.get("auto"))
    partial = out / f".records-{processes.rank}-{os.getpid()}-{time.time_ns()}.jsonl"
    start = time.perf_counter()
    try:
        with open(partial, "a", encoding="utf-8") as log:

            def on_image(job: SampleJob, image_stats: dict):
                g = by_path[job.path]
                log.write(json.dumps({**fixed[g], **per_image, **image_stats}) + "\n")
                log.flush()  # one line per image, after its PNG: a killed run loses at most that image

            counts = generate_missing(
                pipe,
                mine,
                method=method,
                batch_size=batch_size,
                progress=progress,
                desc=f"{pipe.name} / {method}" + (f" (process 0 of {processes.world})" if processes.world > 1 else ""),
                is_done=is_done,
                on_image=on_image,
                **generate_kwargs,
            )
    except OSError as err:
        raise write_error(err, out) from err
    finally:
        if partial.exists() and partial.stat().st_size == 0:
            partial.unlink()
    counts["wall_s"] = time.perf_counter() - start
    return counts


def say_resuming(out: Path, done: int, share: int, deterministic: bool, auto: str | None = None):
    """One line when a run resumes: what is kept, and whether the rest are the bits of one run (auto:
    the candidate settings.json records, which decodes every image of the run)."""
    if done == 0 or done == share:
        return
    bits = (
        "bit-identical to an uninterrupted run (--deterministic)"
        if deterministic
        else "new draws of the same law: bit-identical to an uninterrupted run only on a CPU at one torch thread "
        "(--deterministic: on any device and batch size)"
    )
    if auto:
        bits += f"; auto decodes every image with {auto}, the choice settings.json records"
    print(f"resuming {out}: {done} of {share} images kept; the other {share - done} are {bits}", file=sys.stderr)


def write_records_and_stats(
    pipe, out: Path, settings: dict, total: int, counts: list[dict], batch_size: int, world: int
) -> dict:
    """images.jsonl, every image's record in image order (from every process's partial file, which then
    go), and stats.json -> the stats. An image without a record fails the run: rerunning resumes it."""
    records = read_records(out)
    missing = [g for g in range(total) if g not in records]
    if missing:
        raise VisarError(f"{len(missing)} images have no record after the run (first: {missing[0]}); rerun to resume")
    ordered = [records[g] for g in range(total)]
    try:
        lines = "".join(json.dumps(record) + "\n" for record in ordered)
        write_atomic(out / RECORDS_FILE, lambda file: file.write(lines.encode()))
        for path in out.glob(PARTIAL_RECORDS):
            path.unlink(missing_ok=True)
        stats = run_stats(pipe, settings, ordered, counts, batch_size, world)
        write_json_atomic(out / STATS_FILE, stats)
    except OSError as err:
        raise write_error(err, out) from err
    return stats


def run_stats(pipe, settings: dict, records: list[dict], counts: list[dict], batch_size: int, world: int) -> dict:
    """stats.json: the settings, this run's counts and timings, and every image's record."""
    generated = sum(c["generated"] for c in counts)
    wall = max(c["wall_s"] for c in counts)
    passes = sum(r["forward_passes"] for r in records)
    return {
        "model": settings["model"],
        "method": settings["method"],
        "options": settings.get("options", {}),
        "sampling": settings.get("sampling", {}),
        "seed": settings["seed"],
        "n": len(records),
        "items": len(settings["items"]),
        "batch_size": batch_size,
        "processes": world,
        "device": str(pipe.device),
        "dtype": settings["dtype"],
        "generated": generated,
        "reused": sum(c["reused"] for c in counts),
        "forward_passes": sum(c["forward_passes"] for c in counts),  # this run's, batch passes summed
        "forward_passes_per_image": passes / len(records),
        "tokens_per_forward": sum(pipe.model.num_image_tokens / r["forward_passes"] for r in records) / len(records),
        "sampling_s": sum(c["latency_s"] for c in counts),
        "decode_s": sum(c["decode_s"] for c in counts),
        "wall_s": wall,
        "images_per_s": generated / wall if wall > 0 else 0.0,
        # what auto ran this run and why (process 0's last call; every process chose from the same costs)
        **next((auto_choice(c) for c in counts if "auto" in c), {}),
        "images": records,
    }
