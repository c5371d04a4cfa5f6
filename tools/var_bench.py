"""CoDe and token pruning on a VAR pair, measured in one `visar bench` run (docs/VAR.md's table).

    python tools/var_bench.py --model visar-tiny-var-c2i --refiner visar-tiny-var-c2i-refiner \
        --draft-scales 3,4,5,6,7 --keep 0.75,0.5,0.25 --combined 5:0.5,6:0.5 --n 16 --quality-n 500 \
        --out docs/bench/var

Rows, after the drafter alone (`var`, the reference): the refiner alone (`code` with N = 0),
`code` at each N of --draft-scales (then again at each --refiner-temperature, the refiner's own
sampling temperature), `var-prune` at each --keep fraction (the --prune-scales largest scales), and
`code` with pruning for each N:fraction of --combined. Speed columns from --n images
at --batch-size in one process (latency against the drafter alone; peak memory; the inputs that
went through each model's layers per image), quality columns (shapes-world detector accuracy,
Frechet distance to the drafter alone in the tokenizer's latent space) over --quality-n images per
row, image i of class i mod 40 with seed i in every row (visar.eval.bench). Writes OUT/report.md,
report.json and frontier.png (visar.eval.bench.write_bench_report) and OUT/var_table.md. Not run
by CI.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import visar
from visar.eval.bench import bench, write_bench_report


def csv(kind):
    return lambda text: [kind(v) for v in text.split(",") if v]


def plan(refiner, draft_scales, keeps, prune_scales, combined, refiner_temperatures=()) -> list[tuple[str, dict, str]]:
    """(method, options, row label) for every row after the reference."""
    rows = [("code", {"refiner": refiner, "draft_scales": 0}, "refiner alone (code N=0)")]
    rows += [("code", {"refiner": refiner, "draft_scales": n}, f"code N={n}") for n in draft_scales]
    for t in refiner_temperatures:
        options = [{"refiner": refiner, "draft_scales": n, "refiner_temperature": t} for n in draft_scales]
        rows += [("code", o, f"code N={o['draft_scales']}, refiner temperature {t}") for o in options]
    rows += [("var-prune", {"keep_fraction": f, "prune_scales": prune_scales}, f"var-prune keep={f}") for f in keeps]
    for pair in combined:
        n, f = pair.split(":")
        options = {"refiner": refiner, "draft_scales": int(n), "keep_fraction": float(f), "prune_scales": prune_scales}
        rows.append(("code", options, f"code N={n} + prune keep={f}"))
    return rows


def var_table(report: dict) -> str:
    """The VAR columns: latency against the drafter alone, inputs through each model's layers, quality."""
    lines = [
        "| row | latency / drafter | images/s | peak MB | drafter inputs / image | refiner inputs / image "
        "| detector acc. | Frechet vs drafter |",
        "|" + "---|" * 8,
    ]
    for r in report["rows"]:
        frechet = "-" if r["frechet_vs_ar"] is None else f"{r['frechet_vs_ar']:.3f}"
        accuracy = "-" if r["detector_accuracy"] is None else f"{r['detector_accuracy']:.1%}"
        peak = "-" if r["peak_mem_mb"] is None else f"{r['peak_mem_mb']:.1f}"
        lines.append(
            f"| {r['method']} | {r['latency_ratio_vs_ar']:.2f} | {r['images_per_s']:.1f} | {peak} "
            f"| {r.get('layer_tokens', 0):.0f} | {r.get('draft_layer_tokens', 0):.0f} | {accuracy} | {frechet} |"
        )
    s = report["settings"]
    lines += [
        "",
        f"drafter {report['model']}, refiner {report['refiner']}; speed: {s['n']} images at batch {s['batch_size']} "
        f"on {s['device']}; quality: {s['quality_n']} images per row; sampling {s['sampling']}. The drafter alone's "
        "Frechet is against a second sample set of its own (the noise floor).",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="visar-tiny-var-c2i", help="the drafter (CoDe's large model)")
    parser.add_argument("--refiner", default="visar-tiny-var-c2i-refiner", help="CoDe's small model")
    parser.add_argument("--draft-scales", type=csv(int), default=[3, 4, 5, 6, 7], help="CoDe's N values")
    parser.add_argument("--keep", type=csv(float), default=[0.75, 0.5, 0.25], help="var-prune keep fractions")
    parser.add_argument("--prune-scales", type=int, default=2, help="prune the n largest scales (default 2)")
    parser.add_argument(
        "--refiner-temperature", type=csv(float), default=[], help="also code rows with these refiner temperatures"
    )
    parser.add_argument("--combined", type=csv(str), default=["6:0.5"], help="code + pruning rows, N:fraction")
    parser.add_argument("--n", type=int, default=16, help="images for the speed columns")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--quality-n", type=int, default=500, help="images per row for the quality columns")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", required=True, help="report folder")
    args = parser.parse_args(argv)

    pipe = visar.load(args.model, device=args.device)
    refiner = visar.load(args.refiner, device=args.device)
    rows = plan(refiner, args.draft_scales, args.keep, args.prune_scales, args.combined, args.refiner_temperature)
    report = bench(
        pipe,
        [],
        runs=[(method, options) for method, options, _ in rows],
        n=args.n,
        batch_size=args.batch_size,
        quality_n=args.quality_n,
    )
    report["rows"][0]["method"] = "drafter alone (var)"
    for row, (_, options, label) in zip(report["rows"][1:], rows, strict=True):
        row["method"] = label
        row["options"] = {k: v for k, v in options.items() if k != "refiner"}
    report["refiner"] = refiner.name
    out = Path(args.out)
    write_bench_report(report, out)
    (out / "var_table.md").write_text(var_table(report) + "\n")
    print(var_table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
