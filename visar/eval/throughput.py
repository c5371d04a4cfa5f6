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
from ..accel.timing import synchronized_clock
from ..errors import VisarError
from ..progress import progress_bar
from .bench import conditions, run_images
from .memory import PeakMemory

BATCH_SIZES = (1, 8, 32, 64)


def run_queue(pipe, name: str, conds: list, batch_size: int, refill: bool, options: dict) -> list:
    """The images of `conds` (image i seeded i) at `batch_size`: one call as a running batch, or one call
    per consecutive batch -> the calls' outputs."""
    if not refill:
        return run_images(pipe, name, conds, batch_size, options, "tokens")
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


def throughput_row(pipe, name: str, options: dict, conds: list, batch_size: int, refill: bool) -> dict:
    run_queue(pipe, name, conds[:batch_size], batch_size, False, options)  # warm-up
    start = synchronized_clock(pipe.device)
    with PeakMemory(pipe.device, count_tensors=False) as memory:
        outs = run_queue(pipe, name, conds, batch_size, refill, options)
    wall = synchronized_clock(pipe.device) - start
    if memory.peak_mb is None:  # CPU: counted in an untimed run (counting slows it)
        with PeakMemory(pipe.device) as memory:
            run_queue(pipe, name, conds[: 2 * batch_size], batch_size, refill, options)
    return {
        "method": name,
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
    }


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
    names = [reference] + [m for m in methods if m != reference]
    for name in names:
        get_method(name).check_options(method_options.get(name, {}))
    plan = []
    for name in names:
        for keep in (None, *kv_keeps):
            options = {**method_options.get(name, {}), **({} if keep is None else {"kv_keep": keep})}
            for size in batch_sizes:
                # ar's running batch is its consecutive batches (its images all take N passes)
                refills = get_method(name).refills and size > 1 and name != reference
                for refill in (False, True) if refills else (False,):
                    plan.append((name, options, size, refill))
                if deterministic and size > 1:
                    plan.append((name, {**options, "deterministic": True}, size, False))
    rows = []
    for name, options, size, refill in progress_bar(plan, enabled=progress, desc="throughput", leave=True):
        conds = conditions(pipe, max(images_per_slot * size, 2 * size))
        rows.append(throughput_row(pipe, name, options, conds, size, refill))
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
    return "\n".join(lines)


def decoding(row: dict) -> str:
    """How a row's batch was decoded: a running batch, consecutive fixed batches, or each image alone."""
    if row["alone"]:
        return "alone (deterministic)"
    return "yes" if row["refill"] else "no"
