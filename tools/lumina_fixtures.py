"""Official-code fixtures for Lumina-mGPT 1.0 and 2.0 (issue 57): tiny models, greedy cases, logits, VQ I/O.

Runs the unmodified official code (Alpha-VLLM/Lumina-mGPT@104abe4, Alpha-VLLM/Lumina-mGPT-2.0@f44a4d7) on CPU
with tiny seeded models, in a side environment with transformers 4.46.2 (the official modeling does not run
under transformers 5), one process per version because both repositories have modules named `model.chameleon`
and `data.item_processor`:

    PYTHONPATH=$SIDE/tf446:$SIDE/stubs:$REPO/lumina_mgpt nice -n 10 python3 tools/lumina_fixtures.py \
        --version 1 --repo $REPO --out tests/fixtures/lumina

`--sjd` (version 2) instead runs 2.0's own speculative Jacobi sampler against its vanilla generate and writes
v2/official_sjd.json and v2/official_sjd_law.safetensors (about 35 min).

`$SIDE/stubs` holds one-line stand-ins for `pytorch_lightning` (MoVQ subclasses LightningModule), `fairscale`
(imported by xllmx.util.misc) and `absl.logging` (the 2.0 SJD sampler). tests/fixtures/lumina/README.md says
what each file holds and which behaviour it pins down.

Only `seeded_weights`, `state_sha256` and `release_folder` are meant for import from visar's own environment:
they rebuild the tiny models' weights, which are not stored, and a release folder from them. Everything that
touches the official code is imported inside functions.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

# ----------------------------------------------------------------------------------------------------------
# Seeded weights: the only part visar's tests import.


def _is_norm_weight(key: str, shape: tuple[int, ...]) -> bool:
    # RMSNorm / GroupNorm / SpatialNorm weights are 1-D; Lumina's qk-norm weights are (mp, head_dim).
    return key.endswith("weight") and (len(shape) == 1 or key.rsplit(".", 2)[-2] in ("q_norm", "k_norm"))


def seeded_weights(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """Deterministic float32 values for every key, drawn in sorted key order from one torch.Generator.

    norm weights: 1 + 0.1 * randn; biases: 0.1 * randn; `lm_head.weight`: randn (std 1, so that logits have a
    scale of a few units and every greedy choice wins by a clear margin); other weights (linear, conv,
    embedding, codebook): randn / sqrt(fan_in), fan_in = prod(shape[1:]), which keeps activations at unit
    scale through the tiny stacks so that outputs depend on context, position and guidance.
    """
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for key in sorted(shapes):
        shape = tuple(int(n) for n in shapes[key])
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        if key.endswith("bias"):
            weights[key] = 0.1 * noise
        elif _is_norm_weight(key, shape):
            weights[key] = 1.0 + 0.1 * noise
        elif key == "lm_head.weight":
            weights[key] = noise
        else:
            weights[key] = noise / math.sqrt(math.prod(shape[1:]))
    return weights


def state_sha256(state: dict[str, torch.Tensor]) -> str:
    """sha256 over sorted keys: each key's name, its shape and its float32 little-endian bytes."""
    digest = hashlib.sha256()
    for key in sorted(state):
        tensor = state[key].detach().to("cpu", torch.float32).contiguous()
        digest.update(key.encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.numpy().astype("<f4").tobytes())
    return digest.hexdigest()


def release_folder(version: int, fixtures: Path, folder: Path) -> Path:
    """A Lumina-mGPT release folder rebuilt from the fixtures of `version` (visar's tests and
    tools/lumina_peer.py load it): config.json as the official save_pretrained wrote it, the seeded weights in
    the official layout (checked against the manifest's sha256), the tokenizer files, and the VQ checkpoint as
    the official loader reads it (1.0: vqgan.yaml and vqgan.ckpt; 2.0: movqgan_270M.ckpt), which the
    official code takes from elsewhere (so that the folder loads offline)."""
    import shutil

    from safetensors.torch import save_file

    source = Path(fixtures) / f"v{version}"
    manifest = json.loads((source / "manifest.json").read_text())
    weights = {}
    for part in ("lm", "vq"):
        entry = manifest[part]
        weights[part] = seeded_weights({k: tuple(v) for k, v in entry["shapes"].items()}, entry["seed"])
        if state_sha256(weights[part]) != entry["sha256"]:
            raise RuntimeError(f"the seeded {part} weights of v{version} are not the ones the fixtures were made with")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(source / "config.json", folder / "config.json")
    save_file(weights["lm"], str(folder / "model.safetensors"))
    for file in (source / "tokenizer").iterdir():
        shutil.copy(file, folder / file.name)
    if version == 1:
        shutil.copy(source / "vqgan.yaml", folder / "vqgan.yaml")
        torch.save({"state_dict": weights["vq"]}, folder / "vqgan.ckpt")
    else:
        torch.save(weights["vq"], folder / "movqgan_270M.ckpt")
    return folder


