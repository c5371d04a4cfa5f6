"""Lumina-mGPT 2.0's own speculative Jacobi decoding against visar's methods on the same tiny model (issue 57).

The official side is what tools/lumina_fixtures.py --sjd recorded by running Alpha-VLLM/Lumina-mGPT-2.0's
sampler (tests/fixtures/lumina/v2/official_sjd.json and official_sjd_law.safetensors): forward calls,
seconds and codes per image, and 2,000 images of a law setup. This runs visar on the same tiny 2.0 (rebuilt
from the fixtures), prompt, size (64 x 64 px, 8 x 8 tokens), guidance scales, top-k and seeds, and prints
the side-by-side table (markdown):

    OMP_NUM_THREADS=1 python3 tools/lumina_peer.py [--json OUT.json]

Passes count one model call per step with the conditional and unconditional rows batched in it, as both
SJD implementations and visar run guidance; the official vanilla `generate` runs the unconditional row as a
separate call, so its recorded calls are halved at cfg != 1. Seconds are one CPU thread's, and the
official SJD's are dominated by its Python loops over the 171,385-wide vocabulary (not a GPU figure).
The law column: visar's sjd on the official law setup (32 x 32 px, cfg 1, top-k 8, lm_head scaled by 0.1)
against the official vanilla sampler's 2,000 images, a two-sample chi-square per token for the first 4.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from scipy.stats import chi2_contingency

import visar

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "lumina"
PROMPT = "a red fox"  # the fixtures' "short" prompt
METHODS = {  # visar's side: sjd at 2.0's own settings (window 16, random drafts), and its exact relatives
    "ar": {},
    "sjd": {"window": 16, "init": "random"},
    "mc-sjd": {"window": 16},
    "tree-mc-sjd": {},
}


def fixture_tool():
    spec = importlib.util.spec_from_file_location("lumina_fixtures", REPO / "tools" / "lumina_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def official_rows(recorded: dict) -> list[dict]:
    """The recorded official runs, one row per (method, cfg, top-k): mean passes (batched) and seconds."""
    groups: dict[tuple, list[dict]] = {}
    for r in recorded["records"]:
        groups.setdefault((r["method"], r["cfg"], r["image_top_k"]), []).append(r)
    rows = []
    for (method, cfg, top_k), runs in sorted(groups.items()):
        halve = method == "vanilla" and cfg != 1  # its unconditional row is a separate call
        passes = [r["forward_calls"] / (2 if halve else 1) for r in runs]
        name = "official vanilla generate" if method == "vanilla" else "official SJD (window 16, random drafts)"
        rows.append(row(name, cfg, top_k, passes, [r["seconds"] for r in runs]))
    return rows


def row(name: str, cfg: float, top_k: int, passes: list[float], seconds: list[float]) -> dict:
    return dict(
        method=name,
        cfg=cfg,
        top_k=top_k,
        images=len(passes),
        passes=float(np.mean(passes)),
        seconds=float(np.mean(seconds)),
    )


def visar_rows(pipe, cfgs, top_ks, seeds) -> list[dict]:
    """Each method on one image at a time (as the official code runs), the same seeds."""
    rows = []
    for cfg in cfgs:
        for top_k in top_ks:
            for method, options in METHODS.items():
                passes, seconds = [], []
                for seed in seeds:
                    start = time.perf_counter()
                    out = pipe.generate(
                        prompts=[PROMPT],
                        method=method,
                        guidance_scale=cfg,
                        top_k=top_k,
                        seed=seed,
                        output_type="tokens",
                        **options,
                    )
                    seconds.append(time.perf_counter() - start)
                    passes.append(out.stats["forward_passes"])
                rows.append(row(f"visar {method}", cfg, top_k, passes, seconds))
    return rows


def law_check(folder: Path, law: dict, recorded: dict[str, torch.Tensor]) -> list[dict]:
    """visar's sjd on the official law setup against the official vanilla sampler's images, token by token."""
    width, height = law["size"]
    pipe = visar.load(str(folder), device="cpu", model_args={"width": width, "height": height})
    with torch.no_grad():
        pipe.model.hf.lm_head.weight.mul_(law["lm_head_scale"])
    out = pipe.generate(
        prompts=[PROMPT] * law["n"],
        method="sjd",
        window=16,
        init="random",
        guidance_scale=law["cfg"],
        top_k=law["image_top_k"],
        seed=10_000,
        output_type="tokens",
        batch_size=250,
    )
    ours = out.tokens.reshape(law["n"], -1).numpy()
    theirs = recorded["vanilla_codes"].numpy()
    checks = []
    for token in range(law["tokens"]):
        codes = np.union1d(ours[:, token], theirs[:, token])
        table = np.stack([[np.sum(s[:, token] == c) for c in codes] for s in (ours, theirs)])
        rare = table.sum(0) < 10  # pooled, so that every expected count is large enough for chi-square
        table = np.concatenate([table[:, ~rare], table[:, rare].sum(1, keepdims=True)], axis=1)
        table = table[:, table.sum(0) > 0]
        _, p, dof, _ = chi2_contingency(table)
        tv = 0.5 * np.abs(table[0] / table[0].sum() - table[1] / table[1].sum()).sum()
        checks.append(dict(token=token, two_sample_p=float(p), dof=int(dof), tv=float(tv)))
    return checks


def markdown(rows: list[dict], law: list[dict], official_law: dict) -> str:
    lines = [
        "| method | cfg | top-k | images | passes / image | s / image (1 CPU thread) |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["cfg"], -r["top_k"], r["method"])):
        lines.append(
            f"| {r['method']} | {r['cfg']:g} | {r['top_k']} | {r['images']} | {r['passes']:.1f} | {r['seconds']:.2f} |"
        )
    lines += ["", "Law (first 4 tokens, 2,000 images each; two-sample chi-square p, TV):", ""]
    lines += ["| token | visar sjd vs official vanilla | official SJD vs official vanilla |", "|---|---|---|"]
    for ours, theirs in zip(law, official_law["tokens_compared"], strict=True):
        two = theirs["two_sample_chi2"]
        lines.append(
            f"| {ours['token']} | p = {ours['two_sample_p']:.2f}, TV {ours['tv']:.3f} | "
            f"p = {two['p']:.2f}, TV {theirs['tv_between_samplers']:.3f} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the rows and the law checks here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    recorded = json.loads((FIXTURES / "v2" / "official_sjd.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        folder = fixture_tool().release_folder(2, FIXTURES, Path(tmp) / "lumina2")
        width, height = recorded["record_size"]
        pipe = visar.load(str(folder), device="cpu", model_args={"width": width, "height": height})
        cfgs = sorted({r["cfg"] for r in recorded["records"]})
        top_ks = sorted({r["image_top_k"] for r in recorded["records"]}, reverse=True)
        seeds = sorted({r["seed"] for r in recorded["records"]})
        rows = official_rows(recorded) + visar_rows(pipe, cfgs, top_ks, seeds)
        law = law_check(folder, recorded["law"], load_file(str(FIXTURES / "v2" / "official_sjd_law.safetensors")))
    print(markdown(rows, law, recorded["law"]))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "law": law}, indent=1) + "\n")


if __name__ == "__main__":
    main()
