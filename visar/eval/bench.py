"""`visar bench`: the reference decoding of the model's kind (plain AR for raster models; see
`reference_options`) and each requested method, in one process, side by side.

Speed: every method generates the same `n` images (image i: condition i, seed i) at the same
batch size, after one warm-up batch; forward passes and tokens per forward are per image, the
latency ratio is the method's token-sampling time over AR's, measured in this run. Peak memory is
per method: the most tensor memory one batch's decode allocates above what was held before it
(the weights excluded): on CUDA the allocator's peak over the timed run; on CPU one more batch,
untimed, under `memory.TensorMemory`, which counts the tensors it creates. Read-backs per pass: in
that extra batch (untimed, eager even for a compiled row: counting runs compiled code eagerly), the
operations that make the host wait for the device (`readbacks.ReadBackCounter`: .item(), .tolist(),
nonzero, boolean indexing, device-to-host copies, ...) over the batch's forward passes; on a GPU
each one stalls the launch queue. Ops per pass: in the same batch, every aten operation dispatched
(model and bookkeeping) over its forward passes: what a pass costs in Python dispatches and, on a
GPU, in kernel launches, whatever the device; a method's ops above the AR row's are its bookkeeping.

Quality (`--quality-n` images per method, same seeds for every method):
- detector accuracy: the shapes-world detector's class score (class-conditional shapes models);
- GenEval-style scores (text-conditional shapes models): image i gets prompt i of
  `caption_metadata`, six tasks interleaved; the overall score (the unweighted mean over the six
  tasks) and each task's accuracy, by the shapes-world detector (`visar eval shapes` scores the same);
- Frechet distance to plain AR's images in the tokenizer-latent feature space
  (`latent_features`): the model's own VQ encoder, pre-quantisation latents average-pooled to
  4x4, flattened (C x 16 dims). It runs offline and is sensitive to layout and colour, but it is
  NOT Inception: its numbers are comparable only within this feature space. For lossless
  methods it measures Monte-Carlo noise between two sample sets of the same law (different
  random streams): read it against the AR row's value, AR against a second AR sample set.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..accel import get_method, reference_method
from ..accel.core.stats import add_lists
from ..accel.core.timing import synchronized_clock
from ..errors import VisarError
from ..progress import progress_bar
from .memory import PeakMemory
from .plots import plot_frontier
from .readbacks import ReadBackCounter
from .samples import write_text_atomic

ROW_KEYS = (
    "method",
    "lossless",
    "forward_passes",
    "draft_forward_passes",
    "tokens_per_forward",
    "step_compression",
    "latency_ratio_vs_ar",
    "images_per_s",
    "peak_mem_mb",
    "detector_accuracy",
    "geneval_overall",
    "frechet_vs_ar",
)


def frechet_distance(feats_a: np.ndarray, feats_b: np.ndarray) -> float:
    """Frechet distance between Gaussians fitted to two feature sets [N, D]."""
    from scipy import linalg

    mu_a, mu_b = feats_a.mean(0), feats_b.mean(0)
    cov_a, cov_b = np.cov(feats_a, rowvar=False), np.cov(feats_b, rowvar=False)
    covmean = linalg.sqrtm(cov_a @ cov_b)
    if not np.isfinite(covmean).all():  # the usual regularisation for near-singular products
        eps = np.eye(cov_a.shape[0]) * 1e-6
        covmean = linalg.sqrtm((cov_a + eps) @ (cov_b + eps))
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(cov_a + cov_b - 2 * covmean.real))


def pooled_latents(tokenizer, images: torch.Tensor) -> torch.Tensor:
    """images [B, 3, H, W] in [-1, 1] -> pre-quantisation latents average-pooled to 4x4 [B, C * 16]."""
    return F.adaptive_avg_pool2d(tokenizer.pre_quant(images), 4).flatten(1)


@torch.no_grad()
def latent_features(pipe, images: torch.Tensor) -> np.ndarray:
    """images [B, 3, H, W] in [0, 1] -> tokenizer-latent features [B, C * 16]."""
    device = next(pipe.tokenizer.parameters()).device
    return pooled_latents(pipe.tokenizer, images.to(device) * 2 - 1).cpu().double().numpy()


def conditions(pipe, n: int) -> list:
    """Image i's condition: class i mod C, or the GenEval entry `caption_metadata(n)[i]`."""
    if pipe.is_class_conditional:
        return [i % pipe.num_classes for i in range(n)]
    from .shapes_eval import caption_metadata

    return caption_metadata(n)