def float_shapes(state: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    return {key: list(t.shape) for key, t in sorted(state.items()) if t.is_floating_point()}


# ----------------------------------------------------------------------------------------------------------
# What the fixtures cover.

UPSTREAM = {
    1: ("Alpha-VLLM/Lumina-mGPT", "104abe453ec1acca5863698629c4db2111b0b3fc"),
    2: ("Alpha-VLLM/Lumina-mGPT-2.0", "f44a4d7f15aaf35e097d422b5712468001489c6c"),
}
LM_SEED = {1: 0, 2: 0}
VQ_SEED = {1: 107, 2: 205}

PROMPTS = {"short": "a red fox", "long": "a small blue bird sitting on a branch in the snow"}
# (width, height) in pixels; one grid unit is 32 px: 2 tokens per unit in 1.0, 4 in 2.0.
SIZES = {1: [(64, 64), (64, 96)], 2: [(32, 32), (32, 64)]}
CFGS = [1.0, 3.0, 5.0]
# 2.0's guidance schedule stays above 4 only for a few steps, and only on a large enough grid: at 96x96 px
# (12x12 tokens) cfg 5 gives 4.72, 4.33, then 4; cfg 8 gives five steps above 4.
EXTRA = {1: [], 2: [((96, 96), 5.0), ((96, 96), 8.0)]}

LM_CONFIG = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4
)
VERSION_CONFIG = {
    1: dict(
        vocab_size=8960,
        model_parallel_size=2,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=1,
    ),
    2: dict(
        vocab_size=171385,
        model_parallel_size=1,
        max_position_embeddings=10240,
        bos_token_id=151643,
        eos_token_id=151643,
        pad_token_id=None,
    ),
}
# The Chameleon VQ config inside the LM config (the official model builds `model.vqmodel` from it; the
# release deletes it before saving, so its weights are in no checkpoint). Tiny, so building it is cheap.
TINY_CHAMELEON_VQ_CONFIG = dict(
    embed_dim=8,
    num_embeddings=8192,
    latent_channels=8,
    resolution=256,
    in_channels=3,
    base_channels=32,
    channel_multiplier=[1, 1, 2, 2, 4],
    num_res_blocks=2,
    attn_resolutions=[],
    dropout=0.0,
)
# Taming ddconfigs of the tiny image tokenizers: the real ones with ch 128 / 256 -> 32 and z / embed 256 -> 8
# (Chameleon); MoVQ keeps z = embed = 4 (decode_code hard-codes 4) and attention at resolution 32, the lowest level.
CHAMELEON_DDCONFIG = dict(
    double_z=False,
    z_channels=8,
    resolution=256,
    in_channels=3,
    out_ch=3,
    ch=32,
    ch_mult=[1, 1, 2, 2, 4],
    num_res_blocks=2,
    attn_resolutions=[],
    dropout=0.0,
)
CHAMELEON_VQ = dict(embed_dim=8, n_embed=8192)
MOVQ_DDCONFIG = dict(
    double_z=False,
    z_channels=4,
    resolution=256,
    in_channels=3,
    out_ch=3,
    ch=32,
    ch_mult=[1, 2, 2, 4],
    num_res_blocks=2,
    attn_resolutions=[32],
    dropout=0.0,
)

WORDS = [
    "Generate",
    "an",
    "image",
    "of",
    "according",
    "to",
    "the",
    "following",
    "prompt",
    ":",
    "Hi",
    "my",
    "darling",
    "32x32",
    "32x64",
    "64x32",
    "64x64",
    "64x96",
    "96x64",
    "96x96",
    "a",
    "red",
    "fox",
    "small",
    "blue",
    "bird",
    "sitting",
    "on",
    "branch",
    "in",
    "snow",
]


# ----------------------------------------------------------------------------------------------------------
# Token layout of the tiny vocabularies.


def image_token_name(code: int) -> str:
    """Chameleon's name for VQ code `code`: digits written as letters A-J, e.g. 42 -> IMGIMGEC Z."""
    return "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(code)) + "Z"


def vocab_v1() -> dict[str, int]:
    """1.0: Chameleon's ids for every token the official code hard-codes; image names permuted over 4..8195.

    The official code maps an image id to its code through the token's name (bpe2img), so the permutation
    makes `code == id - 4` false, as it is in the real vocabulary.
    """
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "<eoss>": 8196, "<racm3:break>": 8197}
    order = torch.randperm(8192, generator=torch.Generator().manual_seed(1))
    for slot, code in enumerate(order.tolist()):
        vocab[image_token_name(code)] = 4 + slot
    for token_id in range(8198, 8900):  # <reservedNNNNN> = NNNNN + 4: sep 8710, EOL 8803, grid 8804 + n
        vocab["<image>" if token_id == 8711 else f"<reserved{token_id - 4:05d}>"] = token_id
    for i, word in enumerate(WORDS):
        vocab[word] = 8900 + i
    return vocab


def vocab_v2() -> dict[str, int]:
    """2.0: the ids the official code hard-codes (start 151665, end 151666, EOL 151670); words at 0...

    The grid tokens are found by name (`<reserved{8800+n}>`), so their ids are this fixture's choice
    (151671 + n), as are the separator's (151735) and <|endoftext|> at 151643 (Qwen2.5's; the tokenizer has
    no bos token, so xllmx uses eos as bos). The vanilla path maps image ids to codes as id - 155000; the SJD
    path finds the image ids as the names starting with `<MOVQGAN` (modeling_chameleon.py:1055), so image
    id 155000 + c is named `<MOVQGAN_{c:05d}>` (the real names are not known here, only that prefix).
    """
    vocab = {word: i for i, word in enumerate(WORDS)}
    vocab.update({f"<MOVQGAN_{code:05d}>": 155000 + code for code in range(16384)})
    vocab.update({"<|endoftext|>": 151643, "<racm3:break>": 151665, "<eoss>": 151666})
    for i in range(4):
        vocab[f"<reserved{8796 + i:05d}>"] = 151667 + i
    for n in range(64):
        vocab[f"<reserved{8800 + n:05d}>"] = 151671 + n
    vocab["<reserved08706>"] = 151735
    return vocab


