"""`visar bench --throughput`: images per second and peak memory of each method at several batch sizes,
decoding consecutive fixed batches and a running batch that refills, with KV-cache compression when
asked.

At batch size B every row generates the same `images_per_slot * B` images (image i: condition i,
seed i), after a warm-up of one batch. Columns:
- images/s: images over the timed run's wall time (token sampling only, output_type="tokens");
- passes fed per image: the rows of the batch each forward pass feeds, summed over the run, per image
  (B per pass of a batch of B: a finished image's slot counts until its batch ends, which a running
  batch avoids by refilling it); x alone: over the passes the same images take decoded alone (their
  own `forward_passes_per_image`, which a fixed budget keeps whatever the batch);
- alone: rows with deterministic=True (`--deterministic`), each image decoded alone so that its bits
  do not depend on the batch; x fixed batch prices that against batching;
- peak MB: the most tensor memory the decode allocates above what was held before it (on CUDA the
  allocator's peak over the timed run; on CPU the tensors counted (`memory.TensorMemory`) in one more
  run, untimed, over 2B images, so that a running batch refills in it too).
"""

from __future__ import annotations

from ..accel import get_method, reference_method
from ..accel.core.timing import synchronized_clock
from ..errors import VisarError
from ..progress import progress_bar
from .bench import conditions, generate_batches
from .memory import PeakMemory

BATCH_SIZES = (1, 8, 32, 64)


def run_queue(pipe, name: str, conds: list, batch_size: int, refill: bool, options: dict) -> list:
    """The images of `conds` (image i seeded i) at `batch_size`: one call as a running batch, or one call
    per consecutive batch -> the calls' outputs."""
    if not refill:
        return generate_batches(pipe, name, conds, batch_size, options, "tokens")
    key = "class_labels" if pipe.is_class_conditional else "prompts"
    if not pipe.is_class_conditional:
        conds = [entry["prompt"] for entry in conds]
    return [pipe.generate(**{key: conds}, method=name, output_type="tokens", batch_size=batch_size, **options)]


def passes_fed(outs: list, refill: bool, batch_size: int) -> int:
    """Rows fed over the run: B per pass of a running batch, each batch's passes times its images (each
    image's own passes where it was decoded alone)."""
    if refill:
        return outs[0].stats["batch_passes"] * batch_size
    if outs[0].stats.get("deterministic"):
        return sum(p for o in outs for p in o.stats["forward_passes_per_image"])
    return sum(o.stats["forward_passes"] * len(o.stats["forward_passes_per_image"]) for o in outs)


def throughput_row(pipe, name: str, options: dict, conds: list, batch_size: int, refill: bool, label: str = "") -> dict:
    # warm-up; auto's with the reference, so that its timed run is its first call at this batch (tuning and all)
    warm = reference_method(pipe.model) if name == "auto" else name
    run_queue(pipe, warm, conds[:batch_size], batch_size, False, options if warm == name else {})
    start = synchronized_clock(pipe.device)
    with PeakMemory(pipe.device, count_tensors=False) as memory:
        outs = run_queue(pipe, name, conds, batch_size, refill, options)
    wall = synchronized_clock(pipe.device) - start
    if memory.peak_mb is None:  # CPU: counted in an untimed run (counting slows it)
        if name == "auto":  # as the candidate it ran most: a run slowed by counting must not be timed as tuning
            ran = auto_columns(outs)["ran"]
            options = {**options, "candidates": max(ran, key=ran.get)}
        with PeakMemory(pipe.device) as memory:
            run_queue(pipe, name, conds[: 2 * batch_size], batch_size, refill, options)
    return {
        "method": label or name,
        "options": {k: v for k, v in options.items() if isinstance(v, (str, int, float, bool))},
        "batch_size": batch_size,
        "refill": refill,
        "alone": bool(options.get("deterministic", False)),
        "kv_keep": options.get("kv_keep", 1.0),
        "images": len(conds),
        "images_per_s": len(conds) / wall,
        "passes_fed_per_image": passes_fed(outs, refill, batch_size) / len(conds),
        # what the same images take decoded alone (each image's own passes, batch-invariant at a fixed budget)
        "passes_alone_per_image": sum(p for o in outs for p in o.stats["forward_passes_per_image"]) / len(conds),
        "peak_mem_mb": memory.peak_mb,
        **({"auto": auto_columns(outs)} if name == "auto" else {}),
    }