def generate_batches(pipe, method, conds, batch_size, options, output_type, seed=0):
    """Generate one image per condition (image i with seed `seed + i`); returns the outputs per batch."""
    outs = []
    key = "class_labels" if pipe.is_class_conditional else "prompts"
    for first in range(0, len(conds), batch_size):
        chunk = conds[first : first + batch_size]
        if not pipe.is_class_conditional:
            chunk = [entry["prompt"] for entry in chunk]
        outs.append(pipe.generate(**{key: chunk}, method=method, seed=seed + first, output_type=output_type, **options))
    return outs


def quality_images(pipe, method, conds, options, seed=0) -> torch.Tensor:
    return torch.cat([o.images for o in generate_batches(pipe, method, conds, 16, options, "pt", seed)])


def acceptance_columns(stats: list[dict]) -> dict:
    """Pooled draft acceptance of a method's runs (every method reports the counts; None without drafts):
    overall, by image row and by slot past the committed prefix."""

    def rates(tested_key: str, accepted_key: str) -> list[float | None]:
        # by slot index: auto's tuning calls run candidates of different window sizes, so the lists of
        # one method's calls can differ in length (a shorter one tested nothing at the later slots)
        tested = add_lists([st[tested_key] for st in stats])
        accepted = add_lists([st[accepted_key] for st in stats])
        return [float(a / t) if t else None for a, t in zip(accepted, tested, strict=True)]

    tested = sum(st["draft_tokens"] for st in stats)
    return {
        "acceptance_rate": sum(st["accepted_tokens"] for st in stats) / tested if tested else None,
        "acceptance_by_row": rates("draft_tokens_by_row", "accepted_tokens_by_row"),
        "acceptance_by_slot": rates("draft_tokens_by_slot", "accepted_tokens_by_slot") if tested else [],
    }


def bench(
    pipe,
    methods: list[str],
    *,
    n: int = 16,
    batch_size: int = 1,
    quality_n: int = 0,
    method_options: dict[str, dict] | None = None,
    progress: bool = True,
    runs: list[tuple[str, dict]] | None = None,
    compiled_rows: bool = False,
    compile_kwargs: dict | None = None,
) -> dict:
    """Run AR plus `methods`; returns {"model", "settings", "rows": [...]} (rows as in ROW_KEYS).

    runs: (method, options) pairs to run after AR instead of `methods` (a sweep runs one method
    with several option values; see visar.eval.sweep). compiled_rows: then compile the generator
    (`Pipeline.compile`, in place) and run every method again, as rows marked compiled; their
    `warmup_s` is the first batch, compilation included, and every latency ratio is against the
    eager AR row (compile_kwargs go to `Pipeline.compile`).
    """
    method_options = method_options or {}
    reference = reference_method(pipe.model)
    names = [reference] + [m for m in methods if m != reference]
    plan = [(name, method_options.get(name, {})) for name in names]
    plan[0] = (reference, {**reference_options(pipe), **plan[0][1]})
    if runs is not None:
        plan = plan[:1] + list(runs)
    for name, options in plan:  # kv_keep and kv_evict are Pipeline.generate's: any raster row may take them
        get_method(name).check_options({k: v for k, v in options.items() if k not in ("kv_keep", "kv_evict")})
    if n < 1 or batch_size < 1 or quality_n < 0:
        raise VisarError("--n and --batch-size must be >= 1 and --quality-n >= 0")
    conds = conditions(pipe, max(n, quality_n))
    rows, ar_latency, ar_feats = [], None, None
    passes = [False, True] if compiled_rows else [pipe.is_compiled]
    for compiled in passes:
        if compiled and not pipe.is_compiled:
            pipe.compile(**(compile_kwargs or {}))
        for name, options in progress_bar(
            plan, enabled=progress, desc="bench (compiled)" if compiled else "bench", leave=True
        ):
            row = speed_row(pipe, name, options, conds[:n], batch_size)
            row["compiled"] = compiled
            if ar_latency is None:
                ar_latency = row["latency_s"]
            row["latency_ratio_vs_ar"] = row.pop("latency_s") / ar_latency
            if quality_n and compiled == passes[0]:
                ar_feats = quality_columns(pipe, name, options, conds[:quality_n], row, ar_feats, name == reference)
            rows.append(row)
    return {
        "model": pipe.name,
        "settings": {
            "n": n,
            "batch_size": batch_size,
            "quality_n": quality_n,
            "device": str(pipe.device),
            "dtype": str(pipe.dtype).removeprefix("torch."),
            "options": method_options,
            "sampling": pipe.defaults,
        },
        "rows": rows,
    }


