"""Sample sets on disk that resume: one PNG per image, written atomically, never generated twice.

`eval fid` and `eval geneval` both lay out a list of jobs (file, condition, seed) fixed by each
image's index alone, then call `generate_missing`: files that exist and are complete are
skipped, the rest are generated in batches and written through a temporary file renamed into
place, so an interrupted run leaves only whole images (and ignorable `.tmp` files) behind.

Bitwise stability: every image draws its tokens from its own generator (seeded by its index),
so its tokens do not depend on the batch it is sampled in, up to rounding: the model's matmuls
round differently for another batch shape (on CPU too), which flips a token when a draw lands
within that rounding (about 1e-6) of a bin edge of the sampling CDF (seen once: one image of six,
a gap of 5e-7 at its 166th token, generated in a batch of 4 and in a batch of 2; every token after
it then differs). Such a flip is rare and changes one sample, not the set's law. An image is then
decoded alone, because a batched convolution can differ in the last bit from an unbatched one,
and on CPU on one thread, because a multi-threaded convolution sums in an order set by the thread
count (which moves about one pixel value in a thousand by 1; torchrun gives each process one
thread). An image's file is therefore the same for any batch size, thread count and split into
shards or processes, except where a near-tie flips as above.
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from ..accel import get_method
from ..accel.core.sampling import MAX_SEED
from ..accel.core.stats import per_image
from ..errors import VisarError
from ..progress import progress_bar

PNG_END = b"\x00\x00\x00\x00IEND\xaeB`\x82"  # the IEND chunk every complete PNG ends with


@dataclass(frozen=True)
class SampleJob:
    """One image to produce: where it goes, what it is conditioned on and its generator's seed."""

    path: Path
    condition: Any  # class id (int) or prompt (str)
    seed: int
    negative_prompt: str | None = None  # a prompt's own negative prompt (None: generate_kwargs' or the model's)


def is_complete_png(path: Path) -> bool:
    """True when `path` is a PNG file that ends with its IEND chunk (so it was written to the end)."""
    try:
        with open(path, "rb") as file:
            size = file.seek(0, os.SEEK_END)
            if size < len(PNG_END) + 8:
                return False
            file.seek(-len(PNG_END), os.SEEK_END)
            return file.read() == PNG_END
    except OSError:
        return False


def write_atomic(path: Path, write) -> None:
    """Call `write(file)` on a temporary file beside `path`, then rename it onto `path`.

    The temporary name starts with a dot, so no reader of the layout (torch-fidelity's folder
    glob, GenEval's `\\d+\\.png` match) takes it for an image.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as file:
            write(file)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_error(err: OSError, out) -> VisarError:
    """A failed write (a full disk, a folder without write permission, a file where a folder should be)
    -> one sentence saying what to do about that cause; the images finished so far stay and a rerun resumes
    (where none was written, the sentence says so: an --out that names a file has none to keep)."""
    where = err.filename or out
    if Path(out).is_dir() and next(Path(out).rglob("*.png"), None) is not None:
        return VisarError(
            f"cannot write {where}: {err.strerror or err}. The images finished so far are kept: {write_remedy(err)}, "
            "then rerun the same command to resume"
        )
    return VisarError(
        f"cannot write {where}: {err.strerror or err}. No image was written: {write_remedy(err)}, then run the "
        "command again"
    )


def write_remedy(err: OSError) -> str:
    """What fixes a failed write, by its cause: a user whose --out names a file must not be sent to free space."""
    if err.errno in (errno.EEXIST, errno.ENOTDIR):
        return "a file stands where the output folder (or a folder in it) should be: move it or choose another --out"
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free space"
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "fix the folder's permissions or choose another --out"
    return "free space or fix the folder's permissions"


@contextmanager
def writing(out):
    """Turn an OSError of the block (writing under `out`) into `write_error`'s VisarError."""
    try:
        yield
    except OSError as err:
        raise write_error(err, out) from err


def save_png(array: np.ndarray, path: Path) -> None:
    """uint8 [H, W, 3] -> PNG at `path`, atomically."""
    write_atomic(path, lambda file: Image.fromarray(array).save(file, format="PNG"))


def write_json_atomic(path: Path, data) -> None:
    write_atomic(path, lambda file: file.write(json.dumps(data, indent=1).encode()))


def write_text_atomic(path: Path, text: str) -> None:
    write_atomic(path, lambda file: file.write(text.encode()))


