"""Peak decode memory of plain AR against kv_keep < 1 (docs/SPEED.md, "KV-cache compression").

python tools/kv_keep_memory.py FOLDER --batch-size 64 --steps 4 --kv-keep 1,0.5,0.25
python tools/kv_keep_memory.py hf-janus --tiny-grid 32 --batch-size 64 --steps 3   # or hf-lumina-mgpt

Runs the first `steps` AR passes (prefill included) of a batch under `visar.eval.memory.PeakMemory`
(CPU: the tensors the decode creates; CUDA: the allocator's peak above the weights). The caches are
preallocated whole when the decode opens them, so a few passes reach the decode's peak; the full
decode only adds passes of the same shapes. With --tiny-grid, MODEL is a Hugging Face family whose
tiny random model is built on an N x N grid instead of loaded, with a decoder (`TINY_DECODER`) whose
cache outweighs what one layer's attention computes, as a real model's does: the family's own tiny
decoder (2 layers, heads of 8) holds less cache per slot than its prefill's attention scores.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import visar
from visar.accel import Request
from visar.accel.raster.methods.ar import sample_tokens
from visar.eval.memory import PeakMemory
from visar.families import FAMILIES, hf_janus, hf_lumina

PROMPT = "a red circle on a green square"  # words of every tiny prompt encoder
# 8 layers of 2 heads of 32 (0.3 M parameters): 4 KiB of fp32 cache per slot and row, 8x the attention
# scores and probabilities a 16-position prompt's prefill holds per key in one layer
TINY_DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=2)
TINY_DECODER["num_key_value_heads"] = 2


class Steps:
    """A probe budget that lets `ar.sample_tokens` run `count` steps."""

    def __init__(self, count: int):
        self.left = count

    def tick(self) -> bool:  # as `StepTimer.tick`: another step?
        self.left -= 1
        return self.left >= 0


def tiny_model_args(family: str, grid: int) -> tuple[dict, dict]:
    """(model_args, text_encoder_args) of a Hugging Face family's tiny model on a grid x grid image."""
    if family == "hf-janus":
        config = hf_janus.tiny_config(grid=grid)
        config["text_config"].update(TINY_DECODER, max_position_embeddings=16 + grid * grid)
        width = TINY_DECODER["hidden_size"]  # what the image embeddings and the generation head meet
        config["vision_config"]["projection_dim"] = width
        config["vq_config"].update(projection_dim=width, image_token_embed_dim=width)
        return {**FAMILIES[family].tiny_model_args, "config": config}, FAMILIES[family].tiny_text_encoder_args
    if family == "hf-lumina-mgpt":  # 8 pixels per token (2.0's VQ), so that the header's grid units stay <= 8
        args = {**hf_lumina.tiny_model_args(1, 8 * grid, 8 * grid), "downsampling": 8}
        config = {**TINY_DECODER, "max_position_embeddings": 24 + grid * (grid + 1)}
        return {**args, "config": config}, args
    raise SystemExit(f"--tiny-grid builds hf-janus or hf-lumina-mgpt, not {family}")


def tiny_pipeline(family: str, grid: int) -> visar.Pipeline:
    model_args, text_encoder_args = tiny_model_args(family, grid)
    spec = FAMILIES[family]
    torch.manual_seed(0)
    return visar.Pipeline(
        spec.build_model(model_args),
        spec.build_tokenizer(spec.tiny_tokenizer_args),
        name=f"tiny-{family}-{grid}x{grid}",
        defaults={"guidance_scale": 2.0},
        text_encoder=spec.build_text_encoder(text_encoder_args),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a folder or registered name; with --tiny-grid, hf-janus or hf-lumina-mgpt")
    parser.add_argument("--tiny-grid", type=int, help="build MODEL's tiny random model on an N x N grid")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--kv-keep", default="1,0.5,0.25")
    parser.add_argument("--kv-evict", default="h2o", help="the eviction rule below 1: h2o or line")
    parser.add_argument("--device")
    args = parser.parse_args()
    if args.tiny_grid:
        pipe = tiny_pipeline(args.model, args.tiny_grid)
        pipe.model.to(args.device or "cpu")
    else:
        pipe = visar.load(args.model, device=args.device)
    params = pipe.sampling_params(None, None, None, None)
    if pipe.is_class_conditional:
        cond, cond_mask = pipe.condition((torch.arange(args.batch_size) % pipe.num_classes).tolist())
    else:
        cond, cond_mask = pipe.condition(prompts=[PROMPT] * args.batch_size)
    rows = []
    for kv_keep in (float(v) for v in args.kv_keep.split(",")):
        generators = [torch.Generator().manual_seed(i) for i in range(args.batch_size)]
        request = Request(pipe.model, cond, params, generators, cond_mask, kv_keep=kv_keep, kv_evict=args.kv_evict)
        start = time.perf_counter()
        with torch.no_grad(), PeakMemory(pipe.device) as memory:
            sample_tokens(request, Steps(args.steps))
        rows.append({"kv_keep": kv_keep, "peak_mb": memory.peak_mb, "s": time.perf_counter() - start})
        rows[-1]["vs_ar"] = rows[-1]["peak_mb"] / rows[0]["peak_mb"]
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