def reference_options(pipe) -> dict:
    """The reference row's options: plain decoding, and for a masked model one token per step (the
    order every schedule approximates), not the reference method's own step count."""
    return {"steps": pipe.model.num_image_tokens} if pipe.model.model_kind == "masked" else {}


def speed_row(pipe, name: str, options: dict, conds: list, batch_size: int) -> dict:
    """One method's speed and memory columns over `conds`, after a timed warm-up batch."""
    start = synchronized_clock(pipe.device)
    generate_batches(pipe, name, conds[:batch_size], batch_size, options, "tokens")  # warm-up (compiles, if compiled)
    warmup = synchronized_clock(pipe.device) - start
    start = synchronized_clock(pipe.device)
    with PeakMemory(pipe.device, count_tensors=False) as memory:  # CUDA: the allocator's peak, free to read
        outs = generate_batches(pipe, name, conds, batch_size, options, "tokens")
    wall = synchronized_clock(pipe.device) - start
    # One batch more, untimed (counting slows a decode): its read-backs and, on CPU, its tensor memory.
    with ReadBackCounter() as read_backs:
        if memory.peak_mb is None:
            with PeakMemory(pipe.device) as memory:
                counted = generate_batches(pipe, name, conds[:batch_size], batch_size, options, "tokens")
        else:
            counted = generate_batches(pipe, name, conds[:batch_size], batch_size, options, "tokens")
    latency = sum(o.stats["latency_s"] for o in outs)
    # each batch's passes times its images, counted from the stats (next-scale tokens are a list of maps)
    batch_images = [len(o.stats["forward_passes_per_image"]) for o in outs]
    per_image_passes = sum(o.stats["forward_passes"] * b for o, b in zip(outs, batch_images, strict=True)) / len(conds)
    draft_passes = sum(o.stats["draft_forward_passes"] * b for o, b in zip(outs, batch_images, strict=True))
    return {
        "method": name,
        "options": {k: v for k, v in options.items() if isinstance(v, (str, int, float, bool))},
        "lossless": all(o.stats["lossless"] for o in outs),  # at these options (gsd group_size=1 is exact)
        "forward_passes": per_image_passes,
        "draft_forward_passes": draft_passes / len(conds),
        "tokens_per_forward": float(np.mean([o.stats["tokens_per_forward"] for o in outs])),
        "step_compression": pipe.model.num_image_tokens / per_image_passes,
        "latency_s": latency,
        "images_per_s": len(conds) / wall,
        "peak_mem_mb": memory.peak_mb,
        "detector_accuracy": None,
        "geneval_overall": None,
        "frechet_vs_ar": None,
        # Why a method is as fast as it is: cost of one pass, and where its drafts are accepted.
        "ms_per_forward": 1000 * latency / sum(o.stats["forward_passes"] for o in outs),
        # What stalls a GPU's launch queue: host read-backs per target forward pass, and their kinds.
        "read_backs_per_pass": read_backs.total / sum(o.stats["forward_passes"] for o in counted),
        "read_backs_by_kind": dict(read_backs.by_kind),
        # What a pass dispatches (model and bookkeeping): each eager op is a dispatch and, on a GPU, a launch.
        "ops_per_pass": read_backs.ops / sum(o.stats["forward_passes"] for o in counted),
        "warmup_s": warmup,
        **acceptance_columns([o.stats for o in outs]),
        **layer_token_columns([o.stats for o in outs]),
        **auto_columns([o.stats for o in outs]),
    }


