"""The aMUSEd family: diffusers' `UVit2DModel` + `VQModel` + CLIP text encoder, from an `AmusedPipeline` folder.

diffusers 0.42 marks `AmusedPipeline` deprecated and untested; visar runs the same components with
its own loop (`visar.accel.masked.loop`, method "maskgit" reproduces the pipeline's tokens for a seed).
A folder written by `AmusedPipeline.save_pretrained` (model_index.json with "_class_name":
"AmusedPipeline"; transformer/, vqvae/, text_encoder/, tokenizer/, scheduler/) loads with
`visar.load(FOLDER)`, offline; diffusers and transformers are optional dependencies
(`pip install "visar-ar[hf]"`), imported only when such a model is built.

Sampling defaults: AmusedPipeline's (guidance scale 10, softmax temperature 1, no top-k / top-p;
12 steps and the Gumbel annealing (2, 0) are the maskgit method's defaults). Loading options
(`model_args`): `negative_prompt` ("", the default unconditional branch; a call's own is
`Pipeline.generate(negative_prompt=...)`, as AmusedPipeline takes it), `aesthetic_score` (6),
`crop_coord` ([0, 0]), the pipeline's micro-conditioning. A scheduler saved with masking_schedule
"linear" is run as such with `--opt mask_schedule=linear`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..errors import VisarError
from ..models.amused import AmusedTransformer, ClipPromptIds
from ..tokenizers.diffusers_vq import DiffusersVQTokenizer
from .family import Family, FolderParts, diffusers_module, register_family, transformers_module

PIPELINE_CLASSES = ("AmusedPipeline",)
# AmusedPipeline's __call__ defaults.
DEFAULTS = {"guidance_scale": 10.0, "temperature": 1.0, "top_k": None, "top_p": 1.0}
LOAD_OPTIONS = {"negative_prompt": "", "aesthetic_score": 6, "crop_coord": [0, 0]}

# component -> the files it needs (alternatives in a tuple): what save_pretrained writes.
COMPONENT_FILES = {
    "transformer": ("config.json", ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin")),
    "vqvae": ("config.json", ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin")),
    "text_encoder": ("config.json", ("model.safetensors", "pytorch_model.bin")),
    "tokenizer": (("tokenizer.json", "vocab.json"),),
    "scheduler": ("scheduler_config.json",),
}


def check_layout(folder: Path):
    """One error naming the first file an aMUSEd folder lacks."""
    for component, files in COMPONENT_FILES.items():
        for needed in files:
            options = needed if isinstance(needed, tuple) else (needed,)
            if not any((folder / component / name).is_file() for name in options):
                raise VisarError(
                    f"{folder} is not a complete aMUSEd folder: {component}/{' or '.join(options)} is missing "
                    "(AmusedPipeline.save_pretrained writes transformer/, vqvae/, text_encoder/, tokenizer/ and "
                    "scheduler/)"
                )


def micro_conditions(transformer_config, vq_config, options: dict) -> tuple[float, ...]:
    """AmusedPipeline's micro_conds at its default size: (width, height, crop, crop, aesthetic score)."""
    pixels = int(transformer_config.sample_size) * 2 ** (len(vq_config.block_out_channels) - 1)
    crop = list(options["crop_coord"])
    return (pixels, pixels, crop[0], crop[1], options["aesthetic_score"])


def load_options(model_args: dict | None) -> dict:
    options = {**LOAD_OPTIONS, **(model_args or {})}
    unknown = sorted(set(options) - set(LOAD_OPTIONS))
    if unknown:
        what = f"{unknown} for an aMUSEd folder; known: {sorted(LOAD_OPTIONS)}"
        raise VisarError(f"unknown model_args {what}", cli=f"unknown --model-arg {what}")
    return options


def load_folder(folder: os.PathLike, model_args: dict | None = None) -> FolderParts:
    """An AmusedPipeline save_pretrained folder -> masked model (float32), VQ tokenizer, prompt ids."""
    folder = Path(folder)
    options = load_options(model_args)
    check_layout(folder)
    diffusers, transformers = diffusers_module(), transformers_module()
    local = {"local_files_only": True}
    transformer = diffusers.UVit2DModel.from_pretrained(folder / "transformer", torch_dtype=torch.float32, **local)
    vq = diffusers.VQModel.from_pretrained(folder / "vqvae", torch_dtype=torch.float32, **local)
    text_encoder = transformers.CLIPTextModelWithProjection.from_pretrained(
        folder / "text_encoder", dtype=torch.float32, **local
    )
    tokenizer = transformers.CLIPTokenizer.from_pretrained(folder / "tokenizer", **local)
    scheduler = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    prompt_ids = ClipPromptIds(tokenizer)
    model = AmusedTransformer(
        transformer.eval(),
        text_encoder.eval(),
        negative_ids=prompt_ids.ids([options["negative_prompt"]])[0],
        mask_token_id=scheduler["mask_token_id"],
        micro_conds=micro_conditions(transformer.config, vq.config, options),
    )
    return FolderParts(model, DiffusersVQTokenizer(vq.eval()), prompt_ids, dict(DEFAULTS))