def settled_method(pipe, method: str, first: list, batch_size: int, generate_kwargs: dict, recorded: str | None = None):
    """A run's method, with `auto` settled before its first image, so that which candidate decodes an
    image depends on no timing made while the run goes (a resumed run decodes its images as an
    uninterrupted one): `recorded`, the choice of the run it resumes, else `Pipeline.settle_auto` over
    the run's first conditions `first` (class ids or prompts; the winner kept on this machine, or a
    tuning on throwaway images) -> (method to decode with, generate_kwargs for it, what to record:
    {"auto_choice": "mc-sjd:8"}, or {} for another method or a kind of model that runs no auto, and
    why auto chose it, "" if it did not)."""
    if method != "auto" or pipe.resolve_method(method) != "auto":
        return method, generate_kwargs, {}, ""
    why = "the choice the run this one resumes recorded"
    if recorded is None:
        key = "class_labels" if pipe.is_class_conditional else "prompts"
        kwargs = {k: v for k, v in generate_kwargs.items() if k not in ("progress", "output_type")}
        recorded, why = pipe.settle_auto(**{key: first[:batch_size]}, batch_size=min(batch_size, len(first)), **kwargs)
    name, _, size = recorded.partition(":")
    kwargs = {k: v for k, v in generate_kwargs.items() if k not in get_method("auto").options}  # its candidates
    return name, kwargs | ({"budget": int(size)} if size else {}), {"auto_choice": recorded}, why


def recorded_choice(config: Path) -> str | None:
    """The auto choice a run's config file records (None: none, or no readable file)."""
    try:
        return json.loads(config.read_text()).get("auto_choice")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None  # check_run_config says what is wrong with a file that is there


def check_run_config(path: Path, identity: dict) -> None:
    """Record what makes a run's images what they are, or check a resumed run matches it.

    identity: the settings that decide each image's pixels (model, method, options, sampling,
    seed, dtype, conditions). Batch size, device, N and shards are not part of it: an image's
    file does not depend on them.
    """
    if path.is_file():
        try:
            recorded = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise VisarError(f"cannot read {path}: {err}; remove it or use another output folder") from err
        for key in sorted(set(recorded) | set(identity)):
            if recorded.get(key) != identity.get(key):
                raise VisarError(
                    f"{path.parent} holds images of another run ({key}: {recorded.get(key)!r} there, "
                    f"{identity.get(key)!r} now): resume with the same settings or use another output folder"
                )
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, identity)


@contextmanager
def one_cpu_thread(on: bool = True):
    """Run the block on one CPU thread (when `on`), then restore the thread count."""
    threads = torch.get_num_threads()
    if on:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if on:
            torch.set_num_threads(threads)


def decode_alone(pipe, tokens) -> np.ndarray:
    """One image's tokens (an entry of `per_image`) -> uint8 [H, W, 3], decoded alone (on CPU on one
    thread, see above)."""
    on_cpu = pipe.tokenizer is not None and next(pipe.tokenizer.parameters()).device.type == "cpu"
    batch = [t[None] for t in tokens] if isinstance(tokens, list) else tokens[None]
    with one_cpu_thread(on_cpu):
        return pipe.to_output(pipe.decode(batch), "np")[0]


def _batches(jobs: list[SampleJob], size: int) -> Iterator[list[SampleJob]]:
    """Consecutive jobs, `size` at most, split where jobs with and without their own negative prompt meet
    (a call gives every image one, or none: None is the model's own, which has no text to pass)."""
    chunk = []
    for job in jobs:
        if chunk and (len(chunk) == size or (job.negative_prompt is None) != (chunk[0].negative_prompt is None)):
            yield chunk
            chunk = []
        chunk.append(job)
    if chunk:
        yield chunk


# A running batch's queue holds this many batches' images: long enough that the slots rarely idle
# at its end, short enough that a text model encodes its prompts without holding a whole file's.
QUEUE_BATCHES = 32


def auto_choice(stats: dict) -> dict:
    """What `auto` ran, why, and each timed candidate's images per second ({} for another method): the last call's."""
    return {key: stats[key] for key in ("auto", "auto_reason", "auto_tuning") if key in stats}