def write_text_tokenizer(version: int, vocab: dict[str, int], out_dir: Path) -> None:
    """A WordLevel tokenizer (whitespace/punctuation pre-tokenizer) that xllmx's Tokenizer loads from disk."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    unk = "<unk>" if version == 1 else "<|endoftext|>"
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    # Only tokens that occur in text must be added tokens (matched before pre-tokenization); the rest are
    # looked up by name through the vocabulary.
    specials = ["<racm3:break>", "<eoss>", "<reserved08706>", "<reserved08799>"]
    specials += ["<s>", "<pad>", "</s>", "<unk>"] if version == 1 else ["<|endoftext|>"]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    names = (
        dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>")
        if version == 1
        else dict(eos_token="<|endoftext|>")
    )
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, **names).save_pretrained(out_dir)


# ----------------------------------------------------------------------------------------------------------
# Running the official code on a CPU.


def _to_cpu(device):
    return "cpu" if device is not None and str(device).startswith("cuda") else device


def patch_cuda_hard_codes() -> None:
    """The processors, VocabTranslation and decode paths hard-code 'cuda'; send those tensors to the CPU."""
    for name in ("tensor", "arange", "zeros"):
        original = getattr(torch, name)

        def on_cpu(*args, _original=original, device=None, **kwargs):
            return _original(*args, device=_to_cpu(device), **kwargs)

        setattr(torch, name, on_cpu)
    torch.Tensor.cuda = lambda self, *args, **kwargs: self


def add_official_paths(repo: Path) -> None:
    for path in (repo, repo / "lumina_mgpt"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))


def build_lm(version: int, vocab: dict[str, int], save_dir: Path):
    """The official class from the tiny config, seeded; saved with the official save_pretrained."""
    from model import ChameleonXLLMXConfig, ChameleonXLLMXForConditionalGeneration

    # The config carries the tokenizer's name -> id map, as the releases' do (2.0's tiny vocabulary has names
    # for the words, the special tokens and the image ids only).
    config = ChameleonXLLMXConfig(
        **LM_CONFIG,
        **VERSION_CONFIG[version],
        vocabulary_map=dict(sorted(vocab.items(), key=lambda kv: kv[1])),
        vq_config=TINY_CHAMELEON_VQ_CONFIG,
        rope_theta=10000.0,
        mask_image_logits=False,
        dropout=0.0,
        z_loss_weight=0.0,
    )
    model = ChameleonXLLMXForConditionalGeneration(config)
    del model.model.vqmodel  # as the official finetune solver does before saving: no release holds vqmodel keys
    shapes = float_shapes(model.state_dict())
    weights = seeded_weights(shapes, LM_SEED[version])
    model.load_state_dict(weights, strict=True)
    model.save_pretrained(save_dir, safe_serialization=True)
    return load_lm(save_dir), shapes, state_sha256(weights)


def load_lm(model_dir: Path):
    """As FlexARInferenceSolver loads it (ChameleonForConditionalGeneration.from_pretrained), in fp32 on the CPU.

    The inference class, not the XLLMX one, whose forward is the training loss; `model.vqmodel` comes up newly
    initialised, as with every release, and is never called.
    """
    from model.chameleon import ChameleonForConditionalGeneration

    model = ChameleonForConditionalGeneration.from_pretrained(
        model_dir, torch_dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def build_chameleon_vq(tokenizer_dir: Path):
    """1.0's image tokenizer files where FlexARItemProcessor reads them: vqgan.yaml and {"state_dict": ...}."""
    import yaml
    from model.chameleon_vae_ori.vqgan import VQModel

    vq = VQModel(ddconfig=CHAMELEON_DDCONFIG, **CHAMELEON_VQ)
    shapes = float_shapes(vq.state_dict())
    weights = seeded_weights(shapes, VQ_SEED[1])
    torch.save({"state_dict": weights}, tokenizer_dir / "vqgan.ckpt")
    yaml_config = {"model": {"params": {**CHAMELEON_VQ, "ddconfig": CHAMELEON_DDCONFIG}}}
    (tokenizer_dir / "vqgan.yaml").write_text(yaml.safe_dump(yaml_config, sort_keys=False))
    return shapes, state_sha256(weights)


def build_movq(cache_dir: Path):
    """2.0's MoVQ as get_movqgan_model('270M') loads it: a raw state dict at <cache_dir>/270M/movqgan_270M.ckpt."""
    from movqgan import MOVQ

    vq = MOVQ(ddconfig=MOVQ_DDCONFIG, n_embed=16384, embed_dim=4)
    shapes = float_shapes(vq.state_dict())
    weights = seeded_weights(shapes, VQ_SEED[2])
    (cache_dir / "270M").mkdir(parents=True, exist_ok=True)
    torch.save(weights, cache_dir / "270M" / "movqgan_270M.ckpt")
    return shapes, state_sha256(weights)


def point_item_processor_at(version: int, tokenizer_dir: Path, movq_cache: Path | None) -> None:
    """FlexARItemProcessor loads its tokenizer from the Hub and its VQ from fixed paths onto CUDA: redirect."""
    import data.item_processor as item_processor
    from data.convertsation import Conversation

    processor = item_processor.FlexARItemProcessor
    if version == 1:
        processor.__init__.__defaults__ = (str(tokenizer_dir), Conversation, 512)
        official_tokenizer = item_processor.chameleon_vae_ori.ImageTokenizer

        class CpuImageTokenizer(official_tokenizer):
            def __init__(self, cfg_path, ckpt_path, device=None):
                super().__init__(cfg_path, ckpt_path, device="cpu")

        item_processor.chameleon_vae_ori.ImageTokenizer = CpuImageTokenizer
    else:
        processor.__init__.__defaults__ = (str(tokenizer_dir), Conversation, 512, "cpu")
        official_loader = item_processor.get_movqgan_model

        def tiny_movq(name, pretrained=True, device="cuda", **kwargs):
            return official_loader(
                name, pretrained=pretrained, device="cpu", cache_dir=str(movq_cache), ddconfig=MOVQ_DDCONFIG
            )

        item_processor.get_movqgan_model = tiny_movq


