"""cspd (exact and relaxed) and mar-cache on a MAR pair, measured in one `visar bench` run (docs/MAR.md's table).

    python tools/mar_bench.py --model visar-tiny-mar-c2i --draft visar-tiny-mar-c2i-draft \
        --num-draft 4 --cache 0.05:2,0.1:2 --n 16 --quality-n 500 --out docs/bench/mar

Rows, after the target alone (`mar`, the reference): the draft alone (`mar` on the draft model, run
as `cspd` cannot: a separate bench of the draft pipeline, its latency against the target's), `cspd`
exact and relaxed at each --num-draft, and `mar-cache` at each token_threshold:null_interval of
--cache. Speed columns from --n images at --batch-size in one process (latency against the target
alone; target and draft transformer passes per image; peak memory), quality columns (shapes-world
detector accuracy, Frechet distance to the target alone in the tokenizer's latent space) over
--quality-n images per row, image i of class i mod 40 with seed i in every row
(visar.eval.bench). Writes OUT/report.md, report.json and frontier.png
(visar.eval.bench.write_bench_report) and OUT/mar_table.md. Not run by CI.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import visar
from visar.eval.bench import bench, write_bench_report


def csv(kind):
    return lambda text: [kind(v) for v in text.split(",") if v]


def plan(draft, num_drafts, caches) -> list[tuple[str, dict]]:
    """(method, options) for every row after the reference."""
    rows = []
    for k in num_drafts:
        rows.append(("cspd", {"draft": draft, "num_draft": k, "mode": "exact"}))
        rows.append(("cspd", {"draft": draft, "num_draft": k, "mode": "relaxed"}))
    for pair in caches:
        threshold, interval = pair.split(":")
        rows.append(("mar-cache", {"token_threshold": float(threshold), "null_interval": int(interval)}))
    return rows


def label(method: str, options: dict) -> str:
    if method == "cspd":
        return f"cspd {options['mode']} k={options['num_draft']}"
    if method == "mar-cache":
        return f"mar-cache thr={options['token_threshold']} null every {options['null_interval']}"
    return f"{method} (target alone)"


def mar_table(report: dict, labels: list[str]) -> str:
    """The MAR columns: target and draft passes, latency against the target alone, quality."""
    lines = [
        "| row | lossless | target passes / image | draft passes / image | latency / target | images/s | peak MB "
        "| acceptance | detector acc. | Frechet vs target |",
        "|" + "---|" * 10,
    ]
    for name, r in zip(labels, report["rows"], strict=True):
        frechet = "-" if r["frechet_vs_ar"] is None else f"{r['frechet_vs_ar']:.3f}"
        accuracy = "-" if r["detector_accuracy"] is None else f"{r['detector_accuracy']:.1%}"
        peak = "-" if r["peak_mem_mb"] is None else f"{r['peak_mem_mb']:.1f}"
        acceptance = "-" if r.get("acceptance_rate") is None else f"{r['acceptance_rate']:.1%}"
        lines.append(
            f"| {name} | {'yes' if r['lossless'] else 'no'} | {r['forward_passes']:.1f} "
            f"| {r['draft_forward_passes']:.1f} | {r['latency_ratio_vs_ar']:.2f} | {r['images_per_s']:.2f} | {peak} "
            f"| {acceptance} | {accuracy} | {frechet} |"
        )
    s = report["settings"]
    lines += [
        "",
        f"target {report['model']}, draft {report['draft']}; speed: {s['n']} images at batch {s['batch_size']} on "
        f"{s['device']}; quality: {s['quality_n']} images per row; sampling {s['sampling']}. The target alone's "
        "Frechet is against a second sample set of its own (the noise floor); the draft alone ran as its own bench in "
        "the same process (its latency / target is the ratio of images/s; its Frechet would be to itself).",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="visar-tiny-mar-c2i", help="the target")
    parser.add_argument("--draft", default="visar-tiny-mar-c2i-draft", help="cspd's draft")
    parser.add_argument("--num-draft", type=csv(int), default=[4], help="cspd's draft steps per verification")
    parser.add_argument("--cache", type=csv(str), default=["0.05:2"], help="mar-cache rows, threshold:null_interval")
    parser.add_argument("--n", type=int, default=16, help="images for the speed columns")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--quality-n", type=int, default=500, help="images per row for the quality columns")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", required=True, help="report folder")
    args = parser.parse_args(argv)

    pipe = visar.load(args.model, device=args.device)
    runs = plan(args.draft, args.num_draft, args.cache)
    report = bench(pipe, [], n=args.n, batch_size=args.batch_size, quality_n=args.quality_n, runs=runs)
    target_rate = report["rows"][0]["images_per_s"]
    draft_pipe = visar.load(args.draft, device=args.device)
    draft_row = bench(draft_pipe, [], n=args.n, batch_size=args.batch_size, quality_n=args.quality_n)["rows"][0]
    draft_row["latency_ratio_vs_ar"] = target_rate / draft_row["images_per_s"]
    draft_row["frechet_vs_ar"] = None
    report["rows"].insert(1, draft_row)
    report["draft"] = args.draft
    labels = [label("mar", {}), "draft alone (mar)"] + [label(m, o) for m, o in runs]
    out = Path(args.out)
    write_bench_report(report, out)
    (out / "mar_table.md").write_text(mar_table(report, labels) + "\n")
    print(mar_table(report, labels))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