def auto_columns(outs: list) -> dict:
    """What `auto` ran over the run's calls (images per candidate), each timed candidate's images per
    second as it kept them, and its winner (None while still tuning)."""
    ran: dict[str, int] = {}
    for out in outs:
        for spec, images in out.stats["auto_images"].items():
            ran[spec] = ran.get(spec, 0) + images
    last = outs[-1].stats
    return {"ran": ran, "timed": last["auto_tuning"], "winner": last["auto_winner"]}


def throughput(
    pipe,
    methods: list[str],
    *,
    batch_sizes: tuple[int, ...] = BATCH_SIZES,
    images_per_slot: int = 8,
    kv_keeps: tuple[float, ...] = (),
    method_options: dict[str, dict] | None = None,
    deterministic: bool = False,
    progress: bool = True,
) -> dict:
    """The reference method and `methods` at each batch size: fixed batches, and for a method that
    refills a running batch too; with each of `kv_keeps` (KV-cache compression) as rows of their own,
    and (deterministic) each image decoded alone at each batch size above 1.
    Returns {"model", "settings", "rows"}."""
    method_options = method_options or {}
    if not batch_sizes or min(batch_sizes) < 1 or images_per_slot < 1:
        raise VisarError("--batch-sizes must be whole numbers >= 1 and --images-per-slot >= 1")
    reference = reference_method(pipe.model)
    labels = [reference] + [m for m in methods if m != reference]
    for label in labels:
        name, size_option = method_size(label)
        get_method(name).check_options({**method_options.get(name, {}), **size_option})
    plan = []
    for label in labels:
        name, size_option = method_size(label)
        for keep in (None, *kv_keeps):
            options = {**method_options.get(name, {}), **size_option, **({} if keep is None else {"kv_keep": keep})}
            for size in batch_sizes:
                # a method that does not refill (ar: its images all take N passes) has fixed batches only
                refills = get_method(name).refills and size > 1
                for refill in (False, True) if refills else (False,):
                    plan.append((label, name, options, size, refill))
                    if name == "auto":  # its second call: what runs once tuned (kept for later calls and processes)
                        plan.append((f"{label}, second call", name, options, size, refill))
                if deterministic and size > 1:
                    plan.append((label, name, {**options, "deterministic": True}, size, False))
    rows = []
    for label, name, options, size, refill in progress_bar(plan, enabled=progress, desc="throughput", leave=True):
        conds = conditions(pipe, max(images_per_slot * size, 2 * size))
        rows.append(throughput_row(pipe, name, options, conds, size, refill, label))
    add_ratios(rows)
    return {
        "model": pipe.name,
        "settings": {
            "batch_sizes": list(batch_sizes),
            "images_per_slot": images_per_slot,
            "kv_keeps": list(kv_keeps),
            "deterministic": deterministic,
            "device": str(pipe.device),
            "dtype": str(pipe.dtype).removeprefix("torch."),
            "options": method_options,
            "sampling": pipe.defaults,
        },
        "rows": rows,
    }


def method_size(label: str) -> tuple[str, dict]:
    """ "mc-sjd:8" -> ("mc-sjd", {"budget": 8}): a row of the method at that fixed size, as auto's
    candidates are written; "mc-sjd" -> ("mc-sjd", {})."""
    name, colon, size = label.partition(":")
    if not colon:
        return name, {}
    if not size.isdigit() or int(size) < 1:
        raise VisarError(f"--methods takes METHOD or METHOD:N (N a whole number >= 1, its fixed budget), got {label!r}")
    return name, {"budget": int(size)}