def make_solver(version: int, model):
    """FlexARInferenceSolver without its __init__ (from_pretrained onto 'cuda'); fp32, so autocast is a no-op."""
    from inference_solver import FlexARInferenceSolver

    solver = FlexARInferenceSolver.__new__(FlexARInferenceSolver)
    solver.model = model
    solver.dtype = torch.float32
    solver.item_processor = sys.modules["data.item_processor"].FlexARItemProcessor()
    if version == 2:
        solver.quant, solver.sjd, solver.target_size = False, False, 512
    return solver


class MarginRecorder:
    """A pass-through logits processor placed after guidance and the image constraint, before top-k.

    Records, at each step where more than one token is allowed, the gap between the best and the second best
    score (the greedy margin) and the guidance scale the official processor used at that step.
    """

    def __init__(self, cfg_processor):
        self.cfg_processor = cfg_processor
        self.margins: list[float | None] = []
        self.scales: list[float] = []

    def __call__(self, input_ids, scores):
        top2 = torch.topk(scores[0], 2).values
        allowed = torch.isfinite(scores[0]).sum().item()
        self.margins.append(float(top2[0] - top2[1]) if allowed > 1 else None)
        self.scales.append(float(self.cfg_processor.guidance_scale))
        return scores


class HeaderAndCapture:
    """Wraps model.generate: appends the header [start, H, W] a trained model would sample, keeps the ids.

    The official generate slices its output after the original prompt, so the header reaches decode_ids as
    if the model had emitted it, and the official decode runs unchanged.
    """

    def __init__(self, model, header: list[int]):
        self.generate, self.header = model.generate, header
        self.prompt_ids: list[int] = []
        self.generated_ids: list[int] = []

    def __call__(self, prompt, *args, **kwargs):
        prompt = torch.cat([prompt, torch.tensor([self.header], dtype=prompt.dtype)], dim=1)
        out = self.generate(prompt, *args, **kwargs)
        self.prompt_ids = prompt[0].tolist()
        self.generated_ids = out[0, prompt.shape[1] :].tolist()
        return out


class DecodeCapture:
    """Wraps the official VQ decode call to keep the codes it receives and the float pixels it returns."""

    def __init__(self, owner, name: str):
        self.owner, self.name, self.decode = owner, name, getattr(owner, name)
        self.codes = self.pixels = None

    def __call__(self, codes, h, w):
        out = self.decode(codes, h, w)
        self.codes = codes.flatten().tolist()
        self.pixels = out if isinstance(out, torch.Tensor) else None
        return out

    def __enter__(self):
        setattr(self.owner, self.name, self)
        return self

    def __exit__(self, *exc):
        setattr(self.owner, self.name, self.decode)


