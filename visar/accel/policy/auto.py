"""`auto`: the fastest lossless raster decoding here, measured where it runs (an autotuner).

`auto` chooses among a ladder of fixed lossless configurations ordered by the rows a pass scores:
by default ar, mc-sjd at 8, 16 and 32 slots, and tree-mc-sjd's tree (option `candidates`). Each
samples the model's exact law on its own and keeps its size for the whole decode. The first calls
for a key (the model's weights, device, dtype, batch size, running batch or not, guidance scale,
temperature, top-k, top-p, the entropy temperature and the ladder) decode their own first images with the candidates in
turn, timed as they run in seconds per image (a round is a batch of the call's size; a candidate
takes rounds until it has LEAST_IMAGES): they are the call's outputs, so tuning throws no work
away. The first round runs the middle of the ladder; each next one an untimed neighbour of the
fastest so far (the one with fewer rows first), or of a candidate timed within TIE of it; tuning
ends when all those neighbours have been timed. Speed is taken to rise and then fall along the
ladder (a pass with more rows commits more tokens, and costs more), so where rows are dear (a CPU
at a large batch) the walk times three candidates down to AR and never a tree. The rest of the
call, and every later call and process, runs the winner, as `torch.backends.cudnn.benchmark`
keeps its choice per shape.

What was timed is kept on disk (`cost_store`, TUNING_FILE), beside the seconds of an AR step; a
process that reads it times a few AR steps first (throwaway generators) and tunes again where
they moved by more than DRIFT, so a busy machine's timings are not kept for good. Under a compiled
pipeline a candidate's first round in a process compiles its passes: it decodes untimed, and the
candidate's next round is timed.

The law stays exact: every candidate samples the model's law, and which candidate decodes an
image depends on the timings of other images and on the store, never on that image's own random
numbers (tests/accel/policy/test_auto.py, with a negative control whose choice reads them).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from ... import __version__
from ...errors import VisarError
from ..core.method_registry import METHODS, Request, register_method, run_images
from ..core.stats import COMMON_STATS, merge_batch_stats
from ..core.timing import StepTimer, synchronized_clock
from ..raster.methods.ar import sample_tokens
from . import cost_store

DEFAULT_CANDIDATES = "ar,mc-sjd:8,mc-sjd,mc-sjd:32,tree-mc-sjd"
TUNING_FILE = "auto_tuning.json"
# An AR step timed this much faster or slower than when the kept tuning was made: tune again.
DRIFT = 0.25
# The AR-step probe: rounds of passes, the fastest pass kept (the first of each round also feeds the condition).
PROBE_PASSES, PROBE_ROUNDS = 4, 3
# Candidates timed within this of the fastest are ties: the walk goes on past each of them.
TIE = 0.05
# A candidate is timed on at least this many images (a round at one slot decodes four; a running
# batch of two slots times two rounds; calls of one image time it four times): one image's speed
# varies with its condition more than the gap between neighbouring candidates (text prompts: a
# 32-slot window timed faster than 16 slots on two images, 1.46x slower over 32).
LEAST_IMAGES = 4


@dataclass(frozen=True)
class Candidate:
    spec: str  # as written in the option: "mc-sjd:32"
    method: str
    options: dict


def lossless_raster_methods() -> list[str]:
    """The methods a candidate may name: lossless raster methods that need no second model (in a running
    batch, each refills its slots, or, as ar, decodes consecutive batches of them: `run_images`)."""
    return sorted(
        name
        for name, m in METHODS.items()
        if m.lossless and m.model_kind == "raster" and not m.needs_draft and name != "auto"
    )


def parse_candidates(text) -> tuple[Candidate, ...]:
    """ "ar,mc-sjd:8,mc-sjd" -> the ladder (METHOD or METHOD:N, N the method's fixed `budget`), in the
    order given, which should be by rows a pass scores; one VisarError sentence for a bad one."""
    allowed = lossless_raster_methods()
    usage = (
        f"auto's candidates are comma-separated lossless raster methods ({', '.join(allowed)}), each "
        "optionally METHOD:N with N its fixed size (window slots or tree nodes), ordered by rows a pass scores"
    )
    if not isinstance(text, str) or not text.strip():
        raise VisarError(f"{usage}; got {text!r}")
    ladder = []
    for spec in (part.strip() for part in text.split(",")):
        name, colon, size = spec.partition(":")
        if name not in allowed:
            raise VisarError(f"{usage}; {name!r} is not one")
        options = {}
        if colon:
            if "budget" not in METHODS[name].options or not size.isdigit() or int(size) < 1:
                raise VisarError(f"{usage}; {spec!r} is not one (a size N >= 1 only after a method with one)")
            options = {"budget": int(size)}
        if any(c.spec == spec for c in ladder):
            raise VisarError(f"{usage}; {spec!r} is named twice")
        ladder.append(Candidate(spec, name, options))
    return tuple(ladder)


@dataclass
class Tuning:
    """What the timed rounds of one key measured: candidate -> [images, seconds], and the seconds of
    an AR step on this machine when they were timed."""

    ar_step_s: float
    timed: dict[str, list[float]] = field(default_factory=dict)
    entry: str = ""  # the name it is kept under on disk
    source: str = "timed in this process"
    # candidates run once in this process: a compiled pipeline's first round of a candidate compiles
    # its passes (seconds to minutes), which is not its speed, so that round runs untimed
    warm: set = field(default_factory=set)

    def seconds_per_image(self, spec: str) -> float:
        images, seconds = self.timed[spec]
        return seconds / images

    def fastest(self) -> str | None:
        return min(self.timed, key=self.seconds_per_image, default=None)

    def next_candidate(self, ladder: list[str]) -> str | None:
        """The candidate the next round times, or None once the neighbours of every candidate within
        TIE of the fastest are timed (two rounds that close do not tell which is faster)."""
        if not self.timed:
            return ladder[len(ladder) // 2]
        unfinished = [spec for spec, (images, _) in self.timed.items() if images < LEAST_IMAGES]
        if unfinished:
            return unfinished[0]
        least = self.seconds_per_image(self.fastest())
        close = sorted(
            (s for s in self.timed if self.seconds_per_image(s) <= (1 + TIE) * least), key=self.seconds_per_image
        )
        for best in map(ladder.index, close):
            for i in (best - 1, best + 1):  # fewer rows first: where rows are dear a round there costs least
                if 0 <= i < len(ladder) and ladder[i] not in self.timed:
                    return ladder[i]
        return None

    def winner(self, ladder: list[str]) -> str | None:
        """The fastest candidate once tuning is over, else None."""
        return None if self.next_candidate(ladder) is not None else self.fastest()

    def images_per_second(self) -> dict[str, float]:
        return {spec: round(1 / self.seconds_per_image(spec), 3) for spec in self.timed}

    def record(self, spec: str, images: int, seconds: float):
        """A round's time, added to the candidate's, and kept on disk at once (an interrupted tuning
        keeps its rounds)."""
        images_before, seconds_before = self.timed.get(spec, (0, 0.0))
        # a clock that did not move (a coarse one) still counts the round as taking time
        self.timed[spec] = [images_before + images, seconds_before + max(seconds, 1e-9)]
        cost_store.save_entry(TUNING_FILE, self.entry, {"ar_step_s": self.ar_step_s, "timed": self.timed})


# model -> {key: Tuning}: read or made once per process
_TUNINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tuning_key(request: Request, ladder: list[str]) -> tuple:
    model, params = request.model, request.params
    running = "running" if request.slots is not None else "batch"
    sampling = (params.guidance_scale, params.temperature, params.top_k, params.top_p)
    if params.entropy_temperature is not None:  # only then: the keys kept before it existed still match
        sampling += ("entropy_temperature", params.entropy_temperature)
    return ("auto", __version__, str(model.device), str(model.dtype), request.batch_size, running, *sampling, *ladder)


def kept_tuning(name: str, ladder: list[str]) -> Tuning | None:
    """The tuning kept under `name`, or None where there is none or it is not one (a hand-edited or cut file)."""
    entry = cost_store.load_entry(TUNING_FILE, name)
    try:
        ar_step_s, timed = float(entry["ar_step_s"]), dict(entry["timed"])
        timed = {spec: [int(images), float(seconds)] for spec, (images, seconds) in timed.items()}
    except (TypeError, KeyError, ValueError):
        return None
    if not ar_step_s > 0 or any(
        spec not in ladder or images < 1 or not seconds > 0 for spec, (images, seconds) in timed.items()
    ):
        return None
    return Tuning(ar_step_s, timed, name, "kept on disk")


def scratch_request(request: Request) -> Request:
    """The caller's model and conditions with throwaway generators: a probe draws none of the caller's
    randomness, so what it measures cannot bias the decode."""
    # a running batch's probe keeps the queue (the null conditions of a negative prompt held for the
    # call are made for all of it) and times its first slots' images; it stops long before any is done
    generators = [torch.Generator().manual_seed(i) for i in range(len(request.generators))]
    return replace(request, generators=generators, progress=False, on_image=None)


def ar_step_seconds(request: Request) -> float:
    """The fastest of a few AR steps at this batch, on throwaway generators."""
    device = torch.device(str(request.model.device))
    scratch, fastest = scratch_request(request), float("inf")
    for _ in range(PROBE_ROUNDS):
        start = synchronized_clock(device)
        timer = StepTimer(PROBE_PASSES + 1, device)
        sample_tokens(scratch, timer)
        whole = synchronized_clock(device) - start  # a one-token image has no step to time apart
        fastest = min(fastest, *(timer.times[1:] or [whole]))
    return fastest


def tuning_for(request: Request, ladder: list[str]) -> Tuning:
    """This key's tuning: this process's, else the one kept on disk if an AR step still takes what it
    took then, else a new one."""
    key = tuning_key(request, ladder)
    in_process = _TUNINGS.setdefault(request.model, {})
    if key in in_process:
        return in_process[key]
    name = cost_store.entry_name(request.model, key)
    ar_step_s = ar_step_seconds(request)
    tuning = kept_tuning(name, ladder)
    if tuning is None:
        tuning = Tuning(ar_step_s, entry=name)
    elif abs(ar_step_s / tuning.ar_step_s - 1) > DRIFT:
        was = tuning.ar_step_s
        tuning = Tuning(ar_step_s, entry=name)
        tuning.source = f"timed again: an AR step took {1e3 * ar_step_s:.2f} ms against {1e3 * was:.2f} ms when kept"
    in_process[key] = tuning
    return tuning


def forget_tunings() -> None:
    """Drop this process's tunings (the next call reads the disk again, or tunes)."""
    _TUNINGS.clear()


@register_method(
    "auto",
    lossless=True,
    description="the fastest lossless configuration for this model, device, batch and sampling, timed on the "
    "call's own first images (ar, mc-sjd at 8 / 16 / 32 slots, tree-mc-sjd) and kept on disk",
    batch_invariant=False,
    refills=True,
)
def auto(request: Request, *, candidates: str = DEFAULT_CANDIDATES) -> tuple[Tensor, dict]:
    """The call's images by the fastest of `candidates` (comma-separated METHOD or METHOD:N, ordered by
    rows a pass scores), timing candidates on its first images until the fastest is known (see the
    module's docstring); stats["auto"] says what ran, stats["auto_tuning"] each timed candidate's
    images per second, stats["auto_timed"] its images and seconds so far."""
    ladder = {c.spec: c for c in parse_candidates(candidates)}
    specs = list(ladder)
    tuning = tuning_for(request, specs)
    queue, device = request.cond.shape[0], torch.device(str(request.model.device))
    parts, ran, tuned_images, start = [], {}, 0, 0
    while start < queue:
        spec = tuning.next_candidate(specs)
        stop = start + round_images(request, queue - start)
        timed = spec is not None and stop <= queue
        if not timed:  # tuned; or too few images left for a round of this size: the fastest so far
            spec, stop = tuning.fastest() or spec, queue
        part, timed = timed_round(
            tuning, replace(request, note={**request.note, "auto": spec}), ladder[spec], start, stop, device, timed
        )
        parts.append(part)
        tuned_images += stop - start if timed else 0
        ran[spec] = ran.get(spec, 0) + stop - start
        start = stop
    return torch.cat([tokens for tokens, _ in parts]), {
        **merged_stats([stats for _, stats in parts], request),
        "auto": " + ".join(ran),
        "auto_images": ran,
        "auto_tuning": tuning.images_per_second(),
        "auto_winner": tuning.winner(specs),
        "auto_reason": reason(tuning, specs, tuned_images),
        # the walk's state after this call, read by whoever gives an account of it (the demo's "still
        # timing: N of M images"): candidate -> [images, seconds] timed, and this call's timed images
        "auto_timed": {spec: list(images_seconds) for spec, images_seconds in tuning.timed.items()},
        "auto_timed_in_call": tuned_images,
    }


def settled(request: Request, *, candidates: str = DEFAULT_CANDIDATES) -> tuple[Candidate, str]:
    """The candidate a run decodes every image with, chosen before any of its images counts: the winner
    kept for the request's key (even where an AR step now takes another time), else the walk timed on
    throwaway images (the request's conditions under scratch generators, rounds as `auto` times them,
    kept on disk as ever) until the winner is known. Which candidate decodes a run's image then depends
    on no timing made during the run, so a resumed or deterministic run decodes its images as an
    uninterrupted one -> (candidate, why)."""
    ladder = {c.spec: c for c in parse_candidates(candidates)}
    specs = list(ladder)
    key = tuning_key(request, specs)
    # a winner once kept stays the settled choice (no AR-step probe that could time it again): the
    # choice is a record, as a run's settings.json is
    tuning = _TUNINGS.get(request.model, {}).get(key) or kept_tuning(cost_store.entry_name(request.model, key), specs)
    if tuning is None or tuning.winner(specs) is None:
        tuning = tuning_for(request, specs)
    scratch, device, tuned_images = scratch_request(request), torch.device(str(request.model.device)), 0
    while (spec := tuning.next_candidate(specs)) is not None:
        stop = round_images(request, request.cond.shape[0])
        _, timed = timed_round(tuning, scratch, ladder[spec], 0, stop, device)
        tuned_images += stop if timed else 0
    why = reason(tuning, specs, 0)
    if tuned_images:
        why = f"tuned on {tuned_images} throwaway images before the run: {why}"
    return ladder[tuning.fastest()], why


def timed_round(tuning, request: Request, candidate: Candidate, start: int, stop: int, device, timed=True) -> tuple:
    """`candidate` on the request's images [start, stop) as a call of their own, its seconds recorded in
    `tuning` where `timed`, but not a compiled candidate's first round (it compiles: decoded, not
    timed) -> (what it returns, whether it was timed)."""
    timed = timed and (request.compile_passes is None or candidate.spec in tuning.warm)
    tuning.warm.add(candidate.spec)
    clock = synchronized_clock(device)
    out = run_images(request, candidate.method, candidate.options, start, stop)
    if timed:
        tuning.record(candidate.spec, stop - start, synchronized_clock(device) - clock)
    return out, timed


def round_images(request: Request, left: int) -> int:
    """The images a timed round decodes: the call's batch (each image of a batch decoded at once), a
    running batch's slots, LEAST_IMAGES at one slot (fewer when fewer are left)."""
    if request.slots is None:
        return request.cond.shape[0]
    return request.slots if request.slots > 1 else min(LEAST_IMAGES, left)


def merged_stats(parts: list[dict], request: Request) -> dict:
    """The candidates' stats of consecutive parts of the queue -> the call's common stats."""
    stats = merge_batch_stats([{key: part[key] for key in COMMON_STATS if key in part} for part in parts])
    if request.slots is not None:  # a running batch's counts, over its parts
        queue = request.cond.shape[0]
        stats.update(slots=request.slots, refills=queue - min(request.slots, queue))
        stats["batch_passes"] = sum(part.get("batch_passes", part["forward_passes"]) for part in parts)
    return stats


def reason(tuning: Tuning, ladder: list[str], tuned_images: int) -> str:
    """One sentence: what the choice rests on."""
    speeds = ", ".join(f"{spec} {rate:.2f}" for spec, rate in tuning.images_per_second().items())
    if tuning.winner(ladder) is None:
        said = (
            f"tuning: {len(tuning.timed)} of {len(ladder)} candidates timed so far (images/s: {speeds}); "
            f"{tuned_images} of this call's images decoded while timing; later calls go on"
        )
    elif tuned_images:
        said = f"tuned on this call's first {tuned_images} images: the fastest (images/s: {speeds}), kept on disk"
    else:
        return f"the fastest of its candidates on this machine (images/s: {speeds}; {tuning.source})"
    return said if tuning.source == Tuning.source else f"{said} ({tuning.source})"