def auto_columns(stats: list[dict]) -> dict:
    """What `auto` ran over the run's batches (its candidates, "mc-sjd + mc-sjd:8" while it tuned)."""
    ran = sorted({s["auto"] for s in stats if "auto" in s})
    return {"auto": ran} if ran else {}


def auto_label(row: dict) -> str:
    return " / ".join(row.get("auto", [])) or "-"


def layer_token_columns(stats: list[dict]) -> dict:
    """Next-scale methods count, per image, the inputs that went through each model's layers (pruned
    inputs do not; CoDe's refiner apart): the cost that pruning and collaborative decoding cut."""
    if any(s.get("layer_tokens") is None for s in stats):
        return {}
    return {key: float(np.mean([s[key] for s in stats])) for key in ("layer_tokens", "draft_layer_tokens")}


def quality_columns(pipe, name: str, options: dict, conds: list, row: dict, ar_feats, is_reference: bool):
    """Fill the row's detector accuracy and Frechet distance to the reference -> the reference's
    features (set by the reference row)."""
    images = quality_images(pipe, name, conds, options)
    feats = latent_features(pipe, images)
    if is_reference:  # the noise floor: the reference against a second sample set of its own (other seeds)
        ar_feats = feats
        again = quality_images(pipe, name, conds, options, seed=10**6)
        row["frechet_vs_ar"] = frechet_distance(latent_features(pipe, again), ar_feats)
    else:
        row["frechet_vs_ar"] = frechet_distance(feats, ar_feats)
    from .detector import detect, score_class, score_geneval, summarize

    arrays = (images * 255).round().byte().permute(0, 2, 3, 1).cpu().numpy()
    if pipe.is_class_conditional and pipe.class_names:
        row["detector_accuracy"] = float(
            np.mean([score_class(detect(a), c) for a, c in zip(arrays, conds, strict=True)])
        )
    elif not pipe.is_class_conditional:
        tasks = summarize(
            {"tag": entry["tag"], "correct": score_geneval(detect(a), entry)[0]}
            for a, entry in zip(arrays, conds, strict=True)
        )
        row["geneval_overall"] = tasks.pop("overall")
        row["geneval_tasks"] = tasks
    return ar_feats


def row_name(row: dict) -> str:
    """A row's method, with its budget when it has one ("mc-sjd, budget 8"): runs of one method
    under several budgets stay apart."""
    options = row.get("options") or {}
    name = row["method"] if options.get("budget") is None else f"{row['method']}, budget {options['budget']}"
    if options.get("kv_keep", 1) == 1:
        return name
    rule = f", {options['kv_evict']} rule" if "kv_evict" in options else ""
    return f"{name}, kv_keep {options['kv_keep']}{rule}"