def grid_header(solver, width: int, height: int) -> list[int]:
    """[<racm3:break>, <reserved{8800 + H/32}>, <reserved{8800 + W/32}>]: height first, 32 px per grid unit."""
    processor = solver.item_processor
    names = [
        processor.image_start_token,
        processor.get_n_grids_token(height // 32),
        processor.get_n_grids_token(width // 32),
    ]
    return [processor.token2id(name) for name in names]


def run_case(version: int, solver, prompt_key: str, size: tuple[int, int], cfg: float) -> tuple[dict, torch.Tensor]:
    """One official generate call (batch 1) with image and text top-k 1: greedy, since do_sample is hard-coded."""
    width, height = size
    per_unit = 2 if version == 1 else 4
    rows, cols = height // 32 * per_unit, width // 32 * per_unit
    question = f"Generate an image of {width}x{height} according to the following prompt:\n{PROMPTS[prompt_key]}"
    processors = solver.create_logits_processor(cfg=cfg, image_top_k=1, text_top_k=1)
    recorder = MarginRecorder(processors[0])
    processors.insert(2, recorder)
    capture = HeaderAndCapture(solver.model, grid_header(solver, width, height))
    solver.model.generate = capture
    if version == 1:
        decode = DecodeCapture(solver.item_processor.chameleon_ori_image_tokenizer, "pil_from_img_toks")
    else:
        decode = DecodeCapture(solver.item_processor.vqgan, "decode_code")
    try:
        with decode:
            # max_gen_len stops 1.0 at <eoss> (its eos is the separator 8710, so text could follow); 2.0 stops there.
            _, images = solver.generate(
                images=[],
                qas=[[question, None]],
                max_gen_len=rows * (cols + 1) + 1,
                temperature=1.0,
                logits_processor=processors,
            )
    finally:
        del solver.model.generate
    body = capture.generated_ids
    image_steps = [m for m in recorder.margins if m is not None]
    case = dict(
        name=f"{prompt_key}_{width}x{height}_cfg{cfg:g}",
        prompt=PROMPTS[prompt_key],
        question=question,
        width=width,
        height=height,
        grid=[rows, cols],
        cfg=cfg,
        prompt_ids=capture.prompt_ids,
        header_ids=capture.prompt_ids[-3:],
        generated_ids=body,
        codes=decode.codes,
        guidance_scales=recorder.scales,
        margins=recorder.margins,
        min_margin=min(image_steps),
    )
    assert len(body) == rows * (cols + 1) + 1 and len(decode.codes) == rows * cols
    return case, torch.from_numpy(np.asarray(images[0])).clone()


# ----------------------------------------------------------------------------------------------------------
# Teacher-forced logits and VQ input/output.


@torch.no_grad()
def teacher_forced(model, case: dict, version: int) -> dict[str, torch.Tensor]:
    """Official forward on one case's full sequence and on its unconditional branch [start, H, W, body...].

    Positions: the last prompt token (predicts the first image token), the first row's image steps, the
    first EOL step, the last image step and the <eoss> step. 1.0 rows are full (8,960 ids); 2.0 rows are
    the image-id slice 155000..171383, plus each full row's logsumexp so the rest of the row is checked too.
    """
    sequence = torch.tensor([case["prompt_ids"] + case["generated_ids"]])
    unconditional = torch.tensor([case["header_ids"] + case["generated_ids"]])
    cols = case["grid"][1]
    steps = [0, 1, 2, cols, cols + 1, len(case["generated_ids"]) - 2, len(case["generated_ids"]) - 1]
    prompt_len = len(case["prompt_ids"])
    cond_pos = torch.tensor([prompt_len - 1 + s for s in steps])
    uncond_pos = torch.tensor([2 + s for s in steps])
    cond = model(sequence).logits[0, cond_pos]
    uncond = model(unconditional).logits[0, uncond_pos]
    out = {
        "cond_positions": cond_pos,
        "uncond_positions": uncond_pos,
        "steps": torch.tensor(steps),
        "cond_input_ids": sequence[0],
        "uncond_input_ids": unconditional[0],
        "cond_logsumexp": cond.logsumexp(-1),
        "uncond_logsumexp": uncond.logsumexp(-1),
    }
    if version == 1:
        out.update(cond_logits=cond, uncond_logits=uncond)
    else:
        out.update(cond_logits_image=cond[:, 155000:171384], uncond_logits_image=uncond[:, 155000:171384])
    return out


def test_image(height: int, width: int) -> torch.Tensor:
    """A smooth uint8 RGB image (gradients plus a disc), [H, W, 3]: something for the encoder to quantise."""
    y = torch.linspace(0, 1, height)[:, None]
    x = torch.linspace(0, 1, width)[None, :]
    disc = (((y - 0.4) ** 2 + (x - 0.6) ** 2) < 0.08).float()
    channels = [255 * x.expand(height, width), 255 * y.expand(height, width), 255 * disc * (0.5 + 0.5 * x)]
    return torch.stack(channels, -1).round().clamp(0, 255).to(torch.uint8)


def official_input(image: torch.Tensor) -> torch.Tensor:
    """uint8 [H, W, 3] -> [1, 3, H, W] in [-1, 1], computed in float64 then cast, as img_tokens_from_pil does."""
    return torch.from_numpy(image.numpy() / 255.0 * 2 - 1).permute(2, 0, 1)[None].float()


def code_margins(quantizer, latents: torch.Tensor) -> torch.Tensor:
    """Per latent vector, the gap between the nearest and second-nearest code (squared distance)."""
    flat = latents.permute(0, 2, 3, 1).reshape(-1, latents.shape[1])
    distances = torch.cdist(flat, quantizer.embedding.weight) ** 2
    two = torch.topk(distances, 2, largest=False).values
    return two[:, 1] - two[:, 0]


@torch.no_grad()
def vq_io_v1(solver) -> dict[str, torch.Tensor]:
    """1.0 tokenizer: codes -> float pixels, the official uint8 conversion, an image -> code indices."""
    from PIL import Image

    tokenizer = solver.item_processor.chameleon_ori_image_tokenizer
    vq = tokenizer._vq_model
    codes = torch.randint(0, 8192, (4 * 6,), generator=torch.Generator().manual_seed(7))
    embedding = vq.quantize.get_codebook_entry(codes, (1, 4, 6, vq.quantize.embedding.weight.shape[-1]))
    pixels = vq.decode(embedding)  # what pil_from_img_toks decodes: 4 x 6 codes -> 64 x 96 px
    uint8 = torch.from_numpy(np.asarray(tokenizer._pil_from_chw_tensor(pixels[0]))).clone()
    image = test_image(64, 96)
    indices = tokenizer.img_tokens_from_pil(Image.fromarray(image.numpy()))
    latents = vq.quant_conv(vq.encoder(official_input(image)))
    bpe = solver.item_processor.chameleon_ori_translation.convert_img2bp2(indices)
    return {
        "decode_codes": codes,
        "decode_pixels": pixels[0],
        "decode_uint8": uint8,
        "encode_image": image,
        "encode_indices": indices.flatten(),
        "encode_bpe_ids": bpe.flatten().long(),
        "encode_margins": code_margins(vq.quantize, latents),
    }


@torch.no_grad()
def vq_io_v2(solver) -> dict[str, torch.Tensor]:
    """2.0 tokenizer (MoVQ): decode_code -> float pixels, the official uint8 rounding, an image -> indices."""
    from PIL import Image

    vqgan = solver.item_processor.vqgan
    codes = torch.randint(0, 16384, (4 * 8,), generator=torch.Generator().manual_seed(7))
    pixels = vqgan.decode_code(codes, 4, 8)  # 4 x 8 codes -> 32 x 64 px
    uint8 = torch.from_numpy(np.asarray(solver.show_images(pixels))).clone()
    image = test_image(32, 64)
    indices = solver.item_processor.img_tokens_from_pil(Image.fromarray(image.numpy()))
    latents = vqgan.quant_conv(vqgan.encoder(official_input(image)))
    return {
        "decode_codes": codes,
        "decode_pixels": pixels[0],
        "decode_uint8": uint8,
        "encode_image": image,
        "encode_indices": indices.flatten(),
        "encode_margins": code_margins(vqgan.quantize, latents),
    }


# ----------------------------------------------------------------------------------------------------------


def special_ids(version: int, vocab: dict[str, int]) -> dict[str, int]:
    names = {
        "image_start": "<racm3:break>",
        "image_end": "<eoss>",
        "eol": "<reserved08799>",
        "sep": "<reserved08706>",
        "grid_0": "<reserved08800>",
    }
    ids = {key: vocab[name] for key, name in names.items()}
    ids.update(
        bos=VERSION_CONFIG[version]["bos_token_id"],
        eos_stop=8710 if version == 1 else 151666,
        image_first=4 if version == 1 else 155000,
        image_last=8195 if version == 1 else 171383,
    )
    return ids


def write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value, indent=1) + "\n")


