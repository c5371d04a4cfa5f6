"""The Emu3 family: transformers' `Emu3ForConditionalGeneration` (Emu3-Gen) generating images.

A transformers `save_pretrained` folder (config.json with "architectures":
["Emu3ForConditionalGeneration"], the safetensors, the processor and tokenizer files) loads with
`visar.load(FOLDER)`, offline; transformers is an optional dependency (`pip install "visar-ar[hf]"`).
Load options (`model_args`): `image_area` and `ratio` (the image size, as Emu3's processor takes
them), `negative_prompt` (Emu3's own negative prompt by default), `negative_prompt_format`,
`max_prompt_tokens`. The token grid
is the one the folder's processor writes into an image-generation prompt (`<|image start|>H*W...`, its
`image_sizes`) for those options, or, without them, for the model config's saved `image_area` (the
original Emu3 configs carry one) and else the processor's own defaults (transformers 5.24: 518400
pixels at 1:1, 90 x 90 tokens).

Sampling defaults, from baaivision/Emu3 `image_generation.py`: guidance 3 with the negative prompt
as the unconditional branch, top-k 2048, temperature 1. That script also appends
" masterpiece, film grained, best quality." to each prompt; visar leaves prompts as given.
Only an Emu3-Gen checkpoint is trained to generate images (Emu3-Chat shares the architecture).

Two layouts of a negative prompt. The load-time one (`negative_prompt`) is formatted as that script
formats it, like a prompt: BOS, the text, then the image header `<|image start|>H*W<|image token|>`.
A negative prompt given for one call (`Pipeline.generate(negative_prompt=...)`) is formatted by
`negative_prompt_format`: "text" (the default), as transformers' Emu3 docs build the
`negative_prompt_ids` of `generate` (`processor(text=[negative])`: BOS and the text, no header); or
"generation", the script's layout with the header (the same tokens as the load-time one).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..errors import VisarError
from ..models.hf_emu3 import HFEmu3, split_vq
from ..models.hf_prompts import HFPromptEncoder
from ..tokenizers.hf_vq import Emu3VQTokenizer
from .family import Family, FolderParts, register_family, transformers_module

ARCHITECTURES = ("Emu3ForConditionalGeneration",)
DEFAULT_MAX_PROMPT_TOKENS = 128  # the negative prompt below takes about 60 of Emu3's tokens
NEGATIVE_PROMPT = (
    "lowres, bad anatomy, bad hands, text, error, missing fingers, extra digit, fewer digits, cropped, worst "
    "quality, low quality, normal quality, jpeg artifacts, signature, watermark, username, blurry."
)
DEFAULTS = {"guidance_scale": 3.0, "temperature": 1.0, "top_k": 2048, "top_p": 1.0}
LOAD_OPTIONS = ("image_area", "max_prompt_tokens", "negative_prompt", "negative_prompt_format", "ratio")
# How a per-call negative prompt is formatted (see the module docstring): transformers' docs, or baaivision/Emu3's.
NEGATIVE_PROMPT_FORMATS = ("text", "generation")


def prompt_encoder(processor, max_prompt_tokens: int, size: dict, negative_format: str = "text") -> HFPromptEncoder:
    """Prompts as Emu3's processor formats them for image generation: BOS, the prompt, then
    `<|image start|>H*W<|image token|>` (no chat template), left-padded; size: ratio / image_area
    options for the processor (none: its own). Per-call negative prompts per `negative_format`."""
    if negative_format not in NEGATIVE_PROMPT_FORMATS:
        raise VisarError(
            f"negative_prompt_format {negative_format!r}: expected 'text' (transformers' docs: BOS and the text) or "
            "'generation' (baaivision/Emu3's: with the image header, as the load-time negative prompt)"
        )
    call_kwargs = {"return_for_image_generation": True, **size}
    negative_kwargs = {} if negative_format == "text" else call_kwargs
    return HFPromptEncoder(
        processor, max_prompt_tokens, processor.tokenizer.pad_token_id, call_kwargs, False, negative_kwargs
    )


def generation_grid(processor, size: dict) -> tuple[int, int]:
    """The token grid the processor writes into an image-generation prompt for these size options."""
    try:
        written = processor(text=[""], return_for_image_generation=True, **size)["image_sizes"][0]
    except (ValueError, ZeroDivisionError) as err:
        raise VisarError(f"ratio {size.get('ratio')!r}: expected 'width:height', such as '1:1' or '16:9'") from err
    grid = (int(written[0]), int(written[1]))
    if min(grid) < 1:
        raise VisarError(f"image_area {size.get('image_area')} at ratio {size.get('ratio')} leaves no image tokens")
    return grid


def build_emu3(hf_model, processor, options: dict) -> tuple[HFEmu3, HFPromptEncoder]:
    """The adapter and its prompt encoder, for the load options (see the module docstring)."""
    unknown = sorted(set(options) - set(LOAD_OPTIONS))
    if unknown:
        what = f"{unknown} for an Emu3 folder; known: {list(LOAD_OPTIONS)}"
        raise VisarError(f"unknown model_args {what}", cli=f"unknown --model-arg {what}")
    max_prompt_tokens = int(options.get("max_prompt_tokens", DEFAULT_MAX_PROMPT_TOKENS))
    saved_area = getattr(hf_model.config, "image_area", None)  # the original Emu3 configs' size, if the folder has one
    size = {} if saved_area is None else {"image_area": int(saved_area)}
    size.update({k: options[k] for k in ("ratio", "image_area") if k in options})
    if "ratio" in size:
        size["ratio"] = str(size["ratio"])
    if "image_area" in size:
        size["image_area"] = int(size["image_area"])
    grid = generation_grid(processor, size)
    encoder = prompt_encoder(processor, max_prompt_tokens, size, options.get("negative_prompt_format", "text"))
    negative_ids, negative_mask = encoder.encode([options.get("negative_prompt", NEGATIVE_PROMPT)])
    model = HFEmu3(
        hf_model.eval(),
        max_prompt_tokens=max_prompt_tokens,
        grid_size=grid,
        negative_ids=negative_ids,
        negative_mask=negative_mask,
    )
    return model, encoder


def load_folder(folder: os.PathLike, model_args: dict | None = None) -> FolderParts:
    """A transformers save_pretrained folder -> model (float32, sdpa attention), VQ tokenizer, prompt encoder."""
    transformers = transformers_module()
    folder = Path(folder)
    processor = transformers.AutoProcessor.from_pretrained(folder, local_files_only=True)
    hf_model = transformers.Emu3ForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="sdpa", local_files_only=True
    )
    image_processor = processor.image_processor
    tokenizer = Emu3VQTokenizer(split_vq(hf_model).eval(), image_processor.image_mean, image_processor.image_std)
    model, encoder = build_emu3(hf_model, processor, dict(model_args or {}))
    return FolderParts(model, tokenizer, encoder, dict(DEFAULTS))


def load_weights_elsewhere(module, path, source: str):
    loads = f"{source}: an Emu3 model loads from its transformers folder, weights included:"
    raise VisarError(f"{loads} visar.load(FOLDER)", cli=f"{loads} --model FOLDER")


# -- a tiny random Emu3, for the tests (tests/accel/test_method_conformance.py, tests/models/test_hf_emu3.py) --

TINY_SPECIAL_TOKENS = [
    "<|endoftext|>",  # pad
    "<|extra_203|>",  # BOS
    "<|extra_204|>",  # EOS
    "<|image start|>",
    "<|image end|>",
    "<|image token|>",
    "<|extra_200|>",  # end of line
    "<|extra_201|>",  # end of frame
    "<|extra_0|>",  # <image>, the placeholder for understanding
    "<unk>",
]
TINY_WORDS = ["a", "an", "the", "of", "on", "in", "red", "green", "blue", "circle", "square", "triangle", "dog"]
TINY_WORDS += ["lowres", ",", "blurry", ".", "*"] + [str(n) for n in range(1, 17)]


def tiny_vocabulary(image_vocab: int) -> dict[str, int]:
    visual = [f"<|visual token{k:06d}|>" for k in range(image_vocab)]
    return {token: i for i, token in enumerate(TINY_SPECIAL_TOKENS + TINY_WORDS + visual)}


def tiny_config(image_vocab: int = 8) -> dict:
    """An Emu3Config dict: a 2-layer decoder (GQA) over the tiny vocabulary, a VQ with image_vocab codes."""
    vocabulary = tiny_vocabulary(image_vocab)
    return dict(
        text_config=dict(
            vocab_size=len(vocabulary),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        vq_config=tiny_vq_config(image_vocab),
        vocabulary_map={**vocabulary, "<image>": vocabulary["<|extra_0|>"]},
    )


def tiny_vq_config(image_vocab: int = 8) -> dict:
    return dict(
        codebook_size=image_vocab,
        embed_dim=4,
        latent_channels=4,
        base_channels=32,
        channel_multiplier=[1, 1],
        num_res_blocks=1,
        attn_resolutions=[],
        hidden_size=32,
        num_attention_heads=1,
    )


def tiny_processor(image_vocab: int = 8):
    """An Emu3Processor over a word-level tokenizer of the tiny vocabulary (no files). Its tokenizer pads on
    the left, as transformers' convert_emu3_weights_to_hf.py saves Emu3-Gen-hf's: what the processor pads
    with `padding=True` (transformers' Emu3 docs, a folder saved from it) is what `generate` needs."""
    transformers = transformers_module()
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocabulary = tiny_vocabulary(image_vocab)
    backend = Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens([t for t in vocabulary if t.startswith("<|") or t == "<unk>"])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|extra_203|>",
        eos_token="<|extra_204|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        padding_side="left",
        extra_special_tokens={
            "image_token": "<|extra_0|>",
            "boi_token": "<|image start|>",
            "eoi_token": "<|image end|>",
            "image_wrapper_token": "<|image token|>",
            "eof_token": "<|extra_201|>",
        },
    )
    return transformers.Emu3Processor(image_processor=transformers.Emu3ImageProcessor(), tokenizer=tokenizer)