def add_ratios(rows: list[dict]):
    """Each row against its method's fixed batch of the same size (images/s), its images decoded alone
    (passes fed per image) and the reference's fixed batch of the same size (peak memory); None where
    the other row is missing."""

    def find(method, size, refill, keep):
        key = (method, size, refill, False, keep)
        return next(
            (r for r in rows if (r["method"], r["batch_size"], r["refill"], r["alone"], r["kv_keep"]) == key), None
        )

    reference = rows[0]["method"]
    for r in rows:
        fixed = find(r["method"], r["batch_size"], False, r["kv_keep"])
        ar = find(reference, r["batch_size"], False, 1.0)
        r["speed_vs_fixed"] = r["images_per_s"] / fixed["images_per_s"] if fixed else None
        r["passes_vs_alone"] = r["passes_fed_per_image"] / r["passes_alone_per_image"]
        mem = ar and ar["peak_mem_mb"] and r["peak_mem_mb"]
        r["memory_vs_ar"] = r["peak_mem_mb"] / ar["peak_mem_mb"] if mem else None


def throughput_table(report: dict) -> str:
    lines = [
        "| method | batch | running batch / alone | kv_keep | images/s | x fixed batch | passes fed / image | x alone "
        "| peak MB | x AR's |",
        "|" + "---|" * 10,
    ]

    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    for r in report["rows"]:
        lines.append(
            f"| {r['method']} | {r['batch_size']} | {decoding(r)} | {r['kv_keep']:g} "
            f"| {r['images_per_s']:.2f} | {fmt(r['speed_vs_fixed'], '.2f')} | {r['passes_fed_per_image']:.1f} "
            f"| {r['passes_vs_alone']:.2f} | {fmt(r['peak_mem_mb'], '.1f')} | {fmt(r['memory_vs_ar'], '.2f')} |"
        )
    s = report["settings"]
    lines += [
        "",
        f"model {report['model']} on {s['device']} ({s['dtype']}), {s['images_per_slot']} images per slot at each "
        f"batch size, sampling {s['sampling']}",
    ]
    tuning = auto_table(report["rows"])
    return "\n".join(lines + (["", tuning] if tuning else []))


def auto_table(rows: list[dict]) -> str:
    """auto's rows: what each call ran, the candidates' images per second it timed, and its seconds per
    image against the fastest candidate's row and AR's at the same batch (rows of its candidates
    present in the run; "-" where none is)."""
    autos = [r for r in rows if "auto" in r]
    if not autos:
        return ""
    lines = [
        "auto: what each call ran (images), the images/s it timed per candidate, and its s / image against the "
        "fastest candidate row and AR's at the same batch",
        "",
        "| call | batch | running batch | ran | timed (images/s) | winner | x fastest candidate | x AR |",
        "|" + "---|" * 8,
    ]
    reference = rows[0]["method"]
    for r in autos:
        same = [
            o for o in rows if (o["batch_size"], o["alone"], o["kv_keep"]) == (r["batch_size"], False, r["kv_keep"])
        ]
        # a candidate's row decoded as auto's was (running or not); AR's fixed batches are its running batch
        candidates = [
            o
            for o in same
            if o["method"] in r["auto"]["timed"] and (o["refill"] == r["refill"] or o["method"] == reference)
        ]
        fastest = max((o["images_per_s"] for o in candidates), default=None)
        ar = next((o["images_per_s"] for o in same if o["method"] == reference), None)
        ran = ", ".join(f"{spec} {images}" for spec, images in r["auto"]["ran"].items())
        timed = ", ".join(f"{spec} {rate:.2f}" for spec, rate in r["auto"]["timed"].items())
        winner = r["auto"]["winner"] or "tuning"
        lines.append(
            f"| {r['method']} | {r['batch_size']} | {decoding(r)} | {ran} | {timed} | {winner} "
            f"| {ratio(fastest, r['images_per_s'])} | {ratio(ar, r['images_per_s'])} |"
        )
    return "\n".join(lines)


def ratio(other: float | None, images_per_s: float) -> str:
    """auto's seconds per image over another row's ("-" without one)."""
    return "-" if other is None else f"{other / images_per_s:.2f}"


def decoding(row: dict) -> str:
    """How a row's batch was decoded: a running batch, consecutive fixed batches, or each image alone."""
    if row["alone"]:
        return "alone (deterministic)"
    return "yes" if row["refill"] else "no"