def build_models(version: int, vocab: dict[str, int], out: Path, tmp: Path):
    """Tokenizer, image tokenizer and LM files where the official code reads them; the solver on top."""
    write_text_tokenizer(version, vocab, out / "tokenizer")
    if version == 1:  # FlexARItemProcessor reads ./ckpts/chameleon/tokenizer/ from the working directory
        vq_dir = tmp / "ckpts" / "chameleon" / "tokenizer"
        vq_dir.mkdir(parents=True)
        (vq_dir / "text_tokenizer.json").write_text((out / "tokenizer" / "tokenizer.json").read_text())
        vq_shapes, vq_sha = build_chameleon_vq(vq_dir)
        (out / "vqgan.yaml").write_text((vq_dir / "vqgan.yaml").read_text())
        os.chdir(tmp)
    else:
        vq_shapes, vq_sha = build_movq(tmp / "movqgan")
    point_item_processor_at(version, out / "tokenizer", tmp / "movqgan")
    model, shapes, sha = build_lm(version, vocab, tmp / "lm")
    write_json(out / "config.json", json.loads((tmp / "lm" / "config.json").read_text()))
    vq_spec = (
        dict(CHAMELEON_VQ, ddconfig=CHAMELEON_DDCONFIG)
        if version == 1
        else dict(n_embed=16384, embed_dim=4, ddconfig=MOVQ_DDCONFIG)
    )
    vq_layout = (
        "torch.save({'state_dict': sd}, 'vqgan.ckpt')" if version == 1 else ("torch.save(sd, 'movqgan_270M.ckpt')")
    )
    write_json(
        out / "manifest.json",
        {
            "lm": {"seed": LM_SEED[version], "sha256": sha, "shapes": shapes},
            "vq": {"seed": VQ_SEED[version], "sha256": vq_sha, "layout": vq_layout, **vq_spec, "shapes": vq_shapes},
        },
    )
    return make_solver(version, model)


# ----------------------------------------------------------------------------------------------------------
# 2.0's own speculative Jacobi decoding (generate_examples/jacobi_utils_static.py, sjds.py), with the
# settings of generate.py --speculative_jacobi, against 2.0's vanilla generate on the same tiny model.

SJD_RECORD = dict(size=(64, 64), seeds=range(4), cfgs=(1.0, 3.0), image_top_ks=(4096, 1))
# The law test: a grid small enough to enumerate the exact laws of the first tokens, an image top-k of 8, and
# lm_head scaled by 0.1 (logits of about unit scale) so that the top 8 are not dominated by one token.
SJD_LAW = dict(size=(32, 32), n=2000, cfg=1.0, image_top_k=8, lm_head_scale=0.1, tokens=4)
HEADER_LEN = 3