def markdown_table(report: dict) -> str:
    """The report's table; a text-conditional model's quality column is the GenEval-style overall
    score, with a second table of its per-task accuracies."""
    geneval = any(r.get("geneval_overall") is not None for r in report["rows"])
    quality = ("GenEval overall", "geneval_overall") if geneval else ("detector acc.", "detector_accuracy")
    header = (
        "| method | lossless | forward passes | step compression | tokens/forward | latency / AR | images/s "
        f"| peak MB | {quality[0]} | Frechet vs AR | ms/forward | draft acceptance | read-backs/pass "
        "| ops/pass | auto ran |"
    )
    lines = [header, "|" + "---|" * 15]

    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    def label(r):
        name = row_name(r)
        return f"{name} (compiled, warm-up {r['warmup_s']:.0f} s)" if r.get("compiled") else name

    for r in report["rows"]:
        lines.append(
            f"| {label(r)} | {'yes' if r['lossless'] else 'no'} | {r['forward_passes']:.1f} "
            f"| {r['step_compression']:.2f} | {r['tokens_per_forward']:.2f} | {r['latency_ratio_vs_ar']:.2f} "
            f"| {r['images_per_s']:.2f} | {fmt(r['peak_mem_mb'], '.1f')} "
            f"| {fmt(r.get(quality[1]), '.1%')} | {fmt(r['frechet_vs_ar'], '.3f')} "
            f"| {fmt(r.get('ms_per_forward'), '.1f')} | {fmt(r.get('acceptance_rate'), '.1%')} "
            f"| {fmt(r.get('read_backs_per_pass'), '.2f')} | {fmt(r.get('ops_per_pass'), '.0f')} | {auto_label(r)} |"
        )
    s = report["settings"]
    lines.append("")
    lines.append(
        f"model {report['model']}, {s['n']} images at batch size {s['batch_size']} on {s['device']} "
        f"({s['dtype']}), quality over {s['quality_n']} images per method, sampling {s['sampling']}"
    )
    scored = [r for r in report["rows"] if r.get("geneval_tasks")]
    if scored:
        tasks = list(scored[0]["geneval_tasks"])
        lines += ["", "| method | step compression | latency / AR | overall | " + " | ".join(tasks) + " |"]
        lines.append("|" + "---|" * (4 + len(tasks)))
        for r in scored:
            cells = " | ".join(f"{r['geneval_tasks'][t]:.1%}" for t in tasks)
            lines.append(
                f"| {label(r)} | {r['step_compression']:.2f} | {r['latency_ratio_vs_ar']:.2f} "
                f"| {r['geneval_overall']:.1%} | {cells} |"
            )
    return "\n".join(lines)


REPORT_NOTES = (
    "Lossless methods (yes) sample exactly AR's distribution: their quality columns differ from AR's only by "
    "Monte-Carlo noise (read the Frechet column against the AR row's, AR against a second AR sample set). Lossy "
    "methods (no) trade quality for speed by design: compare their quality columns with AR's.",
    "Step compression = image tokens / forward passes per image; latency / AR < 1 is faster (token sampling "
    "time, this run, same images and seeds); peak MB: the most tensor memory one batch's decode allocates "
    "above what was held before it (weights excluded; CUDA: allocator peak, CPU: tensors counted).",
    "Frechet vs AR is measured in the tokenizer-latent feature space (visar.eval.bench), not Inception.",
    "ms/forward: token-sampling time per forward pass (a Jacobi window's pass costs more than AR's one token); "
    "draft acceptance: accepted / tested drafts, by window slot and image row in report.json.",
    "read-backs/pass: operations that make the host wait for the device (.item(), .tolist(), nonzero, boolean "
    "indexing, device-to-host copies; visar.eval.readbacks) per forward pass, counted in an extra eager batch; on a "
    "GPU each stalls the launch queue. A CPU run cannot see host-device copies (there are none there).",
    "ops/pass: aten operations dispatched per forward pass (the model's and the method's bookkeeping), counted in "
    "the same extra eager batch: each is a Python dispatch and, on a GPU, a kernel launch; a row's ops above the AR "
    "row's are what its bookkeeping costs.",
    "auto ran: the candidates `auto` decoded the row's images with (a tuning call runs several, a tuned call "
    "its winner).",
    "Compiled rows (--compiled-rows, or --compile): the generator under torch.compile; their warm-up is the first "
    "batch, compilation included, kept out of the latency; latency / AR is against the eager AR row.",
)


def write_bench_report(report: dict, folder) -> dict[str, Path]:
    """A run's report in one folder: report.json, report.md (table, notes, plot) and frontier.png."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files = {"json": folder / "report.json", "md": folder / "report.md", "png": folder / "frontier.png"}
    plot_frontier(report, files["png"])
    write_text_atomic(files["json"], json.dumps(report, indent=1))
    notes = "\n".join(f"- {note}" for note in REPORT_NOTES)
    write_text_atomic(
        files["md"],
        f"# visar bench: {report['model']}\n\n{markdown_table(report)}\n\n{notes}\n\n"
        f"![speed against quality, lossless filled, lossy open]({files['png'].name})\n",
    )
    return files


def write_report(report: dict, json_path: str | None, md_path: str | None):
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(Path(json_path), json.dumps(report, indent=1))
    if md_path:
        Path(md_path).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(Path(md_path), markdown_table(report) + "\n")