# -- a tiny random aMUSEd, for the tests (tests/accel/test_method_conformance.py, tests/models/test_amused.py) --
# diffusers' own fast-test sizes (tests/pipelines/amused), a 4 x 4 grid, and a character-level CLIP tokenizer.

TINY_MAX_PROMPT_TOKENS = 16
TINY_CHARACTERS = "abcdefghijklmnopqrstuvwxyz"


def tiny_clip_vocab() -> dict[str, int]:
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for character in TINY_CHARACTERS:
        vocab[character] = len(vocab)
        vocab[character + "</w>"] = len(vocab)
    return vocab


def tiny_tokenizer():
    """A CLIPTokenizer over single characters (no files): bos 0, eos = pad 1."""
    transformers = transformers_module()
    return transformers.CLIPTokenizer(vocab=tiny_clip_vocab(), merges=[], model_max_length=TINY_MAX_PROMPT_TOKENS)


def tiny_transformer_config(grid: int = 4, codebook: int = 8) -> dict:
    return dict(
        hidden_size=8, use_bias=False, cond_embed_dim=8, micro_cond_encode_dim=2, micro_cond_embed_dim=10,
        encoder_hidden_size=8, vocab_size=codebook + 1, codebook_size=codebook, in_channels=8, block_out_channels=8,
        num_res_blocks=1, downsample=True, upsample=True, block_num_heads=1, num_hidden_layers=1,
        num_attention_heads=1, intermediate_size=8, sample_size=grid,
    )  # fmt: skip


def tiny_text_config() -> dict:
    return dict(
        bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_size=8, intermediate_size=8, num_attention_heads=1,
        num_hidden_layers=1, vocab_size=len(tiny_clip_vocab()), projection_dim=8,
        max_position_embeddings=TINY_MAX_PROMPT_TOKENS,
    )  # fmt: skip


def tiny_vq_config(codebook: int = 8) -> dict:
    return dict(
        act_fn="silu", block_out_channels=[8], down_block_types=["DownEncoderBlock2D"], in_channels=3,
        latent_channels=8, layers_per_block=1, norm_num_groups=8, num_vq_embeddings=codebook, out_channels=3,
        sample_size=8, up_block_types=["UpDecoderBlock2D"], mid_block_add_attention=False, lookup_from_codebook=True,
    )  # fmt: skip


def build_model(model_args: dict) -> AmusedTransformer:
    """model_args: "transformer" (UVit2DModel config), "text_encoder" (CLIPTextConfig), "mask_token_id",
    "negative_ids" (the negative prompt's ids), "micro_conds"."""
    diffusers, transformers = diffusers_module(), transformers_module()
    transformer = diffusers.UVit2DModel(**model_args["transformer"])
    text_encoder = transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(**model_args["text_encoder"]))
    return AmusedTransformer(
        transformer.eval(),
        text_encoder.eval(),
        negative_ids=torch.tensor(model_args["negative_ids"]),
        mask_token_id=model_args["mask_token_id"],
        micro_conds=tuple(model_args["micro_conds"]),
    )


def build_tokenizer(tokenizer_args: dict) -> DiffusersVQTokenizer:
    return DiffusersVQTokenizer(diffusers_module().VQModel(**tokenizer_args).eval())


def build_text_encoder(text_encoder_args: dict) -> ClipPromptIds:
    return ClipPromptIds(tiny_tokenizer())


def load_weights_elsewhere(module, path, source: str):
    loads = f"{source}: an aMUSEd model loads from its diffusers folder, weights included:"
    raise VisarError(f"{loads} visar.load(FOLDER)", cli=f"{loads} --model FOLDER")


TINY_MODEL_ARGS = dict(
    transformer=tiny_transformer_config(),
    text_encoder=tiny_text_config(),
    mask_token_id=8,
    # "" under the tiny tokenizer, padded as AmusedPipeline pads: <|startoftext|> <|endoftext|> <pad = eos> ...
    negative_ids=[0] + [1] * (TINY_MAX_PROMPT_TOKENS - 1),
    micro_conds=(4, 4, 0, 0, 6),
)

register_family(
    Family(
        name="amused",
        model_kind="masked",
        build_model=build_model,
        load_model_weights=load_weights_elsewhere,
        build_tokenizer=build_tokenizer,
        load_tokenizer_weights=load_weights_elsewhere,
        official_presets={},
        tiny_model_args=TINY_MODEL_ARGS,
        tiny_tokenizer_args=tiny_vq_config(),
        pipeline_classes=PIPELINE_CLASSES,
        title="aMUSEd",
        hub_names=("amused/amused-256", "amused/amused-512"),
        extra="hf",
        load_folder=load_folder,
        build_text_encoder=build_text_encoder,
    )
)