def generate_missing(
    pipe,
    jobs: list[SampleJob],
    *,
    method: str = "ar",
    batch_size: int = 16,
    progress: bool = True,
    desc: str = "generate",
    is_done: Callable[[SampleJob], bool] | None = None,
    on_image: Callable[[SampleJob, dict], None] | None = None,
    **generate_kwargs,
) -> dict:
    """Generate the jobs whose file is missing or incomplete; returns {"generated", "reused", stats}.

    Class-conditional models take each job's condition as a class id, text-conditional ones as a
    prompt, with the job's own negative prompt where it has one. generate_kwargs go to
    `Pipeline.generate` (sampling settings, method options, a negative prompt for the other jobs).
    is_done(job): whether a job is finished (default: its PNG is complete); on_image(job, stats):
    called once its PNG is in place, with that image's {"forward_passes"}. A method that refills
    (`Method.refills`) decodes a running batch of `batch_size` slots over queues of jobs, each image
    saved as soon as it is done (an interrupted run keeps every finished one); the others decode
    consecutive batches, saved after each.
    """
    if batch_size < 1:
        raise VisarError("--batch-size must be >= 1")
    seeds = [job.seed for job in jobs]
    if seeds and not (0 <= min(seeds) and max(seeds) <= MAX_SEED):
        raise VisarError(
            f"the images' seeds (--seed plus the image's index) run from {min(seeds)} to {max(seeds)}: each must be "
            f"in 0..{MAX_SEED}"
        )
    is_done = is_done or (lambda job: is_complete_png(job.path))
    missing = [job for job in jobs if not is_done(job)]
    totals = {"forward_passes": 0, "latency_s": 0.0, "decode_s": 0.0}
    image_passes = 0
    key = "class_labels" if pipe.is_class_conditional else "prompts"
    refills = get_method(pipe.resolve_method(method)).refills
    with progress_bar(total=len(missing), enabled=progress, desc=desc, unit="img", leave=True) as bar:
        if refills:  # a running batch over a queue of jobs: each image saved as soon as it is done
            for queue in _batches(missing, batch_size * QUEUE_BATCHES):
                own = (
                    {} if queue[0].negative_prompt is None else {"negative_prompt": [j.negative_prompt for j in queue]}
                )

                def save(index, tokens, info, queue=queue):
                    start = time.perf_counter()
                    job = queue[index]
                    job.path.parent.mkdir(parents=True, exist_ok=True)
                    save_png(decode_alone(pipe, tokens), job.path)
                    if on_image is not None:
                        on_image(job, {key: info[key] for key in ("forward_passes", "auto") if key in info})
                    totals["decode_s"] += time.perf_counter() - start
                    bar.update(1)

                out = pipe.generate(
                    **{key: [job.condition for job in queue]},
                    method=method,
                    generator=[torch.Generator().manual_seed(job.seed) for job in queue],
                    output_type="tokens",
                    batch_size=min(batch_size, len(queue)),
                    on_image=save,
                    **{**generate_kwargs, **own},
                )
                totals["forward_passes"] += out.stats["forward_passes"]
                totals["latency_s"] += out.stats["latency_s"]
                totals.update(auto_choice(out.stats))
                image_passes += out.stats["forward_passes"] * min(batch_size, len(queue))  # slot-passes fed
        for chunk in _batches(missing, batch_size) if not refills else ():
            generators = [torch.Generator().manual_seed(job.seed) for job in chunk]
            own = {} if chunk[0].negative_prompt is None else {"negative_prompt": [j.negative_prompt for j in chunk]}
            out = pipe.generate(
                **{key: [job.condition for job in chunk]},
                method=method,
                generator=generators,
                output_type="tokens",
                **{**generate_kwargs, **own},
            )
            start = time.perf_counter()
            for i, (job, tokens) in enumerate(zip(chunk, per_image(out.tokens), strict=True)):
                job.path.parent.mkdir(parents=True, exist_ok=True)
                save_png(decode_alone(pipe, tokens), job.path)
                if on_image is not None:
                    record = {"forward_passes": out.stats["forward_passes_per_image"][i]}
                    if "auto" in out.stats:  # what `auto` ran for this batch
                        record["auto"] = out.stats["auto"]
                    on_image(job, record)
            totals["decode_s"] += time.perf_counter() - start
            totals["forward_passes"] += out.stats["forward_passes"]
            totals["latency_s"] += out.stats["latency_s"]
            totals.update(auto_choice(out.stats))
            image_passes += out.stats["forward_passes"] * len(chunk)
            bar.update(len(chunk))
    stats = {"generated": len(missing), "reused": len(jobs) - len(missing), **totals}
    if missing:
        stats["tokens_per_forward"] = len(missing) * pipe.model.num_image_tokens / max(image_passes, 1)
    return stats
