"""What the page says of `auto` on a click: what this click ran, how far its tuning walk is (image N
of M, M the fewest to the most images the walk can still take), and, once the walk is over, what won
and which candidates it never timed, and why.

The page decodes one image a click, so a candidate is timed on LEAST_IMAGES clicks; the walk
(`Tuning.next_candidate`) times the middle of the ladder, then untimed neighbours of the fastest,
and stops once the neighbours of every candidate within TIE of the fastest are timed: on the
default ladder of 5, three to five candidates, 12 to 20 clicks.
"""

from __future__ import annotations

from ...accel.policy.auto import DEFAULT_CANDIDATES, LEAST_IMAGES, TIE, Tuning, parse_candidates


def ladder_of(options: dict) -> list[str]:
    """The candidates auto walked for these options, in ladder order."""
    return [candidate.spec for candidate in parse_candidates(options.get("candidates", DEFAULT_CANDIDATES))]


def next_of(seconds: dict[str, float], ladder: list[str]) -> str | None:
    """The walk's next candidate once the candidates in `seconds` (seconds per image) are each timed."""
    timed = {spec: [LEAST_IMAGES, value * LEAST_IMAGES] for spec, value in seconds.items()}
    return Tuning(1.0, timed).next_candidate(ladder)


def outcomes(seconds: list[float]) -> list[float]:
    """Seconds per image a next candidate may take, one in each range the walk tells apart: it compares
    a candidate with the fastest and with the fastest times 1 + TIE, so the ranges end at each value
    v, v * (1 + TIE) and v / (1 + TIE); a value at each end, one inside each range, one beyond both ends."""
    if not seconds:
        return [1.0]
    ends = sorted({e for v in seconds for e in (v, v * (1 + TIE), v / (1 + TIE))})
    inside = [(a + b) / 2 for a, b in zip(ends, ends[1:], strict=False)]
    return [ends[0] / 2, *ends, *inside, ends[-1] * 2]


def walk_sizes(seconds: dict[str, float], pending: list[str], ladder: list[str]) -> tuple[int, int]:
    """The fewest and the most candidates the walk times in all, from the candidates it has finished
    timing (`seconds`) and those it has begun (`pending`): every outcome of each next candidate tried."""
    following = pending[0] if pending else next_of(seconds, ladder)
    if following is None:
        return len(seconds), len(seconds)
    sizes = [
        walk_sizes({**seconds, following: value}, pending[1:], ladder) for value in outcomes(list(seconds.values()))
    ]
    return min(fewest for fewest, _ in sizes), max(most for _, most in sizes)


def walk_totals(timed: dict[str, list[float]], ladder: list[str]) -> tuple[tuple[int, int], tuple[int, int]]:
    """The fewest and the most candidates the walk times in all, and the fewest and the most images,
    from `timed` (candidate -> [images, seconds]): a begun candidate takes LEAST_IMAGES in all, and
    so does each candidate the walk may still begin."""
    seconds = {spec: s / images for spec, (images, s) in timed.items() if images >= LEAST_IMAGES}
    pending = [spec for spec in timed if spec not in seconds]
    candidates = walk_sizes(seconds, pending, ladder)
    done = sum(int(images) for spec, (images, _) in timed.items() if spec in seconds)
    images = tuple(done + (n - len(seconds)) * LEAST_IMAGES for n in candidates)
    return candidates, images


def span(fewest: int, most: int) -> str:
    return f"{fewest}" if fewest == most else f"{fewest} to {most}"


def speeds_text(timed: dict[str, list[float]], counts: bool = False) -> str:
    """Each timed candidate's images per second, the fastest first (with its images timed, if `counts`)."""
    rates = sorted(((images / s, spec, int(images)) for spec, (images, s) in timed.items()), reverse=True)
    return ", ".join(
        f"{spec} {rate:.2f}" + (f" ({images} image{'s' * (images != 1)})" if counts else "")
        for rate, spec, images in rates
    )


def untimed_text(timed: dict[str, list[float]], ladder: list[str], winner: str) -> str:
    """The candidates the walk never timed, and why (empty when it timed them all): the timed ones
    are a run of the ladder, and the walk stopped at each end of it at a candidate more than TIE
    slower than the winner."""
    indices = [i for i, spec in enumerate(ladder) if spec in timed]
    if len(indices) == len(ladder) or not indices:
        return ""

    def rate(spec):
        return timed[spec][0] / timed[spec][1]

    first, last = indices[0], indices[-1]
    parts = [
        f"{', '.join(untimed)}, past {edge} ({rate(edge):.2f} images/s, the winner {rate(winner):.2f})"
        for untimed, edge in ((ladder[:first], ladder[first]), (ladder[last + 1 :], ladder[last]))
        if untimed
    ]
    return (
        f" Not timed: {'; '.join(parts)}: auto takes speed to fall away from the fastest along its ladder, "
        f"so it goes no further than a candidate more than {TIE:.0%} slower than the fastest."
    )


def auto_note(summary: dict) -> str:
    """The page's line on what auto did on this click (`run_side`'s summary of an auto call)."""
    tuning = summary["tuning"]
    timed, winner, ran = tuning["auto_timed"], tuning["auto_winner"], summary["ran"]
    ladder = ladder_of(summary["options"])
    images = sum(int(images) for images, _ in timed.values())
    if winner is None:
        candidates, totals = walk_totals(timed, ladder)
        return (
            f"**auto is still timing: image {images} of {span(*totals)}** (one a click: {LEAST_IMAGES} images each "
            f"for {span(*candidates)} of its {len(ladder)} candidates). This click ran {ran} (its image "
            f"{int(timed.get(ran, [0])[0])} of {LEAST_IMAGES}). Images/s so far: {speeds_text(timed, counts=True)}. "
            f"The walk times the middle of its ladder ({', '.join(ladder)}) first, then an untimed neighbour of the "
            f"fastest, and stops once the neighbours of the fastest (and of any within {TIE:.0%} of it) are timed."
        )
    if tuning["auto_timed_in_call"]:
        same = " (the candidate this click ran)" if ran == winner else ""
        return (
            f"**auto finished timing on this click** ({images} images, {len(timed)} of its {len(ladder)} "
            f"candidates): this click ran {ran}, the last candidate timed. The winner: **{winner}**{same}, which "
            f"runs from the next click on and is kept on disk. Images/s: {speeds_text(timed)}."
            + untimed_text(timed, ladder, winner)
        )
    return f"auto ran **{winner}**: {tuning['auto_reason']}.{untimed_text(timed, ladder, winner)}"
