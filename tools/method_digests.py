"""Digest of every registered method's tokens on every embedded generator, for refactors that must
not change a single token: run it before and after, on one thread, and diff the two files.

    OMP_NUM_THREADS=1 python tools/method_digests.py > before.json   # at the old commit
    OMP_NUM_THREADS=1 python tools/method_digests.py > after.json
    diff before.json after.json

`--models a,b` and `--methods x,y` keep only those rows (a quick check between edits).

Each (model, method) row decodes two images (class labels 3 and 7, or two prompts) at seed 11 with
the method's default options; a draft model, where the method needs one, is the embedded one made
for that model. The digest is SHA-256 of the token tensors' bytes (MAR's continuous tokens too, so
run both sides on the same machine and thread count).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import torch

import visar
from visar.accel import METHODS, methods_for
from visar.errors import VisarError
from visar.registry import embedded_models, proxy_models

DRAFTS = {
    "visar-tiny-c2i": "visar-tiny-c2i-draft",
    "visar-tiny-mar-c2i": "visar-tiny-mar-c2i-draft",
    "visar-tiny-var-c2i": "visar-tiny-var-c2i-refiner",
}


def digest(tokens) -> str:
    sha = hashlib.sha256()
    for t in tokens if isinstance(tokens, list) else [tokens]:
        sha.update(t.detach().cpu().contiguous().numpy().tobytes())
    return sha.hexdigest()[:16]


def main() -> int:
    parser = argparse.ArgumentParser(description="SHA-256 digests of every method's tokens on every embedded model")
    parser.add_argument("--models", help="comma-separated embedded model names (default: every generator)")
    parser.add_argument("--methods", help="comma-separated method names (default: every method)")
    args = parser.parse_args()
    models = set(args.models.split(",")) if args.models else None
    methods = set(args.methods.split(",")) if args.methods else None
    torch.set_num_threads(1)
    rows = {}
    proxies = proxy_models()  # a proxy's tokens are its law's
    for name in sorted(embedded_models()):
        if models is not None and name not in models or name in proxies:
            continue
        try:
            pipe = visar.load(name)
        except VisarError:
            continue  # a tokenizer or draft folder, not a generator
        if getattr(pipe, "model", None) is None or name.endswith(("-draft", "-refiner", "-refiner-s6")):
            continue
        text = pipe.text_encoder is not None or pipe.class_names is None and "t2i" in name
        condition = {"prompts": ["a red square", "two blue circles"]} if text else {"class_labels": [3, 7]}
        for method_name in methods_for(pipe.model):
            if methods is not None and method_name not in methods:
                continue
            method = METHODS[method_name]
            options = {method.draft_option: DRAFTS[name]} if method.needs_draft and name in DRAFTS else {}
            if method.needs_draft and not options:
                continue
            try:
                out = pipe.generate(**condition, method=method_name, seed=11, output_type="tokens", **options)
            except VisarError as err:
                rows[f"{name} {method_name}"] = f"error: {err}"[:120]
                continue
            rows[f"{name} {method_name}"] = digest(out.tokens)
            print(name, method_name, rows[f"{name} {method_name}"], file=sys.stderr, flush=True)
    print(json.dumps(rows, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