TINY_GRID = 4
TINY_IMAGE_AREA = (TINY_GRID * 8) ** 2  # Emu3's processor: 8 pixels per token side -> a 4 x 4 grid
TINY_OPTIONS = {"max_prompt_tokens": 16, "image_area": TINY_IMAGE_AREA, "negative_prompt": "lowres , blurry ."}


def build_model(model_args: dict) -> HFEmu3:
    """A random Emu3 over the tiny processor's vocabulary (the tests' model; real ones load from folders).
    model_args: "config" (an Emu3Config dict), "image_vocab", and load options (see LOAD_OPTIONS)."""
    transformers = transformers_module()
    options = dict(model_args)
    config = transformers.Emu3Config(**options.pop("config"))
    processor = tiny_processor(options.pop("image_vocab"))
    hf_model = transformers.Emu3ForConditionalGeneration._from_config(config, attn_implementation="sdpa")
    split_vq(hf_model)  # the tokenizer builds its own (build_tokenizer)
    return build_emu3(hf_model, processor, options)[0]


def build_tokenizer(tokenizer_args: dict) -> Emu3VQTokenizer:
    """tokenizer_args: an Emu3VQVAEConfig dict; the default image processor's mean and std."""
    transformers = transformers_module()
    vq = transformers.Emu3VQVAE._from_config(transformers.Emu3VQVAEConfig(**tokenizer_args))
    image_processor = transformers.Emu3ImageProcessor()
    return Emu3VQTokenizer(vq.eval(), image_processor.image_mean, image_processor.image_std)


def build_text_encoder(text_encoder_args: dict) -> HFPromptEncoder:
    """The tiny processor as a prompt encoder (text_encoder_args: image_vocab and load options)."""
    args = dict(text_encoder_args)
    processor = tiny_processor(args.pop("image_vocab"))
    return prompt_encoder(processor, args["max_prompt_tokens"], {"ratio": "1:1", "image_area": args["image_area"]})


register_family(
    Family(
        name="hf-emu3",
        model_kind="raster",
        build_model=build_model,
        load_model_weights=load_weights_elsewhere,
        build_tokenizer=build_tokenizer,
        load_tokenizer_weights=load_weights_elsewhere,
        official_presets={},
        tiny_model_args=dict(config=tiny_config(), image_vocab=8, **TINY_OPTIONS),
        tiny_tokenizer_args=tiny_vq_config(),
        architectures=ARCHITECTURES,
        title="Emu3",
        hub_names=("BAAI/Emu3-Gen-hf",),
        extra="hf",
        load_folder=load_folder,
        build_text_encoder=build_text_encoder,
        tiny_text_encoder_args=dict(image_vocab=8, max_prompt_tokens=16, image_area=TINY_IMAGE_AREA),
    )
)
