"""Time visar's plain AR against the official LlamaGen sampling loop, side by side, same weights (CPU).

    python tools/compare_official_llamagen.py /path/to/LlamaGen [--size B] [--batch-sizes 1,8] [--cfg 4]

The official code (github.com/FoundationVision/LlamaGen, a checkout or an archive of it) is given by
its path; nothing is fetched. The script builds the official `Transformer` of the chosen size
(GPT-B by default: dim 768, 12 layers, 12 heads, 16,384 codes, 16 x 16 tokens, 1000 classes) with
seeded random weights, saves them as an official checkpoint and loads that file into visar
(`visar.load("llamagen", checkpoint=..., model_args=...)`), so both run the same weights. Then, for
each batch size, without and with classifier-free guidance, it times one full image of tokens by
each: visar's `Pipeline.generate(method="ar")` and the official `generate()`
(`autoregressive/models/generate.py`), plain sampling (temperature 1, no top-k / top-p), after one
warm-up run each, best of --repeats, and prints the ratio (visar / official: < 1 means visar is
faster). A greedy check first says whether both decode the same tokens from the same weights.

--size tiny runs a small model (dim 64, 2 layers, 8 x 8 tokens) to check that the script works.
Not run by CI (it needs the official code); it imports that code, which needs only torch.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

SIZES = {
    "B": dict(dim=768, n_layer=12, n_head=12, vocab_size=16384, block_size=256, num_classes=1000),
    "L": dict(dim=1024, n_layer=24, n_head=16, vocab_size=16384, block_size=256, num_classes=1000),
    "tiny": dict(dim=64, n_layer=2, n_head=4, vocab_size=512, block_size=64, num_classes=10),
}


def official_modules(path: Path):
    """The official model and sampling modules, imported from the checkout at `path`."""
    if not (path / "autoregressive" / "models" / "generate.py").is_file():
        sys.exit(f"{path} is not a LlamaGen checkout (no autoregressive/models/generate.py)")
    sys.path.insert(0, str(path))
    warnings.filterwarnings("ignore", message=".*sdp_kernel.*", category=FutureWarning)  # the official loop's
    from autoregressive.models import generate, gpt  # noqa: PLC0415 (the official code, from its path)

    if not hasattr(torch.backends.cuda, "sdp_kernel"):  # removed from newer torch; a no-op on CPU anyway
        from contextlib import nullcontext

        torch.backends.cuda.sdp_kernel = lambda **kwargs: nullcontext()
    return gpt, generate


def build_pair(gpt, model_args: dict, seed: int):
    """The official Transformer with seeded random weights, and visar's LlamaGen loaded from its state_dict."""
    import visar

    official = gpt.Transformer(gpt.ModelArgs(**model_args)).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # the official init zeroes the output layer: every logit would be 0
        for param in official.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = Path(folder) / "random.pt"
        torch.save({"model": official.state_dict()}, checkpoint)
        pipe = visar.load("llamagen", checkpoint=checkpoint, model_args=model_args, device="cpu")
    return official, pipe


def visar_run(pipe, labels, cfg, top_k=None):
    return pipe.generate(
        class_labels=labels, method="ar", guidance_scale=cfg, temperature=1.0, top_k=top_k, top_p=1.0,
        output_type="tokens", seed=0,
    ).tokens.flatten(1)  # fmt: skip


def official_run(generate, model, labels, cfg, num_tokens, top_k=0):
    cond = torch.tensor(labels, dtype=torch.long)
    return generate.generate(model, cond, num_tokens, cfg_scale=cfg, temperature=1.0, top_k=top_k, top_p=1.0)


def best_time(run, repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("official", type=Path, help="path of the official LlamaGen code (a checkout)")
    parser.add_argument("--size", default="B", choices=sorted(SIZES), help="model size (default B = GPT-B)")
    parser.add_argument("--batch-sizes", default="1,8", help="comma-separated batch sizes (default 1,8)")
    parser.add_argument("--cfg", type=float, default=4.0, help="guidance scale of the CFG rows (default 4)")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per cell after a warm-up (default 2)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    gpt, generate = official_modules(args.official.resolve())
    model_args = SIZES[args.size]
    official, pipe = build_pair(gpt, model_args, args.seed)
    num_tokens = model_args["block_size"]

    with torch.no_grad():  # same weights -> the same greedy tokens (up to float ties)
        same = torch.equal(
            visar_run(pipe, [1], 1.0, top_k=1).cpu(), official_run(generate, official, [1], 1.0, num_tokens, 1).long()
        )
    print(f"LlamaGen GPT-{args.size} {model_args}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"greedy tokens equal (visar vs official, same weights): {'yes' if same else 'NO'}")
    print("| batch | cfg | visar ar (s) | official generate (s) | visar / official |")
    print("|---|---|---|---|---|")
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        labels = [i % model_args["num_classes"] for i in range(batch)]
        for cfg in (1.0, args.cfg):
            with torch.no_grad():
                ours = best_time(lambda labels=labels, cfg=cfg: visar_run(pipe, labels, cfg), args.repeats)
                theirs = best_time(
                    lambda labels=labels, cfg=cfg: official_run(generate, official, labels, cfg, num_tokens),
                    args.repeats,
                )
            print(f"| {batch} | {cfg:g} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