def sjd_settings(size: tuple[int, int], cfg: float, image_top_k: int) -> dict:
    """generate.py's renew_pipeline_sampler arguments, shifted because the header is in the prompt here.

    generate.py runs Jacobi from 3 tokens after the prompt (the header) to `rows * cols + rows - 10`; with
    the header appended to the prompt the same absolute interval is (0, that - 3).
    """
    width, height = size
    return dict(
        jacobi_loop_interval_l=3 - HEADER_LEN,
        jacobi_loop_interval_r=(height // 8) * (width // 8) + height // 8 - 10 - HEADER_LEN,
        max_num_new_tokens=16,
        guidance_scale=cfg,
        seed=None,
        multi_token_init_scheme="random",
        do_cfg=True,
        image_top_k=image_top_k,
        text_top_k=10,
        prefix_token_sampler_scheme="speculative_jacobi",
    )


def configure_sjd(solver, settings: dict) -> None:
    """What renew_pipeline_sampler does to an already renewed solver: set the pipeline, sampler, backbone."""
    solver._init_new_params(**settings)
    solver.model._init_new_params(**settings)
    solver.model.model._init_new_params(**settings)


def shift_sjd_for_given_header(jacobi, model) -> None:
    """Keep the sampler's header-relative rules where they are when the header comes with the prompt.

    The sampler skips guidance for its first 3 steps (the header) and masks all prompt tokens but the last in
    the unconditional row (`prefill_num`); shift both by the 3 header tokens, so the first image token is
    guided and the unconditional row sees [separator, start, H, W], as in a run that sampled the header.
    """
    official_force_no_cfg = jacobi.check_is_force_no_cfg

    def force_no_cfg(*args, current_step=0, **kwargs):
        return official_force_no_cfg(*args, current_step=current_step + HEADER_LEN, **kwargs)

    jacobi.check_is_force_no_cfg = force_no_cfg
    official_cfg_input = model.prepare_cfg_input

    def cfg_input(model_inputs, cfg_repeat_name_list, prefill_num=None, neg_input_ids=None):
        prefill_num = None if prefill_num is None else prefill_num - HEADER_LEN
        return official_cfg_input(
            model_inputs, cfg_repeat_name_list, prefill_num=prefill_num, neg_input_ids=neg_input_ids
        )

    model.prepare_cfg_input = cfg_input


class ForwardCounter:
    """Counts model forward calls (one call may carry the conditional and unconditional rows)."""

    def __init__(self, model):
        self.calls = 0
        official_forward = model.forward

        @functools.wraps(official_forward)  # generate inspects forward's signature for attention_mask
        def counted(*args, **kwargs):
            self.calls += 1
            return official_forward(*args, **kwargs)

        model.forward = counted


def reset_processors(processors, cfg: float, image_top_k: int) -> None:
    """One processor list serves many images (building one takes ~50 s on 2.0's vocabulary, and generate.py
    builds one per image): clear the per-image state the official classes keep, set guidance and top-k."""
    for processor in processors:
        for name in ("h_latent_dim", "w_latent_dim", "image_start_token_id_index", "unconditional_context"):
            if hasattr(processor, name):
                setattr(processor, name, None)
        if hasattr(processor, "guidance_scale"):
            processor.guidance_scale = cfg
        if hasattr(processor, "image_top_k"):
            processor.image_top_k = image_top_k


def sample_image(solver, processors, counter, size, cfg, image_top_k, seed) -> dict:
    """One official generate call after xllmx's random_seed(seed) (python, torch and numpy, as generate.py)."""
    from xllmx.util.misc import random_seed

    width, height = size
    rows, cols = height // 8, width // 8
    question = f"Generate an image of {width}x{height} according to the following prompt:\n{PROMPTS['short']}"
    reset_processors(processors, cfg, image_top_k)
    capture = HeaderAndCapture(solver.model, grid_header(solver, width, height))
    solver.model.generate, counter.calls = capture, 0
    random_seed(seed)
    start = time.perf_counter()
    try:
        solver.generate(
            images=[],
            qas=[[question, None]],
            max_gen_len=rows * (cols + 1) + 1,
            temperature=1.0,
            logits_processor=processors,
        )
    finally:
        del solver.model.generate
    ids = capture.generated_ids
    codes = [t - 155000 for t in ids if 155000 <= t < 171384]
    return dict(
        seed=seed,
        forward_calls=counter.calls,
        seconds=round(time.perf_counter() - start, 4),
        codes=codes,
        generated_ids=ids,
        prompt_ids=capture.prompt_ids,
    )


@torch.no_grad()
def exact_token_laws(model, processor_sets: dict, prompt: list[int], depth: int) -> dict:
    """The exact marginal law of each of the first `depth` image tokens under each processor list, by
    enumerating every prefix with positive probability (the lists are applied as the samplers apply them:
    2-D scores for vanilla, [B, L, V] for SJD; softmax after the last processor)."""
    laws = {name: [{} for _ in range(depth)] for name in processor_sets}
    for name, (processors, three_dim) in processor_sets.items():
        frontier = {(): 1.0}
        for step in range(depth):
            next_frontier = {}
            for prefix, mass in frontier.items():
                input_ids = torch.tensor([prompt + list(prefix)])
                scores = model(input_ids).logits[:, -1]
                reset_processors(processors, 1.0, processors_top_k(processors))
                scores = processors(input_ids, scores[:, None] if three_dim else scores)
                probs = torch.softmax(scores.reshape(-1), -1)
                for token in torch.nonzero(probs).flatten().tolist():
                    p = mass * probs[token].item()
                    laws[name][step][token] = laws[name][step].get(token, 0.0) + p
                    next_frontier[prefix + (token,)] = p
            frontier = next_frontier
    return laws


def processors_top_k(processors) -> int:
    return next(p.image_top_k for p in processors if hasattr(p, "image_top_k"))


def compare_laws(samples: dict[str, torch.Tensor], exact: dict, tokens: int) -> list[dict]:
    """Per token position: chi-square of each sampler against each exact law (cells with expected count < 5
    pooled), a two-sample chi-square between the samplers, and total variation distances."""
    from scipy.stats import chi2, chi2_contingency

    rows = []
    names = list(samples)
    for t in range(tokens):
        support = sorted(
            set().union(*(law[t] for law in exact.values()), *(set(s[:, t].tolist()) for s in samples.values()))
        )
        counts = {
            n: torch.tensor([(samples[n][:, t] == tok).sum().item() for tok in support], dtype=torch.float64)
            for n in names
        }
        probs = {n: torch.tensor([exact[n][t].get(tok, 0.0) for tok in support], dtype=torch.float64) for n in exact}
        row = {"token": t, "support": [tok - 155000 for tok in support]}
        for n in names:
            row[f"{n}_counts"] = counts[n].long().tolist()
        for n in exact:
            row[f"exact_{n}"] = [round(p, 6) for p in probs[n].tolist()]
        for sampler in names:
            for law in exact:
                expected = probs[law] * counts[sampler].sum()
                big = expected >= 5
                obs = torch.cat([counts[sampler][big], counts[sampler][~big].sum()[None]])
                exp = torch.cat([expected[big], expected[~big].sum()[None]])
                keep = exp > 0
                stat = (((obs - exp) ** 2)[keep] / exp[keep]).sum().item()
                impossible = int(counts[sampler][probs[law] == 0].sum().item())
                df = int(keep.sum().item()) - 1
                row[f"chi2_{sampler}_vs_exact_{law}"] = dict(
                    stat=round(stat, 3),
                    df=df,
                    p=float(chi2.sf(stat, df)) if impossible == 0 else 0.0,
                    samples_outside_support=impossible,
                )
                row[f"tv_{sampler}_vs_exact_{law}"] = round(
                    0.5 * (counts[sampler] / counts[sampler].sum() - probs[law]).abs().sum().item(), 4
                )
        table = torch.stack([counts[n] for n in names])
        table = table[:, table.sum(0) > 0]
        stat, p, df, _ = chi2_contingency(table.numpy())
        row["two_sample_chi2"] = dict(stat=round(float(stat), 3), df=int(df), p=float(p))
        freq = [counts[n] / counts[n].sum() for n in names]
        row["tv_between_samplers"] = round(0.5 * (freq[0] - freq[1]).abs().sum().item(), 4)
        rows.append(row)
    return rows


def official_sjd(out: Path, tmp: Path) -> None:
    """Forward calls, time and codes per image for the official SJD and vanilla paths, then the law test."""
    import jacobi_utils_static as jacobi
    from safetensors.torch import save_file

    vanilla = build_models(2, vocab_v2(), tmp / "v2", tmp)
    sjd = make_solver(2, load_lm(tmp / "lm"))
    jacobi.renew_pipeline_sampler(sjd, **sjd_settings(SJD_RECORD["size"], 1.0, 1))
    shift_sjd_for_given_header(jacobi, sjd.model)
    counters = {"vanilla": ForwardCounter(vanilla.model), "sjd": ForwardCounter(sjd.model)}
    processors = {
        "vanilla": vanilla.create_logits_processor(cfg=1.0, image_top_k=1, text_top_k=10),
        "sjd": sjd.create_logits_processor(),
    }
    solvers = {"vanilla": vanilla, "sjd": sjd}

    records = []
    for cfg in SJD_RECORD["cfgs"]:
        for top_k in SJD_RECORD["image_top_ks"]:
            configure_sjd(sjd, sjd_settings(SJD_RECORD["size"], cfg, top_k))
            for method in ("vanilla", "sjd"):
                for seed in SJD_RECORD["seeds"]:
                    record = sample_image(
                        solvers[method], processors[method], counters[method], SJD_RECORD["size"], cfg, top_k, seed
                    )
                    records.append(dict(method=method, cfg=cfg, image_top_k=top_k, **record))
                    print(method, cfg, top_k, seed, record["forward_calls"], record["seconds"], flush=True)

    with torch.no_grad():
        for solver in solvers.values():
            solver.model.lm_head.weight.mul_(SJD_LAW["lm_head_scale"])
    configure_sjd(sjd, sjd_settings(SJD_LAW["size"], SJD_LAW["cfg"], SJD_LAW["image_top_k"]))
    law_draws = {}
    for method in ("vanilla", "sjd"):
        law_draws[method] = [
            sample_image(
                solvers[method],
                processors[method],
                counters[method],
                SJD_LAW["size"],
                SJD_LAW["cfg"],
                SJD_LAW["image_top_k"],
                seed,
            )
            for seed in range(SJD_LAW["n"])
        ]
        print(method, "law samples done", flush=True)
    prompt = law_draws["vanilla"][0]["prompt_ids"]
    exact = exact_token_laws(
        vanilla.model,
        {"vanilla": (processors["vanilla"], False), "sjd": (processors["sjd"], True)},
        prompt,
        SJD_LAW["tokens"],
    )
    first_ids = {m: torch.tensor([d["generated_ids"][: SJD_LAW["tokens"]] for d in law_draws[m]]) for m in law_draws}
    law = compare_laws(first_ids, exact, SJD_LAW["tokens"])

    codes = {f"{m}_codes": torch.tensor([d["codes"] for d in law_draws[m]], dtype=torch.int32) for m in law_draws}
    calls = {
        f"{m}_forward_calls": torch.tensor([d["forward_calls"] for d in law_draws[m]], dtype=torch.int32)
        for m in law_draws
    }
    save_file(
        {**codes, **calls, "seeds": torch.arange(SJD_LAW["n"], dtype=torch.int32)}, out / "official_sjd_law.safetensors"
    )
    for record in records:
        del record["generated_ids"], record["prompt_ids"]
    summary = {
        m: dict(
            mean_forward_calls=calls[f"{m}_forward_calls"].float().mean().item(),
            mean_seconds=sum(d["seconds"] for d in law_draws[m]) / len(law_draws[m]),
        )
        for m in law_draws
    }
    write_json(
        out / "official_sjd.json",
        dict(
            upstream={"repository": UPSTREAM[2][0], "commit": UPSTREAM[2][1]},
            sjd_settings=sjd_settings(SJD_RECORD["size"], 3.0, 4096),
            record_size=SJD_RECORD["size"],
            records=records,
            law=dict(SJD_LAW, summary=summary, tokens_compared=law),
        ),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--version", type=int, choices=[1, 2], required=True)
    parser.add_argument("--repo", type=Path, required=True, help="a checkout of the official repository")
    parser.add_argument("--out", type=Path, required=True, help="tests/fixtures/lumina")
    parser.add_argument("--sjd", action="store_true", help="2.0 only: official_sjd.json and the law test")
    args = parser.parse_args()
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    add_official_paths(args.repo.resolve())
    patch_cuda_hard_codes()
    version, out = args.version, args.out.resolve() / f"v{args.version}"
    out.mkdir(parents=True, exist_ok=True)
    if args.sjd:
        sys.path.insert(0, str(args.repo.resolve() / "lumina_mgpt" / "generate_examples"))
        with tempfile.TemporaryDirectory() as tmp:
            official_sjd(out, Path(tmp))
        return
    vocab = vocab_v1() if version == 1 else vocab_v2()
    runs = [(p, s, g) for p in PROMPTS for s in SIZES[version] for g in CFGS]
    runs += [(p, s, g) for p in PROMPTS for s, g in EXTRA[version]]

    with tempfile.TemporaryDirectory() as tmp:
        solver = build_models(version, vocab, out, Path(tmp))
        cases, images = [], {}
        for prompt_key, size, cfg in runs:
            case, image = run_case(version, solver, prompt_key, size, cfg)
            print(case["name"], "min margin", round(case["min_margin"], 4), flush=True)
            cases.append(case)
            images[f"image_{case['name']}"] = image
        width, height = SIZES[version][1]
        logits_case = next(c for c in cases if c["name"] == f"short_{width}x{height}_cfg3")
        logits = teacher_forced(solver.model, logits_case, version)
        vq_io = (vq_io_v1 if version == 1 else vq_io_v2)(solver)

    save_file({k: v.contiguous() for k, v in logits.items()}, out / "logits.safetensors")
    save_file({k: v.contiguous() for k, v in {**vq_io, **images}.items()}, out / "vq_io.safetensors")
    write_json(
        out / "cases.json",
        {
            "upstream": {"repository": UPSTREAM[version][0], "commit": UPSTREAM[version][1]},
            "special_ids": special_ids(version, vocab),
            "sampling": {
                "temperature": 1.0,
                "image_top_k": 1,
                "text_top_k": 1,
                "do_sample": True,
                "max_new_tokens": "rows * (cols + 1) + 1",
            },
            "logits_case": logits_case["name"],
            "cases": cases,
        },
    )


if __name__ == "__main__":
    main()
